"""From an OpenAI request body to one prepared request: the engine inputs (prompt token ids,
sampling parameters, priority) and what the response must carry.

`prepare` is the one way chat and completion bodies take, and each check has one owner:

- here, what is the API's own and what sheds load before any tokenization: the model name,
  the fields this server refuses, the limits a schema cannot state (server/limits.py), the
  priority class and the queue-full and estimated-wait admission (429s that cost almost
  nothing), the tools (server/tool_calls.py), and OpenAI's rule that prompt and max_tokens
  fit the context together;
- in the engine, what it must check for offline use as well (Engine.add_request: the prompt's
  length and token ids, the sampling parameters, whether an output constraint can be
  enforced). Its refusal comes back with the field it names, and `PreparedRequest.refusal`
  makes it the same 400 as if checked here, naming the request's own field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.config import ConfigError
from appliance.sampling_params import SamplingParams, StructuredOutputs, invalid_field
from appliance.server import limits
from appliance.server.errors import APIError, bad_request
from appliance.server.prompts import chat_prompt, completion_prompts, tool_plan
from appliance.server.schemas import ChatCompletionRequest, CompletionRequest
from appliance.server.scoring import ResponsePlan
from appliance.server.structured import structured_outputs
from appliance.server.tool_calls import with_output_constraint

if TYPE_CHECKING:
    from appliance.server.state import ServerState

Body = CompletionRequest | ChatCompletionRequest
# Token ids travel to the engine core as msgpack integers (at most 64 bits).
WIRE_MAX_TOKEN_ID = 2**64 - 1


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
    # As the client gave it (the engine resolves it for its queues), and its class.
    priority: str | int | None
    priority_class: str
    # Top logprobs per generated token (None: no logprobs).
    logprobs: int | None
    include_usage: bool
    plan: ResponsePlan
    # The request's fields behind the engine's "prompt" and "structured".
    prompt_param: str = "prompt"
    constraint_param: str | None = None
    # The LoRA adapter `model` named ("": the base model).
    lora_name: str = ""

    @property
    def id_prefix(self) -> str:
        return "chatcmpl" if self.chat else "cmpl"

    def refusal(self, detail: str, code: str = "") -> APIError:
        """The engine's refusal of this request's input (engine/request_checks.py,
        SamplingParams.validate) as the 400 naming the request's own field: the engine's
        `prompt` is a chat request's `messages`, its `structured` the field that gave the
        output constraint."""
        param = invalid_field(detail)
        own = {"prompt": self.prompt_param, "structured": self.constraint_param}.get(param or "")
        if param is not None and own is not None and detail.startswith(param):
            detail, param = own + detail[len(param) :], own
        return APIError(400, detail, param=param, code=code or None)


@dataclass
class _Inputs:
    """What differs between a chat and a completion body, once read."""

    prompts: list[list[int]]
    prompt_param: str
    # max_tokens as asked (None: all the room left) and the field that asked it.
    max_tokens: int | None
    max_tokens_param: str
    logprobs: int | None


def prepare(state: ServerState, body: Body) -> PreparedRequest:
    """The one preparation of a generation request; an APIError (400, 404, 429) refuses it."""
    lora_name = check_model(state, body.model)
    if state.config.model.task == "embed":
        raise bad_request(
            'this server serves an embedding model (model.task = "embed"): use /v1/embeddings',
            param="model",
        )
    check_limits(state, body)
    refuse_unsupported(body)
    priority_class = resolve_priority(state, body.priority)
    check_class_open(state, priority_class)
    check_queue(state, priority_class)  # before tokenizing: shedding load stays cheap
    check_estimated_wait(state, priority_class)
    constraint = structured_outputs(body)
    plan = ResponsePlan(prompt_logprobs=body.prompt_logprobs)
    if isinstance(body, ChatCompletionRequest):
        constraint = _with_tools(state, body, plan, constraint)
        inputs = _chat_inputs(state, body, plan)
    else:
        inputs = _completion_inputs(state, body, plan)
    if body.priority is None and inputs.prompts:
        # Length-aware classes (scheduler.long_prompt_class): known once tokenized; the engine
        # resolves each prompt the same way. The long class's queue is checked in its turn.
        longest = max(len(p) for p in inputs.prompts)
        by_length = state.config.resolve_priority(None, longest)[1]
        if by_length != priority_class:
            priority_class = by_length
            check_class_open(state, priority_class)
            check_queue(state, priority_class)
    max_tokens = resolve_max_tokens(state, inputs)
    # Echoed logprobs and vLLM's prompt_logprobs come from one prefill computation.
    k = inputs.logprobs
    wanted = [x for x in (body.prompt_logprobs, k if plan.echo else None) if x is not None]
    params = sampling_params(body, max_tokens, k, max(wanted) if wanted else None)
    params.structured = constraint[0] if constraint else None
    return PreparedRequest(
        chat=isinstance(body, ChatCompletionRequest),
        prompts=inputs.prompts,
        params=params,
        n=body.n,
        stream=body.stream,
        priority=body.priority,
        priority_class=priority_class,
        logprobs=k,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        plan=plan,
        prompt_param=inputs.prompt_param,
        lora_name=lora_name,
        constraint_param=constraint[1] if constraint else None,
    )


def _with_tools(
    state: ServerState,
    body: ChatCompletionRequest,
    plan: ResponsePlan,
    constraint: tuple[StructuredOutputs, str] | None,
) -> tuple[StructuredOutputs, str] | None:
    """The tool plan into `plan`; the output constraint then: the tools' grammar (with the
    request's own constraint folded into its plain answer) where the plan has one."""
    plan.tools = tool_plan(state, body)
    if plan.tools is None or plan.tools.structured is None:
        return constraint
    param = "tools"
    if constraint is not None:
        plan.tools = with_output_constraint(plan.tools, *constraint)
        # A combined grammar that does not compile: the tools compiled on their own.
        param = constraint[1]
    # (a generic plan, which with_output_constraint returns, constrains its output)
    assert plan.tools.structured is not None
    return plan.tools.structured, param


