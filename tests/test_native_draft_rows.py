"""The fused native decode on a speculative step's rows: a drafting request is 1 + n decode rows
of one sequence at consecutive positions, which the kernel's attention reads in one pass over the
sequence's context, each row masked to its own length (kernels/cpu_decode_steps.inc.c,
attend_runs). Checked against the torch forward, which attends row by row, on random paged
contexts whose row lengths cross the kernel's 64-token chunks, in float32 (to 1e-4) and in bf16
(on AMX where the CPU has it). Greedy tokens with and without drafts through the engine on the
fused decode: tests/test_spec_decode.py's "alone" mode."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from appliance.kernels import cpu_native

from appliance.config import load_config
from appliance.engine.executor import load_model
from appliance.engine.loader import LoadedModel
from tests.paged_fixtures import decode_metadata, fill_random_kv

pytestmark = pytest.mark.skipif(
    cpu_native.load() is None, reason=f"native kernels unavailable: {cpu_native.load_error()}"
)

BLOCK = 16


def config(model_dir: Path, dtype: str, **extra: Any) -> Any:
    return load_config(
        None,
        {
            "model.path": str(model_dir),
            "model.dtype": dtype,
            "cache.block_size": BLOCK,
            "cache.kv_cache_memory": 0.1,
            "hardware.device": "cpu",
            **extra,
        },
    )


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[LoadedModel]:
    model = load_model(config(tiny_model_dir, request.param))
    yield model
    model.close()


# (context before the step, rows): each entry one sequence; a sequence of n rows is a drafting
# request's last token and n - 1 drafts. Lengths cross the kernel's 64-token chunks (63 -> 66,
# 126 -> 130), start at one token, and a single row sits between runs.
SEQUENCES = [(126, 4), (63, 1), (62, 3), (0, 2), (40, 1), (5, 6)]


def draft_step(
    loaded: LoadedModel, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, positions, slots, block tables and lengths of one step over random caches: every
    row of a sequence has the sequence's table and its own position and length."""
    gen = torch.Generator().manual_seed(seed)
    fill_random_kv(loaded.runner.kv.device_caches, gen)
    width = max(-(-(ctx + rows) // BLOCK) for ctx, rows in SEQUENCES)
    blocks = torch.randperm(len(SEQUENCES) * width, generator=gen).view(len(SEQUENCES), width)
    tables, positions = [], []
    for seq, (ctx, rows) in enumerate(SEQUENCES):
        for j in range(rows):
            tables.append(blocks[seq])
            positions.append(ctx + j)
    table = torch.stack(tables).to(torch.int32)
    pos = torch.tensor(positions)
    slots = table[torch.arange(len(pos)), pos // BLOCK].long() * BLOCK + pos % BLOCK
    ids = torch.randint(0, loaded.model.args.vocab_size, (len(pos),), generator=gen)
    return ids, pos, slots, table, (pos + 1).to(torch.int32)


def test_draft_rows_in_one_pass_match_the_torch_forward(loaded: LoadedModel) -> None:
    runner, model = loaded.runner, loaded.model
    fused = runner.hooks.fused_decode
    assert fused is not None
    ids, pos, slots, tables, lens = draft_step(loaded, seed=3)
    rows = len(pos)
    assert rows <= runner.fused_max_batch
    got = fused(ids, pos, slots, tables, lens)
    written = [c.k.view(-1, *c.k.shape[2:])[slots].clone() for c in runner.kv.device_caches]
    meta = decode_metadata(slots, tables, lens)
    with runner.hooks.matmuls(rows):
        want = model.compute_logits(model(ids, pos, meta, runner.kv.device_caches)).float()
    if loaded.compute_dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for c, k in zip(runner.kv.device_caches, written, strict=True):
            torch.testing.assert_close(k, c.k.view(-1, *c.k.shape[2:])[slots], atol=1e-4, rtol=1e-4)
    else:
        # bf16: torch rounds every op's output, the native forward keeps float32 activations
        # (and on AMX rounds each product's input): relative error of a bf16 forward.
        err = float((got - want).norm() / want.norm())
        assert err < 3e-2, err
    # Each row saw its own length: a row attending over its successors' tokens would move the
    # logits by far more than the tolerance above. The mutant check: lengths all set to the
    # sequence's longest must change the first row of the first sequence.
    longest = lens.clone()
    start = 0
    for _, n in SEQUENCES:
        longest[start : start + n] = lens[start + n - 1]
        start += n
    wrong = fused(ids, pos, slots, tables, longest)
    assert not torch.allclose(wrong[0], got[0], atol=1e-2)
