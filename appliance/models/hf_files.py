"""Reading Hugging Face model directories without transformers' model classes.

The engine builds its own layers and only needs the config, the tokenizer and the raw tensors.
Everything here is local-only: the appliance never downloads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    return path


def has_model(model_dir: str | Path) -> bool:
    """True when model_dir holds a config.json and safetensors weights (single or sharded)."""
    path = Path(model_dir)
    return (path / CONFIG_FILE).is_file() and (
        (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()
    )


def load_hf_config(model_dir: str | Path) -> Any:
    """The model's `transformers.PretrainedConfig`, from local files only."""
    from transformers import AutoConfig

    path = _dir(model_dir)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path / CONFIG_FILE} not found: not a Hugging Face model dir")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def read_config_json(model_dir: str | Path) -> SimpleNamespace:
    """config.json's keys as attributes, without transformers: what the engine reads of it
    (ModelArgs.from_hf, the EOS ids) needs no config class, and importing one costs every
    start ~2.7 s on 2 cores (LlamaConfig's module pulls in torch.distributed)."""
    path = _dir(model_dir)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path / CONFIG_FILE} not found: not a Hugging Face model dir")
    return SimpleNamespace(**json.loads((path / CONFIG_FILE).read_text("utf-8")))


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model's tokenizer via AutoTokenizer, from local files only (a GGUF checkpoint's
    from beside it or its metadata, appliance.models.gguf_file)."""
    from transformers import AutoTokenizer

    from appliance.models.gguf_file import GgufCheckpoint
    from appliance.models.gguf_meta import find_gguf

    gguf = find_gguf(model_dir)
    if gguf is not None:
        return GgufCheckpoint(gguf).tokenizer()
    path = _dir(model_dir)
    if _generic_fast_tokenizer(path):
        # The class AutoTokenizer would pick anyway, without its detour through the model's
        # config class, whose import pulls in most of transformers and torch.distributed
        # (~2 s of a 2-core box's start-up, in the API process that needs only the tokenizer).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# tokenizer_config.json's tokenizer_class values that name the generic tokenizers-backed class
# (transformers 5 calls it TokenizersBackend, and keeps PreTrainedTokenizerFast as its alias).
_GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _generic_fast_tokenizer(path: Path) -> bool:
    """A tokenizer.json beside a tokenizer_config.json that names the generic class: nothing
    model-specific for AutoTokenizer to resolve."""
    config_file = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config_file.is_file():
        return False
    try:
        name = json.loads(config_file.read_text("utf-8")).get("tokenizer_class")
    except (OSError, ValueError):
        return False
    return name in _GENERIC_TOKENIZER_CLASSES


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a model dir, in load order; raises naming whatever is missing."""
    path = _dir(model_dir)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        # First-appearance order keeps shard 1 before shard 2 for the usual sorted maps.
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no weights in {path}: neither {SINGLE_FILE} nor {INDEX_FILE} exists")


def iter_safetensors(
    model_dir: str | Path, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every weight, opening each safetensors file once.

    For a sharded model only the tensors the index maps to a shard are taken from it, so a stray
    tensor in a shard cannot shadow the one the index points at.
    """
    from safetensors import safe_open

    path = _dir(model_dir)
    files = safetensors_files(path)
    wanted: dict[str, set[str]] | None = None
    if (path / INDEX_FILE).is_file():
        wanted = {}
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        for name, file in weight_map.items():
            wanted.setdefault(file, set()).add(name)
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if wanted is None or name in wanted[file.name]:
                    yield name, f.get_tensor(name)


def eos_token_ids(hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end a generation: the model config's and the tokenizer's."""
    ids: set[int] = set()
    for source in (
        getattr(hf_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    return frozenset(ids)
