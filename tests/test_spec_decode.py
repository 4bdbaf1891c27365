"""Speculative decoding (prompt lookup) on the tiny model and in the core: the template's
limits, the n-gram proposer against a brute-force search, greedy output token for token the
same with and without drafts (prefix-cache hits, chunked prefill, both preemption modes), the
blocks that held rejected drafts returned with no prefix-cache entry, and the adaptive switch
on a synthetic cost model. The real model's acceptance: tests/test_spec_decode_real.py."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from appliance import Engine, SamplingParams
from appliance.config import ConfigError, load_config
from appliance.core.kv_cache_manager import KVCacheManager
from appliance.core.ngram_proposer import NgramIndex, propose
from appliance.core.request import Request
from appliance.core.scheduler import Scheduler
from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.core.spec_decode import SpecDecoder
from appliance.core.step_cost import SCALES, StepCostModel
from appliance.engine.spec_verify import trim_forbidden_drafts
from appliance.sampling_params import StructuredOutputs
from appliance.speculative_config import SpeculativeConfig

# -- the template ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("speculative.method", "eagle", "speculative.method"),
        ("speculative.num_speculative_tokens", 0, "speculative.num_speculative_tokens"),
        ("speculative.num_speculative_tokens", 17, "speculative.num_speculative_tokens"),
        ("speculative.prompt_lookup_max", 1, "speculative.prompt_lookup_min"),
    ],
)
def test_bad_speculative_settings_are_template_errors_naming_the_key(
    key: str, value: object, named: str
) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, {key: value, "speculative.prompt_lookup_min": 2})


# -- the proposer ------------------------------------------------------------------------------


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The longest suffix of lo..hi tokens that occurred earlier with a token after it; its most
    recent such occurrence; the (up to k) tokens after it."""
    n_tok = len(tokens)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        suffix = tokens[n_tok - n :]
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 12), min_size=1, max_size=60),
    lo=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 6),
)
def test_the_proposer_drafts_what_a_brute_force_search_finds(
    tokens: list[int], lo: int, extra: int, k: int
) -> None:
    # The index keeps the 8 most recent occurrences of an n-gram: within that, exact.
    grams = [tuple(tokens[i : i + lo]) for i in range(len(tokens) - lo)]
    assume(all(grams.count(g) <= 8 for g in grams))
    index = NgramIndex(lo)
    # Built incrementally, as the tokens of a request arrive.
    for cut in range(1, len(tokens)):
        propose(tokens[:cut], index, lo + extra, k)
    assert propose(tokens, index, lo + extra, k) == brute_force(tokens, lo, lo + extra, k)


# -- the tiny model: greedy output unchanged ------------------------------------------------------


def engine_for(model_dir: Path, spec: bool, **overrides: object) -> Engine:
    base: dict[str, object] = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "hardware.device": "cpu",
        "cache.block_size": 16,
        "cache.kv_cache_memory": 0.1,
        "cache.swap_space": 0.05,
    }
    if spec:
        # Drafting whatever the cost: a one-token lookup finds a match in most steps of a
        # random model's output over a long prompt, and its drafts are almost all rejected.
        base.update(
            {
                "speculative.method": "ngram",
                "speculative.adaptive": False,
                "speculative.prompt_lookup_min": 1,
                "speculative.num_speculative_tokens": 5,
            }
        )
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return Engine(load_config(None, base))


def prompts(vocab: int, lengths: tuple[int, ...] = (40, 300, 700, 500)) -> list[list[int]]:
    rng = random.Random(7)
    out = [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]
    shared = min(lengths[2], lengths[3]) * 4 // 5
    out[3] = out[2][:shared] + out[3][shared:]  # a shared prefix: prefix-cache hits
    return out


# Four 190-token prompts outgrow a 48-block pool as they decode: preemptions.
SHORT = (190, 190, 190, 190)


