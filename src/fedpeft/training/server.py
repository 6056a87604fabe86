"""The server's own model: the global model with the server's shard of the training data, for algorithms
that train on the server (FedSP); a server half asks for it with ``RuntimeNeeds(server_model=True)`` and gets
it as ``server_model``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedpeft.config import RunConfig
from fedpeft.data.batching import Encoded, ImageEncoded
from fedpeft.training.local import LocalTrainer, TrainResult
from fedpeft.tuners.tuned import TunedModel


@dataclass
class ServerModel:
    """The global model on the server, with the server's shard of the training data (FedSP)."""

    cfg: RunConfig
    tuned: TunedModel
    data: Encoded | ImageEncoded  # the server's shard of the training split
    pad_id: int | None  # the tokenizer's padding token (None for images: nothing is padded)
    device: torch.device

    @property
    def seed(self) -> int:
        return self.cfg.seed

    def base_model(self) -> torch.nn.Module:
        """The backbone without the PEFT method's additions (the prompts are not applied through it)."""
        module = self.tuned.module
        get_base_model = getattr(module, "get_base_model", None)  # HF peft's wrapper has it
        if get_base_model is None:
            return module
        base: torch.nn.Module = get_base_model()
        return base

    def tune(self, state: dict[str, np.ndarray], steps: int, rnd: int) -> dict[str, Any]:
        """Train the trainable state (e.g. prompts) for ``steps`` steps on the server's shard; returns the new
        state as "state" plus the loss and seconds."""
        if len(self.data) == 0:
            raise ValueError("the server holds no training data; set a server data share")
        train = self.cfg.train.model_copy(update={"local_steps": steps})
        trainer = LocalTrainer(train, device=self.device, pad_id=self.pad_id, precision=self.cfg.runtime.precision,
                               flops_sample_steps=0)
        self.tuned.load_state(state)
        torch.manual_seed(int(np.random.SeedSequence([self.cfg.seed, rnd, 0x5E4]).generate_state(1)[0]))
        result: TrainResult = trainer.train(self.tuned, self.data, np.random.default_rng([self.cfg.seed, rnd, 0x5E4]))
        return {"state": self.tuned.state(), "server_train_loss": result.loss, "server_train_seconds": result.seconds}
