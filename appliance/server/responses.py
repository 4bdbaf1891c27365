"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}: OpenAI's Responses API.

One path with chat: a response is a chat request underneath (server/responses_input.py),
prepared, admitted and generated exactly as chat is (server/openai.py's serve_generation);
only the answer's shape is its own (server/responses_format.py). Responses are stored in
memory unless `store` is false (server/response_store.py); `previous_response_id` continues a
stored one's conversation, and an id that is unknown, deleted or dropped from the bounded
store is a 404 naming it.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from litestar import Request, Response

from appliance.server import prepare as prep
from appliance.server import responses_schema as rs
from appliance.server.errors import APIError
from appliance.server.format import TokenText
from appliance.server.generate import Generation
from appliance.server.openai import StreamShape, serve_generation
from appliance.server.response_store import StoredResponse
from appliance.server.responses_format import (
    ResponsesStreamFormatter,
    conversation_of,
    response_body,
)
from appliance.server.responses_input import chat_request, input_messages, rename_field, renamed
from appliance.server.schemas import ChatMessage
from appliance.server.state import ServerState

JSON = "application/json"


def _not_found(param: str, response_id: str) -> APIError:
    return APIError(
        404,
        f"{param}: no stored response {response_id!r} (unknown, deleted, not stored, or "
        "dropped from the in-memory store, which a restart empties)",
        param=param,
        code="response_not_found",
    )


class ResponsesAnswer:
    """The Responses API's answer to one generation: the response object or its events; a
    finished response goes into the store (unless `store` is false)."""

    id_prefix = "resp"

    def __init__(
        self,
        state: ServerState,
        body: rs.ResponsesRequest,
        req: prep.PreparedRequest,
        conversation: list[ChatMessage],
    ) -> None:
        self.state, self.request, self.req, self.conversation = state, body, req, conversation

    def _skeleton(self, gen: Generation, created: int) -> rs.ResponseObject:
        body = self.request
        return rs.ResponseObject(
            id=gen.request_id,
            created_at=created,
            model=self.state.model_name,
            status="in_progress",
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            tools=body.tools or [],
            tool_choice=body.tool_choice or ("auto" if body.tools else "none"),
            parallel_tool_calls=body.parallel_tool_calls,
            text=body.text or {"format": {"type": "text"}},
            previous_response_id=body.previous_response_id,
            metadata=body.metadata,
            store=body.store,
        )

    def _keep(self, response: rs.ResponseObject) -> None:
        if not self.request.store:
            return
        stored = StoredResponse(response, self.conversation + conversation_of(response.output))
        self.state.responses.put(stored, self.state.config.server.max_stored_responses)

    def body(self, gen: Generation, created: int, text_of: TokenText) -> Any:
        response = response_body(self._skeleton(gen, created), gen, self.req.plan)
        self._keep(response)
        return response

    def stream(self, gen: Generation, created: int, text_of: TokenText) -> StreamShape:
        return ResponsesStreamFormatter(
            gen, self._skeleton(gen, created), self.req.plan, self._keep
        )


async def create_response(
    request: Request[Any, Any, Any], body: rs.ResponsesRequest
) -> Response[Any]:
    arrival = time.monotonic()
    state: ServerState = request.app.state.server
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        stored = state.responses.get(body.previous_response_id)
        if stored is None:
            raise _not_found("previous_response_id", body.previous_response_id)
        history = stored.conversation
    inputs = input_messages(body.input)
    try:
        req = prep.prepare(state, chat_request(body, history, inputs))
        # The engine's refusals name the Responses fields too (PreparedRequest.refusal).
        req.prompt_param = "input"
        req.constraint_param = rename_field(req.constraint_param)
        answer = ResponsesAnswer(state, body, req, [*history, *inputs])
        return await serve_generation(request, req, answer, arrival)
    except APIError as err:
        raise renamed(err) from None


def _response_id(request: Request[Any, Any, Any]) -> str:
    return str(request.path_params["response_id"])


async def get_response(request: Request[Any, Any, Any], body: None) -> Response[bytes]:
    state: ServerState = request.app.state.server
    rid = _response_id(request)
    stored = state.responses.get(rid)
    if stored is None:
        raise _not_found("response_id", rid)
    return Response(content=msgspec.json.encode(stored.response), media_type=JSON)


async def delete_response(request: Request[Any, Any, Any], body: None) -> Response[bytes]:
    state: ServerState = request.app.state.server
    rid = _response_id(request)
    if not state.responses.delete(rid):
        raise _not_found("response_id", rid)
    return Response(content=msgspec.json.encode(rs.ResponseDeleted(id=rid)), media_type=JSON)
