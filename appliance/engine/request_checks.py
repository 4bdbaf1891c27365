"""What `Engine.add_request` checks of a request's input before it queues it, for the server
and offline use alike: the prompt (not empty, its token ids within the vocabulary, room left to
generate within max_model_len, enough KV blocks in the whole pool) and the output constraint
(it must compile into an enforceable grammar). The sampling parameters check themselves
(`SamplingParams.validate`), the priority class is the config's (`resolve_priority`).

Each refusal is a ValueError whose message starts with the field it is about ("prompt: ...",
"structured: ..."), so that the server can answer a 400 naming the request's own field without
checking anything again (server/prepare.py `PreparedRequest.refusal`); `InvalidRequest.code`
carries OpenAI's error code where one applies.
"""

from __future__ import annotations

from appliance.engine import guided_check
from appliance.sampling_params import SamplingParams


class InvalidRequest(ValueError):
    """Bad input; `code` is OpenAI's error code for it ("" when none applies)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """Every id in [0, vocab_size)."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequest(
                f"{param}: token id {t} is outside the vocabulary [0, {vocab_size})"
            )


def check_prompt(
    token_ids: list[int],
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    pooling: bool = False,
) -> None:
    """`pooling`: an embedding's prompt needs no room after it (nothing is generated)."""
    if not token_ids:
        raise InvalidRequest("prompt: must contain at least one token")
    check_token_ids(token_ids, vocab_size)
    if pooling and len(token_ids) > max_model_len:
        raise InvalidRequest(
            f"prompt: {len(token_ids)} tokens; this model's maximum context length is "
            f"{max_model_len} tokens",
            code="context_length_exceeded",
        )
    if not pooling and len(token_ids) >= max_model_len:
        raise InvalidRequest(
            f"prompt: {len(token_ids)} tokens; this model's maximum context length is "
            f"{max_model_len} tokens, which leaves no room to generate",
            code="context_length_exceeded",
        )
    blocks_for_prompt = -(-(len(token_ids) + 1) // block_size)
    if blocks_for_prompt > num_blocks:
        raise InvalidRequest(
            f"prompt: {len(token_ids)} tokens need {blocks_for_prompt} KV blocks, "
            f"the pool has {num_blocks}"
        )


def check_structured(params: SamplingParams) -> None:
    """The output constraint, if any, checked; a JSON schema normalised in place (compact text:
    one grammar cache entry per schema)."""
    if params.structured is None:
        return
    if params.min_tokens:
        # The grammar decides where the output ends; a ban on EOS could contradict it.
        raise InvalidRequest("min_tokens cannot be combined with structured outputs")
    try:
        params.structured = guided_check.check(params.structured)
    except guided_check.StructuredError as exc:
        raise InvalidRequest(f"structured: {exc}") from None
