"""Run-time LoRA loads and unloads on every rank's slot pool at once (tensor parallelism).

The driver (rank 0) has read and checked the adapter and the scheduler has given it a slot
(appliance.engine.lora_admin). `LoraRanks.load` then has every worker rank read the adapter
itself and fill that slot with its own shard of the factors (`run_on_this_rank`, answering the
driver), and only when all of them did does rank 0 fill its own: no step can name the adapter
before every rank holds it, since steps and commands share one channel and the engine core
sends no step while a load runs. When any rank fails, every rank drops the adapter again (a
rank whose fill stopped half way has already marked that slot empty, so nothing ever runs on
a half-filled slot) and the load answers the first failure, naming the rank and its cause.
At tensor parallel size 1 there are no workers and the load is rank 0's fill alone."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.engine.lora_pool import LoraSlotPool
from appliance.engine.rank_commands import (
    Done,
    LoadAdapter,
    RankCommand,
    UnloadAdapter,
    WorkerRanks,
)
from appliance.models.peft_adapter import AdapterError, LoraAdapter


def run_on_this_rank(pool: LoraSlotPool | None, command: RankCommand) -> Done:
    """A worker rank's side of a command; never raises (the rank keeps serving steps)."""
    if pool is None:
        return Done("lora.enabled: LoRA is off on this rank")
    error, refused = "", False
    try:
        if isinstance(command, LoadAdapter):
            pool.place(pool.read(command.name, command.path), command.slot)
        elif isinstance(command, UnloadAdapter):
            pool.unload(command.name)
    except AdapterError as exc:
        error, refused = str(exc), True
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which rolls back
        error = f"{type(exc).__name__}: {exc}"
    return Done(error, refused, sorted(pool.adapters), list(pool.slot_names))


def _not_filled(done: Done, name: str, slot: int) -> Done:
    """A rank that answered success yet does not hold the adapter in the slot (a bug, but the
    ranks must never disagree about what a slot holds)."""
    held = done.slots[slot] if slot < len(done.slots) else "no such slot"
    return Done(f"slot {slot} holds {held!r}, not {name!r}, after the load")


@dataclass
class RankFailure:
    """Why a load did not happen on every rank. `refused`: the adapter's fault (a 400), else
    a rank's own (a 500)."""

    rank: int
    detail: str
    refused: bool


class LoraRanks:
    """Every rank's slot pool, driven from rank 0: a load fills the slot on all or none."""

    def __init__(self, pool: LoraSlotPool, workers: WorkerRanks) -> None:
        self.pool = pool
        self.workers = workers

    def load(self, adapter: LoraAdapter, path: str, slot: int) -> RankFailure | None:
        """Fill `slot` with `adapter` (read by rank 0 from `path`) on every rank; None when
        done, else the first failure, with no rank keeping the adapter."""
        try:
            answers = self.workers.run_command(LoadAdapter(adapter.name, path, slot))
        except RuntimeError as exc:  # a worker is gone: the engine stops (engine/tp.py)
            return RankFailure(-1, str(exc), False)
        failures = [
            (rank, done if done.error else _not_filled(done, adapter.name, slot))
            for rank, done in answers
            if done.error or done.slots[slot : slot + 1] != [adapter.name]
        ]
        if not failures:
            try:
                self.pool.place(adapter, slot)
                return None
            except Exception as exc:  # noqa: BLE001 - rolled back and answered below
                failures = [(0, Done(f"{type(exc).__name__}: {exc}"))]
        self.unload(adapter.name)
        rank, done = failures[0]
        detail = f"{done.error} (tensor-parallel rank {rank}; no rank keeps {adapter.name!r})"
        return RankFailure(rank, detail, done.refused)

    def unload(self, name: str) -> None:
        """Drop the adapter on every rank (its slot is empty everywhere afterwards)."""
        self.pool.unload(name)
        answers = self.workers.run_command(UnloadAdapter(name))
        failed = [f"rank {rank}: {done.error}" for rank, done in answers if done.error]
        if failed:  # an unload only drops host copies: a failure is the rank's own breakage
            raise RuntimeError(f"unloading LoRA adapter {name!r} failed on " + "; ".join(failed))