def _chat_inputs(state: ServerState, body: ChatCompletionRequest, plan: ResponsePlan) -> _Inputs:
    prompt = chat_prompt(state, body.messages, body.add_generation_prompt, plan.tools)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    k = (body.top_logprobs or 0) if body.logprobs else None
    if body.max_completion_tokens is not None:
        return _Inputs([prompt], "messages", body.max_completion_tokens, "max_completion_tokens", k)
    return _Inputs([prompt], "messages", body.max_tokens, "max_tokens", k)


def _completion_inputs(state: ServerState, body: CompletionRequest, plan: ResponsePlan) -> _Inputs:
    prompts = completion_prompts(state, body.prompt)
    if any(max(p) > WIRE_MAX_TOKEN_ID for p in prompts if p):
        # The engine checks ids against the vocabulary, but these cannot even be sent to it:
        # refused here, in the same words.
        for p in prompts:
            limits.check_token_ids(p, _vocab_size(state), "prompt")
    asked = body.max_tokens
    plan.echo = body.echo
    if body.echo and asked == 0:
        # Scoring only: the prompt's last logits sample one token (same forward), dropped.
        plan.drop_output, asked = True, 1
    return _Inputs(prompts, "prompt", asked, "max_tokens", body.logprobs)


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


# -- admission and fields this server refuses ----------------------------------------------------
def check_model(state: ServerState, model: str | None) -> str:
    """The LoRA adapter `model` names ("" for the base model); 404 naming an unknown one."""
    if model is None or model == state.model_name:
        return ""
    adapters = state.lora_adapters()
    if model in adapters:
        return model
    served = ", ".join(repr(m) for m in [state.model_name, *adapters])
    raise APIError(
        404,
        f"the model {model!r} does not exist; this server serves {served}",
        param="model",
        code="model_not_found",
    )


def resolve_priority(state: ServerState, value: str | int | None) -> str:
    """The request's priority class name (400 for an unknown class)."""
    try:
        return state.config.resolve_priority(value)[1]
    except ConfigError as exc:
        raise bad_request(str(exc), param="priority") from None


def check_class_open(state: ServerState, priority_class: str) -> None:
    """503 while the operator has paused the class (POST /admin/classes/{name}/pause)."""
    how = state.class_states.get(priority_class)
    if how is not None:
        state.metrics.count_rejection("class_paused", priority_class)
        raise APIError(
            503,
            f"priority class {priority_class!r} is {how} by the operator; retry later",
            code="class_paused",
            headers={"Retry-After": str(state.config.server.retry_after_s)},
        )


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


# -- sampling ------------------------------------------------------------------------------------
def resolve_max_tokens(state: ServerState, inputs: _Inputs) -> int:
    """max_tokens for the engine: as asked, or all the room the longest prompt leaves. That the
    prompt and max_tokens fit the context together is OpenAI's rule, the API's (offline
    generation stops at the limit instead). A prompt that leaves no room at all, and a
    max_tokens below 1, are the engine's refusals: not repeated here."""
    limit = state.info.max_model_len if state.info else state.config.model.max_model_len
    longest = max(len(p) for p in inputs.prompts)
    asked, name = inputs.max_tokens, inputs.max_tokens_param
    if asked is None:
        return limit - longest
    if longest < limit < longest + asked:
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
        speculative=body.speculative,
    )
    # Validated once, by Engine.add_request; a refusal comes back as a 400 naming the field.
    return params
