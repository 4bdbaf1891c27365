/* The bf16 decode forward over tile-packed weights: the same forward as decode_forward_bf16
 * (cpu_decode_forward.inc.c), whose matrix-vector loops cost ~3.3 ms (Sapphire Rapids) to ~4 ms
 * (Zen 4) a step per extra row of the small demo model, with its matrix products as products
 * of 16 x 32 A blocks by 32 x 16 B tiles. Two back-ends compute those products:
 * - AMX (Sapphire Rapids and later): one _tile_dpbf16ps multiplies 16 rows x 32 K by 32 K x 16
 *   columns; for up to 32 rows (two A tiles) a product costs little beyond reading its weights.
 * - AVX-512-BF16 without AMX (Zen 4): the same tiles in vectors. A B tile's row is one K pair
 *   of its 16 columns, so one vdpbf16ps of a row's broadcast K pair against it adds that pair
 *   to 16 outputs; 12 rows x 2 column blocks of accumulators (24 of the 32 registers) take
 *   each weight load, so the weights are read once per 12 rows, not once a row.
 *
 * Weights: a tile-packed copy made once at load (appliance.cpu.tile_weights), per matrix
 * [N/16 column blocks][K/32 K blocks][16 K pairs][16 columns][2]: each (column block, K block)
 * is one 1 KB B tile in VNNI-2 order, a column block's tiles contiguous (one stream per thread).
 * N is padded to 16 and K to 32 with zeros. gate|up is packed with its blocks interleaved (gate
 * block j, then up block j), so one work item gets both halves of 16 outputs of the MLP.
 * Activations: float32 between products, as in the other forward; each product converts its
 * input rows to bf16 once (zero-padded to 16-row groups and 32-K blocks), shared by the team.
 *
 * Compiled where the compiler targets AMX or AVX-512-BF16 (-march=native on such a CPU, minus
 * the mask); AMX needs Linux's tile state too (amx_request_tiles, asked once before the first
 * call). Included by cpu_decode.c after the bf16 instantiation of cpu_decode_steps.inc.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_decode_attention.h"
#include "cpu_decode_simd.h"
#include "cpu_lora.h"

/* Rows of the batch one pass of tile products takes (two A tiles of 16). */
#define TILE_PASS_ROWS 32

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TILES_ISA 1 /* AMX */
#include "cpu_amx_tiles.h"
/* Linux: the permission to use the AMX tile data state (XFEATURE_XTILEDATA). */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

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

/* out [rows][32] = the first `rows` (<= 32) rows of A times B tiles b0 (columns 0-15) and b1
 * (16-31; NULL: none), over k_blocks K blocks. Whole 16-row groups are computed. */
static void tile_products(const uint16_t *a, int64_t a_stride_bytes, const uint16_t *b0,
                          const uint16_t *b1, int64_t k_blocks, int64_t rows, float *out) {
    if (rows > 16) {
        if (b1) amx_tile_products(a, a_stride_bytes, b0, b1, k_blocks, 2, 2, out);
        else amx_tile_products(a, a_stride_bytes, b0, b0, k_blocks, 2, 1, out);
    } else {
        if (b1) amx_tile_products(a, a_stride_bytes, b0, b1, k_blocks, 1, 2, out);
        else amx_tile_products(a, a_stride_bytes, b0, b0, k_blocks, 1, 1, out);
    }
}

#define TILES_BEGIN() amx_configure()
#define TILES_END() _tile_release()

#elif defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define TILES_ISA 2 /* AVX-512-BF16 vectors */
/* Rows of one register block: R x 2 accumulators, 2 weight vectors and a broadcast fit the 32
 * zmm registers up to 13 rows; 12 splits a 32-row pass into 12 + 12 + 8. */
#define VTILE_ROWS 12

/* out[r][0..15] (+16..31 with NB 2) = A rows r < R times B tiles b0 (b1) over k_blocks: for each
 * K pair p of a K block, B's row p (16 columns x the pair) is one vector, and row r's pair p
 * (two bf16, one 32-bit word of A) is broadcast against it. R and NB are constants at each
 * call, so the accumulators stay in registers. */
