"""What /v1/embeddings needs to know of the served model, read from its directory once: the
pooling of the final hidden states (the template's `model.pooling`, or with "auto" the
sentence-transformers Pooling config beside the weights: `modules.json` names the Pooling
module's folder, whose config.json says lasttoken or mean; neither: last token, as vLLM pools
a causal LM), the hidden size, and whether `dimensions` may truncate the vectors (a
Matryoshka model: config.json's `matryoshka_dimensions` or `is_matryoshka`, vLLM's keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, cast

Pooling = Literal["last", "mean"]


@dataclass(frozen=True)
class EmbeddingModel:
    pooling: Pooling
    hidden_size: int | None
    matryoshka: bool
    # The sizes a Matryoshka model was trained for (empty: any size up to hidden_size).
    dimensions: tuple[int, ...] = ()


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _st_pooling(model_dir: Path) -> Pooling | None:
    modules = _json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            cfg = _json(model_dir / str(module.get("path", "")) / "config.json") or {}
            if cfg.get("pooling_mode_lasttoken"):
                return "last"
            if cfg.get("pooling_mode_mean_tokens"):
                return "mean"
    return None


@cache
def embedding_model(model_dir: str, pooling: str) -> EmbeddingModel:
    """`pooling` is the template's model.pooling (auto, last, mean)."""
    root = Path(model_dir)
    config = _json(root / "config.json")
    config = config if isinstance(config, dict) else {}
    kind = (_st_pooling(root) or "last") if pooling == "auto" else cast(Pooling, pooling)
    dims = config.get("matryoshka_dimensions")
    sizes = tuple(int(d) for d in dims) if isinstance(dims, list) else ()
    hidden = config.get("hidden_size")
    return EmbeddingModel(
        pooling=kind,
        hidden_size=hidden if isinstance(hidden, int) else None,
        matryoshka=bool(sizes) or bool(config.get("is_matryoshka")),
        dimensions=sizes,
    )
