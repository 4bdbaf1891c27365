"""Engine outputs -> OpenAI response bodies and SSE chunks (completions and chat)."""

from __future__ import annotations

from typing import Any

import msgspec

from appliance.engine.detokenizer import TokenDecoder
from appliance.engine.outputs import Logprob, RequestOutput
from appliance.server import schemas as s
from appliance.server.generate import Choice, Generation
from appliance.server.scoring import (
    ResponsePlan,
    prepend_prompt,
    prompt_text,
    vllm_prompt_logprobs,
)
from appliance.server.tool_calls import ToolStream, tool_calls

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class TokenText:
    """Token id -> its text, as one-token decodes (what OpenAI's logprobs show), cached."""

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self.cache) < 200_000:
                self.cache[token_id] = text
        return text


def usage(gen: Generation, plan: ResponsePlan | None = None) -> s.Usage:
    prompt, completion = gen.prompt_tokens, gen.completion_tokens
    if plan is not None and plan.drop_output:
        completion = 0
    return s.Usage(
        prompt, completion, prompt + completion, s.PromptTokensDetails(gen.cached_tokens)
    )


# -- completions ---------------------------------------------------------------------------------
def completion_logprobs(
    entries: list[Logprob], k: int, text_of: TokenText, offset: int
) -> tuple[s.CompletionLogprobs, int]:
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in entries:
        tok = text_of(e.token_id)
        tokens.append(tok)
        lps.append(e.logprob)
        top = {text_of(tid): lp for tid, lp in e.top[:k]}
        top.setdefault(tok, e.logprob)  # the sampled token is always listed, as OpenAI does
        tops.append(top)
        offsets.append(offset)
        offset += len(tok)
    return s.CompletionLogprobs(tokens, lps, tops, offsets), offset


def _prompt_lps(plan: ResponsePlan, ch: Choice, text_of: TokenText) -> s.PromptLogprobs | None:
    if plan.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(ch, plan.prompt_logprobs, text_of)


def completion_response(
    gen: Generation,
    model: str,
    created: int,
    k: int | None,
    text_of: TokenText,
    plan: ResponsePlan | None = None,
) -> s.CompletionResponse:
    plan = plan or ResponsePlan()
    choices = []
    for ch in gen.choices:
        entries = [] if plan.drop_output else ch.logprobs
        lp = completion_logprobs(entries, k, text_of, 0)[0] if k is not None else None
        text = "" if plan.drop_output else ch.text
        reason = "length" if plan.drop_output and ch.finish_reason == "stop" else ch.finish_reason
        if plan.echo:
            text = prompt_text(text_of.tokenizer, ch) + text
            if k is not None:
                lp = prepend_prompt(lp, ch, k, text_of)
        choices.append(
            s.CompletionChoice(ch.index, text, lp, reason, _prompt_lps(plan, ch, text_of))
        )
    return s.CompletionResponse(
        id=gen.request_id, created=created, model=model, choices=choices, usage=usage(gen, plan)
    )


# -- chat ----------------------------------------------------------------------------------------
def chat_logprobs(entries: list[Logprob], k: int, text_of: TokenText) -> s.ChatChoiceLogprobs:
    content = []
    for e in entries:
        tok = text_of(e.token_id)
        top = [s.TopLogprob(t := text_of(tid), lp, list(t.encode())) for tid, lp in e.top[:k]]
        content.append(s.ChatLogprob(tok, e.logprob, list(tok.encode()), top))
    return s.ChatChoiceLogprobs(content)


def assistant_message(ch: Choice, plan: ResponsePlan) -> tuple[s.ResponseMessage, str | None]:
    """The assistant message, and the finish reason (tool_calls when calls were made)."""
    tools = plan.tools
    if tools is None:
        return s.ResponseMessage("assistant", ch.text), ch.finish_reason
    if tools.mode == "generic":
        # The content is the plain answer's text, never the JSON object around it.
        content, calls = tools.extract(ch.text)
        if calls:  # whole calls, even where max_tokens fell just after them
            return s.ResponseMessage("assistant", content, tool_calls(calls)), "tool_calls"
        return s.ResponseMessage("assistant", content or ""), ch.finish_reason
    if ch.finish_reason not in ("stop", "length"):
        return s.ResponseMessage("assistant", ch.text), ch.finish_reason
    content, calls = tools.extract(ch.text)
    if not calls or (ch.finish_reason == "length" and tools.mode != "auto"):
        return s.ResponseMessage("assistant", ch.text), ch.finish_reason
    return s.ResponseMessage("assistant", content, tool_calls(calls)), "tool_calls"


def chat_response(
    gen: Generation,
    model: str,
    created: int,
    k: int | None,
    text_of: TokenText,
    plan: ResponsePlan | None = None,
) -> s.ChatCompletionResponse:
    plan = plan or ResponsePlan()
    choices = []
    for ch in gen.choices:
        message, reason = assistant_message(ch, plan)
        lps = chat_logprobs(ch.logprobs, k, text_of) if k is not None else None
        choices.append(s.ChatChoice(ch.index, message, lps, reason, _prompt_lps(plan, ch, text_of)))
    return s.ChatCompletionResponse(
        id=gen.request_id, created=created, model=model, choices=choices, usage=usage(gen, plan)
    )


