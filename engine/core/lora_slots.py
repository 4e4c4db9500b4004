"""Which LoRA adapter is resident in which of the engine's `max_loras` slots. No torch.

The scheduler's bookkeeping for adapter residency: a request takes its adapter's slot
when it is admitted (RUNNING) and gives it back when it leaves (finished or preempted).
An adapter that is not resident takes a slot never used, else the least recently used
slot that no running request holds (its adapter is evicted); when every slot is held
the request waits. The runner loads a slot's weights when the adapter it holds changed
(`engine.models.lora`).
"""

from __future__ import annotations

from collections import OrderedDict

from sluice.engine.lora import LoRARequest


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: dict[LoRARequest, int] = {}
        self._holders = [0] * num_slots  # running requests per slot
        # resident adapters whose slot no running request holds, least recently used first
        self._idle: OrderedDict[int, LoRARequest] = OrderedDict()
        self._never_used = list(range(num_slots - 1, -1, -1))  # popped from the end
        self.num_loads = 0  # slot assignments to an adapter that was not resident

    def slot_of(self, lora: LoRARequest) -> int | None:
        return self._slot_of.get(lora)

    def can_acquire(self, lora: LoRARequest) -> bool:
        return lora in self._slot_of or bool(self._never_used) or bool(self._idle)

    def acquire(self, lora: LoRARequest) -> int | None:
        """The adapter's slot, held once more; None when every slot is held by others."""
        slot = self._slot_of.get(lora)
        if slot is None:
            if self._never_used:
                slot = self._never_used.pop()
            elif self._idle:
                slot, evicted = self._idle.popitem(last=False)
                del self._slot_of[evicted]
            else:
                return None
            self._slot_of[lora] = slot
            self.num_loads += 1
        self._idle.pop(slot, None)
        self._holders[slot] += 1
        return slot

    def release(self, lora: LoRARequest) -> None:
        slot = self._slot_of[lora]
        self._holders[slot] -= 1
        assert self._holders[slot] >= 0
        if self._holders[slot] == 0:
            self._idle[slot] = lora  # most recently used: evicted last

    def resident(self) -> dict[LoRARequest, int]:
        return dict(self._slot_of)

    def num_held(self, slot: int) -> int:
        return self._holders[slot]