static ALWAYS_INLINE void vtile_block(const uint16_t *a, int64_t a_stride_bytes,
                                      const uint16_t *b0, const uint16_t *b1, int64_t k_blocks,
                                      int R, int NB, float *out) {
    __m512 c0[VTILE_ROWS], c1[VTILE_ROWS];
    for (int r = 0; r < R; r++) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < k_blocks; kb++) {
        const char *ak = (const char *)a + kb * 64;
        const uint16_t *w0 = b0 + kb * 512, *w1 = b1 + kb * 512;
        /* The next K block's tiles: the column blocks stream from memory once a pass. */
        __builtin_prefetch(w0 + 512);
        __builtin_prefetch(w0 + 512 + 256);
        if (NB == 2) {
            __builtin_prefetch(w1 + 512);
            __builtin_prefetch(w1 + 512 + 256);
        }
        for (int p = 0; p < 16; p++) {
            const __m512bh v0 = (__m512bh)_mm512_load_si512((const void *)(w0 + p * 32));
            const __m512bh v1 =
                NB == 2 ? (__m512bh)_mm512_load_si512((const void *)(w1 + p * 32)) : v0;
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, ak + r * a_stride_bytes + 4 * p, 4);
                const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                c0[r] = _mm512_dpbf16_ps(c0[r], x, v0);
                if (NB == 2) c1[r] = _mm512_dpbf16_ps(c1[r], x, v1);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out + r * 32, c0[r]);
        if (NB == 2) _mm512_storeu_ps(out + r * 32 + 16, c1[r]);
    }
}

#define VTILE_CASE(R)                                                                          \
    case R:                                                                                    \
        if (b1) vtile_block(ar, a_stride_bytes, b0, b1, k_blocks, R, 2, o);                    \
        else vtile_block(ar, a_stride_bytes, b0, b0, k_blocks, R, 1, o);                       \
        break

/* tile_products of the AMX back-end in vectors: only the `rows` rows asked for are computed. */
static void tile_products(const uint16_t *a, int64_t a_stride_bytes, const uint16_t *b0,
                          const uint16_t *b1, int64_t k_blocks, int64_t rows, float *out) {
    for (int64_t r0 = 0; r0 < rows; r0 += VTILE_ROWS) {
        const uint16_t *ar = (const uint16_t *)((const char *)a + r0 * a_stride_bytes);
        float *o = out + r0 * 32;
        switch (rows - r0 < VTILE_ROWS ? rows - r0 : VTILE_ROWS) {
            VTILE_CASE(1); VTILE_CASE(2); VTILE_CASE(3); VTILE_CASE(4);
            VTILE_CASE(5); VTILE_CASE(6); VTILE_CASE(7); VTILE_CASE(8);
            VTILE_CASE(9); VTILE_CASE(10); VTILE_CASE(11);
            default: VTILE_CASE(12);
        }
    }
}

#define TILES_BEGIN() ((void)0)
#define TILES_END() ((void)0)
#endif

#ifdef TILES_ISA

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#if TILES_ISA == 1
#include "cpu_lora_amx.inc.c"
#endif

/* Where a step's LoRA updates read and work: the descriptor, each kind's shape vector, the
 * rows' plan, and with tile-packed factors (`tiles`) each thread's scratch for them. */
typedef struct {
    const int64_t *lora;
    int64_t shapes[LK_COUNT * L_FIELDS];
    LoraPlan plan;
    int tiles;
    char *scratch;
#if TILES_ISA == 1
    LoraTileLayout layout;
#endif
} TileLora;

/* Layer `layer`'s LoRA update of one kind of linear (LK_*, cpu_lora.h) after its product: x
 * read from `a`, the product's bf16 copy of its input (rows round_up(in, 32) apart: the
 * shapes' x strides say so), out float32. On tiles where the decode keeps tile-packed factors,
 * else in vectors (cpu_lora.inc.c: AVX-512-BF16 pair dots). */
static void tile_lora(const TileLora *l, int64_t layer, int kind, const uint16_t *a, float *out) {
    const int64_t *factors = lora_factors(l->lora, layer, kind);
    const int64_t *shape = l->shapes + kind * L_FIELDS;
    const int64_t *parts = l->lora + kind * LORA_KIND_FIELDS + L_FIELDS;
#if TILES_ISA == 1
    if (l->tiles) {
        lora_run_tiles(shape, parts, a, out, 0, (const uint16_t *)(intptr_t)factors[LP_A_TILES],
                       (const uint16_t *)(intptr_t)factors[LP_B_TILES], &l->plan, l->scratch,
                       &l->layout);
        return;
    }
#endif
    lora_run_tile_x_bf16(shape, a, out, (const uint16_t *)(intptr_t)factors[LP_A],
                          (const uint16_t *)(intptr_t)factors[LP_B_T], &l->plan, parts);
}

/* x [batch, k] float32 -> a [rows_pad, k_pad] bf16, zeros past batch and k (split across the
 * team; its loop's barrier ends it). */
