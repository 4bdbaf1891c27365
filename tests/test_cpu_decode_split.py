"""The native decode attention's split of a step's contexts across threads: the logprobs and
the K/V written equal the torch forward's, step by step (tests/test_cpu_native.py's lockstep)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_cpu_native import assert_native_matches_torch, lockstep


def split_run(model_dir: Path, threads: int, lengths: list[int]) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engines, logprobs = lockstep(model_dir, "float32", 16, len(lengths), lengths)
    finally:
        torch.set_num_threads(before)
    assert_native_matches_torch(engines, logprobs)


@pytest.mark.parametrize(("threads", "lengths"), [(7, [2]), (7, [1, 5, 40]), (4, [3, 70])])
def test_native_decode_splits_the_context_of_few_sequences(
    tiny_model_dir: Path, threads: int, lengths: list[int], cpu_path: str
) -> None:
    """Steps of fewer sequences than threads split each context into token ranges and merge them
    (attention_parts: 7, 2 and 2 ranges here); prompts of a few tokens leave ranges empty."""
    split_run(tiny_model_dir, threads, lengths)


@pytest.mark.parametrize(
    ("threads", "lengths"), [(2, [600, 5, 300, 40]), (3, [20, 900, 20, 1]), (2, [700, 700])]
)
def test_native_decode_cuts_long_contexts_into_ranges(
    tiny_model_dir: Path, threads: int, lengths: list[int], cpu_path: str
) -> None:
    """Steps of at least as many sequences as threads cut the step's context into ranges of
    at least 256 tokens, about two a thread (attention_range_tokens): the 600- and 300-token
    prompts here are 3 and 2 ranges, the 900 4, each 700 2; the short ones one each, attended
    in place."""
    split_run(tiny_model_dir, threads, lengths)
