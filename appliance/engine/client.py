"""The API process's handle on the engine core process.

Spawns `core_process.core_main`, then speaks length-prefixed msgpack over a socket pair through
asyncio streams: writes are buffered (never block the event loop) and one reader task
dispatches every frame: admission results to futures, outputs through the output processor
(text, stop strings, per-request state) to each request's callback, step figures to a frame
hook (metrics). A stop string the processor matches is aborted in the core at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from appliance.config import ApplianceConfig
from appliance.core.policy import SchedulingPolicy, make_policy
from appliance.core.wait_estimate import estimated_wait_s
from appliance.engine import ipc
from appliance.engine.core_process import core_main
from appliance.engine.output_processor import OutputProcessor, RequestState
from appliance.engine.outputs import EngineOutput, RequestOutput
from appliance.sampling_params import SamplingParams

log = logging.getLogger("appliance.client")

OnOutput = Callable[[RequestState, RequestOutput], None]


class EngineError(RuntimeError):
    """The engine core failed to start or died."""


class EngineClient:
    def __init__(
        self,
        config: ApplianceConfig,
        log_level: str = "INFO",
        on_status: Callable[[str], None] | None = None,
        on_frame: Callable[[ipc.Frame], None] | None = None,
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        # The core's scheduler builds its policy from the same config with the same factory:
        # the API's queue checks ask this one instead of keeping a copy of the rule.
        self.policy: SchedulingPolicy = make_policy(config.scheduler)
        self.log_level = log_level
        self.on_status = on_status or (lambda text: log.info("core: %s", text))
        self.on_frame = on_frame
        self.on_death = on_death
        self.info: ipc.CoreInfo | None = None
        self.proc: BaseProcess | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        # Every live request's output state; the tokenizer is set once the API has loaded it.
        self.output = OutputProcessor(tokenizer=None)
        self._acks: dict[str, asyncio.Future[ipc.AddResult]] = {}
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._tokens = itertools.count(1)
        self._closing = False
        self.dead = False
        # Requests sent but not yet admitted, and the core's waiting counts, per class.
        self.in_transit: dict[str, int] = {}
        self.waiting_by_class: dict[str, int] = {}
        self._class_of: dict[str, str] = {}
        # The core's running count and departure rate as of its last frame.
        self.num_running = 0
        self.departure_rate: float | None = None

    # -- life cycle ------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 600.0) -> ipc.CoreInfo:
        """Spawn the core and wait until it has loaded the model (or failed, raising)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=core_main,
            args=(child, msgspec.json.encode(self.config), self.log_level),
            name="appliance-core",
            daemon=True,
        )
        self.proc.start()
        child.close()
        sock = socket.socket(fileno=os.dup(parent.fileno()))
        parent.close()
        self._reader, self._writer = await asyncio.open_unix_connection(sock=sock)
        try:
            info = await asyncio.wait_for(self._wait_ready(), timeout_s)
        except BaseException:
            await self._kill()
            raise
        self.info = info
        self._task = asyncio.create_task(self._read_loop(), name="engine-client-reader")
        return info

    async def _wait_ready(self) -> ipc.CoreInfo:
        while True:
            msg = await self._read()
            if msg is None:
                code = await asyncio.to_thread(self._join, 5.0)
                raise EngineError(f"engine core exited during start-up (exit code {code})")
            if isinstance(msg, ipc.Status):
                self.on_status(msg.text)
            elif isinstance(msg, ipc.Failed):
                raise EngineError(msg.error)
            elif isinstance(msg, ipc.CoreInfo):
                return msg

    def _join(self, timeout: float) -> int | None:
        assert self.proc is not None  # (shutdown checked)
        self.proc.join(timeout)
        return self.proc.exitcode

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, wait for it, and kill it if it does not."""
        if self.proc is None:
            return
        self._closing = True
        if not self.dead and self._writer is not None:
            try:
                self._send(ipc.Shutdown())
                await self._writer.drain()
            except (ConnectionError, RuntimeError):
                pass
        code = await asyncio.to_thread(self._join, timeout_s)
        if code is None:
            log.warning("engine core did not stop within %.0fs: killing it", timeout_s)
        await self._kill()

    async def _kill(self) -> None:
        self._closing = True
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            await asyncio.to_thread(self._join, 5.0)
        if self._writer is not None:
            self._writer.close()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._fail_all("engine core stopped")

    # -- wire ------------------------------------------------------------------------------------
    def _send(self, msg: msgspec.Struct) -> None:
        if self.dead or self._writer is None:
            raise EngineError("the engine core is not running")
        self._writer.write(ipc.frame(ipc.encode(msg)))

    async def _read(self) -> ipc.FromCore | None:
        assert self._reader is not None
        try:
            (n,) = ipc.HEADER.unpack(await self._reader.readexactly(ipc.HEADER.size))
            if n == ipc.LONG_MARKER:
                (n,) = ipc.LONG_HEADER.unpack(await self._reader.readexactly(ipc.LONG_HEADER.size))
            data = await self._reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return ipc.decode_from_core(data)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self._read()
                if msg is None:
                    break
                if isinstance(msg, ipc.Frame):
                    self._dispatch(msg)
                elif isinstance(msg, ipc.StatsReply | ipc.Pong | ipc.LoraReply):
                    fut = self._replies.pop(msg.token, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, ipc.Status):
                    self.on_status(msg.text)
        except Exception:
            log.exception("engine client reader failed")
        if not self._closing:
            self.dead = True
            code = self.proc.exitcode if self.proc is not None else None
            reason = f"engine core died (exit code {code})"
            log.error(reason)
            self._fail_all(reason)
            if self.on_death is not None:
                self.on_death(reason)

    def _dispatch(self, frame: ipc.Frame) -> None:
        for res in frame.added:
            cls = self._class_of.pop(res.request_id, "")
            self.in_transit[cls] = max(0, self.in_transit.get(cls, 0) - 1)
            fut = self._acks.pop(res.request_id, None)
            if res.rejected:
                self.output.end(res.request_id, res.rejected, res.detail)
            if fut is not None and not fut.done():
                fut.set_result(res)
        for rid in frame.started:
            state = self.output.states.get(rid)
            if state is not None:
                state.scheduled = True
        if not frame.added and not frame.outputs and not frame.steps:
            return  # a start notice alone (sent mid-step): no queue figures in it
        self.waiting_by_class = frame.waiting_by_class
        self.num_running = frame.num_running
        self.departure_rate = frame.departure_rate
        stopped = self.output.process(frame.outputs)
        if stopped and not self.dead:
            self._send(ipc.AbortRequests(stopped, reason="stop"))
        if self.on_frame is not None:
            self.on_frame(frame)

    def _fail_all(self, reason: str) -> None:
        for rid, fut in list(self._acks.items()):
            if not fut.done():
                fut.set_result(ipc.AddResult(rid, "error", reason))
        self._acks.clear()
        self.output.process(
            [
                EngineOutput(
                    request_id=rid,
                    new_token_ids=[],
                    finished=True,
                    finish_reason="error",
                    finish_detail=reason,
                )
                for rid in list(self.output.states)
            ]
        )
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(EngineError(reason))
        self._replies.clear()

    # -- requests --------------------------------------------------------------------------------
    def queued(self, priority_class: str) -> int:
        """Waiting requests of a class as the core last reported, plus those still in transit."""
        return self.waiting_by_class.get(priority_class, 0) + self.in_transit.get(priority_class, 0)

    def estimated_wait_s(self, classes_ahead: list[str]) -> float | None:
        """The wait of a request arriving now behind the queued requests of `classes_ahead`
        (those still in transit included), as core/wait_estimate.py models it."""
        ahead = sum(self.queued(c) for c in classes_ahead)
        free = self.config.scheduler.max_num_seqs - self.num_running
        return estimated_wait_s(ahead, free, self.departure_rate)

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: str | int | None,
        priority_class: str,
        on_output: OnOutput,
        index: int = 0,
        arrival_time: float | None = None,
        lora_name: str = "",
    ) -> tuple[RequestState, asyncio.Future[ipc.AddResult]]:
        """Send a request; the future resolves when the core has admitted or refused it."""
        fut: asyncio.Future[ipc.AddResult] = asyncio.get_running_loop().create_future()
        state = self.output.add(
            request_id, prompt_token_ids, params, index=index, on_output=on_output
        )
        if self.dead:
            self.output.end(request_id, "error", "the engine core is not running")
            fut.set_result(ipc.AddResult(request_id, "error", "the engine core is not running"))
            return state, fut
        self._acks[request_id] = fut
        self._class_of[request_id] = priority_class
        self.in_transit[priority_class] = self.in_transit.get(priority_class, 0) + 1
        self._send(
            ipc.AddRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                params=params,
                priority=priority,
                arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                lora_name=lora_name,
            )
        )
        return state, fut

    def abort(self, request_ids: list[str], detail: str = "") -> None:
        """Abort requests (no-op for ids the core no longer knows); frees their blocks."""
        for rid in request_ids:
            self.output.end(rid, "abort", detail)
        if request_ids and not self.dead:
            self._send(ipc.AbortRequests(list(request_ids)))

    def expire(self, request_ids: list[str], detail: str) -> None:
        """Refuse still-queued requests whose queue timeout passed (the API's timer): each
        finishes here at once as `queue_timeout`, through the same callbacks as an engine
        output, and the core drops it (freeing anything it held) between its steps."""
        self.output.process(
            [
                EngineOutput(
                    request_id=rid,
                    new_token_ids=[],
                    finished=True,
                    finish_reason="queue_timeout",
                    finish_detail=detail,
                )
                for rid in request_ids
            ]
        )
        if request_ids and not self.dead:
            self._send(ipc.AbortRequests(list(request_ids), reason="queue_timeout", detail=detail))

    def set_paused(self, paused: bool) -> None:
        self._send(ipc.SetPaused(paused))

    @property
    def num_live(self) -> int:
        return len(self.output)

    async def _ask(self, msg_factory: Callable[[int], msgspec.Struct], timeout_s: float) -> Any:
        token = next(self._tokens)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[token] = fut
        self._send(msg_factory(token))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._replies.pop(token, None)

    async def stats(
        self,
        history_s: float = 0.0,
        detail: bool = False,
        timeout_s: float = 10.0,
        count_objects: bool = False,
    ) -> ipc.StatsReply:
        return await self._ask(
            lambda t: ipc.GetStats(t, history_s, detail, count_objects), timeout_s
        )

    async def load_lora(self, name: str, path: str, timeout_s: float = 120.0) -> ipc.LoraReply:
        """Read, check and slot an adapter in the core (answered between steps)."""
        return await self._ask(lambda t: ipc.LoadLora(t, name, path), timeout_s)

    async def unload_lora(self, name: str, timeout_s: float = 3600.0) -> ipc.LoraReply:
        """Answered once the adapter's running and queued requests have finished."""
        return await self._ask(lambda t: ipc.UnloadLora(t, name), timeout_s)

    async def ping(self, timeout_s: float = 10.0) -> float:
        """Round trip through the core loop (answered between steps); returns seconds."""
        t = time.perf_counter()
        await self._ask(ipc.Ping, timeout_s)
        return time.perf_counter() - t
