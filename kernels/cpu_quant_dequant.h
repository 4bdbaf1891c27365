/* Row tiles (cpu_quant_tiles.h's order) dequantized to float32 rows, a whole tile at a time:
 * the wide passes of kernels/cpu_quant_dense.py dequantize a slice of a matrix's rows into
 * one scratch buffer and hand it to torch's float32 GEMM. dequant_tiled_row (cpu_quant.c)
 * reads one row's 4-byte pieces 32 bytes apart, scalar; here the 4 (q4) or 8 (q8) 32-byte
 * loads of a 32-column block are transposed in registers into the 8 rows' bytes in column
 * order, then widened to float32 8 at a time. The values are the scalar path's exactly: q * s
 * is exact in float32 (at most 8 + 11 significant bits), so the FMA adds the min once, as
 * q * s + m does. Included from cpu_quant.c after dequant_tiled_row. */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* 4 x 8 dwords (chunk j: row r's 4 bytes at dword r) -> u[r % 4] holds row r in its 128-bit
 * half r / 4: row r's 16 bytes in chunk order. */
static inline void transpose_chunks(const uint8_t *b, __m256i u[4]) {
    __m256i c0 = _mm256_loadu_si256((const __m256i *)b), c1 = _mm256_loadu_si256((const __m256i *)(b + 32));
    __m256i c2 = _mm256_loadu_si256((const __m256i *)(b + 64)), c3 = _mm256_loadu_si256((const __m256i *)(b + 96));
    __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
    __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
    u[0] = _mm256_unpacklo_epi64(t0, t2);
    u[1] = _mm256_unpackhi_epi64(t0, t2);
    u[2] = _mm256_unpacklo_epi64(t1, t3);
    u[3] = _mm256_unpackhi_epi64(t1, t3);
}

static inline __m128i row_of(const __m256i u[4], int r) {
    return r < 4 ? _mm256_castsi256_si128(u[r]) : _mm256_extracti128_si256(u[r - 4], 1);
}

/* Tile t of w -> o [8, k]. */
static void dequant_tile(const QW *w, int64_t t, float *o) {
    const int64_t k = w->k, ng = groups_of(w), nblk = k / 32;
    const int q4 = w->bits == 4;
    const uint8_t *tq = w->q + t * 8 * (q4 ? k / 2 : k);
    const uint16_t *sc = w->scales + t * 8 * ng;
    const void *tm = q4 ? min_row(w, t * 8) : NULL;
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t g = blk * 32 / w->group;
        /* The tile's 8 rows' scale (and min) of group g sit side by side. */
        const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g * 8)));
        __m256i u[4], v[4];
        if (q4) {
            const __m256 m8 = w->mins_f32 ? _mm256_loadu_ps((const float *)tm + g * 8)
                                          : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)tm + g * 8)));
            transpose_chunks(tq + blk * 128, u);
            for (int r = 0; r < 8; r++) {
                const __m256i lane = _mm256_set1_epi32(r);
                const __m256 s = _mm256_permutevar8x32_ps(s8, lane), m = _mm256_permutevar8x32_ps(m8, lane);
                const __m128i b = row_of(u, r);
                /* byte i: column i in its low nibble, column i + 16 in its high one */
                const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
                float *ob = o + r * k + blk * 32;
                _mm256_storeu_ps(ob, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s, m));
                _mm256_storeu_ps(ob + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s, m));
                _mm256_storeu_ps(ob + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s, m));
                _mm256_storeu_ps(ob + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s, m));
            }
        } else {
            /* chunks 0-3: columns 0-15 of each row, chunks 4-7: columns 16-31 */
            transpose_chunks(tq + blk * 256, u);
            transpose_chunks(tq + blk * 256 + 128, v);
            for (int r = 0; r < 8; r++) {
                const __m256 s = _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(r));
                const __m128i a = row_of(u, r), b = row_of(v, r);
                float *ob = o + r * k + blk * 32;
                _mm256_storeu_ps(ob, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), s));
                _mm256_storeu_ps(ob + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))), s));
                _mm256_storeu_ps(ob + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
                _mm256_storeu_ps(ob + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), s));
            }
        }
    }
}
#else
static void dequant_tile(const QW *w, int64_t t, float *o) {
    for (int r = 0; r < 8; r++) dequant_tiled_row(w, t * 8 + r, o + r * w->k);
}
#endif

/* out [end - start, k] = float32 rows start..end-1 of a row-tiled w (start and end whole
 * tiles: multiples of 8). */
void quant_dequant_tiles(const int64_t *qw, int64_t start, int64_t end, float *out, int64_t threads) {
    const QW *w = (const QW *)qw;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t t = start / 8; t < end / 8; t++) dequant_tile(w, t, out + (t * 8 - start) * w->k);
}
