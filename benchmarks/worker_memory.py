"""Where the memory of a run with worker processes goes: run it beside ``benchmarks/clients_per_pass.py`` and it
records, at the largest total PSS of the matching setting's process and its children, each process's
smaps_rollup figures and its largest private mappings (Linux).

    python benchmarks/worker_memory.py --setting w2x16 --out benchmarks/results/clients_per_pass_workers_smaps.json &
    python benchmarks/clients_per_pass.py --scenario cross-device --per-pass w2x16 --no-flower

It samples every 2 s (reading /proc/PID/smaps in full only when the total PSS grows), for at most --seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil


def rollup(pid: int) -> dict[str, int]:
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", text, re.MULTILINE)}


def private_by_mapping(pid: int, top: int = 8) -> list[tuple[str, int]]:
    """The ``top`` mappings (by file name, or [heap], [anon], ...) holding the most private kB."""
    totals: dict[str, int] = {}
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path(f"/proc/{pid}/smaps").read_text()):
        head = block.split("\n", 1)[0].split()
        name = head[5] if len(head) > 5 else "[anon]"
        private = sum(int(x) for x in re.findall(r"^Private_(?:Clean|Dirty):\s+(\d+)", block, re.MULTILINE))
        totals[name] = totals.get(name, 0) + private
    return sorted(totals.items(), key=lambda item: -item[1])[:top]


def per_process(procs: list[psutil.Process], read: Callable[[int], Any]) -> dict[int, Any]:
    """``read(pid)`` of each process that still exists."""
    out = {}
    for q in procs:
        try:
            out[q.pid] = read(q.pid)
        except OSError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", required=True, help="the clients_per_pass.py setting to watch, e.g. w2x16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=1500)
    args = ap.parse_args()
    best: dict = {"tot": 0}
    end = time.time() + args.seconds
    while time.time() < end:
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if f"--one {args.setting}" not in cmd or "--child" not in cmd:
                continue
            procs = [p, *p.children()]
            snap = per_process(procs, rollup)
            total = sum(s["Pss"] for s in snap.values())
            if total > best["tot"]:
                best = {"tot": total, "snap": snap, "detail": per_process(procs, private_by_mapping)}
                Path(args.out).write_text(json.dumps(best, indent=1))
        time.sleep(2)


if __name__ == "__main__":
    main()
