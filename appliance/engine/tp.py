"""Tensor parallelism: this process is rank 0 (the driver) and spawns N-1 worker ranks.

The scheduler and the block manager run once, in the driver. Each step the driver sends the
SchedulerOutput (swap mappings included) to every worker (msgpack over a pipe), then all ranks
run the same forward: the all-reduces inside the layers need every rank. Only the driver
samples. Rank r uses GPU r with NCCL, or the CPU with gloo. `executor.load_model` starts this when
`parallel.tensor_parallel_size` > 1; `LoadedModel.close()` (`Engine.close()`) or exit stops it.

A worker that dies ends the engine within a second or so: a monitor thread waits on the worker
processes' sentinels, records which rank died and how, and kills the other workers, which makes
the driver's pending collective fail at once (gloo raises "connection closed by peer"; an NCCL
group is aborted). The step then raises TPWorkerError naming the rank; an idle engine learns it
through `on_failure` (the engine core can exit at once instead of at the next request). A
collective timeout is the backstop for a peer that hangs without dying.

Workers are spawned, so a script that builds a TP engine at import time must guard it with
`if __name__ == "__main__":` (the usual multiprocessing rule).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar, cast

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from appliance.config import ApplianceConfig, ConfigError
from appliance.core.scheduler_output import SchedulerOutput
from appliance.engine.backend import device_type
from appliance.engine.loader import LoadedModel, load_this_rank, resolve_model_dir
from appliance.engine.model_runner import RunnerOutput
from appliance.engine.rank_commands import Done, RankCommand, encode_command
from appliance.engine.tp_worker import (
    STOP,
    Failed,
    Hello,
    Ready,
    WorkerArgs,
    encode_step,
    report_decoder,
    worker_main,
)
from appliance.layers.parallel import set_tensor_parallel

log = logging.getLogger("appliance.tp")

# Backstop for a rank that hangs inside a collective without dying (the monitor catches deaths
# in well under a second). Generous: one step of a long prefill on a slow box must never trip it.
COLLECTIVE_TIMEOUT_S = 300.0
# Spawned workers import torch and the engine before saying hello.
STARTUP_TIMEOUT_S = 300.0
# Loading a shard of a large model from disk.
LOAD_TIMEOUT_S = 1800.0
MONITOR_POLL_S = 0.2
_R = TypeVar("_R", Hello, Ready, Done)


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker died or failed: the engine cannot take another step."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextmanager
def _children_allowed() -> Iterator[None]:
    """Lift the daemon flag of this process while spawning. The server's engine core runs as a
    daemonic process, and multiprocessing refuses children there so that none is orphaned when
    it is killed. Ours cannot be: a worker exits when its command pipe reaches EOF or its parent
    pid changes (tp_worker.py), so the rule's reason does not apply."""
    me = mp.current_process()
    daemonic = bool(me.daemon)
    if daemonic:
        me.daemon = False
    try:
        yield
    finally:
        if daemonic:
            me.daemon = True


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    commands: Connection  # driver -> worker
    reports: Connection  # worker -> driver


_active: TPExecutor | None = None


