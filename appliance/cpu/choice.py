"""What the CPU backend runs, decided from the CPU's features and the config alone: torch-free,
so `appliance plan` (and the console through it) can state the same decision the engine takes
without importing torch. `appliance.cpu.backend.plan_cpu` turns it into torch dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.config import ApplianceConfig
from appliance.kernels.cpu_features import NATIVE_MAX_QUERY_HEADS, CpuFeatures

# What the native kernels (kernels/cpu_decode.c) take: weight/KV dtypes and query heads per
# KV head one attention work item holds scores for.
NATIVE_DTYPES = ("bfloat16", "float32")
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Packed (GGUF/AWQ/GPTQ/INT8) weights on AMX keep a oneDNN-prepacked bf16 copy (AMX tiles)
# beside the packed bytes: decode steps of up to this many sequences run the fused packed
# decode (int8 activations), every other pass (prefills, mixed steps, wider decodes) the copy.
# SmolLM2 Q4_1, continuous 128/128, 2 threads, Sapphire Rapids, tok/s, fused packed decode vs
# the bf16 copy at that width: 16 at once 333 vs 243, 32: 528 vs 368, 48: 427 vs 408, 64:
# 214-257 vs 457-494 (the 16-bit model itself: 248, 381, 490, 467-571 in the same runs). A
# prefill through the copy also computes the first token as the 16-bit model does: SmolLM2's
# "The capital of France is Paris." starts with a 0.1-nat lead over "La" that int8 activations
# overturn (docs/quantized-weights.md).
QUANT_COPY_FUSED_MAX = 48
# Decode steps of up to this many sequences take the fused native forward (bf16 compute). Its
# matrix-vector loops read each weight row once for the whole batch but are not
# register-blocked as a GEMM is. ms a step of the small demo model, native vs torch (Zen 4,
# oneDNN bf16): 9.9 vs 27 (1), 19.6 vs 28.6 (4), 28.1 vs 32.6 (6), 35.6 vs 33.2 (8).
BF16_FUSED_MAX = 6
# The same with the matrix products over tile-packed weights (kernels/cpu_decode_tiles.inc.c).
# On AMX tiles up to 32 rows a product costs about its weight reads (beyond, a second pass over
# them). Quiet 2-core Sapphire Rapids, small demo model, 128-token context, ms a step AMX vs
# torch: 11.2 vs 28.9 (1), 20.0 vs 37.5 (16), 29.6 vs 48.7 (32), 41.6 vs 58.3 (48), 51.5 vs 67.7
# (64). In AVX-512-BF16 vectors (Zen 4) a row costs ~0.9 ms of products, at ~80% of the
# vdpbf16ps peak; 64-token context, ms tiles vs torch: 13.9 vs 32.0 (1), 24.8 vs 42.5 (16),
# 39.4 vs 60.1 (32), 71.2 vs 97.8 (64): docs/benchmarks.md. 64 is cpu-demo's max_num_seqs.
TILE_FUSED_MAX = 64
# A step with a prompt's chunk takes the fused decode too, its tokens as decode rows (the
# attention stores every row's K/V before any row reads, each row masked to its position), up
# to this many rows in all, by path: beyond, the torch forward's batched matmuls win. ms a step
# of the small demo model (or SmolLM2 Q4_1, packed) with two decodes at 150 tokens and a prompt
# of n tokens (n + 2 rows), fused vs torch, 2-core Sapphire Rapids, paths by APPLIANCE_CPU_MASK
# (docs/benchmarks.md, "A chat's prompt as decode rows"):
# - AMX tiles: 15.1 vs 38.1 (18 rows), 26.6 vs 47.3 (66), 48.2 vs 61.2 (130), 70.2 vs 76.6
#   (194), 103.1 vs 92.9 (258);
# - AVX-512-BF16 tiles: 35.4 vs 45.1 (10), 43.6 vs 53.2 (18), 70.0 vs 73.2 (34), 119.2 vs 112.6
#   (66);
# - bf16 matrix-vector loops: 21.7 vs 35.8 (10), 41.6 vs 37.7 (18);
# - float32 compute (AVX2): 25.0 vs 71.6 (10), 74.2 vs 100.4 (34), 140.3 vs 140.3 (66);
# - packed, AMX (wider steps on the bf16 copy): 19.6 vs 37.9 (18), 34.2 vs 40.8 (34), 65.9 vs
#   46.7 (66); packed, AVX2: 20.8 vs 31.7 (18), 68.0 vs 74.0 (66), 135.1 vs 130.0 (130).
#   The packed limits hold with float32 activations only: with int8 ones the rows would round
#   every prompt token's activations to int8 (CpuBackend.fused_prompt_rows).
TILE_PROMPT_ROWS = {"amx": 128, "avx512_bf16": 16}
BF16_PROMPT_ROWS = 8
FP32_PROMPT_ROWS = 32
QUANT_COPY_PROMPT_ROWS = 32  # AMX: the bf16 copy's matmuls
QUANT_PROMPT_ROWS = 64
# The tile forward's back-ends, as the notes name them.
TILE_ISA_NAMES = {"amx": "AMX tiles", "avx512_bf16": "AVX-512-BF16 tiles"}


@dataclass
class CpuChoice:
    """Dtype names ("bfloat16", "float32", "float16") and the paths, each reason in `notes`."""

    weight: str
    compute: str
    kv: str
    prepack: bool
    native_ops: bool
    native_decode: bool
    # Packed weights: a prepacked copy in the compute dtype for every pass but the fused
    # decode's (AMX only: QUANT_COPY_FUSED_MAX).
    quant_dense_copy: bool = False
    # The native bf16 decode's matrix products over a tile-packed weight copy that replaces
    # the row-major one (appliance.cpu.tile_weights), dense bf16 models: "amx" (tile products)
    # or "avx512_bf16" (the same products in vectors); "": the matrix-vector decode.
    tile_decode: str = ""
    # Prefill chunks over the bf16 cache through the native pair-dot-product attention
    # (AVX-512-BF16 without AMX); False: torch's SDPA.
    native_prefill_attention: bool = False
    notes: list[str] = field(default_factory=list)
    # Set when the configuration asks for something slow on this CPU (logged as a warning).
    warning: str = ""


def bf16_matrix_isa(features: CpuFeatures) -> str:
    """Where this CPU runs bf16 matrix products: "amx" (tiles), "avx512_bf16" (pair dot
    products in vectors), or "" (neither)."""
    if features.has("amx_bf16") and features.has("amx_tile"):
        return "amx"
    if features.has("avx512_bf16") and features.has("avx512bw"):
        return "avx512_bf16"
    return ""


def choose(
    config: ApplianceConfig,
    num_heads: int,
    num_kv_heads: int,
    features: CpuFeatures,
    onednn: bool,
    native_built: Callable[[], tuple[bool, str | None]],
    tile_decode_ready: Callable[[], tuple[str | None, str | None]] | None = None,
) -> CpuChoice:
    """`onednn`: whether torch has oneDNN; `native_built()`: whether the native kernels are
    available here, and why not (asked only when the config and shapes allow them);
    `tile_decode_ready()`: the back-end their forward over tile-packed weights runs on ("amx",
    "avx512_bf16"), or (None, why) (asked only on a bf16 native decode where the CPU has AMX or
    AVX-512-BF16; None: taken as the CPU's, `appliance plan`'s torch-free answer)."""
    notes: list[str] = []
    warning = ""
    wanted = config.model.dtype
    bf16_native = features.native_bf16_compute
    if wanted == "auto":
        weight = "bfloat16"
        if bf16_native:
            compute = "bfloat16"
            notes.append("dtype auto: bf16 (the CPU has bf16 arithmetic)")
        else:
            compute = "float32"
            notes.append(
                "dtype auto: bf16 weights and KV, float32 compute (no AVX-512-BF16 or AMX: "
                "bf16 GEMMs would be emulated, ~5x slower than float32)"
            )
    else:
        weight = compute = wanted
        if compute == "bfloat16" and not bf16_native:
            warning = (
                "model.dtype bfloat16 on a CPU without bf16 arithmetic (no AVX-512-BF16, no AMX): "
                "oneDNN emulates bf16 GEMMs, so prefills and decode batches run several times "
                'slower than float32; model.dtype = "auto" keeps bf16 weights and computes in '
                "float32"
            )
        if compute == "float16":
            notes.append("float16: torch path only (oneDNN's fp16 kernels need AVX-512-FP16)")

    prepack = False
    if config.model.cpu_prepack_weights and onednn:
        if compute == "float32" or (compute == "bfloat16" and features.onednn_bf16_prepack):
            prepack = True
        elif compute == "bfloat16":
            notes.append(
                "no bf16 prepacking: oneDNN's bf16 reorder needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT"
            )
    elif not config.model.cpu_prepack_weights:
        notes.append("prepacking off (model.cpu_prepack_weights = false)")

    # AMX's bf16 GEMM outruns the packed kernels on wide passes (measured above). On a Zen 4
    # (AVX-512-BF16, no AMX) the copy's prefill keeps the default model's answer: SmolLM2's
    # "The" leads "L" by 0.1 nat for "What is the capital of France?", and the packed kernels'
    # int8 activations turned it to "L'Étoile, la Marseillaise" there (2026-12-03); oneDNN's bf16
    # GEMM runs a prefill at ~0.5 ms a token on 2 cores. CPUs without bf16 arithmetic keep the
    # packed kernels at every width (a float32 copy would be 4 bytes a weight).
    quant_dense_copy = prepack and compute == "bfloat16" and features.native_bf16_compute
    if quant_dense_copy:
        notes.append(
            "packed weights: a prepacked bf16 copy for prefills and decode steps of more "
            f"than {QUANT_COPY_FUSED_MAX} sequences; the packed kernels for the others"
        )

    native_ops = native_decode = False
    if not config.model.cpu_native_kernels:
        notes.append("native kernels off (model.cpu_native_kernels = false)")
    elif config.parallel.tensor_parallel_size > 1:
        notes.append("native kernels off (tensor_parallel_size > 1 runs the torch path)")
    elif compute not in NATIVE_DTYPES or num_heads // num_kv_heads > NATIVE_MAX_QUERY_HEADS:
        notes.append(
            f"native kernels off (they take bf16/float32 and up to {NATIVE_MAX_QUERY_HEADS} "
            "query heads per KV head)"
        )
    else:
        built, why = native_built()
        if not built:
            notes.append(f"native kernels off ({why})")
        else:
            native_ops = True
            native_decode = config.cache.kv_cache_dtype == "auto"
            if not native_decode:
                notes.append(
                    f"native decode off for kv_cache_dtype {config.cache.kv_cache_dtype} "
                    "(the element-wise kernels still run)"
                )
    tile_decode = ""
    if native_decode and compute == weight == "bfloat16":
        cpu_tiles = bf16_matrix_isa(features)
        why = (
            "model.cpu_tile_decode = false"
            if not config.model.cpu_tile_decode
            else "no AMX or AVX-512-BF16"
            if not cpu_tiles
            else None
        )
        if why is None:
            isa, why = tile_decode_ready() if tile_decode_ready is not None else (cpu_tiles, None)
            tile_decode = isa or ""
        if tile_decode:
            notes.append(
                f"16-bit weights: native decode on {TILE_ISA_NAMES[tile_decode]}, one call for "
                f"steps of up to {TILE_FUSED_MAX} sequences, over a tile-packed bf16 copy of "
                "the matrices that replaces the row-major one"
            )
        else:
            notes.append(
                f"16-bit weights: native decode for steps of up to {BF16_FUSED_MAX} sequences "
                f"({why}: its matrix-vector loops cost ~3-4 ms a step per extra row; torch beyond)"
            )
    native_prefill_attention = False
    if native_decode and compute == "bfloat16":
        # torch's flash attention for CPUs runs its products as bf16 brgemm, on AMX tiles where
        # the CPU has them: a 1,500-token prefill of the small demo model took 0.46 s through
        # it against 0.88 s through the pair dot products on a 2-core Sapphire Rapids
        # (docs/benchmarks.md, "Sapphire Rapids: torch's SDPA for prefill chunks"); without
        # AMX the pair dot products run ~2x its vector path (Zen 4).
        isa = bf16_matrix_isa(features)
        if isa == "amx":
            notes.append("prefill attention: torch's SDPA (its products on AMX tiles)")
        elif isa == "avx512_bf16":
            native_prefill_attention = True
            notes.append("prefill attention: native, in AVX-512-BF16 pair dot products")
    return CpuChoice(
        weight=weight,
        compute=compute,
        kv=weight,
        prepack=prepack,
        native_ops=native_ops,
        native_decode=native_decode,
        quant_dense_copy=quant_dense_copy,
        tile_decode=tile_decode,
        native_prefill_attention=native_prefill_attention,
        notes=notes,
        warning=warning,
    )
