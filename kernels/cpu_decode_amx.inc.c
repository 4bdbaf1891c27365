/* The bf16 decode forward on AMX tiles (Sapphire Rapids and later): the same forward as
 * decode_forward_bf16 (cpu_decode_forward.inc.c), whose matrix-vector loops cost ~3.3 ms a
 * step per extra row of the small demo model, with its matrix products as tile products.
 * One _tile_dpbf16ps multiplies 16 rows x 32 K by 32 K x 16 columns: for up to 32 rows (two
 * A tiles) a product costs little beyond reading its weights once, so a step of 2-32 rows
 * costs about a 1-row step plus attention.
 *
 * Weights: a tile-packed copy made once at load (appliance.cpu.amx_weights), per matrix
 * [N/16 column blocks][K/32 K blocks][16 K pairs][16 columns][2]: each (column block, K block)
 * is one 1 KB B tile in VNNI-2 order, a column block's tiles contiguous (one stream per thread).
 * N is padded to 16 and K to 32 with zeros. gate|up is packed with its blocks interleaved (gate
 * block j, then up block j), so one work item gets both halves of 16 outputs of the MLP.
 * Activations: float32 between products, as in the other forward; each product converts its
 * input rows to bf16 once (zero-padded to 16-row groups and 32-K blocks), shared by the team.
 *
 * Compiled only where the compiler targets AMX (-march=native on such a CPU, no mask); the
 * process asks Linux for the tile state once (amx_request_tiles) before the first call.
 * Included by cpu_decode.c after the bf16 instantiation of cpu_decode_steps.inc.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_decode_attention.h"
#include "cpu_decode_simd.h"
#include "cpu_lora.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_COMPILED 1
#include "cpu_amx_tiles.h"
/* Linux: the permission to use the AMX tile data state (XFEATURE_XTILEDATA). */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* Rows of the batch one pass of tile products takes (two A tiles of 16). */
#define AMX_PASS_ROWS 32

/* Tiles: 0-3 C (row group g, column block b at 2g+b), 4-5 A (row groups), 6-7 B (blocks).
 * out [groups * 16][32] floats receives C, column block b at columns 16b. G and NB are
 * constants at each call (1 or 2), so the branches fold. */