MODES = {
    "plain": {},
    "chunked": {"scheduler__max_num_batched_tokens": 96},
    # One request at a time: its decode and drafts (up to 6 rows) take the fused CPU decode.
    "alone": {"scheduler__max_num_seqs": 1},
    "recompute": {
        "cache__num_blocks": 48,
        "model__max_model_len": 512,
        "scheduler__preemption_mode": "recompute",
    },
    "swap": {
        "cache__num_blocks": 48,
        "model__max_model_len": 512,
        "scheduler__preemption_mode": "swap",
    },
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_output_is_the_same_with_and_without_drafts(tiny_model_dir: Path, mode: str) -> None:
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, min_tokens=30),
    ]
    results = {}
    for spec in (False, True):
        with engine_for(tiny_model_dir, spec, **MODES[mode]) as engine:
            lengths = SHORT if mode in ("recompute", "swap") else (40, 300, 700, 500)
            ps = prompts(engine.loaded.args.vocab_size, lengths)
            results[spec] = engine.generate(ps, params)
            assert engine.kv.pool.num_used_blocks == 0
            if spec:
                stats = engine.scheduler.spec.stats
                assert stats.num_draft_tokens > 10
                if mode in ("recompute", "swap"):
                    assert engine.scheduler.counters.preemptions > 0
                if mode == "alone" and engine.runner.fused_max_batch >= 6:
                    assert engine.runner.native_decode_steps > 0
    for off, on in zip(results[False], results[True], strict=True):
        assert on.token_ids == off.token_ids
        assert len(on.logprobs or []) == len(off.logprobs or [])
        for a, b in zip(on.logprobs or [], off.logprobs or [], strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_a_request_can_opt_out(tiny_model_dir: Path) -> None:
    with engine_for(tiny_model_dir, True) as engine:
        ps = prompts(engine.loaded.args.vocab_size)
        engine.generate(ps[1:3], SamplingParams(max_tokens=30, temperature=0.0, speculative=False))
        assert engine.scheduler.spec.stats.num_drafts == 0


# -- the core: rejected drafts leave nothing behind ---------------------------------------------


def test_rejected_drafts_leave_no_block_and_no_prefix_cache_entry() -> None:
    config = load_config(
        None,
        {
            "cache.block_size": 4,
            "speculative.method": "ngram",
            "speculative.adaptive": False,
            "speculative.num_speculative_tokens": 8,
        },
    )
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(config, kv, max_model_len=128)
    # A prompt whose end repeats its start: the lookup drafts its middle again.
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    req = Request("r", prompt, SamplingParams(max_tokens=50, temperature=0.0))
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {"r": 3})  # prefill; tokens ... 1, 2, 3
    out = sched.schedule()
    (sr,) = out.scheduled
    assert sr.draft_token_ids == [4, 5, 6, 7, 8, 9, 10, 1]
    # 13 known tokens + 8 drafts: 6 blocks of 4 held during the step.
    assert len(req.blocks) == 6 and kv.pool.num_used_blocks == 6
    # Two drafts accepted, the third rejected (the model said 99).
    sched.update_from_output(out, {"r": 99}, {"r": [4, 5]})
    assert req.output_token_ids == [3, 4, 5, 99]
    assert req.num_computed_tokens == 15
    # Blocks past the computed tokens held only rejected drafts: back in the pool.
    assert len(req.blocks) == 4 and kv.pool.num_used_blocks == 4
    assert kv.usage().slots_holding_tokens == 15
    # The prefix cache holds the three full blocks of accepted tokens, nothing of the drafts.
    assert req.num_cached_blocks == 3
    cached = {
        tuple(b.token_ids) for b in kv.pool.blocks if b.block_hash is not None and b.token_ids
    }
    assert cached == {(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 1, 2)}
    # The runner is sent a new (shorter) table with the next step.
    out = sched.schedule()
    assert out.finished_request_ids == ["r"] and out.scheduled[0].new_table


# -- the adaptive switch ------------------------------------------------------------------------


def repeating_decodes(count: int) -> list[Request]:
    """Decoding requests whose prompts repeat (5 6 7 8 9 ... 5 6): each has a 4-token draft."""
    decodes = []
    for i in range(count):
        req = Request(f"r{i}", [5, 6, 7, 8, 9] * 4 + [5, 6], SamplingParams(max_tokens=100))
        req.num_computed_tokens = req.num_tokens - 1
        decodes.append(req)
    return decodes


def synthetic_cost(step_s: float, row_s: float, token_s: float) -> StepCostModel:
    """A fitted cost model with the given per-step, per-decode-row and per-prefill-token
    seconds (attention and prefill-step terms zero)."""
    cost = StepCostModel()
    raw = [step_s, row_s, 0.0, token_s, 0.0, 0.0]
    cost.coef = [c / s for c, s in zip(raw, SCALES, strict=True)]
    return cost


def test_drafting_turns_off_when_the_step_is_compute_bound_and_on_again() -> None:
    spec = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 4096)
    # 32 decoding requests whose prompts repeat: each has a 4-token draft.
    decodes = repeating_decodes(32)
    # Weight reads dominate (a memory-bound step): extra query tokens are almost free.
    memory_bound = synthetic_cost(step_s=0.030, row_s=0.0002, token_s=0.0002)
    # Arithmetic dominates: each token, decode row or draft, costs the same 10 ms.
    compute_bound = synthetic_cost(step_s=0.001, row_s=0.010, token_s=0.010)
    assert len(spec.plan(decodes, memory_bound)) == 32
    assert spec.plan(decodes, compute_bound) == {}
    assert spec.stats.decision.startswith("off")
    plan = spec.plan(decodes, memory_bound)
    # As many of the draft's tokens as their expected gain pays for (acceptance prior 0.5).
    assert len(plan) == 32 and all(d and d == [7, 8, 9, 5][: len(d)] for d in plan.values())
    # A request whose drafts keep failing stops drafting, its neighbours go on.
    for _ in range(20):
        spec.record(decodes[0], 4, 0)
        for r in decodes[1:]:
            spec.record(r, 4, 4)
    modest = synthetic_cost(step_s=0.030, row_s=0.0002, token_s=0.0005)
    plan = spec.plan(decodes, modest)
    assert "r0" not in plan and len(plan) == 31
    # Requests whose drafts are all accepted draft all four tokens.
    assert all(d == [7, 8, 9, 5] for d in plan.values())


