"""Request and response bodies of POST /v1/embeddings (OpenAI's, with vLLM's `priority`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from appliance.server.schemas import MAX_INT32


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    # A string, a list of strings, a list of token ids, or a list of token-id lists (read by
    # server/embeddings.py, which names the bad item).
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    # Truncate each vector to its first `dimensions` (then normalise): Matryoshka models only.
    dimensions: Annotated[int, Meta(ge=1, le=MAX_INT32)] | None = None
    user: str | None = None
    priority: str | Annotated[int, Meta(ge=-MAX_INT32, le=MAX_INT32)] | None = None


class Embedding(msgspec.Struct, kw_only=True):
    index: int
    # Floats, or with encoding_format "base64" their little-endian float32 bytes in base64.
    embedding: list[float] | str
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
