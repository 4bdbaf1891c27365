/* The int8-activation dot products (AVX2 / AVX-VNNI / AVX-512-VNNI) of qmatvec in cpu_quant.c:
 * defines ACT8 (1 where built) and qdot_act8. */
#ifndef CPU_QUANT_ACT8_H
#define CPU_QUANT_ACT8_H

#include "cpu_decode_simd.h"
#include "cpu_quant.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* Integer dot products (llama.cpp's way): x is quantized once per call to int8 in 32-column
 * blocks (scale dx per block), each 32-column run of weights is multiplied with it as bytes
 * and summed in int32, then scaled into the float32 accumulator: ~10 instructions a run
 * instead of ~18, one vpdpbusd where the CPU has AVX-VNNI or AVX-512-VNNI. The weights' min
 * term still uses float32 sums of x. Costs an int8 rounding of the activations (quant-eval
 * measures it); chosen by model.cpu_quant_activations. */
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_U8S8(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (w), (x))
#elif defined(__AVXVNNI__)
#define DOT_U8S8(w, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (w), (x))
#else
#define DOT_U8S8(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), _mm256_set1_epi16(1))
#endif
#define ACT8 1

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Row qrow of w (q4 or q8, K and group multiples of 32) against nb <= 4 rows of int8 x (dx:
 * their block scales, xs: q4's float32 group sums of x); nb a constant once inlined. */
static ALWAYS_INLINE void act8_dot(const QW *w, const uint8_t *qrow, const uint16_t *srow,
                                   const void *mrow, const int8_t *xq, const float *dx,
                                   const float *xs, const int nb, float *out) {
    const int64_t k = w->k, group = w->group, ng = groups_of(w), nblk = k / 32;
    const int q4 = w->bits == 4;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 tot[4];
    float mt[4];
    float sf[GCHUNK], mf[GCHUNK];
    for (int b = 0; b < nb; b++) {
        tot[b] = _mm256_setzero_ps();
        mt[b] = 0.0f;
    }
    for (int64_t g0 = 0; g0 < ng; g0 += GCHUNK) {
        int64_t gn = ng - g0 < GCHUNK ? ng - g0 : GCHUNK;
        h2f_row(srow + g0, gn, sf);
        if (q4) {
            if (w->mins_f32)
                memcpy(mf, (const float *)mrow + g0, gn * sizeof(float));
            else
                h2f_row((const uint16_t *)mrow + g0, gn, mf);
            for (int b = 0; b < nb; b++)
                for (int64_t g = 0; g < gn; g++) mt[b] += mf[g] * xs[b * ng + g0 + g];
        }
        for (int64_t g = g0; g < g0 + gn; g++) {
            __m256 ag[4];
            for (int b = 0; b < nb; b++) ag[b] = _mm256_setzero_ps();
            /* q8's last group may end short of K (K a multiple of 32, not of group). */
            for (int64_t c = g * group; c < (g + 1) * group && c < k; c += 32) {
                __m256i wv, sx = _mm256_setzero_si256();
                if (q4) {
                    __m128i raw = _mm_loadu_si128((const __m128i *)(qrow + c / 2));
                    wv = _mm256_and_si256(
                        _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), mask);
                } else {
                    sx = _mm256_loadu_si256((const __m256i *)(qrow + c));
                    wv = _mm256_sign_epi8(sx, sx); /* |w| as unsigned bytes */
                }
                for (int b = 0; b < nb; b++) {
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * k + c));
                    if (!q4) xv = _mm256_sign_epi8(xv, sx); /* the sign moves to x */
                    __m256 f = _mm256_cvtepi32_ps(DOT_U8S8(wv, xv));
                    ag[b] = _mm256_fmadd_ps(f, _mm256_broadcast_ss(dx + b * nblk + c / 32),
                                            ag[b]);
                }
            }
            __m256 sv = _mm256_broadcast_ss(sf + (g - g0));
            for (int b = 0; b < nb; b++) tot[b] = _mm256_fmadd_ps(ag[b], sv, tot[b]);
        }
    }
    for (int b = 0; b < nb; b++) out[b] = hsum256(tot[b]) + mt[b];
}

#define PREFETCH_ROWS 4

static inline void qdot_act8(const QW *w, int64_t n, const int8_t *xq, const float *dx,
                             const float *xs, int64_t nb, float *out) {
    const int64_t k = w->k, ng = groups_of(w);
    const int q4 = w->bits == 4;
    const uint16_t *srow = w->scales + n * ng;
    const uint8_t *qrow = w->q + n * (q4 ? k / 2 : k);
    const void *mrow = q4 ? min_row(w, n) : NULL;
    const int64_t row_bytes = q4 ? k / 2 : k;
    /* Rows PREFETCH_ROWS ahead stream in while this one is summed: a 4-bit row is short (288
     * bytes at K = 576), and one row ahead left the loads waiting on DRAM. */
    for (int64_t off = 0; off < row_bytes; off += 64)
        __builtin_prefetch(qrow + PREFETCH_ROWS * row_bytes + off);
    switch (nb) {
    case 1: act8_dot(w, qrow, srow, mrow, xq, dx, xs, 1, out); break;
    case 2: act8_dot(w, qrow, srow, mrow, xq, dx, xs, 2, out); break;
    case 3: act8_dot(w, qrow, srow, mrow, xq, dx, xs, 3, out); break;
    default: act8_dot(w, qrow, srow, mrow, xq, dx, xs, 4, out); break;
    }
}
#else
#define ACT8 0
#endif

#endif
