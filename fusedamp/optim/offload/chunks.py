"""The chunks of an offloaded step: the params the CPU steps together (their buckets) and copies back
while it steps the next, in the order their grads landed in backward, and the plan that keeps them
from one step to the next."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusedamp.optim._executor import Stepper
from fusedamp.optim._plan import BuiltFrom
from fusedamp.optim._step import Bucket
from fusedamp.optim.offload.slots import Slot

# Elements of params per chunk of an offloaded step: each chunk's params are copied back while
# the CPU steps the next one (a chunk of 16M bf16 params is 32 MB, ~1 ms over PCIe 5).
CHUNK_ELEMENTS = 1 << 24


@dataclass
class Chunk:
    """Params stepped together (their buckets) and copied back while the next chunk steps."""

    slots: list[Slot]
    buckets: list[Bucket]


def in_arrival_order(slots: list[Slot]) -> list[Slot]:
    """``slots`` in the order their grads first landed in backward; those that never did last, in
    the optimizer's order."""
    return sorted(slots, key=lambda slot: (slot.arrival is None, slot.arrival or 0))


class ChunkPlan:
    """Chunks of host copies and their buckets (and op calls), reused while nothing they were built
    from changed: the same slots in the same order with the same host tensors and groups, and what
    a StepPlan watches (see _plan.BuiltFrom).

    >>> plan = ChunkPlan()
    >>> chunks = plan.chunks(opt, slots, groups={})  # built at the first call, then kept
    """

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self.last: list[Chunk] = []  # the chunks of the last step
        self._built_from: BuiltFrom | None = None

    def chunks(
        self, optimizer: Stepper, slots: list[Slot], groups: dict[int, dict[str, Any]]
    ) -> list[Chunk]:
        """The chunks of ``slots`` in their order; ``groups``: the group each bucket reads instead
        of a param group, by the param group's id (the delayed step's copies)."""
        key = tuple(
            id(x) for slot in slots for x in (slot.host, slot.grad, groups.get(id(slot.group), slot.group))
        )
        built_from = self._built_from
        if key == self._key and built_from is not None and built_from.unchanged(optimizer):
            return self.last
        members: list[list[Slot]] = []
        elements = CHUNK_ELEMENTS
        for slot in slots:
            if elements >= CHUNK_ELEMENTS:
                members.append([])
                elements = 0
            members[-1].append(slot)
            elements += slot.param.numel()
        chunks = []
        for chunk in members:
            entries = [(groups.get(id(s.group), s.group), s.param, s.host, s.grad) for s in chunk]
            chunks.append(Chunk(chunk, optimizer._buckets(entries)))
        self._key, self.last, self._built_from = key, chunks, None
        if BuiltFrom.plannable(optimizer):
            states = [state for chunk in chunks for bucket in chunk.buckets for state in bucket.states]
            self._built_from = BuiltFrom(optimizer, states)
        return chunks
