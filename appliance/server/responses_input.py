"""A Responses API request as the chat request it is underneath.

`input` (a string, or message / function_call / function_call_output items), `instructions`,
the flat function tools, `tool_choice` and `text.format` become a ChatCompletionRequest that
takes the one preparation chat takes (server/prepare.py: limits, priority, admission, tools,
structured outputs, the chat template). Each item is checked here so that a bad one is a 400
naming `input[i]...`; a chat-side refusal is renamed to the Responses field it came from
(`renamed`).
"""

from __future__ import annotations

import re
from typing import Any

from appliance.server.errors import APIError, bad_request
from appliance.server.responses_schema import ResponsesRequest
from appliance.server.schemas import ChatCompletionRequest, ChatMessage

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
# Chat fields -> the Responses fields they were made from (longest prefix first).
_FIELD_NAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string or a list of text parts, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: expected a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}[{j}].type: only text parts ({', '.join(TEXT_PARTS)}, with a string "
                f"`text`) are supported, got {kind!r}",
                param=f"{where}[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: a string is required", param=f"{where}.{key}")
    return value


def input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The request's `input` as chat messages; consecutive function_call items become one
    assistant turn with several tool calls, as a chat client would send them."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    if not value:
        raise bad_request("input: must not be empty", param="input")
    out: list[ChatMessage] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad_request(
                    f"{where}.role: {role!r} is not a message role; expected one of "
                    f"{', '.join(MESSAGE_ROLES)}",
                    param=f"{where}.role",
                )
            text = _text_of(item.get("content"), f"{where}.content")
            out.append(ChatMessage(role="system" if role == "developer" else role, content=text))
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None:
                last.tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            text = _text_of(item.get("output"), f"{where}.output")
            out.append(ChatMessage(role="tool", content=text, tool_call_id=call_id))
        else:
            raise bad_request(
                f"{where}.type: {kind!r} is not supported; expected message, function_call or "
                "function_call_output",
                param=f"{where}.type",
            )
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[Any] | None:
    """Responses' flat function tools ({type, name, parameters, ...}) in chat's shape."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}].type: only function tools are supported, got {tool.get('type')!r}",
                param=f"tools[{i}].type",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        if not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}].name: a string is required", param=f"tools[{i}].name")
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request(
            "tool_choice: expected none, auto, required or {type: function, name}",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (json_schema's name, schema and strict sit
    directly in the format here, under `json_schema` in chat)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format: expected an object", param="text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(
        f"text.format.type must be text, json_object or json_schema, got {kind!r}",
        param="text.format.type",
    )


def refuse_unsupported(body: ResponsesRequest) -> None:
    checks = [
        (bool(body.background), "background"),
        (body.truncation == "auto", "truncation"),
        (body.reasoning is not None, "reasoning"),
        (bool(body.include), "include"),
        (body.conversation is not None, "conversation"),
    ]
    for bad, name in checks:
        if bad:
            raise bad_request(f"{name} is not supported by this server", param=name)


def chat_request(
    body: ResponsesRequest, history: list[ChatMessage], inputs: list[ChatMessage]
) -> ChatCompletionRequest:
    """The chat request underneath: `instructions` as the system message (not carried over
    from a previous response, as OpenAI does), the stored conversation, then the `input`
    messages (input_messages)."""
    refuse_unsupported(body)
    system = []
    if body.instructions is not None:
        system = [ChatMessage(role="system", content=body.instructions)]
    return ChatCompletionRequest(
        model=body.model,
        messages=[*system, *history, *inputs],
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        priority=body.priority,
        stream=body.stream,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format(body.text),
        user=body.user,
    )


def rename_field(name: str | None) -> str | None:
    if name is None:
        return None
    # Chat nests a tool's fields under `function`; a Responses tool holds them itself.
    name = re.sub(r"^tools\[(\d+)\]\.function\.", r"tools[\1].", name)
    for chat, own in _FIELD_NAMES:
        if name.startswith(chat):
            return own + name[len(chat) :] if chat != "messages" else own
    return name


def renamed(err: APIError) -> APIError:
    """A refusal of the chat request underneath, naming the Responses field instead."""
    own = rename_field(err.param)
    if own == err.param or err.param is None or own is None:
        return err
    message = err.message.replace(err.param, own, 1).replace(".function.", ".", 1)
    out = APIError(
        err.status, message, param=own, code=err.code, type=err.type, headers=err.headers
    )
    out.logged = err.logged
    return out
