"""Test adapters saved by peft itself (random factors: `init_lora_weights=False` draws both A
and B, so the adapter changes the output from the first token) and peft's own greedy output as
the reference, unmerged (the adapter's extra matmuls) and merged into the weights."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(
    base_dir: Path,
    out: Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: list[str] | None = None,
    scale: float = 1.0,
) -> Path:
    """A PEFT adapter with random factors on `targets` (every projection by default), saved
    with peft's save_pretrained; `scale` multiplies B (how far the adapter moves the model)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_PROJECTIONS,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    model.save_pretrained(out)
    return out


def peft_greedy(
    base_dir: Path,
    adapter_dir: Path | None,
    prompts: list[list[int]],
    new_tokens: int,
    merged: bool = False,
) -> list[list[int]]:
    """transformers (+ peft on `adapter_dir`) greedy continuations in float32, EOS ignored
    (computed once per argument set: several tests compare against the same reference)."""
    key = tuple(tuple(p) for p in prompts)
    return [list(t) for t in _peft_greedy(base_dir, adapter_dir, key, new_tokens, merged)]


@cache
def _peft_greedy(
    base_dir: Path,
    adapter_dir: Path | None,
    prompts: tuple[tuple[int, ...], ...],
    new_tokens: int,
    merged: bool,
) -> tuple[tuple[int, ...], ...]:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
        if merged:
            model = model.merge_and_unload()
    model.eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([list(p)])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(tuple(gen[0, len(p) :].tolist()))
    return tuple(outs)


def peft_logprobs(
    base_dir: Path, adapter_dir: Path | None, prompt: list[int], continuation: list[int]
) -> torch.Tensor:
    """float32 transformers (+ peft on `adapter_dir`) log-probabilities [len(continuation),
    vocab] of each continuation position, teacher-forced along `continuation`."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)
