"""`appliance quant-eval`: what a weight format costs in accuracy, measured on text the package
ships: for each format, the perplexity of the held-out part of the corpus and the share of
positions whose top-1 next token equals the reference's (teacher forced, so one early
difference does not derail the rest).

The reference is the same model's 16-bit-or-wider weights. For SmolLM2-135M-Instruct the
closest at hand is its Q4_1 GGUF dequantized to fp32 (appliance/tools/smollm2.py): the Q4_1
file itself then measures the packed kernels (its perplexity equals the reference's up to
float32 summation order), and INT8 / bf16 of the fp32 weights measure those formats' loss.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from appliance.config import ApplianceConfig, load_config
from appliance.tools.kv_answers import QUESTIONS

# Format name -> (model.path key: "hf" or "gguf", config overrides).
FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32 (reference)": ("hf", {"model.dtype": "float32"}),
    "bf16": ("hf", {"model.dtype": "bfloat16"}),
    "int8 per-channel": (
        "hf",
        {
            "model.dtype": "float32",
            "model.quantization": "int8",
            "model.cpu_quant_activations": "float32",
        },
    ),
    "int8, int8 activations": (
        "hf",
        {
            "model.dtype": "float32",
            "model.quantization": "int8",
            "model.cpu_quant_activations": "int8",
        },
    ),
    "gguf Q4_1": ("gguf", {"model.dtype": "float32", "model.cpu_quant_activations": "float32"}),
    "gguf Q4_1, int8 activations": (
        "gguf",
        {"model.dtype": "float32", "model.cpu_quant_activations": "int8"},
    ),
    # As the cpu-demo template serves the file: the CPU's own compute dtype and, where the
    # backend keeps one (AMX), the prepacked copy that wide passes read.
    "gguf Q4_1, as served": ("gguf", {"model.dtype": "auto", "model.cpu_prepack_weights": True}),
}


@dataclass
class FormatScore:
    name: str
    perplexity: float
    top1_agreement: float
    weight_bytes: int
    # Greedy chat answers to kv_answers.QUESTIONS token-for-token equal to the reference's
    # (None when not asked for), and the mean share of each reproduced before a change.
    answers_identical: float | None = None
    answers_prefix: float | None = None


# Teacher-forced chunk: 16 rows, so packed weights are read by the narrow native kernels (the
# decode path's arithmetic, int8 activations included) rather than the dense float32 tile.
CHUNK = 16


def teacher_forced_logprobs(
    loaded: Any, windows: Sequence[list[int]], chunk: int = CHUNK
) -> list[torch.Tensor]:
    """Next-token log-probs [len(window), vocab] per window, each window prefilled in chunks
    through the runner's own step preparation on a fresh pool (the serving path's forward)."""
    from appliance.core.scheduler_output import ScheduledRequest
    from appliance.engine.kv_pool import KVCachePool
    from appliance.engine.model_runner import ModelRunner
    from appliance.sampling_params import SamplingParams

    bs, n_layers = loaded.block_size, loaded.args.num_layers
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    out = []
    for window in windows:
        blocks = math.ceil(len(window) / bs)
        # The serving pool's layout (side caches of kept KV heads included).
        heads = loaded.model.attention_layers()[0].num_kv_heads
        pool = KVCachePool(
            n_layers,
            blocks,
            0,
            bs,
            heads,
            loaded.args.head_dim,
            loaded.runner.kv.storage,
            loaded.device,
        )
        runner = ModelRunner(loaded.model, pool, bs, loaded.device)
        block_ids = list(range(blocks))
        rows = []
        with torch.inference_mode():
            for start in range(0, len(window), chunk):
                ids = window[start : start + chunk]
                req = ScheduledRequest("quant-eval", ids, start, block_ids, False, greedy, 0)
                runner.block_tables[req.request_id] = block_ids
                input_ids, positions, meta, _ = runner._prepare([req])
                hidden = loaded.model(input_ids, positions, meta, pool.device_caches)
                logits = loaded.model.compute_logits(hidden).float()
                rows.append(torch.log_softmax(logits, dim=-1))
        out.append(torch.cat(rows))
    return out


def perplexity(logprobs: Sequence[torch.Tensor], windows: Sequence[list[int]]) -> float:
    nll, n = 0.0, 0
    for logp, w in zip(logprobs, windows, strict=True):
        targets = torch.tensor(w[1:])
        nll -= float(logp[torch.arange(len(targets)), targets].sum())
        n += len(targets)
    return math.exp(nll / n)


def top1_agreement(logprobs: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    same = total = 0
    for a, b in zip(logprobs, reference, strict=True):
        same += int((a[:-1].argmax(-1) == b[:-1].argmax(-1)).sum())
        total += a.shape[0] - 1
    return same / total


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights as held: packed linears and tables at their packed size, plus the
    dense copy the CPU backend keeps beside packed linears on AMX."""
    from appliance.layers.embedding import VocabParallelEmbedding
    from appliance.layers.linear import MatmulWeight

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        quant = getattr(m, "quant", None)
        own = isinstance(m, VocabParallelEmbedding) or (
            isinstance(m, MatmulWeight) and "weight" in m._parameters
        )
        if quant is not None and own:
            total += quant.nbytes()
        matmul = m.matmul if isinstance(m, MatmulWeight) else None
        copy = matmul.copy if matmul is not None else None
        if quant is not None and copy is not None:
            total += copy.numel() * copy.element_size()
    return total


