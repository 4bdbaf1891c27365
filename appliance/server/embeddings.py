"""POST /v1/embeddings: each input is one prefill-only engine request (SamplingParams.pooling),
batched by the same scheduler as generation and finished, its blocks freed, once its prompt is
computed (engine/pooling.py). The API checks what OpenAI checks before anything is queued (the
number of inputs, each input's length against the context, `dimensions`), then serves it
through the one generation path (openai.serve_generation) with its own answer: the vectors,
truncated to `dimensions` and L2-normalised, as floats or base64 float32.
"""

from __future__ import annotations

import base64
import math
import struct
import time
from typing import Any

from litestar import Request, Response

from appliance.sampling_params import SamplingParams
from appliance.server import prepare as prep
from appliance.server.embedding_model import EmbeddingModel, embedding_model
from appliance.server.embeddings_schema import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from appliance.server.errors import APIError, bad_request
from appliance.server.format import TokenText
from appliance.server.generate import Generation
from appliance.server.openai import StreamShape, serve_generation
from appliance.server.scoring import ResponsePlan
from appliance.server.state import ServerState


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def embedding_inputs(state: ServerState, value: str | list[Any]) -> list[list[int]]:
    """The inputs as token-id lists; 400 naming `input` (or `input[i]`) for a bad shape, too
    many inputs (server.max_embedding_inputs), or one over the model's context."""
    limit = state.config.server.max_embedding_inputs
    if isinstance(value, str):
        items: list[Any] = [value]
    elif _is_ids(value):
        items = [value]
    elif value and (all(isinstance(v, str) for v in value) or all(_is_ids(v) for v in value)):
        items = value
    else:
        raise bad_request(
            "input: expected a non-empty string, a list of strings, a list of token ids or a "
            "list of non-empty token-id lists",
            param="input",
        )
    if len(items) > limit:
        raise bad_request(
            f"input: {len(items)} inputs; at most {limit} per request "
            "(server.max_embedding_inputs)",
            param="input",
        )
    vocab = state.info.vocab_size if state.info else 0
    context = state.info.max_model_len if state.info else state.config.model.max_model_len
    single = isinstance(value, str) or items[0] is value  # one string or one id list
    out = []
    for i, item in enumerate(items):
        where = "input" if single else f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{where}: must not be empty", param=where)
            ids = list(state.tokenizer.encode(item, add_special_tokens=True))
        else:
            ids = list(item)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(
                    f"{where}: token id {bad} is outside the vocabulary [0, {vocab})", param=where
                )
        if len(ids) > context:
            raise bad_request(
                f"{where}: {len(ids)} tokens; this model's maximum context length is "
                f"{context} tokens",
                param=where,
                code="context_length_exceeded",
            )
        out.append(ids)
    return out


def check_dimensions(model: EmbeddingModel, dimensions: int | None) -> None:
    if dimensions is None:
        return
    if not model.matryoshka:
        raise bad_request(
            "dimensions: this model's embeddings cannot be shortened (it is not a Matryoshka "
            "model: no matryoshka_dimensions or is_matryoshka in its config.json)",
            param="dimensions",
        )
    if model.dimensions and dimensions not in model.dimensions:
        sizes = ", ".join(map(str, model.dimensions))
        raise bad_request(
            f"dimensions: {dimensions} is not one of this model's sizes ({sizes})",
            param="dimensions",
        )
    if model.hidden_size is not None and dimensions > model.hidden_size:
        raise bad_request(
            f"dimensions: {dimensions} exceeds the model's {model.hidden_size}",
            param="dimensions",
        )


def normalised(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values (all: None), scaled to unit L2 norm."""
    v = vector[:dimensions] if dimensions else vector
    norm = math.sqrt(math.fsum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def as_base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


class EmbeddingAnswer:
    id_prefix = "embd"

    def __init__(self, state: ServerState, body: EmbeddingRequest) -> None:
        self.state, self.request = state, body

    def body(self, gen: Generation, created: int, text_of: TokenText) -> Any:
        body = self.request
        data = []
        for ch in gen.choices:
            if len(ch.embedding) == 0:  # ended without its vector (cannot be: a guard)
                raise APIError(500, f"input[{ch.index}]: no embedding came back")
            vector = normalised(ch.embedding, body.dimensions)
            value = as_base64(vector) if body.encoding_format == "base64" else vector
            data.append(Embedding(index=ch.index, embedding=value))
        self.state.metrics.count_embeddings(len(data))
        usage = EmbeddingUsage(gen.prompt_tokens, gen.prompt_tokens)
        return EmbeddingResponse(
            id=gen.request_id, created=created, model=self.state.model_name, data=data, usage=usage
        )

    def stream(self, gen: Generation, created: int, text_of: TokenText) -> StreamShape:
        raise AssertionError("embeddings are never streamed")


async def create_embeddings(
    request: Request[Any, Any, Any], body: EmbeddingRequest
) -> Response[Any]:
    arrival = time.monotonic()
    state: ServerState = request.app.state.server
    # An adapter's name embeds with its adapter on (its hidden states are the adapter's).
    lora_name = prep.check_model(state, body.model)
    model_dir = state.info.model_dir if state.info else state.config.model.path
    model = embedding_model(model_dir, state.config.model.pooling)
    check_dimensions(model, body.dimensions)
    # Admission as chat's (server/prepare.py): the class, its queue, the estimated wait; a
    # long unnamed input's class once tokenized, as the engine resolves it.
    priority_class = prep.resolve_priority(state, body.priority)
    prep.check_queue(state, priority_class)
    prep.check_estimated_wait(state, priority_class)
    prompts = embedding_inputs(state, body.input)
    if body.priority is None:
        by_length = state.config.resolve_priority(None, max(map(len, prompts)))[1]
        if by_length != priority_class:
            priority_class = by_length
            prep.check_queue(state, priority_class)
    req = prep.PreparedRequest(
        chat=False,
        prompts=prompts,
        params=SamplingParams(max_tokens=1, pooling=model.pooling),
        n=1,
        stream=False,
        priority=body.priority,
        priority_class=priority_class,
        logprobs=None,
        include_usage=False,
        plan=ResponsePlan(),
        prompt_param="input",
        lora_name=lora_name,
    )
    return await serve_generation(request, req, EmbeddingAnswer(state, body), arrival)
