/* Decode steps of a Llama-family model on the CPU, in one call.
 *
 * A decode step of a few sequences is bound by reading the weights once. In torch it is ~500
 * small operator calls whose dispatch costs as much as the reads; here the whole forward (every
 * layer, the final norm and the LM head) runs inside one OpenMP region: the matrix-vector
 * products are split across threads by output row, everything between them is small.
 *
 * Weights, norms, biases and the KV cache are in the model dtype T (bfloat16 or float32);
 * activations stay in float32. Layout matches the torch path (kernels/paged_attention.py):
 * k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim], rotate-half rotary tables
 * [max_position, head_dim], merged q|k|v and gate|up projections (rows = output features).
 *
 * Built by kernels/cpu_native.py with the box's C compiler (-march=native); also exports
 * paged_decode_attention_* for the torch path's larger decode batches, and the element-wise
 * steps of the torch forward (cpu_decode.h lists them all).
 *
 * The kernels are written once for both dtypes, as templates (cpu_template.h) instantiated
 * here: cpu_decode_steps.inc.c (norm, rotary, attention: shared with cpu_quant.c, which
 * instantiates it too), cpu_decode_forward.inc.c (the matvecs and the forward),
 * cpu_decode_ops.inc.c (the torch forward's element-wise steps); cpu_decode_tiles.inc.c, the bf16
 * forward over tile-packed weights on AMX tiles or AVX-512-BF16 vectors (a stub where the build
 * targets neither);
 * cpu_lora.inc.c, the LoRA update both forwards add after each projection. Each library is one
 * translation unit, one compiler call: every helper inlines into the loops that call it
 * without link-time optimization, and each library's cache key is its own file and what it
 * includes (cpu_native.py).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_decode_simd.h"
#include "cpu_decode_attention.h"
#include "cpu_template.h"
#include "cpu_lora.h"

#define SUFFIX bf16
#define T uint16_t
#include "cpu_decode_steps.inc.c"
#define SUFFIX f32
#define T float
#include "cpu_decode_steps.inc.c"

/* The LoRA update of kernels/cpu_lora.c (the same template) into the forwards' float32
 * activations from T factors, called inside their parallel region after each projection of a
 * step with adapter rows: lora_run_fused_bf16 / _f32 over float32 x, and lora_run_tile_x_bf16
 * over the bf16 copy of x the tile forward's products make (AVX-512-BF16 dot products where
 * the build has them, as cpu_lora.c's bf16 update). */
#define LORA_NO_ENTRY
#define LORA_OUT_F32
#if (defined(__AMX_BF16__) && defined(__AMX_TILE__)) || LORA_BF16_PAIR_DOTS
#define LORA_NAME tile_x_bf16
#define SUFFIX bf16
#define T uint16_t
#if LORA_BF16_PAIR_DOTS
#define LORA_DPBF16 1
#endif
#include "cpu_lora.inc.c"
#undef LORA_DPBF16
#undef LORA_NAME
#endif
#define LORA_X_F32
#define LORA_NAME fused_bf16
#define SUFFIX bf16
#define T uint16_t
#include "cpu_lora.inc.c"
#undef LORA_NAME
#define LORA_NAME fused_f32
#define SUFFIX f32
#define T float
#include "cpu_lora.inc.c"
#undef LORA_NAME
#undef LORA_X_F32
#undef LORA_OUT_F32
#undef LORA_NO_ENTRY

#define SUFFIX bf16
#define T uint16_t
#include "cpu_decode_forward.inc.c"
#define SUFFIX f32
#define T float
#include "cpu_decode_forward.inc.c"

/* The bf16 forward over tile-packed weights where the build targets AMX or AVX-512-BF16 (after
 * the bf16 steps it calls). */
#include "cpu_decode_tiles.inc.c"

/* A prefill chunk's attention in AVX-512-BF16 pair dot products, where the build targets it. */
#include "cpu_prefill_attention.inc.c"

#define SUFFIX bf16
#define T uint16_t
#include "cpu_decode_ops.inc.c"
#define SUFFIX f32
#define T float
#include "cpu_decode_ops.inc.c"
