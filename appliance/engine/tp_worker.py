"""A tensor-parallel worker rank: a spawned process that loads its shard and runs the forward of
every step the driver sends it, until the driver says stop or goes away.

Control travels over two one-way pipes, not through torch.distributed: a worker waiting for the
next step blocks in `recv_bytes`, which has no timeout to trip while the engine idles for hours,
and which raises EOFError the moment the driver dies. torch.distributed carries only the
collectives inside the forward. Between steps the driver may send a command instead (a
run-time LoRA load or unload: appliance.engine.rank_commands), which the worker answers on its
report pipe before it takes the next message.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from appliance.config import ApplianceConfig
from appliance.core.scheduler_output import SchedulerOutput
from appliance.engine.rank_commands import Done, decode_command, is_command

# Sent instead of a step: leave the loop and exit cleanly.
STOP = b""
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SchedulerOutput)


def encode_step(out: SchedulerOutput) -> bytes:
    return _encoder.encode(out)


def decode_step(data: bytes) -> SchedulerOutput:
    return _decoder.decode(data)


@dataclass
class WorkerArgs:
    rank: int
    size: int
    init_method: str
    backend: str
    # Collective timeout: the backstop for a peer that hangs without dying.
    timeout_s: float
    num_threads: int
    config: ApplianceConfig


class Hello(msgspec.Struct, tag=True):
    """Imports done; about to join the process group (the driver joins only after every
    worker said hello, so a worker that dies while starting never leaves it in a rendezvous)."""


class Ready(msgspec.Struct, tag=True):
    num_blocks: int
    num_swap_blocks: int
    bytes_per_block: int


class Failed(msgspec.Struct, tag=True):
    error: str


Report = Hello | Ready | Failed | Done
report_decoder = msgspec.msgpack.Decoder(Report)


def _exit_with_parent(parent: int) -> None:
    """A driver killed while this rank loads or waits to join the group must not leave it
    behind (the command pipe's EOF covers the idle case; this covers the rest)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def worker_main(args: WorkerArgs, commands: Connection, reports: Connection) -> None:
    """Entry point of a spawned worker. Any failure is reported (with its traceback) and ends
    the process, which the driver's monitor notices."""
    import torch
    import torch.distributed as dist

    from appliance.engine.loader import load_this_rank
    from appliance.engine.lora_ranks import run_on_this_rank
    from appliance.layers.parallel import set_tensor_parallel

    encoder = msgspec.msgpack.Encoder()
    threading.Thread(
        target=_exit_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True
    ).start()
    try:
        if args.backend == "gloo":
            torch.set_num_threads(args.num_threads)
        set_tensor_parallel(args.rank, args.size)
        reports.send_bytes(encoder.encode(Hello()))
        dist.init_process_group(
            args.backend,
            init_method=args.init_method,
            rank=args.rank,
            world_size=args.size,
            timeout=datetime.timedelta(seconds=args.timeout_s),
        )
        loaded = load_this_rank(args.config, progress=lambda _msg: None)
        runner = loaded.runner
        reports.send_bytes(
            encoder.encode(Ready(loaded.num_blocks, loaded.num_swap_blocks, loaded.bytes_per_block))
        )
        while True:
            data = commands.recv_bytes()
            if data == STOP:
                break
            if is_command(data):
                done = run_on_this_rank(runner.lora, decode_command(data))
                reports.send_bytes(encoder.encode(done))
                continue
            runner.execute(decode_step(data))
    except EOFError:
        # The driver is gone: nothing to report to, nothing left to serve.
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001 - report everything, then die
        detail = "".join(traceback.format_exception(exc)).strip()
        try:
            reports.send_bytes(encoder.encode(Failed(f"{type(exc).__name__}: {exc}\n{detail}")))
        except OSError:
            pass
        # os._exit: never run atexit handlers or a hanging process-group teardown on this path.
        os._exit(1)
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)
