"""GPU check, stages `model`, `engine`, `bench` and `tp2`: a random model of Llama-2-7B's layer
shape (hidden 4096, 32 heads, intermediate 11008, vocabulary 32000; 4 layers: 1.07B
parameters, 2.1 GB in bf16) built offline from a fixed seed, served by the engine on the device
through the public API (`Engine`, `load_config` overrides, `SamplingParams`) and compared with
transformers' LlamaForCausalLM on the same weights; `appliance bench offline` on it against
the measured copy bandwidth; tensor parallel 2 against TP 1 where two GPUs exist.

The dry mode (``--device cpu``) runs the same code on the CPU with the tiny demo model."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from appliance.engine.llm_engine import Engine
    from appliance.tools.gpu_check import StageContext

SHAPE = "llama-2-7b-4-layers"
TOKENIZER_VOCAB = 4096  # the tokenizer the demo builder trains; ids above it are padding rows
# GPU / dry mode: prompt lengths and new tokens of the exactness check, the preemption workload.
EXACT = {"cuda": ([1, 17, 129, 300], 32), "cpu": ([1, 17, 40], 8)}
PREEMPT = {"cuda": (8, (40, 90), 48, 24), "cpu": (6, (20, 40), 16, 8)}  # n, lengths, new, blocks


@dataclass(frozen=True)
class BenchRun:
    template: str
    sets: dict[str, Any]
    requests: int
    prompt_len: int
    output_len: int
    static_batch: int
    block_size: int = 16


BENCH = {
    "cuda": BenchRun("7b-a10", {"model.dtype": "bfloat16"}, 16, 128, 64, 8),
    "cpu": BenchRun(
        "cpu-bench",
        {"model.dtype": "float32", "cache.kv_cache_memory": 0.05, "cache.swap_space": 0.0},
        3,
        16,
        4,
        2,
    ),
}


def register_shape() -> None:
    """Llama-2-7B's layers, 4 of them, as a demo shape `build_demo_model` accepts."""
    from appliance.models.demo_spec import DEMO_SHAPES, DemoShape

    DEMO_SHAPES.setdefault(
        SHAPE, DemoShape(4096, 4, 32, 32, 11008, False, 4096, TOKENIZER_VOCAB, 32000, "bfloat16")
    )


def run_model(ctx: StageContext) -> None:
    from appliance.models.demo_model import build_demo_model

    out = Path(ctx.options["model_dir"])
    shape = SHAPE if ctx.cuda else "tiny"
    done = out / f".gpu-check-built-{shape}"  # a build stopped half-way is not reused
    start = time.monotonic()
    if ctx.options.get("model_given"):
        ctx.figure(source=f"given: {out}")
    elif done.is_file():
        ctx.figure(source=f"built earlier: {shape}, seed 0")
    else:
        shutil.rmtree(out, ignore_errors=True)
        register_shape()
        build_demo_model(shape, out, seed=0, progress=lambda m: print("  " + m, flush=True))
        done.touch()
        ctx.figure(source=f"built: {shape}, seed 0")
    cfg = json.loads((out / "config.json").read_text())
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    )
    ctx.figure(
        seconds=round(time.monotonic() - start, 1),
        weights_gb=round(size / 1e9, 3),
        **{k: cfg[k] for k in keys},
    )
    ctx.check("model on disk", size > 0, path=str(out))


def overrides(ctx: StageContext, dtype: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model.path": ctx.options["model_dir"],
        "model.dtype": dtype,
        "hardware.device": ctx.device,
        "cache.block_size": 16,
        "cache.swap_space": 0.0,
        "model.max_model_len": 1024,
    }
    base.update({"cache.num_blocks": 512} if ctx.cuda else {"cache.kv_cache_memory": 0.05})
    base.update({k.replace("__", "."): v for k, v in extra.items()})
    return base


