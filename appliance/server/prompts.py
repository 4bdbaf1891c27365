"""A request's prompts as token ids: a completion's prompt (strings or ids) and a chat's
messages through the chat template, with the tools of its plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from appliance.server.chat_caps import adapt_conversation, template_caps
from appliance.server.errors import bad_request
from appliance.server.schemas import ChatCompletionRequest, ChatMessage
from appliance.server.tool_calls import ToolPlan, plan_tools, template_tool_calls

if TYPE_CHECKING:
    from appliance.server.state import ServerState


def tool_plan(state: ServerState, body: ChatCompletionRequest) -> ToolPlan | None:
    """The chat request's tool plan (server/tool_calls.py) for the served model's template."""
    template = getattr(state.tokenizer, "chat_template", None)
    return plan_tools(body, state.config.model.tool_call_parser, template)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def completion_prompts(state: ServerState, prompt: str | list[Any]) -> list[list[int]]:
    tok = state.tokenizer
    if isinstance(prompt, str):
        return [list(tok.encode(prompt, add_special_tokens=True))]
    if not prompt:
        raise bad_request("prompt: must not be empty", param="prompt")
    if _is_ids(prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [list(tok.encode(p, add_special_tokens=True)) for p in prompt]
    if all(_is_ids(p) and p for p in prompt):
        return [list(p) for p in prompt]
    raise bad_request(
        "prompt: expected a string, a list of strings, a list of token ids (non-negative "
        "integers) or a list of such lists",
        param="prompt",
    )


def _message_dict(i: int, msg: ChatMessage) -> dict[str, Any]:
    content = msg.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                    param=f"messages[{i}].content",
                )
            texts.append(part.text)
        content = "".join(texts)
    out: dict[str, Any] = {"role": msg.role, "content": content or ""}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_calls:
        out["tool_calls"] = template_tool_calls(msg.tool_calls, i)
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    return out


def chat_prompt(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    plan: ToolPlan | None = None,
) -> list[int]:
    """The prompt's token ids: the messages through the chat template, with the tools of
    `plan` (rendered by the template, or described in the generic format's preamble) and
    tool turns rewritten for a template that cannot render them (server/chat_caps.py)."""
    if not messages:
        raise bad_request("messages: must contain at least one message", param="messages")
    tok = state.tokenizer
    convo = [_message_dict(i, m) for i, m in enumerate(messages)]
    preamble = plan.preamble if plan is not None else ""
    parallel = plan.parallel if plan is not None else True
    convo = adapt_conversation(convo, template_caps(tok), preamble, parallel)
    tools = plan.template_tools if plan is not None else None
    try:
        text = tok.apply_chat_template(
            convo, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # jinja errors: the template refused these messages
        raise bad_request(f"messages: the chat template failed: {exc}", param="messages") from None
    # The template writes the special tokens itself (bos included), as transformers does.
    return list(tok.encode(text, add_special_tokens=False))
