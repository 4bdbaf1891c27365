"""Per-request sampling parameters, validated with errors that name the field and its limit."""

from __future__ import annotations

from typing import Literal

import msgspec

# Top logprobs a request may ask for (the API's schema caps its fields at the same number).
MAX_LOGPROBS = 20
# vLLM's _SAMPLING_EPS.
GREEDY_BELOW_TEMPERATURE = 1e-5


def invalid_field(message: str) -> str | None:
    """The field a validation message names: "prompt: ..." or "max_tokens must ..." (the
    engine's messages), for the API error's `param`."""
    head, sep, _ = message.partition(":")
    if sep and head.isidentifier():
        return head
    first = message.split(" ", 1)[0]
    return first if first in SamplingParams.__struct_fields__ else None


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A constraint on the output, compiled (and cached by its text) in the engine core by
    engine/guided.py. Engine.add_request checks it first (engine/request_checks.py)."""

    # json: a JSON schema (text); json_object: any JSON object (spec unused); regex; choice: a
    # JSON list of the allowed strings; grammar: EBNF (GBNF dialect, xgrammar's).
    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    spec: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.spec)


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 16
    # 0 means greedy.
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 (or -1) disables top-k.
    top_k: int = 0
    # Reproducible sampling: the same seed gives the same tokens whatever the batch.
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    # Number of top logprobs to return per generated token (None: no logprobs).
    logprobs: int | None = None
    # Keep the stop string in the returned text (OpenAI drops it).
    include_stop_str_in_output: bool = False
    # Grammar-constrained decoding (None: unconstrained, and the request pays nothing for it).
    structured: StructuredOutputs | None = None
    # Top logprobs per prompt token, computed in the prefill forward (None: none). The first
    # prompt token has none (nothing predicts it).
    prompt_logprobs: int | None = None
    # False: never draft tokens for this request, whatever the template's [speculative] says.
    speculative: bool = True
    # Embedding instead of generation: a prefill-only request whose output is its prompt's
    # final hidden states pooled (last token or mean; engine/pooling.py), no token sampled.
    pooling: Literal["", "last", "mean"] = ""

    def validate(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise ValueError(f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= max_logprobs:
            raise ValueError(
                f"prompt_logprobs must be in [0, {max_logprobs}], got {self.prompt_logprobs}"
            )
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        # As vLLM: a temperature this close to 0 is greedy (dividing logits by it overflows).
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1
