"""Which SuperNode serves which partition, and who may take a partition over.

A SuperNode says which partition it serves (its ``--node-config "partition-id=I ..."``, answered to
the ServerApp's describe message); nothing in Flower binds that claim to the node. So the ServerApp
decides, for a SuperNode N claiming partition p:

* p is free: N serves it (with ``runtime.flower.partition_keys`` pinning p: only if N's key is p's key);
* p is served by M with the same public key as N: the same SuperNode restarted, N serves it;
* p is served by M that did not answer its last message (a round's, within
  ``federation.round_timeout_s``), or does not answer a describe message sent now: N replaces M
  (logged);
* p is served by M that answers and still claims p: N is refused (logged once) and waits as a
  contender; it is examined again at every round and takes p over once M leaves or stops answering.

Keys are compared by their OpenSSH SHA-256 fingerprint (``ssh-keygen -lf key.pub`` prints the same),
read from the SuperLink's node list (``Grid.get_nodes``). With SuperNode authentication a key is the
one the operator registered; without it every SuperNode start makes a new key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fedpeft.keys import node_key_fingerprint, pinned_key_fingerprint  # noqa: F401 (re-exported)

log = logging.getLogger("fedpeft")

class PartitionTable:
    """The ServerApp's map partition -> SuperNode, kept by the rules in this module's docstring."""

    def __init__(self, pinned: Mapping[int, str] | str | None = None):
        # partition -> key fingerprint (runtime.flower.partition_keys; "any" and None pin nothing)
        self.pinned = dict(pinned) if isinstance(pinned, Mapping) else {}
        self.node_of: dict[int, int] = {}  # partition -> the SuperNode serving it
        self.key_of: dict[int, str] = {}  # online SuperNode -> key fingerprint ("" when unknown)
        self.contenders: dict[int, int] = {}  # SuperNode -> the partition it claims and was refused
        self.silent: set[int] = set()  # SuperNodes that did not answer their last message
        self._logged: set[tuple[int, int]] = set()  # (node, partition) refusals already logged

    def set_online(self, nodes: Mapping[int, str]) -> None:
        """The SuperNodes online now (node id -> key fingerprint): a partition whose SuperNode left is free."""
        for partition, node in sorted(self.node_of.items()):
            if node not in nodes:
                del self.node_of[partition]
                log.warning("SuperNode %d (partition %d) is no longer online; waiting for a SuperNode to serve it",
                            node, partition)
        self.key_of = dict(nodes)
        self.contenders = {n: p for n, p in self.contenders.items() if n in nodes}
        self.silent &= set(nodes)

    def forget(self, node: int) -> None:
        """``node`` is unreachable (Flower said so): its partitions are free."""
        for partition in [p for p, n in self.node_of.items() if n == node]:
            del self.node_of[partition]
            log.warning("SuperNode %d (partition %d) is unavailable; waiting for a SuperNode to serve it", node,
                        partition)

    def answered(self, node: int, answered: bool) -> None:
        """Whether ``node`` answered the last message sent to it in time."""
        if answered:
            self.silent.discard(node)
        else:
            self.silent.add(node)

    def incumbent_to_ask(self, node: int, partition: int) -> int | None:
        """The SuperNode that must be asked whether it still serves ``partition`` before ``node`` may take it
        (None: the claim can be decided without asking)."""
        incumbent = self.node_of.get(partition)
        if (incumbent is None or incumbent == node or self._refused_by_pin(node, partition)
                or self._same_key(node, incumbent) or incumbent in self.silent):
            return None
        return incumbent

    def claim(self, node: int, partition: int, still_serving: Mapping[int, int]) -> bool:
        """Decide ``node``'s claim on ``partition``; ``still_serving`` maps the SuperNodes that have just answered
        a describe message to the partition they claimed. True if ``node`` now serves ``partition``."""
        if self._refused_by_pin(node, partition):
            self._refuse(node, partition, f"which runtime.flower.partition_keys pins to key {self.pinned[partition]}")
            return False
        incumbent = self.node_of.get(partition)
        if incumbent is not None and incumbent != node:
            if self._same_key(node, incumbent):
                log.warning("SuperNode %d has the key of SuperNode %d (restarted): it now serves partition %d",
                            node, incumbent, partition)
            elif still_serving.get(incumbent) == partition:
                self._refuse(node, partition, f"which SuperNode {incumbent} serves and still answers for")
                return False
            elif incumbent in self.silent:
                log.warning("SuperNode %d now serves partition %d: SuperNode %d did not answer its last message",
                            node, partition, incumbent)
            else:
                log.warning("SuperNode %d now serves partition %d: SuperNode %d no longer claims it", node,
                            partition, incumbent)
        self.node_of[partition] = node
        self.contenders.pop(node, None)
        return True

    def _same_key(self, node: int, other: int) -> bool:
        key = self.key_of.get(node, "")
        return bool(key) and key == self.key_of.get(other)

    def _refused_by_pin(self, node: int, partition: int) -> bool:
        return partition in self.pinned and self.key_of.get(node, "") != self.pinned[partition]

    def _refuse(self, node: int, partition: int, why: str) -> None:
        self.contenders[node] = partition
        if (node, partition) not in self._logged:
            self._logged.add((node, partition))
            log.warning("SuperNode %d (key %s) claims partition %d, %s: refused", node,
                        self.key_of.get(node) or "unknown", partition, why)
