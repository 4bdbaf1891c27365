"""Request and response bodies of the OpenAI-compatible API, as msgspec Structs.

Unknown request fields are ignored (clients send `user`, `metadata`, ...); fields whose
meaning this server does not implement are declared so that a non-default value can be
refused with a 400 naming it, rather than silently ignored. Limits that are pure schema
(`n`, `top_logprobs`) are msgspec constraints, so the decode error names field and limit.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from appliance.sampling_params import MAX_LOGPROBS

MAX_N = 16
# Integer ranges (a value outside is a 400 naming the field and the bound, from msgspec):
# seeds are signed 64-bit like vLLM's (torch.long) and OpenAI's int64; counts of tokens and
# priorities fit a signed 32-bit int, far beyond any context length.
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
MAX_INT32 = 2**31 - 1
TokenCount = Annotated[int, Meta(ge=1, le=MAX_INT32)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]
# Completions take max_tokens 0 with echo (scoring only); without echo prepare refuses 0.
ScoringTokenCount = Annotated[int, Meta(ge=0, le=MAX_INT32)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` extension: exactly one of these constrains the output."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extras (vLLM's names): a class name such as "realtime" or an integer (lower = sooner).
    priority: str | Annotated[int, Meta(ge=-MAX_INT32, le=MAX_INT32)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=MAX_INT32)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_INT32)] = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    # Structured outputs (server/structured.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM: logprobs of the prompt tokens (top k each), computed in the prefill.
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    # false: no speculative drafts for this request (the template's [speculative] decides).
    speculative: bool = True


class CompletionRequest(_Common, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[Any]
    max_tokens: ScoringTokenCount | None = 16
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's answer to one of those calls.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True


# -- responses -----------------------------------------------------------------------------------
class PromptTokensDetails(msgspec.Struct):
    # Prompt tokens served from the prefix cache.
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token (None for the first), token id -> its logprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(msgspec.Struct):
    content: list[ChatLogprob] | None


class FunctionCall(msgspec.Struct):
    name: str
    # JSON text, as OpenAI sends it.
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = []


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "appliance"
    root: str
    max_model_len: int
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # With messages: the prompt a chat request with these tools would get (vLLM's field).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct):
    prompt: str
