"""Federated algorithms: each one a server half and a client half, registered by name.

Each built-in algorithm is a package here (``fedpeft/algorithms/<name>/``, the federated LoRA methods under
``lora/``): its options, its halves, its helpers and its registration through
:func:`fedpeft.algorithms.registry.register_algorithm`, the same function a plugin calls
(``fedpeft.register_algorithm``). :mod:`.base` holds the contract, :mod:`.aggregate` the maths several share, and
:mod:`.wrapping` the wrappers around any algorithm's halves: the packages :mod:`.robust` (Byzantine-robust rules,
a registered kind of their own, ``fedpeft.register_robust_rule``) and :mod:`.privacy` (differential privacy).
Importing this package imports no torch; the names below load on first use.
"""

from __future__ import annotations

from typing import Any

from fedpeft.lazy import lazy_getattr
from fedpeft.plugins import load_built_ins

_EXPORTS = {
    **dict.fromkeys(("ClientAlgorithm", "ClientContext", "RuntimeNeeds", "ServerAlgorithm", "UpdateMeta",
                     "UpdateRejected", "check_update", "check_update_meta", "random_selection"),
                    "fedpeft.algorithms.base"),
    **dict.fromkeys(("make_client", "make_server", "register_algorithm", "registered_algorithm", "runtime_needs"),
                    "fedpeft.algorithms.registry"),
    "ALGORITHMS": "fedpeft.algorithms.registry",
}
__all__ = sorted(_EXPORTS)  # noqa: PLE0605


_lazy_getattr = lazy_getattr("fedpeft.algorithms", _EXPORTS, globals())


def __getattr__(name: str) -> Any:
    if name == "ALGORITHMS":  # the registry, read through this package, holds fedpeft's built-ins
        load_built_ins()
    return _lazy_getattr(name)