class TPExecutor:
    """The driver's side: owns the worker processes, the process group and rank 0's runner."""

    def __init__(self, size: int, backend: str) -> None:
        self.size = size
        self.backend = backend
        self.workers: list[_Worker] = []
        self.loaded: LoadedModel | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._dead = threading.Event()
        self._failure = ""
        self._closed = False
        self._monitor: threading.Thread | None = None
        self._saved_threads = torch.get_num_threads()
        # Called once, from the monitor thread, with the reason when a worker dies or fails.
        self.on_failure: Callable[[str], None] | None = None

    # -- start ----------------------------------------------------------------------------------
    @classmethod
    def start(
        cls, config: ApplianceConfig, progress: Callable[[str], None] | None = None
    ) -> TPExecutor:
        global _active
        say = progress or (lambda msg: log.info(msg))
        size = config.parallel.tensor_parallel_size
        if _active is not None or dist.is_initialized():
            raise ConfigError(
                "parallel.tensor_parallel_size: a tensor-parallel engine already runs in this "
                "process (torch.distributed has one group per process); close it first"
            )
        on_cuda = device_type(config) == "cuda"
        if on_cuda and torch.cuda.device_count() < size:
            raise ConfigError(
                f"parallel.tensor_parallel_size {size}: only {torch.cuda.device_count()} "
                "CUDA devices are visible"
            )
        # Build or fetch the model once, here, rather than racing N ranks into one directory.
        model_dir = resolve_model_dir(config, say)
        model = msgspec.structs.replace(
            config.model, path=str(model_dir), demo_shape="", packaged=""
        )
        config = msgspec.structs.replace(config, model=model)
        ex = cls(size, "nccl" if on_cuda else "gloo")
        _active = ex
        atexit.register(ex.close)
        try:
            ex._start(config, say)
        except BaseException as exc:
            failure = ex._failure
            ex.close()
            # A refusal (ConfigError) is made by every rank alike: rank 0's is the one to
            # report, even when a worker exited with its own first.
            same_refusal = isinstance(exc, ConfigError) and "ConfigError:" in failure
            if failure and not isinstance(exc, TPWorkerError) and not same_refusal:
                raise TPWorkerError(failure) from exc
            raise
        return ex

    def _start(self, config: ApplianceConfig, say: Callable[[str], None]) -> None:
        threads = max(1, _cpus() // self.size)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        say(
            f"tensor parallel {self.size}: starting {self.size - 1} worker processes ({self.backend})"
        )
        with _children_allowed():
            self._spawn(ctx, config, init_method, threads)
        self._monitor = threading.Thread(
            target=self._watch, name="appliance-tp-monitor", daemon=True
        )
        self._monitor.start()
        for w in self.workers:
            self._await_report(w, Hello, STARTUP_TIMEOUT_S)
        if self.backend == "gloo":
            # One rank per core share: N ranks x all cores would thrash the CPU.
            torch.set_num_threads(threads)
        dist.init_process_group(
            self.backend,
            init_method=init_method,
            rank=0,
            world_size=self.size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        # For the engine's lifetime, not just around each step: anything that runs this
        # process's model (calibration, evaluation tools) must take part in the collectives.
        set_tensor_parallel(0, self.size)
        loaded = load_this_rank(config, say)
        for w in self.workers:
            ready = self._await_report(w, Ready, LOAD_TIMEOUT_S)
            if ready.num_blocks != loaded.num_blocks:
                raise TPWorkerError(
                    f"rank {w.rank} sized its KV pool at {ready.num_blocks} blocks, rank 0 at "
                    f"{loaded.num_blocks}: the ranks must agree"
                )
        loaded.executor = self
        loaded.workers = self
        self.loaded = loaded
        self.runner = loaded.runner
        say(f"tensor parallel {self.size}: all ranks ready")

    def _spawn(self, ctx: Any, config: ApplianceConfig, init_method: str, threads: int) -> None:
        for rank in range(1, self.size):
            cmd_recv, cmd_send = ctx.Pipe(duplex=False)
            rep_recv, rep_send = ctx.Pipe(duplex=False)
            args = WorkerArgs(
                rank, self.size, init_method, self.backend, COLLECTIVE_TIMEOUT_S, threads, config
            )
            proc = ctx.Process(
                target=worker_main,
                args=(args, cmd_recv, rep_send),
                name=f"appliance-tp{rank}",
                daemon=True,
            )
            proc.start()
            # The child holds its own ends; closing ours lets EOF reach whoever is left.
            cmd_recv.close()
            rep_send.close()
            self.workers.append(_Worker(rank, proc, cmd_send, rep_recv))

    def _await_report(self, w: _Worker, kind: type[_R], timeout: float) -> _R:
        """Wait for a worker's next report, failing fast if it reports an error or dies."""
        deadline = time.monotonic() + timeout
        while True:
            if self._failure:
                raise TPWorkerError(self._failure)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TPWorkerError(
                    f"tensor-parallel rank {w.rank} sent no {kind.__name__} within {timeout:.0f} s"
                )
            ready = wait([w.reports, w.process.sentinel], timeout=min(left, MONITOR_POLL_S))
            if w.reports in ready:
                report = report_decoder.decode(w.reports.recv_bytes())
                if isinstance(report, Failed):
                    self._fail(f"tensor-parallel rank {w.rank} failed to start: {report.error}")
                    raise TPWorkerError(self._failure)
                assert isinstance(report, kind), f"rank {w.rank}: expected {kind}, got {report}"
                return report
            if w.process.sentinel in ready:
                self._fail(self._death_message(w))
                raise TPWorkerError(self._failure)

    # -- steps ----------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self._failure:
            raise TPWorkerError(self._failure)
        if self._closed:
            raise TPWorkerError("the tensor-parallel engine is closed")
        data = encode_step(out)
        try:
            for w in self.workers:
                w.commands.send_bytes(data)
            return self.runner.execute(out)
        except Exception as exc:
            # A failed collective almost always means a peer died: give the monitor a moment
            # to name it. Either way the ranks are out of step and cannot be resynchronised.
            self._dead.wait(timeout=2.0)
            self._fail(self._failure or f"tensor-parallel rank 0 failed in a step: {exc!r}")
            raise TPWorkerError(self._failure) from exc

    def run_command(self, command: RankCommand) -> list[tuple[int, Done]]:
        """Run a command (engine/rank_commands.py) on every worker between steps and wait for
        each one's answer. A worker that dies or hangs stops the engine, as in a step."""
        if self._failure:
            raise TPWorkerError(self._failure)
        data = encode_command(command)
        try:
            for w in self.workers:
                w.commands.send_bytes(data)
            return [
                (w.rank, self._await_report(w, Done, COLLECTIVE_TIMEOUT_S)) for w in self.workers
            ]
        except (OSError, TPWorkerError) as exc:
            # Some ranks may have run it and others not: they cannot be resynchronised.
            self._fail(self._failure or f"tensor-parallel command {command!r} failed: {exc!r}")
            raise TPWorkerError(self._failure) from exc

    # -- failure --------------------------------------------------------------------------------
    def _watch(self) -> None:
        by_sentinel = {w.process.sentinel: w for w in self.workers}
        while not self._stopping.is_set():
            for sentinel in wait(list(by_sentinel), timeout=MONITOR_POLL_S):
                if self._stopping.is_set():
                    return
                # wait() gives back what it was given: the sentinels, ints.
                self._fail(self._death_message(by_sentinel[cast(int, sentinel)]))
                return

    def _death_message(self, w: _Worker) -> str:
        w.process.join(timeout=1.0)  # the sentinel fires before the exit status is collected
        code = w.process.exitcode
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        detail = ""
        try:
            if w.reports.poll(0.1):
                report = report_decoder.decode(w.reports.recv_bytes())
                if isinstance(report, Failed):
                    detail = f": {report.error}"
        except (OSError, EOFError, msgspec.DecodeError):
            pass
        return (
            f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) {how}{detail}; "
            "the engine has stopped"
        )

    def _fail(self, reason: str) -> None:
        """Record the first failure and stop every worker, which unblocks rank 0's collective."""
        with self._lock:
            if self._failure:
                return
            self._failure = reason
        log.error("%s", reason)
        self._dead.set()
        for w in self.workers:
            if w.process.is_alive():
                w.process.kill()
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:  # noqa: BLE001 - a faulty hook must not hide the failure
                log.exception("tensor-parallel on_failure hook")
        if self.backend == "nccl" and dist.is_initialized():
            # NCCL waits on a dead peer forever; gloo already raised "connection closed".
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as exc:  # noqa: BLE001 - best effort on the way down
                log.warning("could not abort the NCCL group: %r", exc)

    @property
    def failure(self) -> str:
        return self._failure

    # -- shutdown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (cleanly when they are healthy), tear down the process group and
        restore this process's torch threads and TP state (size 1). Idempotent; also runs at
        exit."""
        global _active
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stopping.set()
        for w in self.workers:
            try:
                w.commands.send_bytes(STOP)
            except OSError:
                pass
        for w in self.workers:
            w.process.join(timeout=10.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=5.0)
            w.commands.close()
            w.reports.close()
        if self._monitor is not None:
            self._monitor.join(timeout=2.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - the group may already be broken
                log.debug("destroy_process_group: %r", exc)
        torch.set_num_threads(self._saved_threads)
        set_tensor_parallel(0, 1)
        atexit.unregister(self.close)
        if _active is self:
            _active = None

    def __repr__(self) -> str:
        state = "failed" if self._failure else "closed" if self._closed else "running"
        pids: list[Any] = [w.process.pid for w in self.workers]
        return f"TPExecutor(size={self.size}, backend={self.backend}, {state}, workers={pids})"
