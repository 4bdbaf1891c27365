"""From an OpenAI request body to one prepared request: the engine inputs (prompt token ids,
validated sampling parameters, priority) and what the response must carry.

`prepare` is the one way chat and completion bodies take. Order matters for an overloaded
box: priority and the queue-full and estimated-wait checks come before any tokenization, so a
request that would be refused costs almost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.config import ConfigError
from appliance.sampling_params import SamplingParams
from appliance.server import limits
from appliance.server.chat_caps import adapt_conversation, template_caps
from appliance.server.errors import APIError, bad_request
from appliance.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from appliance.server.scoring import ResponsePlan
from appliance.server.structured import structured_outputs, validated
from appliance.server.tool_calls import (
    ToolPlan,
    plan_tools,
    template_tool_calls,
    with_output_constraint,
)

if TYPE_CHECKING:
    from appliance.server.state import ServerState

Body = CompletionRequest | ChatCompletionRequest


@dataclass
class PreparedRequest:
    """A chat or completion request, ready for the engine (server/generate.py) and for the
    response's formatting (server/format.py)."""

    chat: bool
    # One per prompt; the engine runs `n` samples of each.
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    # As the client gave it (the engine resolves it too), and its class for admission.
    priority: str | int | None
    priority_class: str
    # Top logprobs per generated token (None: no logprobs).
    logprobs: int | None
    include_usage: bool
    plan: ResponsePlan

    @property
    def id_prefix(self) -> str:
        return "chatcmpl" if self.chat else "cmpl"


def prepare(state: ServerState, body: Body) -> PreparedRequest:
    """The one preparation of a generation request; an APIError (400, 404, 429) refuses it."""
    check_model(state, body.model)
    check_limits(state, body)
    refuse_unsupported(body)
    priority_class = resolve_priority(state, body.priority)
    check_queue(state, priority_class)  # before tokenizing: shedding load stays cheap
    check_estimated_wait(state, priority_class)
    structured = structured_outputs(body)
    plan = ResponsePlan(prompt_logprobs=body.prompt_logprobs)
    if isinstance(body, ChatCompletionRequest):
        plan.tools = tool_plan(state, body)
        if plan.tools is not None and plan.tools.structured is not None:
            if structured is not None:
                plan.tools = with_output_constraint(plan.tools, structured)
            # (a generic plan, which with_output_constraint returns, constrains its output)
            assert plan.tools.structured is not None
            structured = validated(plan.tools.structured, "tools")
        prompts = [chat_prompt(state, body.messages, body.add_generation_prompt, plan.tools)]
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        asked = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        k = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        prompt_param = "messages"
    else:
        prompts = completion_prompts(state, body.prompt)
        if not isinstance(body.prompt, str):  # ids from the client: within the vocabulary
            limits.check_prompt_ids(prompts, _vocab_size(state))
        name, asked, k, prompt_param = "max_tokens", body.max_tokens, body.logprobs, "prompt"
        plan.echo = body.echo
        if body.echo and asked == 0:
            # Scoring only: the prompt's last logits sample one token (same forward), dropped.
            plan.drop_output, asked = True, 1
    max_tokens = resolve_max_tokens(state, prompts, asked, name, prompt_param)
    # Echoed logprobs and vLLM's prompt_logprobs come from one prefill computation.
    wanted = [x for x in (body.prompt_logprobs, k if plan.echo else None) if x is not None]
    params = sampling_params(body, max_tokens, k, max(wanted) if wanted else None)
    params.structured = structured
    return PreparedRequest(
        chat=isinstance(body, ChatCompletionRequest),
        prompts=prompts,
        params=params,
        n=body.n,
        stream=body.stream,
        priority=body.priority,
        priority_class=priority_class,
        logprobs=k,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        plan=plan,
    )


def tool_plan(state: ServerState, body: ChatCompletionRequest) -> ToolPlan | None:
    template = getattr(state.tokenizer, "chat_template", None)
    return plan_tools(body, state.config.model.tool_call_parser, template)


def _vocab_size(state: ServerState) -> int:
    return state.info.vocab_size if state.info else 0


def check_limits(state: ServerState, body: Body) -> None:
    """The limits a schema cannot state (appliance/server/limits.py), before any work."""
    vocab = _vocab_size(state)
    limits.check_top_k(body.top_k, vocab)
    if body.stop_token_ids:
        limits.check_token_ids(body.stop_token_ids, vocab, "stop_token_ids")
    if isinstance(body, ChatCompletionRequest):
        limits.check_roles([m.role for m in body.messages])


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
    # The classes served before this one: the running core's policy says (engine client).
    ahead = client.policy.classes_ahead(cfg.priority_classes, priority_class)
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