def config_for(path: str, overrides: dict[str, Any]) -> ApplianceConfig:
    base = {
        "model.path": path,
        "model.max_model_len": 1024,
        "model.cpu_prepack_weights": False,
        "cache.kv_cache_memory": 0.1,
        "cache.swap_space": 0.0,
        "hardware.device": "cpu",
    }
    return load_config(None, {**base, **overrides})


def evaluate(
    paths: dict[str, str],
    formats: Sequence[str],
    tokens: int = 512,
    window: int = 256,
    chunk: int = CHUNK,
    answer_tokens: int = 0,
) -> list[FormatScore]:
    """Each format of FORMATS (the first is the reference) on the held-out corpus windows and,
    with `answer_tokens`, on greedy chat answers of up to that many tokens (one Engine each,
    the serving path: batched prefill and decode steps)."""
    from appliance.engine.executor import load_model
    from appliance.tools.kv_answers import greedy_answers, heldout_windows, score_answers

    scores: list[FormatScore] = []
    reference: list[torch.Tensor] | None = None
    reference_answers: list[list[int]] | None = None
    windows: list[list[int]] | None = None
    for name in formats:
        kind, overrides = FORMATS[name]
        config = config_for(paths[kind], overrides)
        loaded = load_model(config)
        answers: list[list[int]] = []
        try:
            if windows is None:
                windows = heldout_windows(loaded.tokenizer, tokens, window)
            logp = teacher_forced_logprobs(loaded, windows, chunk)
            size = weight_bytes(loaded.model)
            if answer_tokens:  # the same loaded weights: one load per format
                answers = greedy_answers(config, max_tokens=answer_tokens, loaded=loaded)
        finally:
            loaded.close()
        reference = reference or logp
        score = FormatScore(name, perplexity(logp, windows), top1_agreement(logp, reference), size)
        if answer_tokens:
            reference_answers = reference_answers or answers
            kept = score_answers(name, reference_answers, answers)
            score.answers_identical, score.answers_prefix = kept.identical, kept.matched_prefix
        scores.append(score)
    return scores


def format_table(scores: Sequence[FormatScore]) -> str:
    ref = scores[0].perplexity
    answers = any(s.answers_identical is not None for s in scores)
    head = "| weights | bytes held | perplexity | vs reference | top-1 agreement |"
    rule = "|---|---:|---:|---:|---:|"
    if answers:
        head += " greedy answers identical | matched prefix |"
        rule += "---:|---:|"
    lines = [head, rule]
    for s in scores:
        line = (
            f"| {s.name} | {s.weight_bytes / 2**20:.1f} MiB | {s.perplexity:.3f} | "
            f"{100 * (s.perplexity / ref - 1):+.2f}% | {100 * s.top1_agreement:.1f}% |"
        )
        if s.answers_identical is not None and s.answers_prefix is not None:
            n = len(QUESTIONS)
            line += f" {round(s.answers_identical * n)}/{n} | {100 * s.answers_prefix:.1f}% |"
        lines.append(line)
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "quant-eval",
        help="perplexity and top-1 agreement of weight formats "
        "(SmolLM2-135M-Instruct: its Q4_1 GGUF vs the fp32 dequantized reference)",
    )
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--tokens", type=int, default=512, help="held-out corpus tokens")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--chunk", type=int, default=CHUNK, help="tokens per teacher-forced step")
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=64,
        help="greedy chat answers to 16 questions of up to this many tokens, compared "
        "with the reference's (0: skip)",
    )
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    from appliance.tools.smollm2 import build_smollm2, gguf_file

    paths = {"hf": str(build_smollm2()), "gguf": str(gguf_file())}
    scores = evaluate(paths, ns.formats, ns.tokens, ns.window, ns.chunk, ns.answer_tokens)
    print(format_table(scores))
    return 0
