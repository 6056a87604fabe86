"""PEFT methods: wrapping a backbone and reading/writing its trainable state by name.

Named ``tuners`` (as in HF peft) so that it does not shadow the ``peft`` package.
"""

from fedpeft.tuners.tuned import PEFT_METHODS, StateError, TunedModel, apply_tuner, method_options

__all__ = ["PEFT_METHODS", "StateError", "TunedModel", "apply_tuner", "method_options"]
