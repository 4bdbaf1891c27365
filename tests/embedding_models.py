"""A Qwen3-Embedding-shaped model built offline for the embedding tests: a tiny random Qwen2
(tied embeddings) saved as a bare model (tensor names without `model.`, no lm_head), with the
sentence-transformers files that say last-token pooling, a tokenizer that appends the
end-of-text token to every input (as Qwen3-Embedding's does), and `is_matryoshka` in its
config.json (vLLM's key for models whose vectors may be shortened)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from appliance.models.demo_model import build_demo_model

EOS = "<|end_of_text|>"


def build_embedding_model(out: Path) -> Path:
    build_demo_model("tiny", out, arch="qwen2", seed=5)
    weights = load_file(out / "model.safetensors")
    bare = {
        k.removeprefix("model."): v.contiguous()
        for k, v in weights.items()
        if k != "lm_head.weight"
    }
    save_file(bare, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["is_matryoshka"] = True
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((out / "tokenizer.json").read_text())
    eos_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == EOS)
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": EOS, "type_id": 0}},
        ],
        "pair": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 0}},
            {"SpecialToken": {"id": EOS, "type_id": 0}},
        ],
        "special_tokens": {EOS: {"id": EOS, "ids": [eos_id], "tokens": [EOS]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(tok))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": config["hidden_size"],
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_lasttoken": True,
        "include_prompt": True,
    }
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return out
