"""`appliance bench lora`: what serving LoRA adapters costs. One loaded model, one run: N
concurrent requests on the base model alone, then the same N spread over the adapters and
the base (round robin), each as one offline batch; output tok/s and TPOT (the mean time of a
decode-only step: every running request gets one token from it), and each adapter's load time
from disk (read, checked, given a slot).

The adapters are written here in the PEFT format with random factors (rank r on every
projection), so the bench needs no training and no peft; the tests prove the arithmetic
against peft (tests/test_lora_exact.py)."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from appliance.bench.offline import make_prompts
from appliance.config import load_config
from appliance.config_sources import model_override, parse_override_value
from appliance.engine.executor import load_model
from appliance.engine.llm_engine import Engine
from appliance.engine.lora_admin import LoraAdmin
from appliance.engine.lora_pool import LoraSlotPool
from appliance.engine.stats import StepHistory
from appliance.models.peft_adapter import projection_shapes
from appliance.sampling_params import SamplingParams

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraRun:
    traffic: str
    requests: int
    adapters_used: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    tpot_ms: float
    decode_steps: int
    # Decode steps the fused native decode ran (it knows no LoRA: adapter rows take torch).
    native_decode_steps: int


def write_adapter(out: Path, pool: LoraSlotPool, rank: int, seed: int) -> Path:
    """A PEFT adapter (adapter_config.json + adapter_model.safetensors) for the pool's model:
    random A and B of rank `rank` on every projection, scaled so the update is small."""
    args = pool.args
    shapes = projection_shapes(args)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(args.num_layers):
        for name, (rows, cols) in shapes.items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, cols, generator=gen) / math.sqrt(
                cols
            )
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
        "base_model_name_or_path": args.name,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run(
    engine: Engine, prompts: list[list[int]], names: list[str], output_len: int, traffic: str
) -> LoraRun:
    engine.history = StepHistory(maxlen=None)
    native_before = engine.runner.native_decode_steps
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for prompt, name in zip(prompts, names, strict=True):
        engine.add_request(prompt, params, lora_name=name)
    start = time.perf_counter()
    outputs = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs += len(out.new_token_ids)
    seconds = time.perf_counter() - start
    decodes = [r for r in engine.history.records if r.num_seqs and r.num_prompt_tokens == 0]
    tpot = sum(r.duration_s for r in decodes) / max(1, len(decodes))
    return LoraRun(
        traffic=traffic,
        requests=len(prompts),
        adapters_used=len({n for n in names if n}),
        output_tokens=outputs,
        seconds=seconds,
        output_tokens_per_s=outputs / seconds,
        tpot_ms=tpot * 1e3,
        decode_steps=len(decodes),
        native_decode_steps=engine.runner.native_decode_steps - native_before,
    )


def mean_run(runs: list[LoraRun]) -> LoraRun:
    """The runs' mean: tok/s over the summed tokens and seconds, TPOT averaged."""
    first = runs[0]
    tokens, seconds = sum(r.output_tokens for r in runs), sum(r.seconds for r in runs)
    return LoraRun(
        traffic=first.traffic,
        requests=first.requests,
        adapters_used=first.adapters_used,
        output_tokens=tokens // len(runs),
        seconds=seconds / len(runs),
        output_tokens_per_s=tokens / seconds,
        tpot_ms=sum(r.tpot_ms for r in runs) / len(runs),
        decode_steps=sum(r.decode_steps for r in runs) // len(runs),
        native_decode_steps=sum(r.native_decode_steps for r in runs) // len(runs),
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "lora",
        help="LoRA adapters: mixed adapter traffic against base-only, and adapter load time",
        description=__doc__,
    )
    p.add_argument("--template", default="cpu-demo")
    p.add_argument("--model", default=None, help="model directory (overrides model.path)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="base-only and mixed runs alternate this many times; the table is their mean "
        "(a shared box's speed drifts within a minute)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    overrides: dict[str, Any] = model_override(ns.model) if ns.model else {}
    for item in ns.set:
        key, _, value = item.partition("=")
        overrides[key] = parse_override_value(value)
    overrides.update(
        {
            "lora.enabled": True,
            "lora.max_loras": ns.adapters,
            "lora.max_lora_rank": ns.rank,
            "scheduler.max_num_seqs": max(ns.requests, 1),
        }
    )
    config = load_config(ns.template, overrides)
    loaded = load_model(config)
    try:
        pool = loaded.runner.lora
        assert pool is not None  # lora.enabled above
        prompts = make_prompts(loaded.args.vocab_size, ns.requests, ns.prompt_len, ns.seed)
        names = [f"adapter-{i}" for i in range(ns.adapters)]
        load_ms: list[float] = []
        with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
            engine = Engine(config, loaded=loaded)
            admin = LoraAdmin(engine)
            for i, name in enumerate(names):
                path = write_adapter(Path(tmp) / name, pool, ns.rank, ns.seed + i)
                t = time.perf_counter()
                answer = admin.load(name, str(path))
                load_ms.append((time.perf_counter() - t) * 1e3)
                if answer.status != 200:
                    raise SystemExit(f"loading {name}: {answer.detail}")
        # Warm both paths once (oneDNN primitives, first slot fills), then measure.
        warm = min(4, len(prompts), len(names))  # fewer requests or adapters than 4: as many
        run(Engine(config, loaded=loaded), prompts[:warm], [""] * warm, 4, "warm-up")
        run(Engine(config, loaded=loaded), prompts[:warm], names[:warm], 4, "warm-up")
        spread = ["", *names]
        mixed = [spread[i % len(spread)] for i in range(len(prompts))]
        base_only = [""] * len(prompts)
        bases: list[LoraRun] = []
        loras: list[LoraRun] = []
        for _ in range(max(1, ns.rounds)):
            for names_of, out in ((base_only, bases), (mixed, loras)):
                traffic = "mixed" if names_of is mixed else "base only"
                engine = Engine(config, loaded=loaded)
                out.append(run(engine, prompts, names_of, ns.output_len, traffic))
        base, lora = mean_run(bases), mean_run(loras)
    finally:
        loaded.close()
    report = {
        "template": ns.template,
        "backend": loaded.backend.summary(),
        "adapters": ns.adapters,
        "rank": ns.rank,
        "slot_pool_mib": pool.nbytes / 2**20,
        "adapter_load_ms": load_ms,
        "runs": [asdict(base), asdict(lora)],
        "mixed_vs_base_tok_s": lora.output_tokens_per_s / base.output_tokens_per_s,
    }
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['backend']}")
    print(
        f"{ns.adapters} adapters of rank {ns.rank} on every projection; slot pool "
        f"{report['slot_pool_mib']:.1f} MiB; {ns.requests} concurrent requests, prompt "
        f"{ns.prompt_len}, output {ns.output_len} tokens; mean of {max(1, ns.rounds)} "
        "alternating rounds"
    )
    print(
        f"{'traffic':<10} {'requests':>8} {'adapters':>8} {'tok/s':>8} {'TPOT ms':>8} "
        f"{'decodes':>8} {'native':>7}"
    )
    for r in (base, lora):
        print(
            f"{r.traffic:<10} {r.requests:>8} {r.adapters_used:>8} {r.output_tokens_per_s:>8.1f} "
            f"{r.tpot_ms:>8.1f} {r.decode_steps:>8} {r.native_decode_steps:>7}"
        )
    print(f"mixed / base-only output tok/s: {report['mixed_vs_base_tok_s']:.2f}")
    loads = ", ".join(f"{ms:.0f}" for ms in load_ms)
    print(f"adapter load from disk (read, check, slot), ms: {loads}")
    return 0
