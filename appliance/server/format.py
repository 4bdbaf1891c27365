"""Engine outputs -> OpenAI response bodies and SSE chunks (completions and chat)."""

from __future__ import annotations

from typing import Any

import msgspec

from appliance.engine.outputs import Logprob, RequestOutput
from appliance.server import schemas as s
from appliance.server.generate import Choice, Generation

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class TokenText:
    """Token id -> its text, as one-token decodes (what OpenAI's logprobs show), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self.cache) < 200_000:
                self.cache[token_id] = text
        return text


def usage(gen: Generation) -> s.Usage:
    prompt, completion = gen.prompt_tokens, gen.completion_tokens
    return s.Usage(
        prompt, completion, prompt + completion, s.PromptTokensDetails(gen.cached_tokens)
    )


# -- completions ---------------------------------------------------------------------------------
def completion_logprobs(
    entries: list[Logprob], k: int, text_of: TokenText, offset: int
) -> tuple[s.CompletionLogprobs, int]:
    tokens, lps, tops, offsets = [], [], [], []
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


def completion_response(
    gen: Generation, model: str, created: int, k: int | None, text_of: TokenText
) -> s.CompletionResponse:
    choices = []
    for ch in gen.choices:
        lp = completion_logprobs(ch.logprobs, k, text_of, 0)[0] if k is not None else None
        choices.append(s.CompletionChoice(ch.index, ch.text, lp, ch.finish_reason))
    return s.CompletionResponse(
        id=gen.request_id, created=created, model=model, choices=choices, usage=usage(gen)
    )


# -- chat ----------------------------------------------------------------------------------------
def chat_logprobs(entries: list[Logprob], k: int, text_of: TokenText) -> s.ChatChoiceLogprobs:
    content = []
    for e in entries:
        tok = text_of(e.token_id)
        top = [s.TopLogprob(t := text_of(tid), lp, list(t.encode())) for tid, lp in e.top[:k]]
        content.append(s.ChatLogprob(tok, e.logprob, list(tok.encode()), top))
    return s.ChatChoiceLogprobs(content)


def chat_response(
    gen: Generation, model: str, created: int, k: int | None, text_of: TokenText
) -> s.ChatCompletionResponse:
    choices = [
        s.ChatChoice(
            ch.index,
            s.ResponseMessage("assistant", ch.text),
            chat_logprobs(ch.logprobs, k, text_of) if k is not None else None,
            ch.finish_reason,
        )
        for ch in gen.choices
    ]
    return s.ChatCompletionResponse(
        id=gen.request_id, created=created, model=model, choices=choices, usage=usage(gen)
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
    ) -> None:
        self.gen, self.chat, self.model, self.created = gen, chat, model, created
        self.k, self.include_usage, self.text_of = k, include_usage, text_of
        self.offsets: dict[int, int] = {}

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
        has_lp = self.k is not None and bool(ro.new_logprobs)
        if not ro.new_text and not has_lp and not ro.finished:
            return None  # text held back (a possible stop string or a partial character)
        reason = ch.finish_reason if ro.finished else None
        if self.chat:
            lp = chat_logprobs(ro.new_logprobs, self.k, self.text_of) if has_lp else None
            delta = s.DeltaMessage(content=ro.new_text) if ro.new_text else s.DeltaMessage()
            return sse(self._chat_chunk([s.ChatStreamChoice(ch.index, delta, lp, reason)]))
        clp = None
        if has_lp:
            assert self.k is not None
            clp, self.offsets[ch.index] = completion_logprobs(
                ro.new_logprobs, self.k, self.text_of, self.offsets.get(ch.index, 0)
            )
        body = s.CompletionResponse(
            id=self.gen.request_id,
            created=self.created,
            model=self.model,
            choices=[s.CompletionChoice(ch.index, ro.new_text, clp, reason)],
        )
        return sse(body)

    def closing(self) -> list[bytes]:
        out = []
        if self.include_usage:
            if self.chat:
                body: Any = s.ChatCompletionChunk(
                    id=self.gen.request_id,
                    created=self.created,
                    model=self.model,
                    choices=[],
                    usage=usage(self.gen),
                )
            else:
                body = s.CompletionResponse(
                    id=self.gen.request_id,
                    created=self.created,
                    model=self.model,
                    choices=[],
                    usage=usage(self.gen),
                )
            out.append(sse(body))
        out.append(DONE)
        return out


def error_event(err: Any) -> bytes:
    """An error after the stream began (the status line is already sent): OpenAI's SDKs raise
    on a data event that carries an `error` object."""
    from appliance.server.errors import ErrorBody, ErrorInfo

    return sse(ErrorBody(ErrorInfo(err.message, err.type, err.param, err.code)))
