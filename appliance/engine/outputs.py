"""What the engine hands back (`EngineOutput`, token ids only: the engine process keeps no
text) and what the output processor makes of it for a caller (`RequestOutput`, with text)."""

from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct):
    token_id: int
    logprob: float
    # Most likely tokens at this position: (token id, logprob), best first.
    top: list[tuple[int, float]]


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request's part of one engine step, as it crosses from the engine core."""

    request_id: str
    # Tokens sampled this step (at most one per step; empty for a finish without a token).
    new_token_ids: list[int]
    # Only for requests that asked for logprobs.
    new_logprobs: list[Logprob] = []
    # Only for requests that asked for prompt logprobs: the next prompt positions' entries
    # (the first covers prompt token 1; token 0 has none), as prefill chunks compute them.
    prompt_logprobs: list[Logprob] = []
    finished: bool = False
    # stop | length | abort | queue_full | queue_timeout | error
    finish_reason: str | None = None
    finish_detail: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # On the finishing output: from arrival to first scheduled (None: never scheduled).
    queue_time_s: float | None = None
    num_preemptions: int = 0
    # An embedding request's pooled vector (unnormalised), on its finishing output.
    embedding: list[float] = []


class RequestOutput(msgspec.Struct, kw_only=True):
    """What one engine output meant for a request, after the output processor."""

    request_id: str
    new_token_ids: list[int]
    # Text that became final this step (stop strings held back until resolved).
    new_text: str = ""
    new_logprobs: list[Logprob] = []
    prompt_logprobs: list[Logprob] = []
    finished: bool = False
    finish_reason: str | None = None
    finish_detail: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class CompletionResult(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    finish_detail: str = ""
    logprobs: list[Logprob] | None = None
    # Prompt positions 1.. (None unless asked for): position 0 has no logprob.
    prompt_logprobs: list[Logprob] | None = None
    num_cached_tokens: int = 0
    # An embedding request's pooled, unnormalised vector (SamplingParams.pooling).
    embedding: list[float] = []
