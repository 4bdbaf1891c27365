"""The OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models, and
vLLM's /tokenize and /detokenize. Each handler takes the request and its decoded body; the
paths, methods and body types are server/routes.py's table.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

import msgspec
from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Stream

from appliance.engine.outputs import RequestOutput
from appliance.server import limits
from appliance.server import prepare as prep
from appliance.server import schemas as s
from appliance.server.errors import APIError, ClientGone, bad_request, from_validation
from appliance.server.format import (
    StreamFormatter,
    TokenText,
    chat_response,
    completion_response,
    error_event,
)
from appliance.server.generate import RETRYABLE, Choice, Generation
from appliance.server.state import ServerState

T = TypeVar("T")
JSON = "application/json"
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def _state(request: Request[Any, Any, Any]) -> ServerState:
    return request.app.state.server


def ready_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    state: ServerState = connection.app.state.server
    if not state.ready:
        raise APIError(
            503,
            f"the server is {state.phase}; retry later",
            code=state.phase,
            headers={"Retry-After": str(state.config.server.retry_after_s)},
        )


async def decode_body(request: Request[Any, Any, Any], schema: type[T]) -> T:
    raw = await request.body()
    limits.check_json_depth(raw)  # before the decoder recurses into it
    dec = _decoders.get(schema) or _decoders.setdefault(schema, msgspec.json.Decoder(schema))
    try:
        return dec.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_validation(exc) from None
    except RecursionError:  # deep nesting the byte check let through (it cannot be: a guard)
        raise bad_request(
            f"invalid request body: JSON nested deeper than {limits.MAX_JSON_DEPTH} levels",
            code="json_too_deep",
        ) from None


def _json(obj: Any, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(content=msgspec.json.encode(obj), media_type=JSON, headers=headers or {})


async def _until_disconnect(request: Request[Any, Any, Any]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(request: Request[Any, Any, Any], aw: Awaitable[T]) -> T:
    """Await `aw` unless the client goes away first (then ClientGone). Only used while no
    response has started: once streaming, Litestar's Stream listens for the disconnect."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone
    return task.result()


# -- generation ----------------------------------------------------------------------------------
class StreamShape(Protocol):
    """A streamed answer's bytes (format.StreamFormatter, responses_format's formatter)."""

    def opening(self) -> list[bytes]: ...
    def chunk(self, ch: Choice, ro: RequestOutput) -> bytes | None: ...
    def closing(self) -> list[bytes]: ...


class Answer(Protocol):
    """How a prepared request's outputs become its HTTP answer: the id prefix, the whole
    body, or the stream. Chat and completions are one answer, the Responses API another; the
    generation under them is the same."""

    id_prefix: str

    def body(self, gen: Generation, created: int, text_of: TokenText) -> Any: ...
    def stream(self, gen: Generation, created: int, text_of: TokenText) -> StreamShape: ...


class ChatOrCompletion:
    def __init__(self, req: prep.PreparedRequest, model: str) -> None:
        self.req, self.model, self.id_prefix = req, model, req.id_prefix

    def body(self, gen: Generation, created: int, text_of: TokenText) -> Any:
        req = self.req
        build = chat_response if req.chat else completion_response
        return build(gen, self.model, created, req.logprobs, text_of, req.plan)

    def stream(self, gen: Generation, created: int, text_of: TokenText) -> StreamShape:
        req = self.req
        return StreamFormatter(
            gen, req.chat, self.model, created, req.logprobs, req.include_usage, text_of, req.plan
        )


async def _generate(request: Request[Any, Any, Any], body: prep.Body) -> Response[Any]:
    arrival = time.monotonic()
    state = _state(request)
    req = prep.prepare(state, body)
    return await serve_generation(request, req, ChatOrCompletion(req, state.model_name), arrival)


async def serve_generation(
    request: Request[Any, Any, Any], req: prep.PreparedRequest, answer: Answer, arrival: float
) -> Response[Any]:
    """Run one prepared request in the engine and answer it, whole or streamed."""
    state = _state(request)
    rid = state.next_id(answer.id_prefix)
    gen = Generation(state, rid, req, arrival)
    await gen.submit()
    ctx = _LogContext(state, gen, request.url.path, req.stream)
    text_of = _token_text(state)
    created = int(time.time())
    if req.stream:
        return await _stream(request, gen, ctx, answer.stream(gen, created, text_of))
    try:
        await race_disconnect(request, gen.done.wait())
    except ClientGone:
        gen.abort("client disconnected")
        ctx.finish(499)
        raise
    finally:
        gen.close()
    err = gen.failure()
    if err is not None:
        ctx.finish(err.status)
        err.logged = True
        raise err
    ctx.finish(200)
    return _json(answer.body(gen, created, text_of), {"x-request-id": rid})


def _token_text(state: ServerState) -> TokenText:
    if state.token_text is None or state.token_text.tokenizer is not state.tokenizer:
        state.token_text = TokenText(state.tokenizer)
    return state.token_text


