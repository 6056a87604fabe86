"""Local training and evaluation loops."""

from fedpeft.training.local import LocalTrainer, NonFiniteLoss, TrainResult

__all__ = ["LocalTrainer", "NonFiniteLoss", "TrainResult"]
