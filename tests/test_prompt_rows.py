"""A short prompt's chunk fed to the fused native decode as decode rows, one a token, beside the
step's decodes (engine/spec_verify.py: chunks_as_decode_rows; the rule: StepShape.runs_as_rows):
the kernel stores every row's K/V before any row attends and masks each row to its own position,
so the rows compute what the torch forward's prefill computes. Held to the torch prefill on
random paged contexts (a prompt from position 0, one after a cached prefix, runs longer than the
kernel's query group), to transformers through the engine, and the cost model prices such a
step as the rows it runs as."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from appliance.kernels import cpu_native

from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.core.step_cost import StepCostModel, StepShape
from appliance.engine.executor import load_model
from appliance.engine.loader import LoadedModel
from appliance.engine.spec_verify import chunks_as_decode_rows
from appliance.layers.attention import AttentionMetadata, PagedBatch
from appliance.sampling_params import SamplingParams
from tests.paged_fixtures import fill_random_kv
from tests.test_engine_exact import engine_for, greedy, hf_reference
from tests.test_native_draft_rows import BLOCK, config

native = pytest.mark.skipif(
    cpu_native.load() is None, reason=f"native kernels unavailable: {cpu_native.load_error()}"
)

# Decodes (context before the step) and prompt chunks (cached tokens before, chunk length): a
# prompt from its start, and one after a cached prefix; both longer than a run of rows the
# kernel reads in one pass (MAX_QUERY_HEADS / group = 16 rows on the tiny model).
DECODES = [70, 130]
CHUNKS = [(0, 40), (48, 21)]


@pytest.fixture(
    scope="module",
    params=[("float32", {}), ("bfloat16", {}), ("bfloat16", {"model.cpu_tile_decode": False})],
    ids=["float32", "bfloat16", "bfloat16-matvec"],
)
def loaded(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[LoadedModel]:
    dtype, extra = request.param
    model = load_model(config(tiny_model_dir, dtype, **extra))
    yield model
    model.close()


def mixed_step(loaded: LoadedModel, seed: int) -> dict[str, torch.Tensor]:
    """One step of DECODES and CHUNKS over random caches: its tokens, positions, slots, each
    row's table and length (the rows' view), and the torch forward's metadata (decodes, then
    the chunks as a prefill)."""
    gen = torch.Generator().manual_seed(seed)
    fill_random_kv(loaded.runner.kv.device_caches, gen)
    ends = [ctx + 1 for ctx in DECODES] + [start + n for start, n in CHUNKS]
    width = max(-(-end // BLOCK) for end in ends)
    blocks = torch.randperm(len(ends) * width, generator=gen).view(len(ends), width)
    positions = [ctx for ctx in DECODES]
    seqs = list(range(len(DECODES)))
    for i, (start, n) in enumerate(CHUNKS):
        positions += range(start, start + n)
        seqs += [len(DECODES) + i] * n
    pos = torch.tensor(positions)
    seq = torch.tensor(seqs)
    tables = blocks[seq].to(torch.int32)
    slots = tables[torch.arange(len(pos)), pos // BLOCK].long() * BLOCK + pos % BLOCK
    nd = len(DECODES)
    lens = [c + 1 for c in DECODES]
    chunk_lens = torch.tensor([start + n for start, n in CHUNKS])
    starts = torch.tensor([0] + [n for _, n in CHUNKS]).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=slots,
        decode=PagedBatch(blocks[:nd], torch.tensor(lens), torch.arange(nd + 1), 1, max(lens), nd),
        prefill=PagedBatch(
            blocks[nd:],
            chunk_lens,
            starts,
            max(n for _, n in CHUNKS),
            int(chunk_lens.max()),
            int(starts[-1]),
        ),
    )
    ids = torch.randint(0, loaded.model.args.vocab_size, (len(pos),), generator=gen)
    return {"ids": ids, "pos": pos, "slots": slots, "tables": tables, "lens": pos + 1, "meta": meta}


@native
def test_a_prompt_as_decode_rows_matches_the_torch_prefill(loaded: LoadedModel) -> None:
    runner, model = loaded.runner, loaded.model
    fused = runner.hooks.fused_decode
    assert fused is not None
    s = mixed_step(loaded, seed=5)
    rows = len(s["pos"])
    got = fused(s["ids"], s["pos"], s["slots"], s["tables"], s["lens"].to(torch.int32))
    caches = runner.kv.device_caches
    written = [c.k.view(-1, *c.k.shape[2:])[s["slots"]].clone() for c in caches]
    with runner.hooks.matmuls(rows):
        want = model.compute_logits(model(s["ids"], s["pos"], s["meta"], caches)).float()
    if loaded.compute_dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for c, k in zip(caches, written, strict=True):
            torch.testing.assert_close(
                k, c.k.view(-1, *c.k.shape[2:])[s["slots"]], atol=1e-4, rtol=1e-4
            )
    else:
        # bf16: torch rounds every op's output, the native forward keeps float32 activations
        # (on AMX it rounds each product's input): a bf16 forward's relative error, here over
        # 63 rows at up to 131 tokens of N(0, 1) context (the drafting rows' test: 3e-2).
        assert relative_error(got, want) < 5e-2
    # Each prompt row saw only the tokens before it: with every row of the first chunk given
    # the chunk's whole length, its rows move far beyond the dtype's error.
    whole = s["lens"].clone()
    first = slice(len(DECODES), len(DECODES) + CHUNKS[0][1])
    whole[first] = CHUNKS[0][1]
    wrong = fused(s["ids"], s["pos"], s["slots"], s["tables"], whole.to(torch.int32))
    assert relative_error(wrong[first], want[first]) > 5 * relative_error(got[first], want[first])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@native
def test_short_prompts_beside_decodes_run_as_rows_and_match_transformers(
    tiny_model_dir: Path, cpu_path: str
) -> None:
    """Chats arrive while others decode: their prompts (from the start, and after a cached
    prefix) go through the fused decode as rows; greedy output equals transformers'."""
    engine = engine_for(tiny_model_dir, cache__block_size=BLOCK)
    assert engine.runner.fused_prompt_rows > 0
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(11)
    first = [[rng.randrange(10, vocab) for _ in range(n)] for n in (60, 90)]
    later = [[rng.randrange(10, vocab) for _ in range(n)] for n in (7, 16, 17)]
    # A follow-up turn: the first prompt's 48 cached tokens, then 6 new ones.
    later.append(first[0][:48] + [rng.randrange(10, vocab) for _ in range(6)])
    reqs = [engine.add_request(p, greedy()) for p in first]
    for _ in range(3):
        engine.step()
    for p in later:
        reqs.append(engine.add_request(p, greedy()))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    prompts = first + later
    expected = hf_reference(
        str(tiny_model_dir), tuple(map(tuple, prompts)), len(reqs[0].output_token_ids)
    )
    for i, (r, want) in enumerate(zip(reqs, expected, strict=True)):
        assert r.output_token_ids == want, f"prompt {i} ({len(prompts[i])} tokens) diverged"
    assert engine.runner.prompt_row_steps >= len(later)
    assert engine.kv.pool.num_used_blocks == 0


