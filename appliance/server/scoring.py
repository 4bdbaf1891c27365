"""Prompt scoring in responses: `echo` (the prompt's text and, with logprobs, its tokens'
log-probabilities, the first one null, before the generated ones) and vLLM's
`prompt_logprobs` field. The numbers come from the engine's prefill forward
(EngineOutput.prompt_logprobs); this module only shapes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.server import schemas as s

if TYPE_CHECKING:
    from appliance.engine.detokenizer import TokenDecoder
    from appliance.server.format import TokenText
    from appliance.server.generate import Choice
    from appliance.server.tool_calls import ToolPlan


@dataclass
class ResponsePlan:
    """What a response carries beyond the generated text."""

    echo: bool = False
    # max_tokens 0 with echo: the engine samples one token with the prompt's last logits
    # (the same forward, no extra pass) and the response drops it.
    drop_output: bool = False
    # Top k per prompt token in vLLM's prompt_logprobs field (None: no field).
    prompt_logprobs: int | None = None
    tools: ToolPlan | None = None


def prompt_text(tokenizer: TokenDecoder, ch: Choice) -> str:
    return tokenizer.decode(ch.prompt_token_ids, skip_special_tokens=True)


def echo_logprobs(
    ch: Choice, k: int, text_of: TokenText
) -> tuple[list[str], list[float | None], list[dict[str, float] | None]]:
    """Tokens, logprobs and top-k dicts of the prompt (position 0 has no logprob)."""
    ids = ch.prompt_token_ids
    tokens = [text_of(t) for t in ids]
    lps: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for e, tok in zip(ch.prompt_logprobs, tokens[1:], strict=False):
        lps.append(e.logprob)
        top = {text_of(tid): lp for tid, lp in e.top[:k]}
        top.setdefault(tok, e.logprob)
        tops.append(top)
    return tokens, lps, tops


def prepend_prompt(
    lp: s.CompletionLogprobs | None, ch: Choice, k: int, text_of: TokenText
) -> s.CompletionLogprobs:
    """The prompt's entries before the generated ones, text offsets shifted after them."""
    tokens, lps, tops = echo_logprobs(ch, k, text_of)
    offsets, off = [], 0
    for tok in tokens:
        offsets.append(off)
        off += len(tok)
    if lp is None:
        return s.CompletionLogprobs(tokens, lps, tops, offsets)
    return s.CompletionLogprobs(
        tokens + lp.tokens,
        lps + lp.token_logprobs,
        tops + lp.top_logprobs,
        offsets + [o + off for o in lp.text_offset],
    )


def vllm_prompt_logprobs(ch: Choice, k: int, text_of: TokenText) -> s.PromptLogprobs:
    """vLLM's shape: per prompt token, {token id: {logprob, rank, decoded_token}} with the
    prompt token itself and its top k (the first prompt token: null)."""
    out: s.PromptLogprobs = [None]
    for e, tid in zip(ch.prompt_logprobs, ch.prompt_token_ids[1:], strict=False):
        entry = {
            str(t): s.PromptLogprob(lp, r + 1, text_of(t)) for r, (t, lp) in enumerate(e.top[:k])
        }
        if str(tid) not in entry:
            entry[str(tid)] = s.PromptLogprob(e.logprob, None, text_of(tid))
        out.append(entry)
    return out