def make_engine(ctx: StageContext, dtype: str, **extra: Any) -> Engine:
    from appliance import Engine
    from appliance.config import load_config

    return Engine(load_config(None, overrides(ctx, dtype, **extra)))


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, TOKENIZER_VOCAB) for _ in range(n)] for n in lengths]


def greedy(engine: Engine, batch: list[list[int]], new: int) -> list[list[int]]:
    from appliance import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate(batch, params)]


def hf_greedy(ctx: StageContext, batch: list[list[int]], new: int) -> tuple[list[list[int]], Any]:
    """transformers' greedy tokens in float32 on the same device, and the model (for gaps)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model: Any = AutoModelForCausalLM.from_pretrained(ctx.options["model_dir"], dtype=torch.float32)
    model = model.to(ctx.device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine runs
    outs = []
    with torch.no_grad():
        for p in batch:
            ids = torch.tensor([p], device=ctx.device)
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs, model


def matched(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def top2_gap(model: Any, tokens: list[int], device: str) -> float:
    """transformers' top-1 minus top-2 logit after `tokens`: how near a tie a divergence is."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device=device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def run_engine(ctx: StageContext) -> None:
    lengths, new = EXACT[ctx.device]
    batch = prompts(lengths, seed=1)
    start = time.monotonic()
    with make_engine(ctx, "float32") as engine:
        ctx.figure(load_seconds=round(time.monotonic() - start, 1))
        t = time.monotonic()
        ours = greedy(engine, batch, new)
        ctx.figure(generate_seconds=round(time.monotonic() - t, 2))
        ctx.check("KV blocks returned", engine.kv.pool.num_used_blocks == 0)
        n, (lo, hi), pnew, blocks = PREEMPT[ctx.device]
        rng = random.Random(3)
        work = prompts([rng.randrange(lo, hi) for _ in range(n)], seed=4)
        alone = [greedy(engine, [p], pnew)[0] for p in work]
    Path(ctx.work, "engine-tokens.json").write_text(
        json.dumps({"prompts": batch, "new": new, "tokens": ours})
    )
    ref, model = hf_greedy(ctx, batch, new)
    prefixes = [matched(a, b) for a, b in zip(ours, ref, strict=True)]
    gaps = [
        round(top2_gap(model, p + r[:m], ctx.device), 6) if m < new else None
        for p, r, m in zip(batch, ref, prefixes, strict=True)
    ]
    del model
    _free(ctx)
    ctx.check(
        "float32 greedy tokens equal transformers'",
        ours == ref,
        prompt_lens=lengths,
        new_tokens=new,
        matched_prefix=prefixes,
        hf_top2_gap_at_divergence=gaps,
    )
    check_preemption(ctx, work, alone, pnew, blocks)
    if not ctx.cuda:
        ctx.figure(bfloat16="not in the dry mode")
        return
    with make_engine(ctx, "bfloat16") as engine:
        half = greedy(engine, batch, new)
    _free(ctx)
    agree = [matched(a, b) for a, b in zip(half, ref, strict=True)]
    ctx.figure(bf16_matched_prefix_vs_fp32_reference=agree)
    ctx.check("bfloat16 generates", all(len(h) == new for h in half), matched_prefix=agree)


