"""Progress inside a round: how many of the selected clients are done and, while local training is long, the
local step of the clients in training; on the run's progress bar and as lines of events.log.

A round of a cross-silo run can take minutes; without this, a slow round and a stuck one look alike. The
embedded runtime draws its bar itself; a Flower ServerApp logs the same lines, which ``flwr run --stream``
carries back to the launcher, and :class:`Follower` turns them into the bar of the ``fedpeft run`` console.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# A line the runtimes write and follow() reads back: keep the two in step.
CLIENTS_DONE = "round {rnd}/{rounds}: {done} of {selected} clients done"
ROUND_DONE = "round {rnd}/{rounds} done"
_CLIENTS_DONE = re.compile(r"round (\d+)/(\d+): (\d+) of (\d+) clients done")
_ROUND_DONE = re.compile(r"round (\d+)/(\d+) done")
STEP_NOTE_S = 60.0  # events.log: a local-step line at most this often while one training lasts
BAR_REFRESH_S = 0.5  # the bar's text: redrawn at most this often during local training


class RoundProgress:
    """What the round in progress has done, told to ``note`` (events.log; the ServerApp's log) and, when given, a
    tqdm ``bar`` whose units are rounds. ``clock`` is for tests."""

    def __init__(self, rounds: int, note: Callable[[str], None], bar: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        self.rounds = rounds
        self.note = note
        self.bar = bar
        self.clock = clock
        self.rnd = 0
        self.selected = 0
        self.training: list[int] = []
        self.counted: set[int] = set()  # the round's clients counted done
        self.after: dict[str, str] = {}  # the last round's figures, kept on the bar during the next one
        self._step_noted = self._drawn = 0.0
        self._started = 0.0

    @property
    def done(self) -> int:
        """The round's clients done so far."""
        return len(self.counted)

    def round_started(self, rnd: int, selected: Sequence[int]) -> None:
        self.rnd, self.selected, self.training = rnd, len(selected), []
        self.counted = set()
        self._draw(f"0/{self.selected} clients")

    def clients_training(self, cids: Sequence[int]) -> None:
        """``cids`` start their local work (one client, or a pass of several)."""
        self.training = list(cids)
        self._started = self._step_noted = self.clock()

    def step(self, done: int, total: int) -> None:
        """The clients in training finished local step ``done`` of ``total`` (LocalTrainer.on_step)."""
        now = self.clock()
        if now - self._drawn >= BAR_REFRESH_S or done == total:
            self._draw(f"{self.done}/{self.selected} clients, {_clients(self.training)} step {done}/{total}")
        if now - self._step_noted >= STEP_NOTE_S and done < total:
            self._step_noted = now
            self.note(f"round {self.rnd}/{self.rounds}: {_clients(self.training)} at local step {done} of {total} "
                      f"({now - self._started:.0f} s)")

    def clients_done(self, cids: Iterable[int]) -> None:
        """``cids`` finished (an update, or a failure: either way the round no longer waits for them); a client
        already counted in this round is not counted again."""
        cids = [c for c in cids if c not in self.counted]
        if not cids:
            return
        self.counted.update(cids)
        self.training = [c for c in self.training if c not in cids]
        self.note(CLIENTS_DONE.format(rnd=self.rnd, rounds=self.rounds, done=self.done, selected=self.selected)
                  + f" ({_clients(cids)})")
        self._draw(f"{self.done}/{self.selected} clients")

    def round_ended(self, figures: dict[str, str]) -> None:
        """The round's row is written: ``figures`` (loss, MiB, the metric) stay on the bar."""
        self.after = figures
        self.note(ROUND_DONE.format(rnd=self.rnd, rounds=self.rounds) + (f": {_figures(figures)}" if figures else ""))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(_figures(figures))

    def _draw(self, now: str) -> None:
        if self.bar is None:
            return
        self._drawn = self.clock()
        self.bar.set_postfix_str(", ".join(x for x in (_figures(self.after), f"round {self.rnd}: {now}") if x))


def _figures(figures: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in figures.items())


def _clients(cids: Sequence[int]) -> str:
    if not cids:
        return "local training"
    if len(cids) == 1:
        return f"client {cids[0]}"
    return f"clients {', '.join(map(str, cids))}" if len(cids) <= 4 else f"{len(cids)} clients in one pass"


_WARNING = re.compile(r"\b(WARNING|ERROR) fedpeft: ")


class Follower:
    """Drives ``bar`` (a tqdm over rounds, or None) from the lines of a ServerApp's log as ``flwr run --stream``
    prints it: the progress lines move the bar; fedpeft's warnings and errors are printed (above the bar), as the
    embedded runtime prints them; other lines are passed over."""

    def __init__(self, bar: Any, write: Callable[[str], None]):
        self.bar, self.write = bar, write
        self.after = ""  # the last round's figures, kept on the bar during the next one

    def __call__(self, lines: Iterable[str]) -> None:
        bar = self.bar
        for line in lines:
            if m := _WARNING.search(line):
                self.write(f"{m[1]} fedpeft: {line[m.end():].strip()}")
            elif bar is None:
                continue
            elif m := _CLIENTS_DONE.search(line):
                rnd, _, done, selected = (int(g) for g in m.groups())
                if bar.n < rnd - 1:  # (a resumed run's first round)
                    bar.update(rnd - 1 - bar.n)
                bar.set_postfix_str(", ".join(x for x in (self.after, f"round {rnd}: {done}/{selected} clients") if x))
            elif m := _ROUND_DONE.search(line):
                rnd = int(m[1])
                if rnd > bar.n:
                    bar.update(rnd - bar.n)
                self.after = line[m.end():].lstrip(": ").strip()
                bar.set_postfix_str(self.after)


class FileFollower(threading.Thread):
    """Reads the lines appended to ``path`` (from its size when started) every ``poll_s`` seconds and hands them to
    a :class:`Follower` of ``bar`` until :meth:`stop`."""

    def __init__(self, path: Path, bar: Any, poll_s: float = 0.5, write: Callable[[str], None] | None = None):
        super().__init__(name="fedpeft-progress", daemon=True)
        self.path, self.poll_s = path, poll_s
        self.follow = Follower(bar, write or _write)
        self.offset = path.stat().st_size if path.is_file() else 0
        self.partial = b""
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            self.read()
        self.read()

    def read(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        self.follow(line.decode("utf-8", "replace") for line in lines)

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def _write(text: str) -> None:
    """A line on stderr, above a tqdm bar if one is drawn."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)
