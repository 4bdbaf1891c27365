"""Train a demo model briefly on the shipped corpus (CPU, a minute or two for `tiny`).

A random model's next-token distributions are nearly flat (top-1 log-prob ~ -4 over a 4096-token
vocabulary, top-1/top-2 gaps of ~0.01 nats), so any perturbation flips its argmax and its layers'
sensitivities say little about a real model's. Numerics that depend on trained behaviour (KV
quantization accuracy: `appliance kv-eval`) are better judged on a model that has learnt the
corpus's structure: peaked predictions, attention that copies names and numbers.

The last `HOLDOUT` of the corpus (by characters) is never trained on: `heldout_text()` is the
fair evaluation text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from appliance.models.demo_spec import corpus_text

HOLDOUT = 0.1


def heldout_text() -> str:
    text = corpus_text()
    return text[int(len(text) * (1 - HOLDOUT)) :]


def train_demo_model(
    model_dir: str | Path,
    steps: int,
    *,
    batch: int = 16,
    seq_len: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[float]:
    """Train the model in `model_dir` in place (AdamW, warm-up + cosine, bf16 autocast on the
    CPU) on the first 1 - HOLDOUT of the corpus; returns the loss of every step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = progress or (lambda _msg: None)
    path = str(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    saved_dtype = model.dtype
    model = model.float().train()
    text = corpus_text()
    train_text = text[: int(len(text) * (1 - HOLDOUT))]
    data = torch.tensor(tokenizer(train_text, add_special_tokens=False)["input_ids"])
    bos = torch.tensor([tokenizer.bos_token_id])
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 10)
    losses: list[float] = []
    start = time.monotonic()
    say(
        f"training {path} for {steps} steps of {batch} x {seq_len} tokens ({len(data)} in the text)"
    )
    for step in range(steps):
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        starts = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)
        # Every window opens with bos, as prompts (and kv-eval's windows) do.
        x = torch.stack([torch.cat([bos, data[s : s + seq_len - 1]]) for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % 20 == 0 or step == steps - 1:
            say(f"step {step:4d}  loss {losses[-1]:.3f}  ({time.monotonic() - start:.0f} s)")
    model = model.to(saved_dtype).eval()
    model.save_pretrained(path, safe_serialization=True)
    for weights in Path(path).glob("model*.safetensors"):
        weights.chmod(0o644)
    return losses