def check_preemption(
    ctx: StageContext, work: list[list[int]], alone: list[list[int]], new: int, blocks: int
) -> None:
    """The same requests in a pool too small for them all: preempted (recompute, then swap
    over the same loaded model) and resumed, their tokens equal to each request's run alone."""
    from appliance import Engine
    from appliance.config import load_config

    # Blocks of the pool the preemption run holds: enough for the longest request alone.
    extra = {
        "cache.num_blocks": blocks,
        "cache.swap_space": 0.25,
        "model.max_model_len": blocks * 16,
    }
    with make_engine(ctx, "float32", **extra, scheduler__preemption_mode="recompute") as first:
        for mode in ("recompute", "swap"):
            engine = first
            if mode != "recompute":  # another engine over the same loaded model and pools
                cfg = overrides(ctx, "float32", **extra, scheduler__preemption_mode=mode)
                engine = Engine(load_config(None, cfg), loaded=first.loaded)
            got = greedy(engine, work, new)
            counters = engine.stats().counters
            same = [a == b for a, b in zip(got, alone, strict=True)]
            ctx.check(
                f"preemption ({mode}): tokens equal the requests' runs alone",
                all(same) and counters.preemptions > 0 and engine.kv.pool.num_used_blocks == 0,
                requests=len(work),
                blocks=blocks,
                preemptions=counters.preemptions,
                by_mode=counters.by_mode(),
                identical=sum(same),
                matched_prefix=[matched(a, b) for a, b in zip(got, alone, strict=True)],
            )
            if engine is not first:
                engine.close()
    _free(ctx)


def _free(ctx: StageContext) -> None:
    import gc

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def run_cli(ctx: StageContext, argv: list[str]) -> tuple[int, str]:
    """`appliance ARGV` in a child process (the CLI imports every tool, this one included):
    its exit code and standard output, which is echoed; the exit code and seconds as figures."""
    print("  appliance " + " ".join(argv), flush=True)
    start = time.monotonic()
    cli = "import sys; from appliance.cli import main; sys.exit(main(sys.argv[1:]))"
    # -P: the stage runs from the checkout, whose appliance/ (without the kernels/ that the
    # installed package maps in) would shadow the installed one on `-c`'s path.
    done = subprocess.run(
        [sys.executable, "-P", "-c", cli, *argv], stdout=subprocess.PIPE, text=True, check=False
    )
    print(done.stdout[-6000:], flush=True)
    ctx.figure(exit_code=done.returncode, seconds=round(time.monotonic() - start, 1))
    return done.returncode, done.stdout


def run_bench(ctx: StageContext) -> None:
    """`appliance bench offline` through the CLI (a child process: the CLI imports every tool,
    this one included), then its decode rate against the bandwidth bound: (weights + KV of the
    context read per step) / copy bandwidth."""

    run = BENCH[ctx.device]
    sets = {"hardware.device": ctx.device, "cache.block_size": run.block_size, **run.sets}
    bandwidth = measured_bandwidth(ctx)
    ctx.figure(copy_bandwidth_gbs=round(bandwidth / 1e9, 1))
    argv = ["bench", "offline", "--model", ctx.options["model_dir"], "--template", run.template]
    argv += ["--json", "--num-requests", str(run.requests), "--prompt-len", str(run.prompt_len)]
    argv += ["--output-len", str(run.output_len), "--static-batch", str(run.static_batch)]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    rc, text = run_cli(ctx, argv)
    line = next((x for x in reversed(text.splitlines()) if x.startswith("{")), "")
    if rc != 0 or not line:
        ctx.fail(f"bench offline exited {rc} (output above)")
    report = json.loads(line)
    weights = report["weight_bytes_per_step"]["torch"]
    kv = report["kv"]
    # One request at a time reads the weights and its context's KV each step (on average the
    # prompt and half the output).
    kv_bytes = kv["bytes_per_block"] / run.block_size * (run.prompt_len + run.output_len / 2)
    bound = bandwidth / (weights + kv_bytes)
    modes = {r["mode"]: r for r in report["results"]}
    ctx.figure(
        bench_copy_bandwidth_gbs=round(report["rates"]["copy_bytes_per_s"] / 1e9, 1),
        weight_gb_per_step=round(weights / 1e9, 3),
        kv_blocks=kv["num_blocks"],
        modes={
            m: {
                "tok_s": round(r["output_tokens_per_s"], 1),
                "bound_tok_s": round(r["bound_tokens_per_s"], 1),
                "share_of_bound": round(r["share_of_bound"], 3),
                "mean_batch": round(r["mean_batch"], 1),
            }
            for m, r in modes.items()
        },
    )
    one = modes.get("one-at-a-time")
    if one is not None:
        tok_s = one["output_tokens_per_s"]
        ctx.figure(
            decode_tok_s_batch1=round(tok_s, 1),
            bandwidth_bound_tok_s_batch1=round(bound, 1),
            share_of_bandwidth_bound_batch1=round(tok_s / bound, 3),
        )
    for m, r in modes.items():
        ctx.check(
            f"bench offline {m}",
            r["output_tokens_per_s"] > 0 and r["share_of_bound"] <= 1.0,
            tok_s=round(r["output_tokens_per_s"], 1),
        )


