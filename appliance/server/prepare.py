"""From an OpenAI request body to engine inputs: priority, the cheap queue-full check, prompt
token ids (chat template included), and validated sampling parameters.

Order matters for an overloaded box: priority and the queue-full check come before any
tokenization, so a request that would be refused costs almost nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from appliance.config import ConfigError
from appliance.sampling_params import SamplingParams
from appliance.server.chat_caps import adapt_conversation, template_caps
from appliance.server.errors import APIError, bad_request
from appliance.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from appliance.server.tool_calls import template_tool_calls

if TYPE_CHECKING:
    from appliance.server.state import ServerState
    from appliance.server.tool_calls import ToolPlan

Body = CompletionRequest | ChatCompletionRequest


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def resolve_priority(state: ServerState, value: str | int | None) -> str:
    """The request's priority class name (400 for an unknown class)."""
    try:
        return state.config.resolve_priority(value)[1]
    except ConfigError as exc:
        raise bad_request(str(exc), param="priority") from None


def check_queue(state: ServerState, priority_class: str) -> None:
    """429 before tokenizing when the class's waiting queue is already full."""
    cfg = state.config
    limit = cfg.class_limits(priority_class).max_waiting_requests
    client = state.client
    if not limit or client is None:
        return
    queued = client.queued(priority_class)
    if queued >= limit:
        state.metrics.count_rejection("queue_full", priority_class)
        raise APIError(
            429,
            f"queue full for priority class {priority_class!r} "
            f"({queued} waiting >= max_waiting_requests {limit})",
            code="queue_full",
            headers={"Retry-After": str(cfg.server.retry_after_s)},
        )


def check_estimated_wait(state: ServerState, priority_class: str) -> None:
    """429 at arrival when the request would wait longer than its class's queue timeout
    (scheduler.estimated_wait_admission): failing now beats failing after the whole limit."""
    cfg = state.config
    timeout = cfg.class_limits(priority_class).queue_timeout_s
    client = state.client
    if not cfg.scheduler.estimated_wait_admission or not timeout or client is None:
        return
    classes = cfg.priority_classes
    mine = classes[priority_class].priority if priority_class in classes else None
    by_priority = cfg.scheduler.policy == "priority" and mine is not None
    ahead = [
        c
        for c, pc in classes.items()
        if not by_priority or (mine is not None and pc.priority <= mine)
    ]
    if priority_class not in ahead:
        ahead.append(priority_class)
    wait = client.estimated_wait_s(ahead)
    if wait is not None and wait > timeout:
        state.metrics.count_rejection("estimated_wait", priority_class)
        raise APIError(
            429,
            f"estimated wait for priority class {priority_class!r} is {wait:.1f}s > "
            f"queue_timeout_s {timeout} ({sum(client.queued(c) for c in ahead)} requests "
            "queued ahead)",
            code="queue_timeout_estimated",
            headers={"Retry-After": str(cfg.server.retry_after_s)},
        )


def refuse_unsupported(body: Body) -> None:
    checks: list[tuple[bool, str]] = [
        (body.presence_penalty != 0.0, "presence_penalty"),
        (body.frequency_penalty != 0.0, "frequency_penalty"),
        (bool(body.logit_bias), "logit_bias"),
    ]
    if isinstance(body, CompletionRequest):
        checks += [
            (body.suffix is not None, "suffix"),
            (body.best_of is not None and body.best_of != body.n, "best_of"),
        ]
    for bad, name in checks:
        if bad:
            raise bad_request(f"{name} is not supported by this server", param=name)


# -- prompts -------------------------------------------------------------------------------------
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


# -- sampling ------------------------------------------------------------------------------------
def resolve_max_tokens(
    state: ServerState, prompts: list[list[int]], asked: int | None, name: str, prompt_param: str
) -> int:
    limit = state.info.max_model_len if state.info else state.config.model.max_model_len
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        raise bad_request(
            f"{prompt_param}: {longest} tokens; this model's maximum context length is {limit} "
            "tokens, which leaves no room to generate",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if asked is None:
        return limit - longest
    if asked < 1:
        raise bad_request(f"{name} must be at least 1, got {asked}", param=name)
    if longest + asked > limit:
        raise bad_request(
            f"{name}: {asked} + {longest} prompt tokens exceeds this model's maximum context "
            f"length of {limit} tokens",
            param=name,
            code="context_length_exceeded",
        )
    return asked


def sampling_params(
    body: Body, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        prompt_logprobs=prompt_logprobs,
    )
    # Validated once, by Engine.add_request; a refusal comes back as a 400 naming the field.
    return params
