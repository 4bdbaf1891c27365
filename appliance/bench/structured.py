"""`appliance bench offline --structured json-schema`: what grammar-constrained decoding costs.

Output tok/s with and without a JSON schema, one request alone and all requests at once; and
the time a schema adds to the first token, the first time it is seen (compiled) and cached.
Both runs decode the same number of tokens: the schema is an array long enough that its
grammar is live for every one of them (ignore_eos, greedy), so the difference is the mask's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from appliance.config import load_config
from appliance.engine.llm_engine import Engine
from appliance.engine.loader import LoadedModel
from appliance.sampling_params import SamplingParams, StructuredOutputs


def bench_schema(output_len: int, tag: str = "values") -> str:
    items = {"type": "integer", "minimum": 0, "maximum": 999}
    return json.dumps(
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 99},
                tag: {
                    "type": "array",
                    "items": items,
                    "minItems": output_len,
                    "maxItems": output_len,
                },
            },
            "required": ["id", tag],
        }
    )


@dataclass
class ThroughputRow:
    batch: int
    plain_tok_s: float
    schema_tok_s: float
    # From the two wall-clock rates (noisy on a shared box).
    cost_pct: float
    # Timed inside the engine: mask fill + apply + accept, per step and as a share of the
    # constrained run's time (what the grammar costs, whatever else runs on the box).
    grammar_ms_per_step: float
    grammar_share_pct: float


@dataclass
class FirstTokenRow:
    case: str
    compile_ms: float
    first_token_ms: float
    # Wall-clock TTFT minus the unconstrained one (noisy on a shared box).
    added_ms: float
    # Timed inside the engine: compile (or cache hit) + matcher + first mask fill and apply.
    grammar_ms: float


def _engine(loaded: LoadedModel, template: str, overrides: dict[str, Any], seqs: int) -> Engine:
    o = {**overrides, "scheduler.policy": "continuous", "scheduler.max_num_seqs": seqs}
    return Engine(load_config(template, o), loaded=loaded)


def _grammar_s(loaded: LoadedModel) -> float:
    g = loaded.runner.guided
    return loaded.runner.sampler.grammar_apply_s + (g.fill_s + g.accept_s if g else 0.0)


def _throughput(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, float, int]:
    """Output tok/s, seconds of grammar work and steps of one run."""
    for p in prompts:
        engine.add_request(p, params)
    loaded = engine.loaded
    grammar_before, steps = _grammar_s(loaded), 0
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - start
    return tokens / elapsed, (_grammar_s(loaded) - grammar_before) / elapsed, steps


def _first_token_s(engine: Engine, prompt: list[int], params: SamplingParams) -> float:
    loaded = engine.loaded
    guided = loaded.runner.guided
    grammar_before = _grammar_s(loaded)
    start = time.perf_counter()
    req = engine.add_request(prompt, params)
    while not req.output_token_ids:
        engine.step()
    elapsed = time.perf_counter() - start
    engine.abort(req.request_id)
    engine.step()
    if guided is not None and params.structured is not None:
        # compile() ran inside the first step: its time is last_compile_s.
        guided_ms.append(1e3 * (_grammar_s(loaded) - grammar_before + guided.last_compile_s))
    return elapsed


# Grammar work of each constrained first-token run, in order (filled by _first_token_s).
guided_ms: list[float] = []


def run_structured(
    ns: argparse.Namespace, loaded: LoadedModel, overrides: dict[str, Any], prompts: list[list[int]]
) -> int:
    out_len = ns.output_len
    plain = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    so = StructuredOutputs(kind="json", spec=bench_schema(out_len))
    schema = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, structured=so)
    rows = []
    for batch in (1, len(prompts)):
        engine = _engine(loaded, ns.template, overrides, batch)
        subset = prompts[:batch]
        _throughput(engine, subset[:1], schema)  # warm: tokenizer info, first compile
        # Alternating rounds, best of each: the box's other load shifts between runs.
        a = b = share = 0.0
        steps = 1
        for _ in range(ns.structured_rounds):
            a = max(a, _throughput(engine, subset, plain)[0])
            rate, share_now, steps = _throughput(engine, subset, schema)
            b = max(b, rate)
            share = max(share, share_now)
        total_s = batch * out_len / b
        rows.append(
            ThroughputRow(
                batch, a, b, 100 * (1 - b / a), 1e3 * share * total_s / steps, 100 * share
            )
        )

    engine = _engine(loaded, ns.template, overrides, 1)
    guided = loaded.runner.guided
    assert guided is not None
    short = prompts[0][:16]
    first_plain = statistics.median(
        _first_token_s(engine, short, SamplingParams(max_tokens=1)) for _ in range(5)
    )
    firsts, first_compile, cached, cached_compile = [], [], [], []
    guided_ms.clear()
    for i in range(5):
        # A schema never seen before (a new property name), then the same one again.
        fresh = StructuredOutputs(kind="json", spec=bench_schema(out_len, f"values_{ns.seed}_{i}"))
        firsts.append(_first_token_s(engine, short, SamplingParams(max_tokens=1, structured=fresh)))
        first_compile.append(guided.last_compile_s)
        cached.append(_first_token_s(engine, short, SamplingParams(max_tokens=1, structured=fresh)))
        cached_compile.append(guided.last_compile_s)
    med = statistics.median
    ft = [
        FirstTokenRow("unconstrained", 0.0, 1e3 * first_plain, 0.0, 0.0),
        FirstTokenRow(
            "schema, first",
            1e3 * med(first_compile),
            1e3 * med(firsts),
            1e3 * (med(firsts) - first_plain),
            med(guided_ms[0::2]),
        ),
        FirstTokenRow(
            "schema, cached",
            1e3 * med(cached_compile),
            1e3 * med(cached),
            1e3 * (med(cached) - first_plain),
            med(guided_ms[1::2]),
        ),
    ]
    if ns.json:
        print(
            json.dumps(
                {"throughput": [asdict(r) for r in rows], "first_token": [asdict(r) for r in ft]}
            )
        )
        return 0
    print(
        f"structured outputs, json-schema: {len(prompts)} requests x {ns.prompt_len} prompt + "
        f"{out_len} output tokens, greedy, every output token under the grammar"
    )
    print(
        f"{'batch':>5} {'plain tok/s':>12} {'schema tok/s':>13} {'cost (wall)':>12} "
        f"{'grammar ms/step':>16} {'grammar share':>14}"
    )
    for r in rows:
        print(
            f"{r.batch:>5} {r.plain_tok_s:>12.1f} {r.schema_tok_s:>13.1f} {r.cost_pct:>11.1f}% "
            f"{r.grammar_ms_per_step:>16.2f} {r.grammar_share_pct:>13.1f}%"
        )
    print(
        f"{'first token (16-token prompt)':<30} {'compile ms':>10} {'TTFT ms':>8} "
        f"{'added ms (wall)':>16} {'grammar ms':>11}"
    )
    for f in ft:
        print(
            f"{f.case:<30} {f.compile_ms:>10.2f} {f.first_token_ms:>8.1f} {f.added_ms:>16.1f} "
            f"{f.grammar_ms:>11.2f}"
        )
    return 0
