"""LoRA adapters in the PEFT format (`adapter_config.json` + `adapter_model.safetensors`, as
`peft`'s `save_pretrained` writes them and vLLM's `/v1/load_lora_adapter` reads them), checked
against the base model at load: every refusal names the field and the limit.

Each targeted projection gets A (rank x in_features) and B (out_features x rank) in the
checkpoint's full (unsharded) shapes; the scaling (lora_alpha / r, or / sqrt(r) under rsLoRA)
is folded into B once here, so the forward adds x A^T B^T and nothing else."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from appliance.models.args import ModelArgs

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, as Hugging Face's Llama modules name them.
TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.\w+)?\.weight"
)


class AdapterError(ValueError):
    """An adapter that cannot serve on this base model; the message names the field."""


@dataclass
class LoraFactors:
    """One projection's factors: a (rank, in_features), b (out_features, rank), scaled."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    alpha: float
    target_modules: frozenset[str]
    # (layer index, projection name) -> factors, on the CPU in float32.
    modules: dict[tuple[int, str], LoraFactors] = field(default_factory=dict)
    base_model: str = ""

    @property
    def nbytes(self) -> int:
        return sum(f.a.numel() * 4 + f.b.numel() * 4 for f in self.modules.values())


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each targetable projection of the base model."""
    q = args.num_heads * args.head_dim
    kv = args.num_kv_heads * args.head_dim
    h, inter = args.hidden_size, args.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def _read_config(path: Path) -> dict[str, object]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"lora_path {str(path)!r}: no {CONFIG_FILE} there")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{file}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{file}: expected a JSON object")
    return raw


def _target_modules(raw: dict[str, object], file: Path) -> frozenset[str]:
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        # PEFT also takes a regex over module names; the module's last name is what it targets.
        chosen = frozenset(t for t in TARGETABLE if re.search(targets, f"self_attn.{t}"))
        chosen |= frozenset(t for t in TARGETABLE if re.search(targets, f"mlp.{t}"))
        if not chosen:
            raise AdapterError(
                f"{file}: target_modules {targets!r} matches none of this model's projections "
                f"({', '.join(TARGETABLE)})"
            )
        return chosen
    if not isinstance(targets, list) or not targets:
        raise AdapterError(f"{file}: target_modules must be a non-empty list of module names")
    lacking = sorted(str(t) for t in targets if t not in TARGETABLE)
    if lacking:
        raise AdapterError(
            f"{file}: target_modules {lacking} are not projections of this model "
            f"(it has {', '.join(TARGETABLE)})"
        )
    return frozenset(str(t) for t in targets)


def _refuse_unsupported(raw: dict[str, object], file: Path) -> None:
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type {raw.get('peft_type')!r}: only LORA is served")
    if raw.get("use_dora"):
        raise AdapterError(f"{file}: use_dora: DoRA adapters are not served")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias {raw.get('bias')!r}: only 'none' is served")
    if raw.get("modules_to_save"):
        raise AdapterError(
            f"{file}: modules_to_save: adapters that replace whole modules are not served"
        )
    if raw.get("alpha_pattern"):
        raise AdapterError(f"{file}: alpha_pattern: per-module alphas are not served")
    if raw.get("fan_in_fan_out"):
        raise AdapterError(f"{file}: fan_in_fan_out: only Linear layers (not Conv1D) are served")


def read_adapter(name: str, path: str | Path, args: ModelArgs, max_rank: int) -> LoraAdapter:
    """Read and check an adapter directory against the base model's `args`; AdapterError names
    the field (r over lora.max_lora_rank, a target module the model lacks, a factor whose
    shape differs from the base's projection)."""
    folder = Path(path).expanduser()
    raw = _read_config(folder)
    file = folder / CONFIG_FILE
    _refuse_unsupported(raw, file)
    targets = _target_modules(raw, file)
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{file}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{file}: r {rank} exceeds lora.max_lora_rank {max_rank}")
    alpha_raw = raw.get("lora_alpha", rank)
    if not isinstance(alpha_raw, int | float):
        raise AdapterError(f"{file}: lora_alpha must be a number, got {alpha_raw!r}")
    alpha = float(alpha_raw)
    rslora = bool(raw.get("use_rslora", False))
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"lora_path {str(folder)!r}: no {WEIGHTS_FILE} there")
    tensors = load_file(str(weights))
    shapes = projection_shapes(args)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.fullmatch(key)
        if match is None:
            raise AdapterError(
                f"{weights.name}: tensor {key!r} is not a LoRA factor of a projection"
            )
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in TARGETABLE:
            raise AdapterError(f"{weights.name}: tensor {key!r}: the model has no {module!r}")
        if layer >= args.num_layers:
            raise AdapterError(
                f"{weights.name}: tensor {key!r}: layer {layer}, the base model has "
                f"{args.num_layers} layers"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    modules: dict[tuple[int, str], LoraFactors] = {}
    for (layer, module), pair in sorted(pairs.items()):
        where = f"model.layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{weights.name}: {where} has lora_{next(iter(pair))} only")
        a, b = pair["A"].float(), pair["B"].float()
        out_f, in_f = shapes[module]
        r = int(a.shape[0])
        if a.dim() != 2 or a.shape[1] != in_f:
            raise AdapterError(
                f"{weights.name}: {where}.lora_A has shape {tuple(a.shape)}; the base model's "
                f"{module} takes {in_f} input features"
            )
        if b.dim() != 2 or b.shape != (out_f, r):
            raise AdapterError(
                f"{weights.name}: {where}.lora_B has shape {tuple(b.shape)}; the base model's "
                f"{module} gives {out_f} output features (expected ({out_f}, {r}))"
            )
        if r > max_rank:
            raise AdapterError(
                f"{weights.name}: {where}: rank {r} exceeds lora.max_lora_rank {max_rank}"
            )
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        modules[(layer, module)] = LoraFactors(a.contiguous(), (b * scaling).contiguous())
    if not modules:
        raise AdapterError(f"{weights.name}: no LoRA factors")
    return LoraAdapter(
        name=name,
        path=str(folder),
        rank=max(f.rank for f in modules.values()),
        alpha=alpha,
        target_modules=targets,
        modules=modules,
        base_model=str(raw.get("base_model_name_or_path") or ""),
    )