def scheduled(start: int, tokens: int, **params: Any) -> ScheduledRequest:
    return ScheduledRequest(
        f"r{start}-{tokens}", list(range(tokens)), start, [], True, SamplingParams(**params), 0
    )


def test_the_rule_and_the_rows_agree() -> None:
    """StepShape.runs_as_rows counts the rows chunks_as_decode_rows makes; scored and pooled
    prompts never run as rows."""
    step = [scheduled(100, 1), scheduled(200, 1), scheduled(0, 40), scheduled(48, 21)]
    shape = StepShape.of(SchedulerOutput(scheduled=step))
    rows = chunks_as_decode_rows(step)
    assert len(rows) == 63
    assert shape.runs_as_rows(63) and not shape.runs_as_rows(62)
    assert [r.start_pos for r in rows[2:42]] == list(range(40))
    assert [r.sample for r in rows] == [True, True] + [False] * 39 + [True] + [False] * 20 + [True]
    as_rows = shape.as_run(63)
    assert (as_rows.decode_rows, as_rows.prefill_tokens) == (63, 0)
    # Each row attends over its own position + 1 tokens.
    assert as_rows.decode_context == sum(r.start_pos + 1 for r in rows)
    for params in ({"prompt_logprobs": 1}, {"pooling": "last"}):
        scored = StepShape.of(SchedulerOutput(scheduled=[*step[:3], scheduled(48, 21, **params)]))
        assert not scored.runs_as_rows(1000)


def test_the_cost_model_prices_a_step_as_the_device_runs_it() -> None:
    """With prompt rows, a short prompt's step is learnt and priced as decode rows (no prefill
    step cost); past the limit, as a prefill."""
    model = StepCostModel(prompt_rows=64)

    # A synthetic box: 10 ms a step, 0.2 ms a row, 1 µs a context token; a torch prefill step
    # 40 ms more, 0.5 ms a token.
    def seconds(shape: StepShape) -> float:
        run = shape.as_run(64)
        return (
            0.010
            + 2e-4 * run.decode_rows
            + 1e-6 * run.decode_context
            + (0.040 + 5e-4 * run.prefill_tokens if run.prefill_tokens else 0.0)
        )

    rng = random.Random(0)
    for _ in range(400):
        shape = StepShape()
        for _ in range(rng.randrange(1, 9)):
            shape = shape.with_decode(rng.randrange(10, 2000))
        if rng.random() < 0.5:
            shape = shape.with_chunk(rng.randrange(0, 512), rng.choice((16, 54, 200, 512)))
        model.observe(shape, seconds(shape))
    assert model.ready
    chat = StepShape().with_decode(150).with_decode(150).with_chunk(0, 54)
    assert chat.runs_as_rows(64)
    estimate = model.estimate(chat)
    assert estimate is not None and abs(estimate - seconds(chat)) < 1e-3
    assert estimate < 0.025  # as rows: no 40 ms prefill step
    summary = StepShape().with_decode(150).with_chunk(0, 512)
    estimate = model.estimate(summary)
    assert estimate is not None and abs(estimate - seconds(summary)) < 2e-3
