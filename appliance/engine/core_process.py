"""The engine core process: loads the model, then loops schedule -> forward -> outputs.

It runs in its own (spawned) process so that the step loop, which holds the GIL for most of a
step, never stalls the API's event loop. Between steps it drains every pending message (adds,
aborts, stats requests), so an abort or a new request waits at most one step.

Top-level imports stay light: the API process imports this module only to name the target
function for `multiprocessing`; torch and the engine are imported inside the child.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec

from appliance.core.request import FinishReason
from appliance.engine import ipc
from appliance.engine.heap import HeapTrimmer

if TYPE_CHECKING:
    from appliance.config import ApplianceConfig
    from appliance.core.scheduler_output import SchedulerOutput
    from appliance.engine.llm_engine import Engine
    from appliance.engine.lora_admin import LoraAdmin
    from appliance.engine.model_runner import RunnerOutput

log = logging.getLogger("appliance.core")

# How long the idle loop blocks on the pipe: bounds how late it notices a dead parent.
IDLE_POLL_S = 1.0
# Fault injection for tests: seconds of sleep added to every engine step (a slow step, as on a
# loaded CPU box or a long prefill), to prove that deadlines do not wait for step boundaries.
STEP_DELAY_ENV = "APPLIANCE_TEST_STEP_DELAY_S"


def core_main(conn: Connection, config_json: bytes, log_level: str = "INFO") -> None:
    """Entry point of the core process (multiprocessing target)."""
    # systemd (KillMode=control-group) and a terminal's Ctrl-C signal the whole group; only the
    # API process decides when to stop, so the core finishes in-flight work while it drains.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        core = _Core.start(conn, config_json)
    except Exception as exc:  # report why, the API decides what to do
        log.exception("engine core failed to start")
        _send(conn, ipc.Failed(f"{type(exc).__name__}: {exc}"))
        return
    try:
        core.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the API process went away: nothing left to serve
    finally:
        core.loaded.close()  # tensor-parallel worker ranks, if any


def core_threads(configured: int = 0) -> int | None:
    """Torch threads for the core (hardware.engine_threads; 0: every core). Measured over HTTP
    on a 2-core Zen 3 with the load generator on the same box (cpu-demo, 64 plain requests at
    once, 128/128): 2 threads 138.7 output tok/s (TTFT p50 11.0 s), 1 thread 96.1 (18.3 s); the
    API process's HTTP and SSE work fits in the gaps of the core's OpenMP regions. None keeps
    torch's choice (OMP_NUM_THREADS set, no configured value)."""
    if configured > 0:
        return configured
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return None
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def live_request_objects() -> dict[str, int]:
    """Objects that exist per request in this process, counted after a garbage collection:
    wherever a finished request's state were kept, it would show here."""
    import gc

    from appliance.core.request import Request
    from appliance.engine.outputs import EngineOutput, Logprob

    gc.collect()
    kinds = (Request, EngineOutput, Logprob)
    counts = {kind.__name__: 0 for kind in kinds}
    for obj in gc.get_objects():
        if isinstance(obj, kinds):
            counts[type(obj).__name__] += 1
    return counts


def _slow_forward(engine: Engine, delay_s: float) -> None:
    """The fault injection of STEP_DELAY_ENV: every forward pass takes `delay_s` longer (after
    scheduling, as a long prefill or a loaded box would)."""
    runner = engine.runner
    if engine.executor is runner:
        # Both of the runner's entries (execute and the pausable step) go through this one.
        run = runner.execute_or_pause

        def slow_run(out: SchedulerOutput, pause: Callable[[], bool] | None) -> RunnerOutput | None:
            time.sleep(delay_s)
            return run(out, pause)

        # Fault injection: the instance's method, replaced on this instance only.
        runner.execute_or_pause = slow_run  # type: ignore[method-assign]
    else:
        execute = engine.executor.execute

        def slow_execute(out: SchedulerOutput) -> RunnerOutput:
            time.sleep(delay_s)
            return execute(out)

        engine.executor.execute = slow_execute  # type: ignore[method-assign]
    log.warning("fault injection: every engine step sleeps %.1fs (%s)", delay_s, STEP_DELAY_ENV)


def _send(conn: Connection, msg: msgspec.Struct) -> None:
    conn.send_bytes(ipc.encode(msg))


