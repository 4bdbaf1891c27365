"""Commands the tensor-parallel driver sends its worker ranks between steps, and each rank's
answer: load a LoRA adapter into a slot, unload one.

They travel on the command pipe the steps use (appliance.engine.tp_worker), so a command
reaches every rank before any step sent after it, and a worker answers on its report pipe.
A command is marked by a first byte msgpack never writes (0xc1): no encoded step begins with
it, so the steps stay plain SchedulerOutput messages, decoded as before.

Torch-free: the worker module imports it before torch is loaded."""

from __future__ import annotations

from typing import Protocol

import msgspec

# msgpack reserves 0xc1 ("never used"): an encoded step can never start with it.
COMMAND_MARK = b"\xc1"


class LoadAdapter(msgspec.Struct, tag=True):
    """Read the adapter at `path` and fill `slot` with this rank's shard of its factors (the
    driver has checked it and the scheduler gave it that slot)."""

    name: str
    path: str
    slot: int


class UnloadAdapter(msgspec.Struct, tag=True):
    """Drop the adapter (its host copy, and the slot it fills, if any). Idempotent."""

    name: str


class ListAdapters(msgspec.Struct, tag=True):
    """Change nothing; answer what this rank holds (a check that the ranks agree)."""


RankCommand = LoadAdapter | UnloadAdapter | ListAdapters


class Done(msgspec.Struct, tag=True):
    """A rank's answer: `error` is empty when the command succeeded. `refused` says the error
    is the adapter's (the reader's message naming the field), not the rank's own failure.
    `adapters` and `slots` are what the rank holds afterwards: the adapters on its host and
    the adapter each slot is filled with (None: empty, or a fill that did not finish)."""

    error: str = ""
    refused: bool = False
    adapters: list[str] = []
    slots: list[str | None] = []


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankCommand)


def encode_command(command: RankCommand) -> bytes:
    return COMMAND_MARK + _encoder.encode(command)


def is_command(data: bytes) -> bool:
    return data[:1] == COMMAND_MARK


def decode_command(data: bytes) -> RankCommand:
    return _decoder.decode(memoryview(data)[1:])


class WorkerRanks(Protocol):
    """The ranks other than this one (the driver's view): runs a command on each and returns
    (rank, answer) for every worker, in rank order; raises when a worker is gone."""

    def run_command(self, command: RankCommand) -> list[tuple[int, Done]]: ...


class NoWorkers:
    """Tensor parallel size 1: no other rank to tell."""

    def run_command(self, command: RankCommand) -> list[tuple[int, Done]]:
        return []
