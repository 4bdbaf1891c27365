"""What the engine hands back: per-step request outputs and finished completions."""

from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct):
    token_id: int
    logprob: float
    # Most likely tokens at this position: (token id, logprob), best first.
    top: list[tuple[int, float]]


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    # Tokens sampled this step (at most one per step; empty for a finish without a token).
    new_token_ids: list[int]
    # Text that became final this step (stop strings held back until resolved).
    new_text: str = ""
    new_logprobs: list[Logprob] = []
    finished: bool = False
    # stop | length | abort | queue_full | queue_timeout | error
    finish_reason: str | None = None
    finish_detail: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


class CompletionResult(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    finish_detail: str = ""
    logprobs: list[Logprob] | None = None
    num_cached_tokens: int = 0
