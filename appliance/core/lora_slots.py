"""Which LoRA adapter holds which of the device's `lora.max_loras` slots, as the scheduler
decides it: plain Python, no tensors. The runner's slot pool (appliance.engine.lora_pool)
copies an adapter's factors into the slot a scheduled request names when that slot holds
something else.

An adapter keeps its slot while any running request uses it (`busy`); a request whose
adapter finds no slot (every slot busy) is not admitted this step. Otherwise the least
recently used idle adapter gives its slot up."""

from __future__ import annotations


class LoraSlotTable:
    def __init__(self, max_loras: int) -> None:
        self.slots: list[str | None] = [None] * max_loras
        self._last_used: dict[str, int] = {}
        self._clock = 0

    def slot_of(self, name: str) -> int:
        """The adapter's slot; -1 for the base model ("") or an adapter out of the pool."""
        if not name:
            return -1
        try:
            return self.slots.index(name)
        except ValueError:
            return -1

    def acquire(self, name: str, busy: set[str]) -> bool:
        """Give `name` a slot (keeping the one it has); False when every slot holds an adapter
        in `busy` (adapters that running requests use: never evicted)."""
        self._clock += 1
        if name in self.slots:
            self._last_used[name] = self._clock
            return True
        if None in self.slots:
            slot = self.slots.index(None)
        else:
            idle = [i for i, held in enumerate(self.slots) if held not in busy]
            if not idle:
                return False
            slot = min(idle, key=lambda i: self._last_used.get(self.slots[i] or "", 0))
            self._last_used.pop(self.slots[slot] or "", None)
        self.slots[slot] = name
        self._last_used[name] = self._clock
        return True

    def release(self, name: str) -> None:
        """An unloaded adapter leaves its slot."""
        slot = self.slot_of(name)
        if slot >= 0:
            self.slots[slot] = None
        self._last_used.pop(name, None)

    def resident(self) -> list[str]:
        return [name for name in self.slots if name is not None]
