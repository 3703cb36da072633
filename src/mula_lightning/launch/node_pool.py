"""The nodes of a launch: N active, B buffer, and the ones taken out after a failure.

Why (Aurora paper, Section 4, "Hard node failure handling"): a week-long run on hundreds of nodes loses nodes. The
job allocates B buffer nodes up front; when an active node fails, the next attempt runs on the healthy active
nodes plus a buffer node in the failed one's place, without a person editing a node list and resubmitting.

Replacement keeps positions: a healthy node keeps its node rank from one attempt to the next and a buffer node
takes the failed node's rank, so everything that depends on the node rank (data shards per rank, expert
placement) stays where it was.

A node is *failed* (never used again) on hard evidence only: SLURM reported it failed, every rank on it was killed
by a SIGKILL the launcher did not send, or a process on it is stopped (a hang traced to it). Every other failure
makes the node it is traced to *suspect* (:mod:`~mula_lightning.launch.attribution`: a crash, an abort, a
segfault, a NaN on one node, a hang where its ranks fell behind): the cause may be the program's or a peer's, so
the next attempt keeps the node; it is taken out when it is blamed again in the following attempt
(:data:`SUSPECT_LIMIT` times in a row). A node that stays a straggler (named by
:class:`~mula_lightning.callbacks.straggler_detection.StragglerDetection` in several reports in a row) is *slow*: the
run goes on with it, and the next attempt (after whatever failure comes) replaces it by a buffer node when one is
free; with none free it stays, since a slow node is better than too few.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["SUSPECT_LIMIT", "NodePool", "OutOfNodesError"]

#: consecutive attempts a node may be the first to fail (with an ordinary error) before it is taken out
SUSPECT_LIMIT = 2


class OutOfNodesError(RuntimeError):
    """Fewer healthy nodes than the run needs: the launch stops (the checkpoints are left as they are)."""


@dataclass
class NodePool:
    """``nodes[:nnodes]`` start active, the rest are buffer nodes; :meth:`choose` gives each attempt's nodes."""

    nodes: Sequence[str]
    nnodes: int
    failed: dict[str, str] = field(default_factory=dict)  # host -> why it was taken out
    suspect: dict[str, int] = field(default_factory=dict)  # host -> consecutive attempts it failed first
    current: list[str] = field(default_factory=list)
    slow: dict[str, str] = field(default_factory=dict)  # host -> why it is replaced at the next attempt if possible

    def __post_init__(self) -> None:
        self.nodes = list(dict.fromkeys(self.nodes))
        if self.nnodes < 1:
            raise ValueError(f"--nnodes ({self.nnodes}) must be at least 1")
        if len(self.nodes) < self.nnodes:
            raise ValueError(
                f"--nnodes {self.nnodes} but only {len(self.nodes)} nodes are available ({', '.join(self.nodes)})"
            )
        self.current = list(self.nodes[: self.nnodes])

    @property
    def buffer(self) -> list[str]:
        """Healthy nodes not in the current attempt, in allocation order."""
        return [n for n in self.nodes if n not in self.current and n not in self.failed]

    def mark_failed(self, host: str, reason: str) -> None:
        """Take ``host`` out of every later attempt (unknown hosts are refused: a typo must not pass silently)."""
        if host not in self.nodes:
            raise ValueError(f"node {host!r} is not one of this launch's nodes ({', '.join(self.nodes)})")
        self.failed.setdefault(host, reason)
        self.suspect.pop(host, None)
        self.slow.pop(host, None)

    def mark_suspect(self, host: str, reason: str) -> bool:
        """Count one more attempt that ``host`` failed first; take it out at :data:`SUSPECT_LIMIT`. Returns whether
        it was taken out."""
        return host in self.mark_suspects([host], reason)

    def mark_suspects(self, hosts: Sequence[str], reason: str) -> list[str]:
        """Count one more attempt blamed on ``hosts`` (the host of the first failure, or every host of one
        expert-parallel group after a NaN); hosts blamed :data:`SUSPECT_LIMIT` attempts in a row are taken out.
        Returns the hosts taken out.

        Raises:
            ValueError: a host that is not one of this launch's nodes.
        """
        unknown = [h for h in hosts if h not in self.nodes]
        if unknown:
            raise ValueError(f"node(s) {unknown} not among this launch's nodes ({', '.join(self.nodes)})")
        counts = {h: self.suspect.get(h, 0) + 1 for h in dict.fromkeys(hosts)}
        self.suspect = counts  # "in a row": a failure blamed elsewhere resets the others
        out = []
        for host, count in list(counts.items()):
            if count >= SUSPECT_LIMIT:
                self.mark_failed(host, f"{reason} (blamed in {count} attempts in a row)")
                out.append(host)
        return out

    def mark_slow(self, host: str, reason: str) -> None:
        """Replace ``host`` by a buffer node at the next :meth:`choose` if one is free (a straggler)."""
        if host not in self.nodes:
            raise ValueError(f"node {host!r} is not one of this launch's nodes ({', '.join(self.nodes)})")
        self.slow.setdefault(host, reason)

    def clear_suspects(self) -> None:
        """An attempt failed with no node to blame: the suspicion chain is broken."""
        self.suspect = {}

    def choose(self, swap_slow: bool = True) -> list[str]:
        """The nodes of the next attempt: the current ones, each failed node replaced by the first buffer node, then
        each slow node while buffer nodes are left (it is failed from then on, with its reason; not with
        ``swap_slow=False``: an in-job restart keeps the processes of every node that did not fail).

        Raises:
            OutOfNodesError: naming the failed nodes, the number needed and the number left.
        """
        spare = self.buffer
        chosen: list[str] = []
        for node in self.current:
            if node not in self.failed:
                chosen.append(node)
            elif spare:
                chosen.append(spare.pop(0))
        for i, node in enumerate(chosen):
            if swap_slow and node in self.slow and spare:
                self.mark_failed(node, self.slow.pop(node))
                chosen[i] = spare.pop(0)
        if len(chosen) < self.nnodes:
            failed = ", ".join(f"{h} ({why})" for h, why in self.failed.items())
            healthy = len(self.nodes) - len(self.failed)
            raise OutOfNodesError(
                f"out of nodes: {self.nnodes} needed, {healthy} healthy left of {len(self.nodes)} "
                f"(failed: {failed}); allocate more buffer nodes (--buffer-nodes) or fix the failed ones"
            )
        self.current = chosen
        return list(chosen)