def test_drafts_the_grammar_forbids_are_dropped_before_the_forward(tiny_model_dir: Path) -> None:
    with engine_for(tiny_model_dir, True) as engine:
        guided = engine.runner.guided
        assert guided is not None
        tok = engine.tokenizer
        a, b, c, z = (tok.convert_tokens_to_ids(t) for t in "abcz")
        so = StructuredOutputs(kind="regex", spec="(ab)+c")
        sr = ScheduledRequest(
            request_id="r",
            token_ids=[a, b, a, z, c],  # the last known token, then four drafts
            start_pos=10,
            block_ids=[0],
            sample=True,
            sampling_params=SamplingParams(structured=so),
            output_index=1,  # "a" is out and accepted by the matcher
            draft_token_ids=[b, a, z, c],
        )
        guided.bitmask([("r", so, 0)])
        guided.accept("r", a)
        trim_forbidden_drafts(SchedulerOutput(scheduled=[sr]), guided)
        # "a b a" continue (ab)+; "z" is outside the grammar, so it and what follows go.
        assert sr.draft_token_ids == [b, a] and sr.token_ids == [a, b, a]
        # The matcher is where it was: after "a", "b" is allowed and "c" is not.
        mask = guided.bitmask([("r", so, 1)])
        assert mask is not None
        bits = mask[0][0]
        allowed = {t for t in (b, c) if (int(bits[t // 32]) >> (t % 32)) & 1}
        assert allowed == {b}


@pytest.mark.parametrize("schema", ["completion", "chat"])
def test_the_request_body_opts_out_with_speculative_false(schema: str) -> None:
    from appliance.server.prepare import sampling_params
    from appliance.server.schemas import ChatCompletionRequest, CompletionRequest

    body_type = CompletionRequest if schema == "completion" else ChatCompletionRequest
    base = (
        {"prompt": "hi"}
        if schema == "completion"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    for asked, expected in ((None, True), (True, True), (False, False)):
        raw = base if asked is None else {**base, "speculative": asked}
        body = msgspec.convert(raw, body_type)
        assert sampling_params(body, 8, None).speculative is expected
    with pytest.raises(msgspec.ValidationError, match="speculative"):
        msgspec.convert({**base, "speculative": "no"}, body_type)


def test_drafts_keep_a_step_within_the_fused_decode_rows() -> None:
    spec = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 4096, 6)
    decodes = repeating_decodes(2)
    for req in decodes:
        for _ in range(10):
            spec.record(req, 4, 4)
    cheap = synthetic_cost(step_s=0.030, row_s=0.0002, token_s=0.0002)
    plan = spec.plan(decodes, cheap)
    # 2 decode rows + drafts <= 6 rows: the step stays on the fused decode.
    assert 0 < sum(len(d) for d in plan.values()) <= 4
    # A step over the limit already pays the general path: no cap.
    spec.fused_decode_rows = 1
    assert sum(len(d) for d in spec.plan(decodes, cheap).values()) == 8


def test_no_lookup_runs_where_no_draft_can_pay() -> None:
    """Where even a sure draft would not pay (compute-bound, or the step already fills the fused
    decode's rows), the planner decides before looking any draft up: no request's n-gram index
    is touched, and the indexes catch up once drafting pays again."""
    spec = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 4096, 64)
    decodes = repeating_decodes(32)
    compute_bound = synthetic_cost(step_s=0.001, row_s=0.010, token_s=0.010)
    assert spec.plan(decodes, compute_bound) == {}
    assert spec.stats.decision == "off: no draft can pay at this batch"
    assert all(r.spec is not None and r.spec.index.indexed == 0 for r in decodes)
    memory_bound = synthetic_cost(step_s=0.030, row_s=0.0002, token_s=0.0002)
    # A step whose rows already fill the fused decode: nothing looked up either.
    spec.fused_decode_rows = 32
    assert spec.plan(decodes, memory_bound) == {}
    assert all(r.spec is not None and r.spec.index.indexed == 0 for r in decodes)
    spec.fused_decode_rows = 64
    plan = spec.plan(decodes, memory_bound)
    # Drafts again, within the 32 rows the fused decode has left; every index caught up.
    assert plan and sum(len(d) for d in plan.values()) <= 32
    assert all(r.spec and r.spec.index.indexed > 0 for r in decodes)
