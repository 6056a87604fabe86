"""bitsandbytes only for runs that quantize.

peft imports bitsandbytes whenever it is installed (``peft.helpers``, and LoRA's layer dispatch), and on a
CPU bitsandbytes 0.50 logs "Failed to load CPU gemm_4bit_forward from kernels-community ... pip install
kernels" as it loads: every run would print it, which a new user reads as an error. A run without
``model.quantization`` therefore hides bitsandbytes from the import system (a ``None`` entry in
``sys.modules``: ``import bitsandbytes`` raises ImportError and ``importlib.util.find_spec`` answers None, so
peft and transformers take it as not installed). A quantized run in the same process lifts that again and
clears the availability answers the libraries cached meanwhile.
"""

from __future__ import annotations

import sys

MODULE = "bitsandbytes"
# modules that decide at import time, or cache, whether bitsandbytes is there: re-imported / cleared on unhide
_IMPORT_TIME_USERS = ("transformers.integrations.bitsandbytes", "peft.tuners.lora.bnb", "peft.tuners.ia3.bnb")
_CACHED_CHECKS = (("peft.import_utils", "is_bnb_available"), ("peft.import_utils", "is_bnb_4bit_available"),
                  ("transformers.utils.import_utils", "is_bitsandbytes_available"))


_hidden_here = False  # whether this module hid it (restore() gives back only what it took)


def hidden() -> bool:
    """Whether bitsandbytes is hidden from imports in this process."""
    return MODULE in sys.modules and sys.modules[MODULE] is None


def restore() -> None:
    """Make bitsandbytes importable again if this module hid it (the end of a run: the process is the user's
    again); a None entry someone else put in sys.modules stays."""
    if hidden() and _hidden_here:
        use_bitsandbytes(True)


def use_bitsandbytes(needed: bool) -> None:
    """Hide bitsandbytes for a run that does not quantize (unless something already imported it), or make it
    importable again for one that does."""
    global _hidden_here
    if not needed:
        if MODULE not in sys.modules:
            sys.modules[MODULE] = None  # type: ignore[assignment]  # the import system's "not importable" mark
            _hidden_here = True
        return
    if not hidden():
        return
    del sys.modules[MODULE]
    _hidden_here = False
    for name in _IMPORT_TIME_USERS:
        if sys.modules.get(name) is not None and getattr(sys.modules[name], "bnb", None) is None:
            del sys.modules[name]  # imported while hidden: import it again when needed
    for module_name, function in _CACHED_CHECKS:
        check = getattr(sys.modules.get(module_name), function, None)
        if check is not None and hasattr(check, "cache_clear"):
            check.cache_clear()
