/* The interface of cpu_quant.c, the library kernels/cpu_quant.py builds and calls through
 * ctypes: the packed-weight descriptor QW and the layer layout the Python side fills in, the
 * exported functions, and the inline helpers on QW that the kernels' headers share. */
#ifndef CPU_QUANT_H
#define CPU_QUANT_H

#include <stdint.h>
#include <string.h>

/* A packed weight as cpu_quant.py passes it: int64 fields, pointers as integers. */
typedef struct {
    int64_t bits;            /* 4 or 8 */
    int64_t n, k, group;
    const uint8_t *q;        /* q4: [n, k/2]; q8: int8 [n, k] */
    const uint16_t *scales;  /* fp16 [n, groups] */
    const void *mins;        /* [n, groups], q4 only: fp16, or float32 when mins_f32 */
    int64_t mins_f32;        /* AWQ/GPTQ: -zero * scale is exact in float32, not in fp16 */
    int64_t act8;            /* x quantized to int8 per 32 columns: integer dot products */
    int64_t tiles;           /* 8: the row-tile order (cpu_quant_tiles.h), int8 x always */
} QW;

/* Per-layer pointers of the quantized decode (cpu_quant.py QLAYER_FIELDS): the linears are
 * QW descriptors, the qkv bias float32, norms and the KV cache in the model dtype T. */
enum { Q_LN1, Q_WQKV, Q_BQKV, Q_WO, Q_LN2, Q_WGU, Q_WDOWN, Q_KCACHE, Q_VCACHE, Q_COUNT };

/* Whether this build has the row-tile kernels (cpu_quant.py tiles weights only then). */
int quant_tiles_supported(void);
/* y [batch, n] = x [batch, k] . w^T (+ bias), float32; qw a QW. Returns 0, or -1 if out of
 * memory. */
int quant_matmul(const int64_t *qw, const float *x, const float *bias, float *y, int64_t batch,
                 int64_t threads);
/* out [nrows, k] = float32 rows `rows` of w (all n rows when rows is NULL). */
void quant_dequant_rows(const int64_t *qw, const int64_t *rows, int64_t nrows, float *out,
                        int64_t threads);
/* The decode forward of cpu_decode.h's decode_forward_* with every linear read packed
 * (cpu_quant_decode.inc.c): layer_ptrs Q_COUNT pointers a layer, lm_head a QW. */
int qdecode_forward_bf16(const int64_t *shape, const int64_t *layer_ptrs,
                         const uint16_t *final_norm, const int64_t *lm_head,
                         const float *cos_table, const float *sin_table,
                         const int64_t *positions, const int64_t *slots, const int32_t *tables,
                         const int32_t *seq_lens, float eps, float scale, float *hidden,
                         float *logits);
int qdecode_forward_f32(const int64_t *shape, const int64_t *layer_ptrs, const float *final_norm,
                        const int64_t *lm_head, const float *cos_table, const float *sin_table,
                        const int64_t *positions, const int64_t *slots, const int32_t *tables,
                        const int32_t *seq_lens, float eps, float scale, float *hidden,
                        float *logits);

/* IEEE half -> float: F16C's one instruction where the CPU has it (the per-group scalar work
 * is as large as the vector work at group 32), else by bits (normals, subnormals, inf/nan). */
#if defined(__F16C__)
#include <immintrin.h>
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* Groups whose scales (and mins) one pass converts to float32 up front (the AVX2 dot kernels). */
#define GCHUNK 256

/* fp16 -> float32 of n values (scales of up to GCHUNK groups), 8 at a time. */
static inline void h2f_row(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) out[i] = h2f(h[i]);
}
#else
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f);
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif

static inline int64_t groups_of(const QW *w) { return (w->k + w->group - 1) / w->group; }

/* Min i of a row's groups (row base pointer `mrow`, typed by the flag). */
static inline float min_at(const QW *w, const void *mrow, int64_t i) {
    return w->mins_f32 ? ((const float *)mrow)[i] : h2f(((const uint16_t *)mrow)[i]);
}

static inline const void *min_row(const QW *w, int64_t n) {
    int64_t off = n * groups_of(w);
    return w->mins_f32 ? (const void *)((const float *)w->mins + off)
                       : (const void *)((const uint16_t *)w->mins + off);
}

#endif
