"""The `[speculative]` section of a template: prompt-lookup (n-gram) drafting with vLLM's knobs
and names. Its own module so that config.py stays one screenful per section; config.py holds it
as `ApplianceConfig.speculative`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# vLLM's limit on drafts per step is the model's context; past ~16 a prompt-lookup draft is
# almost never accepted whole, and each drafted token is a query row every layer computes.
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # "" = off; "ngram": drafts copied from the request's own prompt and output where its last
    # tokens occurred before (vLLM's prompt lookup). Other methods (a draft model, EAGLE) are not
    # built: naming one is a template error.
    method: Literal["", "ngram"] = ""
    # Tokens drafted per step for one request; each is verified in the same forward as the
    # request's next token.
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=MAX_SPECULATIVE_TOKENS)] = 4
    # Lengths of the suffix looked up in the earlier tokens (the longest match wins).
    prompt_lookup_min: Annotated[int, Meta(ge=1)] = 2
    prompt_lookup_max: Annotated[int, Meta(ge=1)] = 5
    # Draft only while the step cost model says the expected tokens per second beat plain
    # decoding (core/spec_decode.py); false: draft whenever a match is found.
    adaptive: bool = True

    def __post_init__(self) -> None:
        # msgspec reports a ValueError here as a validation error at `$.speculative`.
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"speculative.prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @property
    def enabled(self) -> bool:
        return self.method != ""