class _Core:
    def __init__(
        self, conn: Connection, config: ApplianceConfig, engine: Engine, loaded: Any
    ) -> None:
        self.conn = conn
        self.config = config
        self.engine = engine
        self.loaded = loaded
        self.running = True
        # Set by the operator (/admin/pause): no steps run until /admin/resume.
        self.paused = False
        engine.on_started = self._send_started
        # What steps freed goes back to the OS when idle and every few busy seconds: without
        # it glibc keeps the heap a mix of step sizes leaves behind (appliance.engine.heap).
        self.heap = HeapTrimmer(config.hardware.heap_trim_interval_s)
        from appliance.engine.lora_admin import LoraAdmin  # torch: the child only

        self.lora: LoraAdmin = LoraAdmin(engine)
        # Between two layers of a step, the core takes new requests (a cut-in, Engine.step);
        # every other message waits here for the step's end: an abort then could free blocks
        # the rest of the step writes.
        self._frame = ipc.Frame()
        self._held: list[ipc.ToCore] = []
        engine.take_arrivals = self._take_arrivals
        delay = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
        if delay > 0:
            _slow_forward(engine, delay)

    @classmethod
    def start(cls, conn: Connection, config_json: bytes) -> _Core:
        t0 = time.perf_counter()
        from appliance.config import config_from_dict
        from appliance.engine.executor import load_model
        from appliance.engine.llm_engine import Engine
        from appliance.engine.lora_admin import LoraAdmin

        imports = time.perf_counter() - t0
        config = config_from_dict(msgspec.json.decode(config_json), "reloaded config")
        threads = core_threads(config.hardware.engine_threads)
        if threads:
            import torch

            torch.set_num_threads(threads)
            log.info("engine core: %d torch threads", threads)

        def progress(text: str) -> None:
            _send(conn, ipc.Status(text))

        progress(f"imports done in {imports:.2f}s, loading the model")
        loaded = load_model(config, progress=progress)
        t = time.perf_counter()
        engine = Engine(config, loaded=loaded)
        phases = {"core_imports": imports, **loaded.phase_times}
        phases["engine_init"] = time.perf_counter() - t
        _send(
            conn,
            ipc.CoreInfo(
                model_name=engine.model_name,
                model_dir=str(loaded.model_dir),
                max_model_len=engine.max_model_len,
                vocab_size=loaded.args.vocab_size,
                num_blocks=loaded.num_blocks,
                num_swap_blocks=loaded.num_swap_blocks,
                block_size=loaded.block_size,
                device=str(loaded.device),
                dtype=str(loaded.dtype).removeprefix("torch."),
                pid=os.getpid(),
                phase_times=phases,
                backend=loaded.backend.describe(),
                lora_adapters=LoraAdmin(engine).adapters(),
            ),
        )
        return cls(conn, config, engine, loaded)

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        engine = self.engine
        while self.running:
            out = self._frame = ipc.Frame()
            held, self._held = self._held, []
            for msg in held:
                self._handle(msg, out)
            busy = not self.paused and (engine.has_unfinished() or bool(engine.scheduler.finished))
            if not busy:
                self.heap.idle()
            # Block only when idle; while busy, take what has arrived and step.
            if self.running and self.conn.poll(0 if busy else IDLE_POLL_S):
                while True:
                    self._handle(ipc.decode_to_core(self.conn.recv_bytes()), out)
                    if not self.running or not self.conn.poll(0):
                        break
            if not self.running:
                break
            stepped = not self.paused and bool(engine.has_unfinished() or engine.scheduler.finished)
            if stepped:
                self._step(out)
            if out.added or out.outputs or out.steps:
                out.waiting_by_class = self._waiting_by_class()
                out.num_running = len(engine.scheduler.running)
                out.departure_rate = engine.departures.rate
                _send(self.conn, out)
            # After the frame: an unload is answered once its requests' last outputs are out.
            for token, answer in self.lora.finished_unloads():
                self._lora_reply(token, answer.status, answer.detail)
            if stepped:  # after the send: a trim never delays a step's tokens
                self.heap.stepped()

    def _take_arrivals(self) -> bool:
        """Engine.take_arrivals: the requests that arrived since the step began, added now;
        pings and stats answered; the rest held for the step's end."""
        added = False
        while self.conn.poll(0):
            msg = ipc.decode_to_core(self.conn.recv_bytes())
            if isinstance(msg, ipc.AddRequest):
                self._frame.added.append(self._add(msg))
                added = True
            elif isinstance(msg, ipc.GetStats | ipc.Ping):
                self._handle(msg, self._frame)
            else:
                self._held.append(msg)
        return added

    def _send_started(self, request_ids: list[str]) -> None:
        _send(self.conn, ipc.Frame(started=request_ids))

    def _step(self, out: ipc.Frame) -> None:
        outputs = self.engine.step()
        rec = self.engine.history.records[-1] if self.engine.history.records else None
        if rec is not None and rec.num_seqs:
            out.steps.append((rec.num_scheduled_tokens, rec.num_seqs))
        out.outputs.extend(outputs)

    def _handle(self, msg: ipc.ToCore, out: ipc.Frame) -> None:
        if isinstance(msg, ipc.AddRequest):
            out.added.append(self._add(msg))
        elif isinstance(msg, ipc.AbortRequests):
            reason = FinishReason(msg.reason)
            for rid in msg.request_ids:
                if reason is FinishReason.QUEUE_TIMEOUT:
                    self.engine.expire(rid, msg.detail)
                else:
                    self.engine.abort(rid, reason)
        elif isinstance(msg, ipc.GetStats):
            _send(self.conn, self._stats(msg))
        elif isinstance(msg, ipc.Ping):
            _send(self.conn, ipc.Pong(msg.token))
        elif isinstance(msg, ipc.SetPaused):
            self.paused = msg.paused
        elif isinstance(msg, ipc.Reconfigure):
            _send(self.conn, self._reconfigure(msg))
        elif isinstance(msg, ipc.HoldClass):
            self.engine.scheduler.hold_class(msg.priority_class, msg.held)
        elif isinstance(msg, ipc.Shutdown):
            self.running = False
        elif isinstance(msg, ipc.LoadLora):
            answer = self.lora.load(msg.name, msg.path)
            self._lora_reply(msg.token, answer.status, answer.detail)
        elif isinstance(msg, ipc.UnloadLora):
            pending = self.lora.begin_unload(msg.token, msg.name)
            if pending is not None:
                self._lora_reply(msg.token, pending.status, pending.detail)

    def _lora_reply(self, token: int, status: int, detail: str) -> None:
        adapters = self.lora.adapters() or {}
        _send(
            self.conn, ipc.LoraReply(token=token, status=status, detail=detail, adapters=adapters)
        )

    def _reconfigure(self, msg: ipc.Reconfigure) -> ipc.Reconfigured:
        from appliance.config import ConfigError, config_from_dict

        try:
            self.engine.reconfigure(config_from_dict(msg.config, "live config"))
        except ConfigError as exc:
            return ipc.Reconfigured(msg.token, self.engine.step_count, str(exc))
        return ipc.Reconfigured(msg.token, self.engine.step_count)

    def _add(self, msg: ipc.AddRequest) -> ipc.AddResult:
        try:
            req = self.engine.add_request(
                msg.prompt_token_ids,
                msg.params,
                request_id=msg.request_id,
                priority=msg.priority,
                arrival_time=msg.arrival_time,
                lora_name=msg.lora_name,
            )
        except ValueError as exc:
            return ipc.AddResult(msg.request_id, "invalid", str(exc), getattr(exc, "code", ""))
        if req.is_finished:
            reason = req.finish_reason.value if req.finish_reason else "queue_full"
            return ipc.AddResult(msg.request_id, reason, req.finish_detail)
        return ipc.AddResult(msg.request_id)

    def _waiting_by_class(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for req in self.engine.scheduler.waiting:
            counts[req.priority_class] = counts.get(req.priority_class, 0) + 1
        return counts

    # -- figures ---------------------------------------------------------------------------------
    def _stats(self, msg: ipc.GetStats) -> ipc.StatsReply:
        from appliance.engine.stats import snapshot

        reply = ipc.StatsReply(
            token=msg.token, snapshot=snapshot(self.engine, msg.history_s, msg.detail)
        )
        if msg.count_objects:
            reply.live_objects = live_request_objects()
        return reply