static void tile_activations(const float *x, int64_t batch, int64_t k, uint16_t *a,
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

#if VW != 16
#error "the tile forward's epilogues take 16-float vectors (both back-ends need AVX-512)"
#endif

/* dst[0..cols) (+)= src (+ bias): a whole column block in one vector, a partial one (the
 * matrix's last, N not a multiple of 16) element by element. */
static inline void tile_store(float *dst, const float *src, const uint16_t *bias, int64_t cols,
                              int accumulate) {
    if (cols == 16) {
        vf v = f32_loadv(src);
        if (bias) v += bf16_loadv(bias);
        if (accumulate) v += f32_loadv(dst);
        f32_storev(dst, v);
        return;
    }
    for (int64_t c = 0; c < cols; c++) {
        float v = src[c] + (bias ? bf16_load(bias[c]) : 0.0f);
        dst[c] = accumulate ? dst[c] + v : v;
    }
}

/* y[b, n] (+)= x[b, :] . w[n, :] (+ bias[n]) with w tile-packed; `a` the bf16 scratch for x.
 * Work items: pairs of column blocks, split statically across the team. */
static void tile_matmul(const float *x, const uint16_t *w, const uint16_t *bias, float *y,
                        int64_t batch, int64_t n_out, int64_t k, int accumulate, uint16_t *a) {
    const int64_t k_pad = round_up(k, 32), rows_pad = round_up(batch, 16);
    const int64_t blocks = round_up(n_out, 16) / 16, k_blocks = k_pad / 32;
    tile_activations(x, batch, k, a, rows_pad, k_pad);
    float out[TILE_PASS_ROWS * 32];
    #pragma omp for schedule(static)
    for (int64_t pair = 0; pair < (blocks + 1) / 2; pair++) {
        const int64_t nb = 2 * pair;
        const uint16_t *b0 = w + nb * k_blocks * 512;
        const uint16_t *b1 = nb + 1 < blocks ? b0 + k_blocks * 512 : NULL;
        const int64_t n0 = nb * 16, cols0 = n_out - n0 < 16 ? n_out - n0 : 16;
        const int64_t cols1 = b1 ? (n_out - n0 - 16 < 16 ? n_out - n0 - 16 : 16) : 0;
        for (int64_t r0 = 0; r0 < batch; r0 += TILE_PASS_ROWS) {
            const int64_t rows = batch - r0 < TILE_PASS_ROWS ? batch - r0 : TILE_PASS_ROWS;
            tile_products(a + r0 * k_pad, k_pad * 2, b0, b1, k_blocks, rows, out);
            for (int64_t i = 0; i < rows; i++) {
                float *dst = y + (r0 + i) * n_out + n0;
                tile_store(dst, out + i * 32, bias ? bias + n0 : NULL, cols0, accumulate);
                if (cols1)
                    tile_store(dst + 16, out + i * 32 + 16, bias ? bias + n0 + 16 : NULL, cols1,
                               accumulate);
            }
        }
    }
}

/* silu(g) * u over 16 lanes: g / (1 + exp(-g)) * u, exp_v as the attention's softmax has it. */
static inline vf silu_mul_v(vf g, vf u) { return g / (1.0f + exp_v(-g)) * u; }

/* act[b, i] = silu(gate_i . x) * (up_i . x), w the interleaved gate|up packing: work item j
 * is gate block j and up block j (blocks 2j, 2j+1). With `pre` (a step with adapter rows, whose
 * gate|up update lands before the SiLU) the pre-activations go there instead, [gate | up] a
 * row as the unpacked weight lays them out, and act is left alone. */
static void tile_gate_up(const float *x, const uint16_t *w, float *act, float *pre,
                         int64_t batch, int64_t inter, int64_t k, uint16_t *a) {
    const int64_t k_pad = round_up(k, 32), rows_pad = round_up(batch, 16);
    const int64_t k_blocks = k_pad / 32;
    tile_activations(x, batch, k, a, rows_pad, k_pad);
    float out[TILE_PASS_ROWS * 32];
    #pragma omp for schedule(static)
    for (int64_t j = 0; j < round_up(inter, 16) / 16; j++) {
        const uint16_t *g = w + 2 * j * k_blocks * 512, *u = g + k_blocks * 512;
        const int64_t cols = inter - j * 16 < 16 ? inter - j * 16 : 16;
        for (int64_t r0 = 0; r0 < batch; r0 += TILE_PASS_ROWS) {
            const int64_t rows = batch - r0 < TILE_PASS_ROWS ? batch - r0 : TILE_PASS_ROWS;
            tile_products(a + r0 * k_pad, k_pad * 2, g, u, k_blocks, rows, out);
            for (int64_t i = 0; i < rows; i++) {
                const float *gi = out + i * 32, *ui = gi + 16;
                if (pre) {
                    float *row = pre + (r0 + i) * 2 * inter + j * 16;
                    tile_store(row, gi, NULL, cols, 0);
                    tile_store(row + inter, ui, NULL, cols, 0);
                } else if (cols == 16) {
                    f32_storev(act + (r0 + i) * inter + j * 16,
                               silu_mul_v(f32_loadv(gi), f32_loadv(ui)));
                } else {
                    for (int64_t c = 0; c < cols; c++)
                        act[(r0 + i) * inter + j * 16 + c] = silu(gi[c]) * ui[c];
                }
            }
        }
    }
}

int tiles_compiled(void) { return TILES_ISA; }

#if TILES_ISA == 1
/* 0 when Linux grants this process the AMX tile state (or already had), else the errno. */
int amx_request_tiles(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -1;
    return 0;
}
#else
int amx_request_tiles(void) { return -1; }
#endif

/* The forward of decode_forward_bf16 (same arguments, same scratch layout, the same LoRA
 * updates from the same slot factors, unpacked) with the weights of every product tile-packed
 * (qkv, o, gate|up interleaved, down, LM head). */
int decode_forward_tiles_bf16(const int64_t *shape, const int64_t *layer_ptrs,
                            const uint16_t *final_norm, const uint16_t *lm_head,
                            const float *cos_table, const float *sin_table,
                            const int64_t *positions, const int64_t *slots,
                            const int32_t *tables, const int32_t *seq_lens, float eps,
                            float scale, float *hidden, float *logits, const int64_t *lora,
                            const int32_t *lora_slots) {
    const Shape *s = (const Shape *)shape;
    const int64_t hs = s->hidden, qkv_w = (s->heads + 2 * s->kv_heads) * s->head_dim;
    const int64_t q_w = s->heads * s->head_dim;
    TileLora l = {.lora = lora};
    /* Tile-packed factors in the descriptor: all kinds have them or none (fused_lora.py); only
     * AMX reads them (the vector back-end's update reads the row-major factors). */
    l.tiles = TILES_ISA == 1 && lora && lora_factors(lora, 0, LK_QKV)[LP_A_TILES] != 0;
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
#if TILES_ISA == 1
    if (adapters && l.tiles) {
        l.layout = lora_tile_layout(l.shapes, LK_COUNT);
        l.scratch = aligned_alloc(64, l.layout.bytes * (size_t)s->threads);
        /* zeros: the shrink's bf16 copy is never written past the rank */
        if (l.scratch) memset(l.scratch, 0, l.layout.bytes * (size_t)s->threads);
    }
#endif
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
        TILES_BEGIN();
        for (int64_t layer = 0; layer < s->layers; layer++) {
            const int64_t *p = layer_ptrs + layer * P_COUNT;
            uint16_t *k_cache = (uint16_t *)(intptr_t)p[P_KCACHE];
            uint16_t *v_cache = (uint16_t *)(intptr_t)p[P_VCACHE];
            rms_norm_bf16(hidden, (const uint16_t *)(intptr_t)p[P_LN1], normed, s->batch, hs, eps);
            tile_matmul(normed, (const uint16_t *)(intptr_t)p[P_WQKV],
                       (const uint16_t *)(intptr_t)p[P_BQKV], qkv, s->batch, qkv_w, hs, 0, a);
            if (adapters) tile_lora(&l, layer, LK_QKV, a, qkv);
            rope_attention_bf16(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache,
                                tables, seq_lens, s, scale, attn, split);
            tile_matmul(attn, (const uint16_t *)(intptr_t)p[P_WO], NULL, hidden, s->batch, hs,
                       q_w, 1, a);
            if (adapters) tile_lora(&l, layer, LK_O, a, hidden);
            rms_norm_bf16(hidden, (const uint16_t *)(intptr_t)p[P_LN2], normed, s->batch, hs, eps);
            tile_gate_up(normed, (const uint16_t *)(intptr_t)p[P_WGU], act, gate_up, s->batch,
                        s->inter, hs, a);
            if (adapters) {
                tile_lora(&l, layer, LK_GATE_UP, a, gate_up);
                lora_silu_mul(gate_up, act, s->batch, s->inter);
            }
            tile_matmul(act, (const uint16_t *)(intptr_t)p[P_WDOWN], NULL, hidden, s->batch, hs,
                       s->inter, 1, a);
            if (adapters) tile_lora(&l, layer, LK_DOWN, a, hidden);
        }
        rms_norm_bf16(hidden, final_norm, normed, s->batch, hs, eps);
        tile_matmul(normed, lm_head, NULL, logits, s->batch, s->vocab, hs, 0, a);
        TILES_END();
    }
    if (adapters) lora_plan_free(&l.plan);
    free(l.scratch);
    free(a);
    free(scratch);
    return 0;
}

#else

int tiles_compiled(void) { return 0; }
int amx_request_tiles(void) { return -1; }
int decode_forward_tiles_bf16(const int64_t *shape, const int64_t *layer_ptrs,
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
    return -2; /* not built for tiles: the Python side never calls it then (tiles_compiled) */
}

#endif
