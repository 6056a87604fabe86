"""Where a round's clients train. A schedule (synchronous rounds: fedpeft.runtime.synchronous; buffered asynchronous
aggregation: fedpeft.runtime.asynchronous) decides which clients train from which global version and when updates
are aggregated; it hands a :class:`Transport` each starting client's payload and gets each one's result. Two
transports exist: in this process over the one shared backbone, with fused passes (fedpeft.runtime.inprocess), and
Flower's Grid (fedpeft.runtime.flower.server_app). No transport knows the schedule, and the synchronous schedule
knows no transport. The asynchronous schedule on the simulated clock (fedpeft.runtime.asynchronous) runs in this
process and adds the in-process transport's fused-pass accounting of its whole aggregation window; on a transport
whose rounds run in real time (Flower) it runs on the wall clock (fedpeft.runtime.realtime_async) through the
:class:`StreamingTransport` half: clients started without waiting, their results taken as they arrive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fedpeft import wire
from fedpeft.runtime.outcome import ClientResult, RoundOutcome

if TYPE_CHECKING:
    from fedpeft.runtime.embedded import EmbeddedRuntime
    from fedpeft.runtime.progress import RoundProgress


class Transport(Protocol):
    fuses_clients: bool  # whether runtime.clients_per_pass > 1 trains clients together
    # whether system.deadline_s and over_selection act in real time on the replies as they arrive (then run_clients
    # fills the run's dropped_in_real_time and surplus_in_real_time) rather than on the simulated clock
    rounds_in_real_time: bool

    def bind(self, run: EmbeddedRuntime, checkpoint: dict[str, Any] | None) -> None:
        """Called once the run's server, clients' states and files exist; ``checkpoint``: the state a resumed run
        restores (None for a new run)."""

    def start(self) -> None:
        """Called last when the run opens: wait for whatever the clients need (a Flower run's SuperNodes)."""

    def run_clients(self, rnd: int, payloads: dict[int, wire.Payload]) -> dict[int, ClientResult]:
        """Every client's result for round (or refill) ``rnd``, each trained from its payload."""

    def secure_round(self, rnd: int, selected: list[int], payloads: dict[int, wire.Payload],
                     out: RoundOutcome) -> bool:
        """Run and aggregate the whole round into ``out`` when the transport aggregates it itself (SecAgg+: the
        server sees only the mean) and say True; False: the schedule aggregates the updates run_clients returns."""

    def round_progress(self, bar: Any) -> RoundProgress | None:
        """Where progress inside a round goes (None: the run's bar and events.log)."""

    def round_info(self) -> dict[str, Any]:
        """The transport's own entries of the row of the round just run (then forgotten)."""

    def state(self) -> dict[str, Any]:
        """Entries of the run's checkpoint that a resumed run gives back to bind()."""

    def close(self) -> None:
        """The run is over (ended, failed or killed in this process): stop what start() started; safe twice."""


@runtime_checkable
class StreamingTransport(Transport, Protocol):
    """A transport that starts clients without waiting for them and hands their results over as they arrive
    (buffered asynchronous aggregation in real time)."""

    def start_clients(self, draw: int, payloads: dict[int, wire.Payload]) -> tuple[dict[int, int],
                                                                                   dict[int, ClientResult]]:
        """Send each client its payload (``draw``: the refill that chose it) and return at once: (bytes sent to each
        client that started, the results of the clients that could not be started)."""

    def unavailable(self) -> set[int]:
        """Clients not to start now although no slot waits for them: one given up whose message may still be
        queued or training where it was sent (a second message would train after it)."""

    def poll_arrivals(self) -> list[tuple[int, int, ClientResult]]:
        """(client, draw, result) of each started client whose reply arrived, or whose time ran out, since the last
        call, in the order they were taken; waits one poll interval first when none is there yet."""