async def _stream(
    request: Request[Any, Any, Any], gen: Generation, ctx: _LogContext, fmt: StreamShape
) -> Response[Any]:
    # Wait for the first output before the status line, so that a request refused while
    # queued (queue timeout) still gets a real 429 that a gateway can act on.
    try:
        first = await race_disconnect(request, gen.next_event())
    except ClientGone:
        gen.abort("client disconnected")
        gen.close()
        ctx.finish(499)
        raise
    if first is not None and first[1].finished and not first[0].token_ids:
        err = gen.failure()
        if err is not None:
            gen.abort(first[0].finish_reason or "abort")
            gen.close()
            ctx.finish(err.status)
            err.logged = True
            raise err
    return Stream(
        _sse_body(gen, ctx, fmt, first),
        media_type="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "x-request-id": gen.request_id,
        },
    )


async def _sse_body(
    gen: Generation, ctx: _LogContext, fmt: StreamShape, first: Any
) -> AsyncIterator[bytes]:
    status = 499
    try:
        parts = fmt.opening()
        event = first
        while event is not None:
            ch, ro = event
            if ro.finished and ch.finish_reason in (*RETRYABLE, "error") and not ch.token_ids:
                err = gen.failure()
                if err is not None:
                    parts.append(error_event(err))
            else:
                chunk = fmt.chunk(ch, ro)
                if chunk is not None:
                    parts.append(chunk)
            if gen.events.empty() and parts:
                # One write per batch of outputs that arrived together (one engine step).
                yield b"".join(parts)
                parts = []
            event = await gen.next_event()
        if gen.cut_error is not None:
            # Cut by a drain: after each choice's last chunk ("abort"), the error event that
            # tells the client why (OpenAI's SDKs raise it).
            parts.append(error_event(gen.cut_error))
        yield b"".join(parts + fmt.closing())
        status = 200
    finally:
        if not gen.done.is_set():
            gen.abort("client disconnected")  # frees the request's KV blocks in the engine
        gen.close()
        ctx.finish(status)


class _LogContext:
    def __init__(self, state: ServerState, gen: Generation, endpoint: str, stream: bool) -> None:
        self.state, self.gen, self.endpoint, self.stream = state, gen, endpoint, stream

    def finish(self, status: int) -> None:
        gen = self.gen
        ttft = gen.first_token_s()
        queued = gen.queue_time_s()
        self.state.request_log.line(
            id=gen.request_id,
            endpoint=self.endpoint,
            status=status,
            priority_class=gen.priority_class,
            stream=self.stream,
            n=len(gen.choices),
            prompt_tokens=gen.prompt_tokens,
            completion_tokens=gen.completion_tokens,
            cached_tokens=gen.cached_tokens,
            finish_reason=sorted({ch.finish_reason or "none" for ch in gen.choices}),
            ttft_ms=None if ttft is None else round(ttft * 1000, 1),
            queue_ms=None if queued is None else round(queued * 1000, 1),
            latency_ms=round((time.monotonic() - gen.arrival) * 1000, 1),
            **({"drain": gen.drain_outcome} if gen.drain_outcome else {}),
        )


async def completions(request: Request[Any, Any, Any], body: s.CompletionRequest) -> Response[Any]:
    return await _generate(request, body)


async def chat_completions(
    request: Request[Any, Any, Any], body: s.ChatCompletionRequest
) -> Response[Any]:
    return await _generate(request, body)


async def models(request: Request[Any, Any, Any], body: None) -> Response[bytes]:
    state = _state(request)
    info = state.info
    created = int(time.time() - (time.monotonic() - state.started_at))
    max_len = info.max_model_len if info else 0
    card = s.ModelCard(
        id=state.model_name,
        created=created,
        root=info.model_dir if info else "",
        max_model_len=max_len,
    )
    adapters = [
        s.ModelCard(id=name, created=created, root=path, max_model_len=max_len, parent=card.id)
        for name, path in state.lora_adapters().items()
    ]
    return _json(s.ModelList([card, *adapters]))


async def tokenize(request: Request[Any, Any, Any], body: s.TokenizeRequest) -> Response[bytes]:
    state = _state(request)
    prep.check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        limits.check_roles([m.role for m in body.messages])
        chat = s.ChatCompletionRequest(
            messages=body.messages,
            tools=body.tools,
            tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
        )
        plan = prep.tool_plan(state, chat)
        ids = prep.chat_prompt(state, body.messages, body.add_generation_prompt, plan)
    else:
        ids = list(state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    limit = state.info.max_model_len if state.info else 0
    return _json(s.TokenizeResponse(len(ids), limit, ids))


async def detokenize(request: Request[Any, Any, Any], body: s.DetokenizeRequest) -> Response[bytes]:
    state = _state(request)
    prep.check_model(state, body.model)
    vocab = state.info.vocab_size if state.info else 0
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(
            f"tokens: id {bad} is outside the vocabulary [0, {vocab})", param="tokens"
        )
    return _json(s.DetokenizeResponse(state.tokenizer.decode(body.tokens)))
