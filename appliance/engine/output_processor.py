"""From the engine's token ids to what a caller reads: text, stop strings, logprobs, finish.

The engine process emits `EngineOutput`s (token ids, logprobs, finish reasons) and keeps no
text; this processor, on the caller's side, holds each live request's output state. The server
(streaming and non-streaming alike) and the offline `Engine.generate` use the same one, as vLLM
v1's AsyncLLM and LLMEngine share its OutputProcessor. A request's state goes when its finish
is seen, so nothing per request outlives it on either side.

A stop string is found here, after detokenizing; `process` returns the ids it finished that
way and the caller aborts them in the engine at once, so their KV blocks return right away.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.engine.detokenizer import IncrementalDetokenizer, TokenDecoder
from appliance.engine.outputs import CompletionResult, EngineOutput, Logprob, RequestOutput
from appliance.sampling_params import SamplingParams


@dataclass(eq=False)
class RequestState:
    """One request's output so far."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Incremental text (None: the text is decoded once, at the finish).
    detokenizer: IncrementalDetokenizer | None
    # Called with each delta (streaming consumers, per-request metrics); None: nobody listens.
    on_output: Callable[[RequestState, RequestOutput], None] | None = None
    # The position of this request among its API request's choices.
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    finish_detail: str = ""
    num_cached_tokens: int = 0
    # From the engine's finishing output: arrival to first scheduled (None: never scheduled).
    queue_time_s: float | None = None
    num_preemptions: int = 0
    # The engine has scheduled it (told before the step's forward pass, or implied by any
    # output): the queue timeout no longer applies.
    scheduled: bool = False
    # time.monotonic() when the first and the latest token reached the consumer (the server's
    # latency metrics set them; the processor does not time anything).
    first_token_at: float | None = None
    last_token_at: float | None = None
    # An embedding request's pooled vector (engine/pooling.py), set by its finishing output.
    embedding: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> CompletionResult:
        return CompletionResult(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids,
            text=self.text,
            finish_reason=self.finish_reason or "abort",
            finish_detail=self.finish_detail,
            logprobs=self.logprobs if self.params.logprobs is not None else None,
            prompt_logprobs=(
                self.prompt_logprobs if self.params.prompt_logprobs is not None else None
            ),
            num_cached_tokens=self.num_cached_tokens,
            embedding=self.embedding,
        )


class OutputProcessor:
    def __init__(self, tokenizer: TokenDecoder | None) -> None:
        # None until set: the engine client's processor gets the API process's tokenizer once
        # it is loaded, before the first request.
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        stream_text: bool = True,
        index: int = 0,
        on_output: Callable[[RequestState, RequestOutput], None] | None = None,
    ) -> RequestState:
        """Start tracking a request. Without `stream_text` (offline) and stop strings, its text
        is decoded once at the finish instead of token by token."""
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        assert self.tokenizer is not None, "no tokenizer yet"
        detok = None
        if stream_text or params.stop:
            detok = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output
            )
        state = RequestState(request_id, list(prompt_token_ids), params, detok, on_output, index)
        self.states[request_id] = state
        return state

    def process(self, outputs: list[EngineOutput]) -> list[str]:
        """Apply one step's outputs; returns the requests a stop string finished, which the
        caller must abort in the engine (the engine does not know they are done)."""
        stopped: list[str] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # finished here already (stop string, abort): late tokens are dropped
            detok = state.detokenizer
            new_ids, new_text = out.new_token_ids, ""
            if detok is not None:
                for n, token in enumerate(new_ids, 1):
                    new_text += detok.add(token)
                    if detok.stopped:
                        # A speculative step's tokens after the stop string are not output.
                        new_ids = new_ids[:n]
                        break
            delta = RequestOutput(
                request_id=out.request_id,
                new_token_ids=new_ids,
                new_text=new_text,
                new_logprobs=out.new_logprobs[: len(new_ids)]
                if state.params.logprobs is not None
                else [],
                prompt_logprobs=out.prompt_logprobs,
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens,
            )
            state.scheduled = state.scheduled or bool(new_ids)
            state.token_ids.extend(new_ids)
            state.logprobs.extend(delta.new_logprobs)
            state.prompt_logprobs.extend(out.prompt_logprobs)
            state.num_cached_tokens = out.num_cached_tokens
            # A stop string before the step's last token ends the request there, whatever the
            # engine said of the later tokens (a length limit among a speculative step's).
            early = len(new_ids) < len(out.new_token_ids)
            if detok is not None and detok.stopped and (early or not out.finished):
                if not out.finished:
                    stopped.append(out.request_id)
                self._finish(state, delta, "stop", "")
            elif out.finished:
                state.queue_time_s = out.queue_time_s
                state.num_preemptions = out.num_preemptions
                state.embedding = out.embedding
                self._finish(state, delta, out.finish_reason or "stop", out.finish_detail)
            state.text += delta.new_text
            if state.on_output is not None:
                state.on_output(state, delta)
        return stopped

    def _finish(self, state: RequestState, delta: RequestOutput, reason: str, detail: str) -> None:
        detok = state.detokenizer
        if detok is not None:
            delta.new_text += detok.flush()
        else:
            assert self.tokenizer is not None  # (add checked)
            delta.new_text = self.tokenizer.decode(state.token_ids, skip_special_tokens=True)
        delta.finished = True
        delta.finish_reason = reason
        delta.finish_detail = detail
        state.finish_reason = reason
        state.finish_detail = detail
        del self.states[state.request_id]

    def end(self, request_id: str, reason: str, detail: str = "") -> RequestState | None:
        """End a request on the caller's side (client gone, refused, engine died): its state
        goes without a delta; the caller tells the engine, if the engine still has it."""
        state = self.states.pop(request_id, None)
        if state is not None:
            state.finish_reason = reason
            state.finish_detail = detail
        return state
