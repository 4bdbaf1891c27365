"""One API request in the engine: its `n` x prompts sub-requests, their outputs, its life.

Each sub-request's output state (text, tokens, logprobs, finish) is the engine client's output
processor's `RequestState`, one per choice. The processor calls back here from the client's
reader task with each delta; the callback updates the request-level metrics right away (so
TTFT and inter-token times are measured when the tokens reach this process, whatever the
consumer does), and queues an event for a streaming consumer.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import msgspec

from appliance.engine.client import EngineError
from appliance.engine.output_processor import RequestState
from appliance.engine.outputs import RequestOutput
from appliance.sampling_params import SamplingParams
from appliance.server.errors import APIError

if TYPE_CHECKING:
    from appliance.server.prepare import PreparedRequest
    from appliance.server.state import ServerState

# Engine finish reasons that mean "refused, try later" rather than an answer.
RETRYABLE = ("queue_full", "queue_timeout", "ttft_slo")


# A choice of the response: one sub-request's output state.
Choice = RequestState


class Generation:
    def __init__(
        self, state: ServerState, request_id: str, req: PreparedRequest, arrival: float
    ) -> None:
        self.state = state
        self.request_id = request_id
        self.req = req
        self.params = req.params
        self.priority = req.priority
        self.priority_class = req.priority_class
        self.arrival = arrival
        self.stream = req.stream
        n = self.n = req.n
        # (index, prompt) per choice; the choices' states exist once submitted.
        self._planned = [
            (p_idx * n + i, prompt) for p_idx, prompt in enumerate(req.prompts) for i in range(n)
        ]
        self.choices: list[Choice] = []
        self.pending = len(self._planned)
        self.events: asyncio.Queue[tuple[Choice, RequestOutput] | None] = asyncio.Queue()
        self.done = asyncio.Event()
        self.aborted = False
        # Fires at arrival + the class's queue_timeout_s (the queue timeout on a timer: an engine
        # step may be long, a gateway's fast-fail must come on time).
        self._queue_timer: asyncio.TimerHandle | None = None
        # Set when a drain ran out of time and cut this request (cut()): the error it ends with.
        self.cut_error: APIError | None = None
        # "drained" when it was in flight as a drain began, "cut" once cut: the request log's.
        self.drain_outcome: str | None = None

    # -- submission ------------------------------------------------------------------------------
    def _params_for(self, index: int) -> SamplingParams:
        offset = index % self.n
        if self.params.seed is None or offset == 0:
            return self.params
        # Distinct but reproducible samples for n > 1: seed, seed + 1, ...
        return msgspec.structs.replace(self.params, seed=self.params.seed + offset)

    async def submit(self) -> None:
        """Hand every sub-request to the engine; raises APIError when any is refused."""
        client = self.state.client
        if client is None or client.dead:
            raise APIError(503, "the engine is not running", code="not_ready")
        self.state.inflight.add(self)
        futures = []
        try:
            for index, prompt in self._planned:
                state, fut = client.add(
                    f"{self.request_id}-{index}",
                    prompt,
                    self._params_for(index),
                    self.priority,
                    self.priority_class,
                    self._on_output,
                    index=index,
                    arrival_time=self.arrival,
                    lora_name=self.req.lora_name,
                )
                self.choices.append(state)
                futures.append(fut)
        except EngineError as exc:  # the core went away between the guard and here
            self.abort("engine gone", count=False)
            self.close()
            raise APIError(503, f"engine unavailable: {exc}", code="engine_error") from None
        self._arm_queue_timer()
        # The core acknowledges between its steps: a request may time out (or be cut) before
        # that, and then its answer must not wait for the step to end.
        acks = asyncio.gather(*futures)
        done = asyncio.ensure_future(self.done.wait())
        try:
            either: set[asyncio.Future[Any]] = {acks, done}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
        if not acks.done():
            return  # finished already; the late acknowledgements change nothing
        refused = next((r for r in acks.result() if r.rejected), None)
        if refused is not None:
            self.abort(refused.rejected, count=False)
            self.close()
            if refused.rejected == "invalid":  # bad input, in the engine's words
                raise self.req.refusal(refused.detail, refused.code)
            raise self._refusal(refused.rejected, refused.detail)

    def _refusal(self, reason: str, detail: str) -> APIError:
        retry = str(self.state.config.server.retry_after_s)
        if reason in RETRYABLE:
            return APIError(
                429,
                f"{reason.replace('_', ' ')} for priority class {self.priority_class!r}: {detail}",
                code=reason,
                headers={"Retry-After": retry},
            )
        return APIError(
            503,
            f"engine unavailable: {detail}",
            code="engine_error",
            headers={"Retry-After": retry},
        )

    # -- the queue timeout, on a timer ----------------------------------------------------------
    def _arm_queue_timer(self) -> None:
        timeout = self.state.config.class_limits(self.priority_class).queue_timeout_s
        if not timeout or self.done.is_set():
            return
        delay = max(0.0, self.arrival + timeout - time.monotonic())
        self._queue_timer = asyncio.get_running_loop().call_later(
            delay, self._queue_deadline, timeout
        )

    def _queue_deadline(self, timeout: float) -> None:
        """Refuse the choices the engine has not started yet (429 queue_timeout, as the
        scheduler's own check would at its next step); the rest are no use without them."""
        self._queue_timer = None
        client = self.state.client
        if self.done.is_set() or client is None:
            return
        queued = [ch.request_id for ch in self.choices if not ch.finished and not ch.scheduled]
        if not queued:
            return
        waited = time.monotonic() - self.arrival
        client.expire(queued, f"waited {waited:.1f}s > queue_timeout_s {timeout}")
        self.abort("queue timeout of a sibling choice")

    # -- outputs ---------------------------------------------------------------------------------
    def _on_output(self, ch: Choice, ro: RequestOutput) -> None:
        now = time.monotonic()
        metrics = self.state.metrics
        if ro.new_token_ids:
            if ch.first_token_at is None:
                ch.first_token_at = now
                metrics.observe_first_token(now - self.arrival, ro.num_prompt_tokens)
                interval = None
            else:
                interval = now - (ch.last_token_at or now)
            ch.last_token_at = now
            metrics.observe_tokens(len(ro.new_token_ids), interval)
        if ro.finished:
            metrics.observe_finish(ch.finish_reason or "stop", now - self.arrival, ch.queue_time_s)
            self._observe_phases(ch)
        if self.stream:
            self.events.put_nowait((ch, ro))
        if ro.finished:
            self._one_finished()

    def _observe_phases(self, ch: Choice) -> None:
        prefill = decode = None
        if ch.first_token_at is not None:
            decode = (ch.last_token_at or ch.first_token_at) - ch.first_token_at
            if ch.queue_time_s is not None:  # scheduled at arrival + queue time (one clock)
                prefill = ch.first_token_at - (self.arrival + ch.queue_time_s)
        self.state.metrics.observe_request(
            len(ch.prompt_token_ids), len(ch.token_ids), prefill, decode
        )

    def _one_finished(self) -> None:
        self.pending -= 1
        if self.pending == 0 and not self.aborted and self.choices:
            self.state.metrics.observe_max_generation_tokens(
                max(len(ch.token_ids) for ch in self.choices)
            )
        if self.pending == 0:
            self.done.set()
            self.events.put_nowait(None)

    def abort(self, reason: str = "abort", count: bool = True) -> None:
        """Stop every unfinished sub-request (client gone, drain timeout, admin); frees blocks."""
        if self.done.is_set():
            return
        self.aborted = True
        open_choices = [ch for ch in self.choices if ch.finish_reason is None]
        client = self.state.client
        if client is not None and not client.dead:
            client.abort([ch.request_id for ch in open_choices], reason)
        now = time.monotonic()
        for ch in open_choices:
            ch.finish_reason = "abort"
            ch.finish_detail = reason
            if count:
                self.state.metrics.observe_finish("abort", now - self.arrival, None)
            self._one_finished()
        # Sub-requests never submitted (the engine went away while submitting) end here too.
        for _ in range(len(self._planned) - len(self.choices)):
            self._one_finished()

    def cut(self, message: str, code: str = "drain_timeout") -> None:
        """End the request now because the server is stopping (a drain out of time). Unlike
        abort(), a streaming consumer sees it: each unfinished choice gets a last chunk with
        finish_reason "abort" (vLLM's), then the stream carries `cut_error` as an SSE error
        event (which OpenAI's SDKs raise); a request not yet answered gets it as a 503."""
        if self.done.is_set():
            return
        retry = str(self.state.config.server.retry_after_s)
        self.cut_error = APIError(503, message, code=code, headers={"Retry-After": retry})
        self.drain_outcome = "cut"
        open_choices = [ch for ch in self.choices if ch.finish_reason is None]
        for ch in open_choices:
            ch.finish_detail = message
            if self.stream:
                self.events.put_nowait(
                    (
                        ch,
                        RequestOutput(
                            request_id=ch.request_id,
                            new_token_ids=[],
                            finished=True,
                            finish_reason="abort",
                            finish_detail=message,
                        ),
                    )
                )
        self.abort(message)

    def close(self) -> None:
        if self._queue_timer is not None:
            self._queue_timer.cancel()
            self._queue_timer = None
        self.state.inflight.discard(self)

    # -- results ---------------------------------------------------------------------------------
    async def next_event(self) -> tuple[Choice, RequestOutput] | None:
        return await self.events.get()

    def failure(self) -> APIError | None:
        """The error to answer with when a choice ended without an answer (non-streaming, or
        before a stream's first byte)."""
        if self.cut_error is not None:
            return self.cut_error
        for ch in self.choices:
            if ch.finish_reason in RETRYABLE:
                return self._refusal(ch.finish_reason, ch.finish_detail)
            if ch.finish_reason == "error":
                return APIError(500, f"generation failed: {ch.finish_detail}", code="engine_error")
        return None

    @property
    def prompt_tokens(self) -> int:
        # Each distinct prompt counts once, however many samples were drawn from it.
        return sum(len(ch.prompt_token_ids) for ch in self.choices[:: self.n])

    @property
    def completion_tokens(self) -> int:
        return sum(len(ch.token_ids) for ch in self.choices)

    @property
    def cached_tokens(self) -> int:
        return sum(ch.num_cached_tokens for ch in self.choices[:: self.n])

    def first_token_s(self) -> float | None:
        times = [ch.first_token_at for ch in self.choices if ch.first_token_at is not None]
        return min(times) - self.arrival if times else None

    def queue_time_s(self) -> float | None:
        times = [ch.queue_time_s for ch in self.choices if ch.queue_time_s is not None]
        return min(times) if times else None
