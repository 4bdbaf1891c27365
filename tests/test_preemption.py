"""Priorities, preemption (swap and recompute) and admission control on the real engine with
the tiny model: outputs equal unpreempted runs, nothing is lost, urgent work starts fast."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from appliance import Engine, SamplingParams
from appliance.config import load_config
from appliance.core.request import RequestStatus


def engine_for(model_dir: Path, **overrides: object) -> Engine:
    base: dict[str, object] = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "hardware.device": "cpu",
        "cache.block_size": 16,
        "scheduler.policy": "priority",
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return Engine(load_config(None, base))


def workload(vocab: int, n: int = 6, seed: int = 3) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randrange(20, 60))]
        if i % 2:
            params = SamplingParams(
                max_tokens=60, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True
            )
        else:
            params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        out.append((prompt, params))
    return out


@pytest.fixture(scope="module")
def alone_outputs(tiny_model_dir: Path) -> list[list[int]]:
    engine = engine_for(tiny_model_dir, cache__kv_cache_memory=0.1)
    return [
        engine.generate([p], sp)[0].token_ids for p, sp in workload(engine.loaded.args.vocab_size)
    ]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_outputs_equal_unpreempted_runs(
    tiny_model_dir: Path, alone_outputs: list[list[int]], mode: str
) -> None:
    engine = engine_for(
        tiny_model_dir,
        cache__num_blocks=16,
        cache__swap_space=0.05,
        scheduler__preemption_mode=mode,
        model__max_model_len=256,
    )
    # The host swap pool is allocated empty: poison it, so a read of a swap block that was
    # never written would show in the outputs.
    for layer in engine.runner.kv.host_caches:
        layer.k.fill_(float("nan"))
        layer.v.fill_(float("nan"))
    jobs = workload(engine.loaded.args.vocab_size)
    results = engine.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    assert [r.token_ids for r in results] == alone_outputs
    counters = engine.stats().counters
    assert counters.preemptions > 0
    assert counters.by_mode().get(mode, 0) > 0
    if mode == "swap":
        assert counters.blocks_swapped_out > 0 and counters.blocks_swapped_in > 0
    else:
        assert counters.tokens_recomputed > 0
    log = engine.preemption_log()
    assert log and all(e.mode == mode for e in log)
    # Nothing lost: everything finished, every block back, swap pool empty.
    assert all(r.finish_reason == "length" for r in results)
    usage = engine.kv.usage()
    assert usage.used == 0 and usage.swap_blocks_used == 0


def test_swap_pool_full_falls_back_to_recompute(
    tiny_model_dir: Path, alone_outputs: list[list[int]]
) -> None:
    engine = engine_for(
        tiny_model_dir,
        cache__num_blocks=16,
        cache__swap_space=0.0,
        scheduler__preemption_mode="swap",
        model__max_model_len=256,
    )
    # The host swap pool is allocated empty: poison it, so a read of a swap block that was
    # never written would show in the outputs.
    for layer in engine.runner.kv.host_caches:
        layer.k.fill_(float("nan"))
        layer.v.fill_(float("nan"))
    jobs = workload(engine.loaded.args.vocab_size)
    results = engine.generate([p for p, _ in jobs], [sp for _, sp in jobs])
    assert [r.token_ids for r in results] == alone_outputs
    counters = engine.stats().counters
    assert counters.swap_fallbacks > 0 and counters.by_mode().get("recompute", 0) > 0
    assert all(e.swap_fallback for e in engine.preemption_log())


def test_realtime_starts_fast_and_is_never_preempted_by_batch(tiny_model_dir: Path) -> None:
    engine = engine_for(
        tiny_model_dir,
        cache__num_blocks=24,
        scheduler__preemption_threshold=0.5,
        scheduler__preemption_patience_steps=1,
        model__max_model_len=384,
    )
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(5)
    batch = [
        engine.add_request(
            [rng.randrange(10, vocab) for _ in range(60)],
            SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.0),
            priority="batch",
        )
        for _ in range(6)
    ]
    for _ in range(10):
        engine.step()
    assert engine.kv.pool.usage() > 0.5
    realtime = engine.add_request(
        [rng.randrange(10, vocab) for _ in range(40)],
        SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0),
        priority="realtime",
    )
    steps = 0
    while realtime.first_scheduled_time is None:
        engine.step()
        steps += 1
        assert steps <= 3, "real-time request did not start within 3 steps"
    while engine.has_unfinished():
        engine.step()
    assert realtime.num_preemptions == 0
    assert all(e.priority_class == "batch" for e in engine.preemption_log())
    assert all(r.finish_reason is not None for r in batch)


def test_thrash_guard_bounds_preemptions_per_request(tiny_model_dir: Path) -> None:
    engine = engine_for(
        tiny_model_dir,
        cache__num_blocks=20,
        scheduler__max_preemptions_per_request=2,
        model__max_model_len=300,
    )
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(9)
    reqs = [
        engine.add_request(
            [rng.randrange(10, vocab) for _ in range(rng.randrange(30, 90))],
            SamplingParams(max_tokens=120, ignore_eos=True, temperature=0.0),
            priority="batch" if i % 3 else "realtime",
        )
        for i in range(10)
    ]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().counters.preemptions > 0
    assert max(r.num_preemptions for r in reqs) <= 2
    assert all(r.finish_reason is not None and r.finish_reason.value == "length" for r in reqs)
    assert engine.kv.pool.num_used_blocks == 0


def test_queue_full_and_queue_timeout_reasons(tiny_model_dir: Path) -> None:
    engine = engine_for(
        tiny_model_dir,
        cache__num_blocks=8,
        scheduler__max_num_seqs=1,
        model__max_model_len=128,
        **{
            "priority_classes.batch.priority": 10,
            "priority_classes.batch.max_waiting_requests": 2,
            "priority_classes.batch.queue_timeout_s": 0.2,
        },
    )
    params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.0)
    first = engine.add_request([11, 12, 13], params, priority="batch")
    engine.step()  # first is running; max_num_seqs=1 keeps the rest waiting
    waiting = [engine.add_request([20 + i] * 5, params, priority="batch") for i in range(2)]
    rejected = engine.add_request([30] * 5, params, priority="batch")
    assert rejected.is_finished and rejected.finish_reason.value == "queue_full"
    time.sleep(0.25)
    outputs = engine.step()
    reasons = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert all(reasons.get(r.request_id) == "queue_timeout" for r in waiting)
    assert engine.stats().counters.rejected_by == {"queue_full/batch": 1, "queue_timeout/batch": 2}
    engine.abort(first.request_id)
    engine.step()
    assert not engine.has_unfinished() and engine.kv.pool.num_used_blocks == 0


def test_cancel_while_swapped_frees_swap_blocks(tiny_model_dir: Path) -> None:
    engine = engine_for(
        tiny_model_dir,
        cache__num_blocks=12,
        cache__swap_space=0.05,
        scheduler__preemption_mode="swap",
        model__max_model_len=192,
    )
    params = SamplingParams(max_tokens=150, ignore_eos=True, temperature=0.0)
    reqs = [engine.add_request([15 + i] * 40, params) for i in range(3)]
    swapped = None
    for _ in range(200):
        engine.step()
        swapped = next((r for r in reqs if r.status is RequestStatus.SWAPPED), None)
        if swapped is not None:
            break
    assert swapped is not None, "no request was swapped out"
    assert engine.kv.usage().swap_blocks_used > 0
    engine.abort(swapped.request_id)
    assert engine.kv.usage().swap_blocks_used == 0
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.pool.num_used_blocks == 0
