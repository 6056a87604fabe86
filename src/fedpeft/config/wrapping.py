"""The base of a wrapper's options: what goes around an algorithm's halves, as Flower's strategy wrappers go around
any strategy (``algorithm.robust``: a Byzantine-robust rule; ``algorithm.dp``: differential privacy).

An algorithm offers a wrapper by having its option (``robust: fedpeft.RobustRule | None = None``) and by calling
``ServerAlgorithm.combine`` where it takes the weighted mean of the clients' changes; the wrapper then takes that
mean's place and may change what the server does around it (which clients it samples, which updates it accepts,
what it reports and checkpoints, when the run must stop) and what the client sends. The wrappers' code lives with
their kind (``fedpeft/algorithms/robust/``, ``fedpeft/algorithms/privacy/``); a config names it here as
``"package.module:attribute"`` (a test checks every such reference resolves), so validating a config imports none
of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from fedpeft.config.section import Section

if TYPE_CHECKING:
    from fedpeft.config.schema import RunConfig


class WrapperOptions(Section):
    """Base of a wrapper's options (a field of an algorithm's options holding one turns the wrapper on)."""

    # where a config sets it, for messages (e.g. "algorithm.robust")
    key: ClassVar[str]
    # the server wrapper, "package.module:attribute", called as wrapper(server, options)
    server_wrapper: ClassVar[str]
    # the client wrapper, "package.module:attribute", called as wrapper(client, options), or None (the client half
    # as it is)
    client_wrapper: ClassVar[str | None] = None

    # why the wrapper cannot go with federation.asynchronous, or None when it can
    asynchronous_unavailable: ClassVar[str | None] = None
    # why it cannot go with runtime.flower.secure_aggregation (which reveals only the weighted mean of the updates)
    secure_aggregation_unavailable: ClassVar[str] = "it works on each client's update, which SecAgg+ hides"

    def check(self, run: RunConfig) -> None:
        """Refuse (ValueError, one line naming the key and the fix) settings of the run this wrapper cannot work
        with; called when a whole config is validated."""

    def check_system(self, run: RunConfig) -> None:
        """Refuse settings of the ``system`` section (simulated devices, over-selection) the wrapper cannot work
        with; called where the config checks that section."""

    def check_asynchronous(self, run: RunConfig, buffer_size: int) -> None:
        """Refuse an asynchronous run (``federation.asynchronous``, aggregating every ``buffer_size`` updates) the
        wrapper cannot work with; called last among the checks of that section."""
