"""Request, response and stream-event bodies of OpenAI's Responses API (POST /v1/responses),
as msgspec Structs.

The request's `input` items and `tools` are read by server/responses.py (into a chat request)
so that an unknown item or tool type is a 400 naming `input[i].type` / `tools[i].type`; here
they are plain JSON objects. Fields this server does not implement are declared so that a
non-default value can be refused by name rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from appliance.server.schemas import MAX_INT32, TokenCount


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    # A string (one user message) or a list of items: messages, function_call and
    # function_call_output items.
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras, as in chat.
    priority: str | Annotated[int, Meta(ge=-MAX_INT32, le=MAX_INT32)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    # Refused when set (server/responses.py): not implemented here.
    background: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    conversation: Any = None


# -- the response object -------------------------------------------------------------------------
class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText] = []


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    # in_progress (stream events before the end), completed, incomplete, failed.
    status: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    completed_at: int | None = None


class ResponseDeleted(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class StreamEvent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One server-sent event of a streamed response; each type carries the fields OpenAI's
    event of that type has (the rest are left out)."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item_id: str | None = None
    content_index: int | None = None
    item: OutputItem | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    name: str | None = None
    logprobs: list[Any] | None = None
