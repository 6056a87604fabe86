"""The runtime's checks of the updates that arrive, before the server aggregates them (every schedule's)."""

from __future__ import annotations

import logging

from fedpeft import algorithms, wire
from fedpeft.runtime.personal import PERSONAL, check_personal

log = logging.getLogger("fedpeft")


def accept_updates(server: algorithms.ServerAlgorithm, rnd: int,
                   updates: dict[int, wire.Payload]) -> tuple[dict[int, wire.Payload], dict[int, str]]:
    """The decoded updates of a round split into accepted and rejected (client -> reason, logged): first the
    runtime's own part of an update (the personalized scores), then the server's checks (metadata, arrays)."""
    rejected: dict[int, str] = {}
    checked = {}
    for cid in sorted(updates):
        meta = updates[cid].meta
        problem = check_personal(meta[PERSONAL]) if isinstance(meta, dict) and PERSONAL in meta else None
        if problem is None:
            checked[cid] = updates[cid]
        else:
            rejected[cid] = problem
            log.warning("round %d: update of client %d rejected: %s", rnd, cid, problem)
    accepted, refused = server.accept(rnd, checked)
    return accepted, {**rejected, **refused}
