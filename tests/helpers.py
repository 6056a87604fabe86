"""Small builders shared by the runtime tests."""

from __future__ import annotations

from fedpeft.config import load_config

TIMING_KEYS = {"time_client_s", "time_aggregation_s", "time_evaluation_s", "time_overhead_s", "time_round_s", "wall_s",
               "client_train_seconds", "agg_importance_s_mean",
               "client_process_s", "client_setup_s", "client_start_delay_s", "client_return_delay_s",
               "peak_rss_mb", "peak_accelerator_mb", "backbone_bytes"}  # and the memory figures


def tiny_config(*overrides: str):
    base = [
        "model.name=tiny-bert", "task.dataset=sst2", "task.max_train_examples=64", "task.max_length=32",
        "federation.num_clients=4", "federation.clients_per_round=2", "federation.rounds=2",
        "train.batch_size=8", "eval.max_examples=32", "eval.batch_size=32", "runtime.progress=false",
    ]
    return load_config(None, [*base, *overrides])


def without_timings(rows):
    out = []
    for r in rows:
        out.append({k: v for k, v in r.items() if k not in TIMING_KEYS})
    return out


def crash_at_round(rt, monkeypatch, rnd: int) -> None:
    """Make ``rt.run()`` raise KeyboardInterrupt on reaching round ``rnd`` (earlier rounds are checkpointed)."""
    real_round = rt.run_round

    def die(r, wall_start):
        if r == rnd:
            raise KeyboardInterrupt
        return real_round(r, wall_start)

    monkeypatch.setattr(rt, "run_round", die)


def crash_in_checkpoint(monkeypatch, rnd: int) -> None:
    """Make the checkpoint of round ``rnd`` raise KeyboardInterrupt: the round's metrics row is written, its
    checkpoint never is (``monkeypatch.undo()`` restores checkpoint.save)."""
    from fedpeft import checkpoint

    real_save = checkpoint.save

    def save_then_die(run_dir, r, state):
        if r == rnd:
            raise KeyboardInterrupt
        return real_save(run_dir, r, state)

    monkeypatch.setattr(checkpoint, "save", save_then_die)