def measured_bandwidth(ctx: StageContext) -> float:
    """Bytes/s of a large device copy, counting the read and the write (as the benchmarks do)."""
    if ctx.cuda:
        from appliance.kernels.bench import copy_bandwidth

        rate = copy_bandwidth(2.0, iters=10, warmup=3)
        torch.cuda.empty_cache()  # the engine sizes its KV pool from the free memory
        return rate
    from appliance.bench.hardware import copy_bandwidth as host_copy_bandwidth

    return host_copy_bandwidth(torch.device("cpu"), mib=128, repeats=3)


def run_tp2(ctx: StageContext) -> None:
    """Tensor parallel 2 (NCCL) on the exactness prompts: its float32 greedy tokens against the
    engine stage's TP 1 tokens."""
    saved = Path(ctx.work, "engine-tokens.json")
    if not saved.is_file():
        ctx.skip("the engine stage left no TP 1 tokens to compare with")
    data = json.loads(saved.read_text())
    start = time.monotonic()
    with make_engine(ctx, "float32", parallel__tensor_parallel_size=2) as engine:
        ctx.figure(load_seconds=round(time.monotonic() - start, 1))
        got = greedy(engine, data["prompts"], data["new"])
        ctx.check("KV blocks returned", engine.kv.pool.num_used_blocks == 0)
    prefixes = [matched(a, b) for a, b in zip(got, data["tokens"], strict=True)]
    ctx.check("TP 2 greedy tokens equal TP 1's", got == data["tokens"], matched_prefix=prefixes)


def run_bench_lora(ctx: StageContext) -> None:
    """`appliance bench lora` on the device (Triton's segment LoRA kernels): requests spread over
    4 adapters of rank 16 and the base against the same requests on the base alone."""
    run = BENCH[ctx.device]
    argv = ["bench", "lora", "--model", ctx.options["model_dir"], "--template", run.template]
    argv += ["--json", "--adapters", "4", "--rank", "16", "--requests", str(run.requests)]
    argv += ["--prompt-len", "64", "--output-len", "32", "--rounds", "1"]
    sets = {"hardware.device": ctx.device, "cache.block_size": run.block_size, **run.sets}
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    rc, text = run_cli(ctx, argv)
    # The JSON report is the output's last top-level object (indent=2: "{" on a line alone).
    lines = text.splitlines()
    first = next((i for i in reversed(range(len(lines))) if lines[i] == "{"), len(lines))
    if rc != 0 or first == len(lines):
        ctx.fail(f"bench lora exited {rc} (output above)")
    report = json.loads("\n".join(lines[first:]))
    runs = {r["traffic"]: r for r in report["runs"]}
    ctx.figure(
        backend=report["backend"],
        adapter_load_ms=[round(ms, 1) for ms in report["adapter_load_ms"]],
        mixed_vs_base_tok_s=round(report["mixed_vs_base_tok_s"], 3),
        runs={
            t: {"tok_s": round(r["output_tokens_per_s"], 1), "tpot_ms": round(r["tpot_ms"], 2)}
            for t, r in runs.items()
        },
    )
    ctx.check(
        "bench lora: mixed and base-only traffic both ran",
        rc == 0 and all(r["output_tokens"] > 0 for r in runs.values()),
    )