static ALWAYS_INLINE void amx_tile_products(const uint16_t *a, int64_t a_stride_bytes,
                                            const uint16_t *b0, const uint16_t *b1,
                                            int64_t k_blocks, int G, int NB, float *out) {
    _tile_zero(0);
    if (NB == 2) _tile_zero(1);
    if (G == 2) {
        _tile_zero(2);
        if (NB == 2) _tile_zero(3);
    }
    const char *a1 = (const char *)a + 16 * a_stride_bytes;
    for (int64_t kb = 0; kb < k_blocks; kb++) {
        _tile_loadd(4, (const char *)a + kb * 64, a_stride_bytes);
        _tile_loadd(6, b0 + kb * 512, 64);
        if (NB == 2) _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (NB == 2) _tile_dpbf16ps(1, 4, 7);
        if (G == 2) {
            _tile_loadd(5, a1 + kb * 64, a_stride_bytes);
            _tile_dpbf16ps(2, 5, 6);
            if (NB == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, out, 128);
    if (NB == 2) _tile_stored(1, out + 16, 128);
    if (G == 2) {
        _tile_stored(2, out + 16 * 32, 128);
        if (NB == 2) _tile_stored(3, out + 16 * 32 + 16, 128);
    }
}

static void amx_products(const uint16_t *a, int64_t a_stride_bytes, const uint16_t *b0,
                         const uint16_t *b1, int64_t k_blocks, int64_t groups, float *out) {
    if (groups == 2) {
        if (b1) amx_tile_products(a, a_stride_bytes, b0, b1, k_blocks, 2, 2, out);
        else amx_tile_products(a, a_stride_bytes, b0, b0, k_blocks, 2, 1, out);
    } else {
        if (b1) amx_tile_products(a, a_stride_bytes, b0, b1, k_blocks, 1, 2, out);
        else amx_tile_products(a, a_stride_bytes, b0, b0, k_blocks, 1, 1, out);
    }
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#include "cpu_lora_amx.inc.c"

/* Where a step's LoRA updates read and work: the descriptor, each kind's shape vector, the
 * rows' plan, and with tile-packed factors (`tiles`) each thread's scratch for them. */
typedef struct {
    const int64_t *lora;
    int64_t shapes[LK_COUNT * L_FIELDS];
    LoraPlan plan;
    int tiles;
    char *scratch;
    LoraTileLayout layout;
} AmxLora;

/* Layer `layer`'s LoRA update of one kind of linear (LK_*, cpu_lora.h) after its product: x
 * read from `a`, the product's bf16 copy of its input (rows round_up(in, 32) apart: the
 * shapes' x strides say so), out float32. On tiles where the decode keeps tile-packed factors,
 * else in vectors (cpu_lora.inc.c). */
static void amx_lora(const AmxLora *l, int64_t layer, int kind, const uint16_t *a, float *out) {
    const int64_t *factors = lora_factors(l->lora, layer, kind);
    const int64_t *shape = l->shapes + kind * L_FIELDS;
    const int64_t *parts = l->lora + kind * LORA_KIND_FIELDS + L_FIELDS;
    if (l->tiles)
        lora_run_tiles(shape, parts, a, out, 0, (const uint16_t *)(intptr_t)factors[LP_A_TILES],
                       (const uint16_t *)(intptr_t)factors[LP_B_TILES], &l->plan, l->scratch,
                       &l->layout);
    else
        lora_run_amx_bf16(shape, a, out, (const uint16_t *)(intptr_t)factors[LP_A],
                          (const uint16_t *)(intptr_t)factors[LP_B_T], &l->plan, parts);
}

/* x [batch, k] float32 -> a [rows_pad, k_pad] bf16, zeros past batch and k (split across the
 * team; its loop's barrier ends it). */
static void amx_activations(const float *x, int64_t batch, int64_t k, uint16_t *a,
                            int64_t rows_pad, int64_t k_pad) {
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows_pad; r++) {
        uint16_t *dst = a + r * k_pad;
        int64_t j = 0;
        if (r < batch) {
            const float *src = x + r * k;
            for (; j + VW <= k; j += VW) bf16_storev(dst + j, f32_loadv(src + j));
            for (; j < k; j++) dst[j] = bf16_store(src[j]);
        }
        for (; j < k_pad; j++) dst[j] = 0;
    }
}

/* y[b, n] (+)= x[b, :] . w[n, :] (+ bias[n]) with w tile-packed; `a` the bf16 scratch for x.
 * Work items: pairs of column blocks, split statically across the team. */
static void amx_matmul(const float *x, const uint16_t *w, const uint16_t *bias, float *y,
                       int64_t batch, int64_t n_out, int64_t k, int accumulate, uint16_t *a) {
    const int64_t k_pad = round_up(k, 32), rows_pad = round_up(batch, 16);
    const int64_t blocks = round_up(n_out, 16) / 16, k_blocks = k_pad / 32;
    amx_activations(x, batch, k, a, rows_pad, k_pad);
    float out[AMX_PASS_ROWS * 32];
    #pragma omp for schedule(static)
    for (int64_t pair = 0; pair < (blocks + 1) / 2; pair++) {
        const int64_t nb = 2 * pair;
        const uint16_t *b0 = w + nb * k_blocks * 512;
        const uint16_t *b1 = nb + 1 < blocks ? b0 + k_blocks * 512 : NULL;
        for (int64_t r0 = 0; r0 < batch; r0 += AMX_PASS_ROWS) {
            const int64_t rows = batch - r0 < AMX_PASS_ROWS ? batch - r0 : AMX_PASS_ROWS;
            amx_products(a + r0 * k_pad, k_pad * 2, b0, b1, k_blocks, (rows + 15) / 16, out);
            for (int64_t i = 0; i < rows; i++) {
                float *dst = y + (r0 + i) * n_out;
                for (int64_t c = 0; c < 32; c++) {
                    const int64_t n = nb * 16 + c;
                    if (n >= n_out || (c >= 16 && !b1)) break;
                    float v = out[i * 32 + c] + (bias ? bf16_load(bias[n]) : 0.0f);
                    dst[n] = accumulate ? dst[n] + v : v;
                }
            }
        }
    }
}

/* act[b, i] = silu(gate_i . x) * (up_i . x), w the interleaved gate|up packing: work item j
 * is gate block j and up block j (blocks 2j, 2j+1). With `pre` (a step with adapter rows, whose
 * gate|up update lands before the SiLU) the pre-activations go there instead, [gate | up] a
 * row as the unpacked weight lays them out, and act is left alone. */
static void amx_gate_up(const float *x, const uint16_t *w, float *act, float *pre,
                        int64_t batch, int64_t inter, int64_t k, uint16_t *a) {
    const int64_t k_pad = round_up(k, 32), rows_pad = round_up(batch, 16);
    const int64_t k_blocks = k_pad / 32;
    amx_activations(x, batch, k, a, rows_pad, k_pad);
    float out[AMX_PASS_ROWS * 32];
    #pragma omp for schedule(static)
    for (int64_t j = 0; j < round_up(inter, 16) / 16; j++) {
        const uint16_t *g = w + 2 * j * k_blocks * 512, *u = g + k_blocks * 512;
        for (int64_t r0 = 0; r0 < batch; r0 += AMX_PASS_ROWS) {
            const int64_t rows = batch - r0 < AMX_PASS_ROWS ? batch - r0 : AMX_PASS_ROWS;
            amx_products(a + r0 * k_pad, k_pad * 2, g, u, k_blocks, (rows + 15) / 16, out);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t c = 0; c < 16 && j * 16 + c < inter; c++) {
                    if (pre) {
                        float *row = pre + (r0 + i) * 2 * inter + j * 16 + c;
                        row[0] = out[i * 32 + c];
                        row[inter] = out[i * 32 + 16 + c];
                    } else {
                        act[(r0 + i) * inter + j * 16 + c] =
                            silu(out[i * 32 + c]) * out[i * 32 + 16 + c];
                    }
                }
        }
    }
}

int amx_compiled(void) { return 1; }

/* 0 when Linux grants this process the AMX tile state (or already had), else the errno. */
int amx_request_tiles(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -1;
    return 0;
}

/* The forward of decode_forward_bf16 (same arguments, same scratch layout, the same LoRA
 * updates from the same slot factors, unpacked) with the weights of every product tile-packed
 * (qkv, o, gate|up interleaved, down, LM head). */
int decode_forward_amx_bf16(const int64_t *shape, const int64_t *layer_ptrs,
                            const uint16_t *final_norm, const uint16_t *lm_head,
                            const float *cos_table, const float *sin_table,
                            const int64_t *positions, const int64_t *slots,
                            const int32_t *tables, const int32_t *seq_lens, float eps,
                            float scale, float *hidden, float *logits, const int64_t *lora,
                            const int32_t *lora_slots) {
    const Shape *s = (const Shape *)shape;
    const int64_t hs = s->hidden, qkv_w = (s->heads + 2 * s->kv_heads) * s->head_dim;
    const int64_t q_w = s->heads * s->head_dim;
    AmxLora l = {.lora = lora};
    /* Tile-packed factors in the descriptor: all kinds have them or none (fused_lora.py). */
    l.tiles = lora && lora_factors(lora, 0, LK_QKV)[LP_A_TILES] != 0;
    const int adapters = lora_fused_begin(lora, lora_slots, s->batch, s->threads, l.shapes,
                                          &l.plan, l.tiles ? LORA_TILE_ROWS : LORA_ROWS);
    if (adapters < 0) return -1;
    for (int k = 0; adapters && k < LK_COUNT; k++)
        l.shapes[k * L_FIELDS + L_X_STRIDE] = round_up(l.shapes[k * L_FIELDS + L_IN], 32);
    size_t floats = (size_t)s->batch * (hs + qkv_w + q_w + s->inter) + attention_scratch_floats(s);
    if (adapters) floats += (size_t)s->batch * 2 * s->inter;
    float *scratch = calloc(floats, sizeof(float)); /* zeros: the split's counters */
    /* The bf16 A rows of the widest product input (hidden, q heads or intermediate). */
    int64_t widest = hs > q_w ? hs : q_w;
    widest = widest > s->inter ? widest : s->inter;
    size_t a_bytes = (size_t)round_up(s->batch, 16) * round_up(widest, 32) * 2;
    uint16_t *a = aligned_alloc(64, round_up((int64_t)a_bytes, 64));
    if (adapters && l.tiles) {
        l.layout = lora_tile_layout(l.shapes, LK_COUNT);
        l.scratch = aligned_alloc(64, l.layout.bytes * (size_t)s->threads);
        /* zeros: the shrink's bf16 copy is never written past the rank */
        if (l.scratch) memset(l.scratch, 0, l.layout.bytes * (size_t)s->threads);
    }
    if (!scratch || !a || (adapters && l.tiles && !l.scratch)) {
        free(scratch);
        free(a);
        free(l.scratch);
        if (adapters) lora_plan_free(&l.plan);
        return -1;
    }
    float *normed = scratch, *qkv = normed + s->batch * hs;
    float *attn = qkv + s->batch * qkv_w, *act = attn + s->batch * q_w;
    float *split = act + s->batch * s->inter;
    float *gate_up = adapters ? split + attention_scratch_floats(s) : NULL;
    #pragma omp parallel num_threads(s->threads)
    {
        amx_configure();
        for (int64_t layer = 0; layer < s->layers; layer++) {
            const int64_t *p = layer_ptrs + layer * P_COUNT;
            uint16_t *k_cache = (uint16_t *)(intptr_t)p[P_KCACHE];
            uint16_t *v_cache = (uint16_t *)(intptr_t)p[P_VCACHE];
            rms_norm_bf16(hidden, (const uint16_t *)(intptr_t)p[P_LN1], normed, s->batch, hs, eps);
            amx_matmul(normed, (const uint16_t *)(intptr_t)p[P_WQKV],
                       (const uint16_t *)(intptr_t)p[P_BQKV], qkv, s->batch, qkv_w, hs, 0, a);
            if (adapters) amx_lora(&l, layer, LK_QKV, a, qkv);
            rope_attention_bf16(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache,
                                tables, seq_lens, s, scale, attn, split);
            amx_matmul(attn, (const uint16_t *)(intptr_t)p[P_WO], NULL, hidden, s->batch, hs,
                       q_w, 1, a);
            if (adapters) amx_lora(&l, layer, LK_O, a, hidden);
            rms_norm_bf16(hidden, (const uint16_t *)(intptr_t)p[P_LN2], normed, s->batch, hs, eps);
            amx_gate_up(normed, (const uint16_t *)(intptr_t)p[P_WGU], act, gate_up, s->batch,
                        s->inter, hs, a);
            if (adapters) {
                amx_lora(&l, layer, LK_GATE_UP, a, gate_up);
                lora_silu_mul(gate_up, act, s->batch, s->inter);
            }
            amx_matmul(act, (const uint16_t *)(intptr_t)p[P_WDOWN], NULL, hidden, s->batch, hs,
                       s->inter, 1, a);
            if (adapters) amx_lora(&l, layer, LK_DOWN, a, hidden);
        }
        rms_norm_bf16(hidden, final_norm, normed, s->batch, hs, eps);
        amx_matmul(normed, lm_head, NULL, logits, s->batch, s->vocab, hs, 0, a);
        _tile_release();
    }
    if (adapters) lora_plan_free(&l.plan);
    free(l.scratch);
    free(a);
    free(scratch);
    return 0;
}

#else

int amx_compiled(void) { return 0; }
int amx_request_tiles(void) { return -1; }
int decode_forward_amx_bf16(const int64_t *shape, const int64_t *layer_ptrs,
                            const uint16_t *final_norm, const uint16_t *lm_head,
                            const float *cos_table, const float *sin_table,
                            const int64_t *positions, const int64_t *slots,
                            const int32_t *tables, const int32_t *seq_lens, float eps,
                            float scale, float *hidden, float *logits, const int64_t *lora,
                            const int32_t *lora_slots) {
    (void)lora, (void)lora_slots;
    (void)shape, (void)layer_ptrs, (void)final_norm, (void)lm_head, (void)cos_table;
    (void)sin_table, (void)positions, (void)slots, (void)tables, (void)seq_lens, (void)eps;
    (void)scale, (void)hidden, (void)logits;
    return -2; /* not built for AMX: the Python side never calls it then (amx_compiled) */
}

#endif