# -- streaming -----------------------------------------------------------------------------------
class StreamFormatter:
    """SSE chunks for one streamed request. `k` is the number of top logprobs (None: none)."""

    def __init__(
        self,
        gen: Generation,
        chat: bool,
        model: str,
        created: int,
        k: int | None,
        include_usage: bool,
        text_of: TokenText,
        plan: ResponsePlan | None = None,
    ) -> None:
        self.gen, self.chat, self.model, self.created = gen, chat, model, created
        self.k, self.include_usage, self.text_of = k, include_usage, text_of
        self.plan = plan or ResponsePlan()
        self.offsets: dict[int, int] = {}
        # Choices whose echoed prompt went out; per choice tool-call state.
        self.echoed: set[int] = set()
        self.tool_streams: dict[int, ToolStream] = {}

    def opening(self) -> list[bytes]:
        """Chat streams announce the assistant role first, one chunk per choice."""
        if not self.chat:
            return []
        return [
            sse(
                self._chat_chunk(
                    [s.ChatStreamChoice(ch.index, s.DeltaMessage(role="assistant", content=""))]
                )
            )
            for ch in self.gen.choices
        ]

    def _chat_chunk(self, choices: list[s.ChatStreamChoice]) -> s.ChatCompletionChunk:
        return s.ChatCompletionChunk(
            id=self.gen.request_id, created=self.created, model=self.model, choices=choices
        )

    def chunk(self, ch: Choice, ro: RequestOutput) -> bytes | None:
        plan = self.plan
        new_text, new_lps = ro.new_text, ro.new_logprobs
        if plan.drop_output:
            new_text, new_lps = "", []
        has_lp = self.k is not None and bool(new_lps)
        echo_now = (
            plan.echo and ch.index not in self.echoed and bool(ro.new_token_ids or ro.finished)
        )
        if not new_text and not has_lp and not ro.finished and not echo_now:
            return None  # text held back (a possible stop string or a partial character)
        reason = ch.finish_reason if ro.finished else None
        if plan.drop_output and reason == "stop":
            reason = "length"
        if self.chat:
            return self._chat_delta(ch, ro, new_text, has_lp, reason)
        clp = None
        if has_lp:
            assert self.k is not None
            clp, self.offsets[ch.index] = completion_logprobs(
                new_lps, self.k, self.text_of, self.offsets.get(ch.index, 0)
            )
        prompt_lps = None
        if echo_now:
            self.echoed.add(ch.index)
            prefix = prompt_text(self.text_of.tokenizer, ch)
            new_text = prefix + new_text
            if self.k is not None:
                clp = prepend_prompt(clp, ch, self.k, self.text_of)
                self.offsets[ch.index] = self.offsets.get(ch.index, 0) + len(
                    "".join(clp.tokens[: len(ch.prompt_token_ids)])
                )
        if ro.finished and plan.prompt_logprobs is not None:
            prompt_lps = _prompt_lps(plan, ch, self.text_of)
        body = s.CompletionResponse(
            id=self.gen.request_id,
            created=self.created,
            model=self.model,
            choices=[s.CompletionChoice(ch.index, new_text, clp, reason, prompt_lps)],
        )
        return sse(body)

    def _chat_delta(
        self, ch: Choice, ro: RequestOutput, text: str, has_lp: bool, reason: str | None
    ) -> bytes | None:
        lp = (
            chat_logprobs(ro.new_logprobs, self.k, self.text_of)
            if has_lp and self.k is not None
            else None
        )
        delta = s.DeltaMessage(content=text) if text else s.DeltaMessage()
        tools = self.plan.tools
        if tools is not None:
            stream = self.tool_streams.setdefault(ch.index, ToolStream(tools))
            content, calls = stream.feed(text, ro.finished)
            delta = s.DeltaMessage(content=content or None, tool_calls=calls or None)
            if ro.finished and stream.made_calls and reason in ("stop", "length"):
                if reason == "stop" or tools.mode in ("auto", "generic"):
                    reason = "tool_calls"
            if not content and not calls and not has_lp and reason is None:
                return None
        return sse(self._chat_chunk([s.ChatStreamChoice(ch.index, delta, lp, reason)]))

    def closing(self) -> list[bytes]:
        out = []
        if self.include_usage:
            if self.chat:
                body: Any = s.ChatCompletionChunk(
                    id=self.gen.request_id,
                    created=self.created,
                    model=self.model,
                    choices=[],
                    usage=usage(self.gen, self.plan),
                )
            else:
                body = s.CompletionResponse(
                    id=self.gen.request_id,
                    created=self.created,
                    model=self.model,
                    choices=[],
                    usage=usage(self.gen, self.plan),
                )
            out.append(sse(body))
        out.append(DONE)
        return out


def error_event(err: Any) -> bytes:
    """An error after the stream began (the status line is already sent): OpenAI's SDKs raise
    on a data event that carries an `error` object."""
    from appliance.server.errors import ErrorBody, ErrorInfo

    return sse(ErrorBody(ErrorInfo(err.message, err.type, err.param, err.code)))
