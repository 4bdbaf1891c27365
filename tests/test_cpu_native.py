"""The native CPU decode kernels (kernels/cpu_decode.c) against the torch reference: decode
attention over the paged cache at several block sizes, head groupings and head sizes; the
whole-model decode forward against the torch forward (logits and the K/V it writes), on a
Llama and a Qwen2-shaped model; and the engine's fallback when the kernels cannot be built."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from appliance.kernels import cpu_native
from appliance.kernels.cpu_features import detect
from appliance.kernels.paged_attention import paged_attention

from appliance.config import load_config
from appliance.cpu.attention import cpu_paged_attention
from appliance.cpu.plan import FP32_FUSED_MAX
from appliance.engine.llm_engine import Engine
from appliance.layers.norm import RMSNorm
from appliance.layers.rotary import RotaryEmbedding, apply_rotary
from appliance.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    cpu_native.load() is None, reason=f"native kernels unavailable: {cpu_native.load_error()}"
)


def random_paged_batch(
    seq_lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    # Scattered, shuffled block ids, padded with 0 as the runner pads its tables.
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    rows, start = [], 0
    for n in blocks_per_seq:
        rows.append(ids[start : start + n] + [0] * (width - n))
        start += n
    query = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
    return query, k_cache, v_cache, torch.tensor(rows), torch.tensor(seq_lens)


@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "head_dim"),
    # Query heads per KV head 3, 1, 8, 3, 2 (head_dim off the vector width: the generic loops),
    # 2 and 4: each of the kernel's register-held group sizes (1-4) and the generic loop. Head
    # sizes of 1, 2, 4, 5 and 8 vectors of AVX-512 (2-16 of AVX2): the value pass's several
    # columns at once (PV_COLS) and its one-vector remainder.
    [
        (16, 9, 3, 64),
        (16, 6, 2, 80),
        (1, 4, 4, 32),
        (32, 8, 1, 128),
        (16, 6, 2, 40),
        (16, 4, 2, 36),
        (16, 4, 2, 32),
        (8, 8, 2, 64),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("copies", [1, 4])
def test_decode_attention_matches_torch_reference(
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    copies: int,
    cpu_path: str,
) -> None:
    # Lengths cross the kernel's 64-token chunks and the block boundaries; one is a lone token.
    # 24 sequences are enough for the kernel to take all KV heads of a sequence per work item.
    seq_lens = [1, 17, 64, 65, 150, 300] * copies
    query, k_cache, v_cache, tables, lens = random_paged_batch(
        seq_lens, block_size, heads, kv_heads, head_dim, seed=block_size + head_dim
    )
    query, k_cache, v_cache = query.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    scale = head_dim**-0.5
    out = cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    # The reference in float64 on the same (already rounded) inputs.
    reference = paged_attention(
        query.double(),
        k_cache.double(),
        v_cache.double(),
        tables,
        lens,
        torch.arange(len(seq_lens) + 1),
        scale,
        1,
        max(seq_lens),
    )
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(out.double(), reference, **tol)
    assert out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_ops_match_the_torch_layers(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    rows, hidden, heads, kv_heads, head_dim = 37, 200, 5, 1, 40
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}

    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.rand(hidden, generator=gen).to(dtype) + 0.5
    x = torch.randn(rows, hidden, generator=gen).to(dtype) * 3
    add = torch.randn(rows, hidden, generator=gen).to(dtype)
    torch.testing.assert_close(cpu_native.add_rms_norm(x, None, norm.weight, 1e-5), norm(x), **tol)
    residual = x + add
    out = cpu_native.add_rms_norm(x, add, norm.weight, 1e-5)
    torch.testing.assert_close(x, residual, atol=0, rtol=0)  # the add is one rounding, as torch's
    torch.testing.assert_close(out, norm(residual), **tol)

    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (rows,), generator=gen)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    qk = qkv[:, : (heads + kv_heads) * head_dim].float().view(rows, -1, head_dim)
    expected = apply_rotary(qk, cos, sin).view(rows, -1)
    rotated = qkv.clone()
    cpu_native.rotary_(rotated, heads + kv_heads, head_dim, rotary.cos, rotary.sin, positions)
    torch.testing.assert_close(rotated[:, : expected.shape[1]].float(), expected, **tol)
    assert torch.equal(rotated[:, expected.shape[1] :], qkv[:, expected.shape[1] :])  # v untouched

    gate_up = torch.randn(rows, 2 * 344, generator=gen).to(dtype) * 4
    gate, up = gate_up.split(344, dim=-1)
    torch.testing.assert_close(cpu_native.silu_mul(gate_up), F.silu(gate) * up, **tol)


@pytest.mark.parametrize("max_query_len", [1, 5])
def test_cpu_backend_sends_decodes_native_and_the_rest_to_torch(
    max_query_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    seq_lens = [9, 40, 33]
    query, k_cache, v_cache, tables, lens = random_paged_batch(seq_lens, 16, 4, 2, 32, seed=3)
    query = query.repeat_interleave(max_query_len, dim=0)
    qsl = torch.arange(len(seq_lens) + 1) * max_query_len
    args = (query, k_cache, v_cache, tables, lens, qsl, 0.2, max_query_len, max(seq_lens))
    calls: list[int] = []
    native = cpu_native.paged_decode_attention
    monkeypatch.setattr(
        cpu_native, "paged_decode_attention", lambda *a: calls.append(1) or native(*a)
    )
    out = cpu_paged_attention(*args, native_prefill=True)
    torch.testing.assert_close(out, paged_attention(*args), atol=1e-5, rtol=1e-5)
    assert len(calls) == (max_query_len == 1)
    # A quantized cache always takes the torch path (the kernels read model-dtype caches).
    calls.clear()
    scale = torch.ones(2)
    cpu_paged_attention(
        *args[:7], max_query_len, max(seq_lens), "int8", scale, scale, native_prefill=True
    )
    assert not calls


def engine(model_dir: Path, dtype: str, native: bool, block_size: int = 16) -> Engine:
    return Engine(
        load_config(
            None,
            {
                "model.path": str(model_dir),
                "model.dtype": dtype,
                "model.cpu_native_kernels": native,
                "cache.block_size": block_size,
                "cache.kv_cache_memory": 0.1,
                "hardware.device": "cpu",
            },
        )
    )


def lockstep(
    model_dir: Path, dtype: str, block_size: int, batch: int, lengths: list[int] | None = None
) -> tuple[list[Engine], list[list[list[float]]]]:
    """Run the same requests on a native-decode engine and a torch-only one, step by step;
    return both engines and each one's top-5 logprobs of every sampled token."""
    engines = [engine(model_dir, dtype, native, block_size) for native in (True, False)]
    assert engines[0].loaded.runner.fused_max_batch > 0
    assert engines[1].loaded.runner.fused_max_batch == 0
    rng = random.Random(batch)
    lengths = lengths or [rng.randrange(1, 90) for _ in range(batch)]
    prompts = [[rng.randrange(10, 4000) for _ in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    for eng in engines:
        for p in prompts:
            eng.add_request(p, params)
    logprobs: list[list[list[float]]] = [[], []]
    while engines[0].has_unfinished():
        for i, eng in enumerate(engines):
            for out in eng.step():
                for lp in out.new_logprobs or []:
                    # Values only, best first: robust to ties between token ids.
                    logprobs[i].append([lp.logprob, *(v for _, v in lp.top)])
    assert not engines[1].has_unfinished()
    return engines, logprobs


@pytest.mark.parametrize(("block_size", "batch"), [(16, 1), (1, 3), (32, FP32_FUSED_MAX)])
def test_native_decode_matches_torch_forward_float32(
    tiny_model_dir: Path, block_size: int, batch: int, cpu_path: str
) -> None:
    engines, logprobs = lockstep(tiny_model_dir, "float32", block_size, batch)
    assert engines[1].loaded.runner.native_decode_steps == 0
    assert_native_matches_torch(engines, logprobs)


def assert_native_matches_torch(engines: list[Engine], logprobs: list[list[list[float]]]) -> None:
    """lockstep's native engine decoded natively, and its logprobs and the K/V it wrote equal
    the torch-only engine's."""
    native, plain = engines
    assert native.loaded.runner.native_decode_steps > 0
    torch.testing.assert_close(
        torch.tensor(logprobs[0]), torch.tensor(logprobs[1]), atol=1e-4, rtol=1e-4
    )
    for c1, c2 in zip(
        native.loaded.runner.kv.device_caches, plain.loaded.runner.kv.device_caches, strict=True
    ):
        torch.testing.assert_close(c1.k, c2.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(c1.v, c2.v, atol=1e-4, rtol=1e-4)


def test_prepacked_linears_keep_the_plain_weight_the_native_decode_reads(
    tiny_model_dir: Path, cpu_path: str
) -> None:
    # dtype auto: bf16 prepacked where oneDNN can (AVX-512), else a float32 prepacked copy
    # beside the bf16 weights (AVX2); either way the native decode reads the bf16 weights,
    # row-major, or on AMX / AVX-512-BF16 its own tile-packed copy (tests/test_cpu_tile_decode.py).
    eng = engine(tiny_model_dir, "auto", native=True)
    down = eng.loaded.model.model.layers[0].mlp.down_proj
    assert down.matmul is not None and down.matmul.copy is not None and down.matmul.prepacked
    if eng.loaded.backend.plan.tile_decode:  # type: ignore[attr-defined]
        assert down.weight.numel() == 0
    else:
        assert down.weight.numel() > 0 and down.weight.dtype == torch.bfloat16
    assert eng.loaded.runner.fused_max_batch > 0
    out = eng.generate([[5, 6, 7], [9, 10]], SamplingParams(max_tokens=6, temperature=0.0))
    assert [len(o.token_ids) for o in out] == [6, 6]
    assert eng.loaded.runner.native_decode_steps > 0


def test_float32_compute_over_bf16_weights_matches_the_native_decode(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AVX2 path of dtype auto: torch forward in float32 on a float32 copy of the bf16
    weights, KV in bf16, and the fused native decode on the bf16 weights. The two compute the
    same function (the same weight values, float32 arithmetic), so their logprobs agree."""
    monkeypatch.setenv("APPLIANCE_CPU_MASK", "avx512,amx")
    (native, plain), (lp_native, lp_plain) = lockstep(tiny_model_dir, "auto", 16, 3)
    for eng in (native, plain):
        assert eng.loaded.compute_dtype == torch.float32
        assert eng.loaded.runner.kv.device_caches[0].k.dtype == torch.bfloat16
    assert native.loaded.runner.native_decode_steps > 0
    # Both sides round the same float32 values to bf16 K/V; summation order differs (~1e-6),
    # which now and then lands a K/V element on the other side of a bf16 rounding step (0.4%):
    # measured up to 1.4e-2 in a logprob, in ~1% of them.
    torch.testing.assert_close(torch.tensor(lp_native), torch.tensor(lp_plain), atol=3e-2, rtol=0)


@pytest.fixture(scope="module")
def odd_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose sizes are multiples of neither the 16-float (AVX-512) nor the 8-float
    (AVX2) vectors of the kernels (hidden 204, head size 36, intermediate 340): every scalar
    tail of the native forward runs, whatever the build's vector width."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("odd-llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=204,
        intermediate_size=340,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=36,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # sharper than HF's N(0, 0.02), as the demo models
            p.normal_(0.0, 1.6 / p.shape[-1] ** 0.5) if p.dim() == 2 else p.uniform_(0.8, 1.2)
    model.save_pretrained(out)
    return out


def test_native_decode_with_sizes_off_the_vector_width(odd_model_dir: Path, cpu_path: str) -> None:
    (native, _), (lp_native, lp_plain) = lockstep(odd_model_dir, "float32", 16, 3)
    assert native.loaded.runner.native_decode_steps > 0
    torch.testing.assert_close(
        torch.tensor(lp_native), torch.tensor(lp_plain), atol=1e-4, rtol=1e-4
    )


def test_native_decode_on_qwen2_bias_and_tied_embeddings(qwen2_model_dir: Path) -> None:
    _, (lp_native, lp_plain) = lockstep(qwen2_model_dir, "float32", 16, 4)
    torch.testing.assert_close(
        torch.tensor(lp_native), torch.tensor(lp_plain), atol=1e-4, rtol=1e-4
    )


def test_native_decode_bf16_close_to_float32(tiny_model_dir: Path) -> None:
    """In bf16 the native forward keeps activations in float32 where torch rounds each op's
    output to bf16: compare both with the float32 model's logprobs, the native one must be at
    least as close."""
    _, (lp_native, lp_plain) = lockstep(tiny_model_dir, "bfloat16", 16, 1)
    _, (lp_ref, _) = lockstep(tiny_model_dir, "float32", 16, 1)
    ref = torch.tensor(lp_ref)
    err_native = (torch.tensor(lp_native) - ref).abs().max().item()
    err_plain = (torch.tensor(lp_plain) - ref).abs().max().item()
    assert err_native <= err_plain + 1e-3, (err_native, err_plain)


def test_without_a_compiler_the_engine_falls_back_to_torch(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APPLIANCE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_native.forget_builds()
    try:
        assert cpu_native.load() is None
        assert "no-such-compiler" in (cpu_native.load_error() or "")
        eng = engine(tiny_model_dir, "float32", native=True)
        assert eng.loaded.runner.fused_max_batch == 0
        notes = eng.loaded.backend.plan.notes  # type: ignore[attr-defined]
        assert any("no-such-compiler" in n for n in notes)
        out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].token_ids) == 4
    finally:
        monkeypatch.undo()
        cpu_native.forget_builds()
    assert cpu_native.load() is not None and cpu_native.load_error() is None


def test_build_is_cached_per_source_and_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APPLIANCE_KERNEL_CACHE", str(tmp_path))
    first = cpu_native.build()
    mtime = first.stat().st_mtime_ns
    assert cpu_native.build() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_every_file_a_kernel_includes_is_part_of_the_build_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The libraries are cached by a hash of their sources: a header or template they #include
    that the key missed would leave an edit to it unbuilt. Follows the #include "..." lines of
    each library's C file (through the templates they include), then edits a copy of each file
    it reached, one at a time, and sees that library's key change."""
    folder = cpu_native.SOURCE.parent
    keyed = set(cpu_native.kernel_sources())
    copy = tmp_path / "kernels"
    copy.mkdir()
    for path in keyed:
        (copy / path.name).write_text(path.read_text())
    monkeypatch.setattr(cpu_native, "SOURCE", copy / "cpu_decode.c")
    features, cc, flags = detect(), "cc", ["-O3"]
    for library in ("cpu_decode.c", "cpu_quant.c"):
        pending, seen = [folder / library], set()
        while pending:
            path = pending.pop()
            if path in seen:
                continue
            seen.add(path)
            pending += [folder / n for n in re.findall(r'#include "([^"]+)"', path.read_text())]
        assert seen <= keyed, sorted(p.name for p in seen - keyed)
        assert len(seen) >= 8 and any(p.name.endswith(".inc.c") for p in seen), seen

        def key(library: str = library) -> str:
            return cpu_native._build_key(
                cc, flags, features, (copy / library, *cpu_native.kernel_sources())
            )

        for path in sorted(seen):
            before = key()
            edited = copy / path.name
            edited.write_text(edited.read_text() + "\n/* edited */\n")
            assert key() != before, path.name


def test_a_masked_feature_builds_another_library_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mask reaches the compiler: hiding AVX2 (which every CI machine has) builds a
    separate library with -mno-avx2, and its decode attention still matches the reference."""
    monkeypatch.setenv("APPLIANCE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("APPLIANCE_CPU_MASK", raising=False)
    native = cpu_native.build()
    monkeypatch.setenv("APPLIANCE_CPU_MASK", "avx2")
    masked_features = detect()
    if "avx2" not in masked_features.masked:
        pytest.skip("this CPU has no AVX2 to mask")
    assert "-mno-avx2" in cpu_native.build_flags() and masked_features.isa == "sse"
    masked = cpu_native.build()
    assert masked != native and masked.exists()
    query, k_cache, v_cache, tables, lens = random_paged_batch([5, 70, 33], 16, 4, 2, 64, seed=9)
    out = cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    qsl = torch.arange(4)
    ref = paged_attention(query, k_cache, v_cache, tables, lens, qsl, 0.125, 1, 70)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 7, 24])
def test_float32_queries_over_a_bf16_cache_match_the_reference(batch: int) -> None:
    # The decode attention of a float32 forward that keeps its KV in bf16 (CPUs without bf16
    # arithmetic): float32 in, float32 out, against the torch reference on the same cache.
    lens = [random.Random(batch).randrange(1, 200) for _ in range(batch)]
    query, k_cache, v_cache, tables, seq_lens = random_paged_batch(lens, 16, 9, 3, 64, seed=batch)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    out = cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.125)
    assert out.dtype == torch.float32
    qsl = torch.arange(batch + 1)
    ref = paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, 0.125, 1, max(lens))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_quantized_kv_under_float32_compute(
    tiny_model_dir: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AVX2 path with a quantized cache (vLLM's CPU build refuses FP8 KV without AVX-512):
    float32 compute over FP8/INT8 KV, layer 0 kept in bf16. The first token comes from the
    prefill, whose attention already reads the quantized cache: on this random model its
    logprob stays within the format's error of the bf16 cache's (accuracy on a trained model
    is the KV-accuracy tests' job); every later logprob is finite."""
    monkeypatch.setenv("APPLIANCE_CPU_MASK", "avx512,amx")

    def run(kv: str) -> tuple[Engine, list[list[float]]]:
        eng = Engine(
            load_config(
                None,
                {
                    "model.path": str(tiny_model_dir),
                    "hardware.device": "cpu",
                    "cache.kv_cache_dtype": kv,
                    "cache.kv_cache_keep_16bit": [0] if kv != "auto" else [],
                    "cache.kv_cache_memory": 0.1,
                },
            )
        )
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
        outs = eng.generate([[5, 6, 7, 8, 9] * 4, [300, 301, 302]], params)
        return eng, [[lp.logprob for lp in o.logprobs or []] for o in outs]

    quant, lp_quant = run(fmt)
    _, lp_plain = run("auto")
    assert quant.loaded.compute_dtype == torch.float32
    caches = quant.loaded.runner.kv.device_caches
    assert caches[0].k.dtype == torch.bfloat16 and caches[1].k.dtype in (torch.uint8, torch.int8)
    assert bool(caches[1].k.view(torch.uint8).any())
    assert all(len(a) == 10 and all(x == x and x > -1e4 for x in a) for a in lp_quant)
    first_quant = torch.tensor([a[0] for a in lp_quant])
    first_plain = torch.tensor([a[0] for a in lp_plain])
    torch.testing.assert_close(first_quant, first_plain, atol=0.2, rtol=0)
