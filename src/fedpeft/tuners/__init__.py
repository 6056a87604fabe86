"""PEFT methods: wrapping a backbone and reading/writing its trainable state by name.

Named ``tuners`` (as in HF peft) so that it does not shadow the ``peft`` package. Each built-in method is a
package here (``fedpeft/tuners/<method>/``: its options, its ``apply`` and its registration through
:func:`fedpeft.register_peft_method`, the same function a plugin calls); :mod:`.registry` holds the contract,
:mod:`.tuned` wraps a backbone with the configured method. Importing this package imports no torch; the
names below load on first use.
"""

from __future__ import annotations

from typing import Any

from fedpeft.lazy import lazy_getattr
from fedpeft.plugins import load_built_ins

_EXPORTS = {
    "PEFT_METHODS": "fedpeft.tuners.registry",
    "PeftMethod": "fedpeft.tuners.registry",
    "TunerContext": "fedpeft.tuners.registry",
    "register_peft_method": "fedpeft.tuners.registry",
    "registered_peft_method": "fedpeft.tuners.registry",
    "StateError": "fedpeft.tuners.tuned",
    "TunedModel": "fedpeft.tuners.tuned",
    "apply_tuner": "fedpeft.tuners.tuned",
    "method_options": "fedpeft.tuners.tuned",
}
__all__ = sorted(_EXPORTS)  # noqa: PLE0605


_lazy_getattr = lazy_getattr("fedpeft.tuners", _EXPORTS, globals())


def __getattr__(name: str) -> Any:
    if name == "PEFT_METHODS":  # the registry, read through this package, holds fedpeft's built-ins
        load_built_ins()
    return _lazy_getattr(name)
