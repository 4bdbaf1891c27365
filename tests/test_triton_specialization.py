"""The Triton decode launch's compile-time constants do not follow the step's context length.

Triton compiles a kernel once per distinct set of constexpr values (and of the ==1 / %16
properties of its integer arguments). A constexpr that followed the step's longest context made
the first H200 run compile a new decode kernel at almost every step (~0.4 s each: a 4-layer
7B-shaped model decoded at 38 tok/s one request at a time, 26 ms a step, 4.3 ms once warm at
batch 8). Runs the launch under the interpreter (conftest.py sets TRITON_INTERPRET=1), with
the split sizes a 132-SM GPU would choose, and records what each launch passes as constexprs."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from appliance.kernels import triton_attention  # noqa: E402

from tests.test_kernels import assert_close, decode, make_batch  # noqa: E402

pytestmark = pytest.mark.filterwarnings(  # the interpreter's range(<tensor>) on numpy 2.x
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)


class LaunchRecorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **constexprs)` runs the real
    one and keeps the keyword arguments (the constexprs and launch options) of each launch."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple[str, Any], ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            self.launches.append(tuple(sorted(kwargs.items())))
            return launch(*args, **kwargs)

        return run


def test_decode_constexprs_do_not_follow_the_context_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decode_kernel = LaunchRecorder(triton_attention._decode_kernel)
    reduce_kernel = LaunchRecorder(triton_attention._decode_reduce_kernel)
    monkeypatch.setattr(triton_attention, "_decode_kernel", decode_kernel)
    monkeypatch.setattr(triton_attention, "_decode_reduce_kernel", reduce_kernel)
    monkeypatch.setattr(triton_attention, "_num_sms", lambda index: 132)  # an H100 / H200
    gpu = torch.device("cuda", 0)
    # One sequence growing step by step (a real decode's lengths), then a few longer ones that
    # the GPU's choice splits into 512-token pieces.
    lengths = [1, 2, 15, 16, 17, 128, 129, 130, 131, 500, 1100, 1700, 2100]
    for i, length in enumerate(lengths):
        b = make_batch([length, max(length // 3, 1)], [1, 1], 2, 32, 16, seed=i)
        split = triton_attention.choose_split_size(2, 2, b.max_seq_len, gpu, 64)
        assert_close(decode(b, split_size=split), b.reference(), torch.float32)
    assert len(decode_kernel.launches) == len(lengths)
    variants = set(decode_kernel.launches)
    # Unsplit and split: two kernels whatever the lengths, not one per length.
    assert len(variants) == 2, sorted(variants)
    assert {dict(v)["USE_SPLITS"] for v in variants} == {False, True}
    # The merge compiles once per power-of-two split count (at most log2(MAX_SPLITS) + 1).
    assert len(reduce_kernel.launches) == 3
    assert {dict(v)["SPLITS_PAD"] for v in reduce_kernel.launches} == {4, 8}
