"""Loading and unloading LoRA adapters while the engine runs (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, through the core process).

A load reads and checks the adapter (a bad one: 400 naming the field) and takes a device slot
at once, evicting the least recently used idle adapter where the pool is full; when every slot
serves running requests it is refused with 409, never by evicting a busy adapter. At tensor
parallel size > 1 every rank then reads its shard into that slot before the answer, or none
keeps it (engine/lora_ranks.py); the unload drops it on every rank. An unload
stops new requests naming the adapter at once and completes when the requests that use it
(running or queued) have finished: `finished_unloads` reports those between steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.engine.lora_pool import LoraSlotPool
from appliance.engine.lora_ranks import LoraRanks
from appliance.models.peft_adapter import AdapterError

if TYPE_CHECKING:
    from appliance.engine.llm_engine import Engine


@dataclass
class LoraAnswer:
    status: int
    detail: str


class LoraAdmin:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # (reply token, adapter name) of unloads waiting for the adapter's requests.
        self.pending: list[tuple[int, str]] = []

    def _pool(self) -> LoraSlotPool | None:
        return self.engine.runner.lora

    def _ranks(self, pool: LoraSlotPool) -> LoraRanks:
        return LoraRanks(pool, self.engine.loaded.workers)

    def adapters(self) -> dict[str, str] | None:
        """The adapters requests may name (name -> path); None when LoRA is off."""
        pool = self._pool()
        if pool is None:
            return None
        return {n: a.path for n, a in sorted(pool.adapters.items()) if n not in pool.draining}

    def load(self, name: str, path: str) -> LoraAnswer:
        pool, engine = self._pool(), self.engine
        if pool is None:
            return LoraAnswer(400, "lora_name: LoRA is off; set lora.enabled = true (or adapters)")
        if not name or name == engine.model_name:
            return LoraAnswer(400, f"lora_name: {name!r} is not a usable adapter name")
        if name in pool.adapters:
            return LoraAnswer(400, f"lora_name: the adapter {name!r} is already loaded")
        sched = engine.scheduler
        busy = {r.lora_name for r in sched.running if r.lora_name}
        try:
            adapter = pool.read(name, path)
        except AdapterError as exc:
            return LoraAnswer(400, str(exc))
        if not sched.lora_slots.acquire(name, busy):
            slots = len(sched.lora_slots.slots)
            return LoraAnswer(
                409,
                f"lora_name: all {slots} slots (lora.max_loras) hold adapters of running "
                "requests; retry when one is idle",
            )
        # Every rank fills the slot the scheduler gave it, or none does (engine/lora_ranks.py).
        failure = self._ranks(pool).load(adapter, path, sched.lora_slots.slot_of(name))
        if failure is not None:
            sched.lora_slots.release(name)
            return LoraAnswer(400 if failure.refused else 500, failure.detail)
        return LoraAnswer(200, f"Success: LoRA adapter '{name}' added successfully.")

    def begin_unload(self, token: int, name: str) -> LoraAnswer | None:
        """None: the adapter's requests still run; the answer comes from finished_unloads."""
        pool = self._pool()
        if pool is None or name not in pool.adapters or name in pool.draining:
            return LoraAnswer(404, f"lora_name: no LoRA adapter named {name!r} is loaded")
        pool.draining.add(name)
        self.pending.append((token, name))
        return None

    def finished_unloads(self) -> list[tuple[int, LoraAnswer]]:
        """Unloads whose adapter no request uses any more: done now."""
        if not self.pending:
            return []
        pool, sched = self._pool(), self.engine.scheduler
        in_use = {r.lora_name for r in sched.requests.values()}
        done, still = [], []
        for token, name in self.pending:
            if name in in_use:
                still.append((token, name))
                continue
            if pool is not None:
                self._ranks(pool).unload(name)
            sched.lora_slots.release(name)
            done.append(
                (token, LoraAnswer(200, f"Success: LoRA adapter '{name}' removed successfully."))
            )
        self.pending = still
        return done
