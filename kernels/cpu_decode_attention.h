/* The decode attention's limits and the helpers of its split (cpu_decode_steps.inc.c, the
 * attention itself, is a template per weight dtype; these are not): the split's arithmetic,
 * rotate-half rotary, the merge of a split sequence's partial results. */
#ifndef CPU_DECODE_ATTENTION_H
#define CPU_DECODE_ATTENTION_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_decode.h"

/* Tokens of one attention chunk: scores live on the stack. */
#define CHUNK 64
/* Limits the Python side checks (cpu_native.py MAX_GROUP / MAX_HEAD_DIM). */
#define MAX_GROUP 16
/* Query heads one attention work item holds scores for (a multiple of MAX_GROUP). */
#define MAX_QUERY_HEADS 64
#define MAX_HEAD_DIM 256
/* Tokens ahead whose K/V rows are prefetched in a range's first chunk (later chunks: the next
 * chunk's rows during this one's passes). */
#define PREFETCH 16

/* Steps of fewer sequences than threads split each sequence's context into this many token
 * ranges (flash-decoding's split), every range over all KV heads: one sequence of a model with
 * 3 KV heads was 3 work items for 2 threads (the layer waited for the one that took two), and a
 * KV head's rows are 1/3 of each token's contiguous K/V. 1: no split. */
static inline int64_t attention_parts(const Shape *s) {
    return s->batch >= s->threads ? 1 : s->threads / s->batch;
}

/* Floats of one (sequence, range) slot of the split's scratch: the rotated queries, the
 * unnormalized outputs, then each query head's max and sum. */
static inline int64_t attention_part_floats(const Shape *s) { return s->heads * (2 * s->head_dim + 2); }

/* Steps of at least as many sequences as threads cut the step's context into about this many
 * ranges a thread (attention_range_tokens), each over all of a sequence's KV heads, for the
 * dynamic schedule to balance: one 2k-token summary beside short chats was one item per KV
 * head, whose rows are a third of each token's contiguous K/V (the loads' prefetch and the
 * memory's pages followed a 128-byte piece every 384 bytes), or one item per sequence that one
 * thread took alone while the other finished the chats. */
#define RANGES_PER_THREAD 2
/* ... but no range under this many tokens: each range starts its prefetch from cold and adds a
 * merge. */
#define MIN_RANGE_TOKENS 256

/* Tokens per range for a step of batch >= threads: the step's context over the team's ranges. */
static inline int64_t attention_range_tokens(const int32_t *seq_lens, const Shape *s) {
    int64_t total = 0;
    for (int64_t b = 0; b < s->batch; b++) total += seq_lens[b];
    const int64_t ranges = s->threads * RANGES_PER_THREAD;
    const int64_t unit = (total + ranges - 1) / ranges;
    return unit < MIN_RANGE_TOKENS ? MIN_RANGE_TOKENS : unit;
}

/* Ranges of a sequence of len tokens: a sequence no longer than a range is one. */
static inline int64_t attention_seq_ranges(int64_t len, int64_t unit) {
    return len > unit ? (len + unit - 1) / unit : 1;
}

/* Floats of scratch rope_attention_ needs: a slot per range of a split sequence, then one
 * completion counter per sequence. With attention_parts > 1, parts slots a sequence; else at
 * most batch + threads * RANGES_PER_THREAD slots in all (a sequence's ranges are at most its
 * share of the step's ranges, rounded up). */
static inline size_t attention_scratch_floats(const Shape *s) {
    const int64_t parts = attention_parts(s);
    const int64_t slots = parts > 1 ? s->batch * parts : s->batch + s->threads * RANGES_PER_THREAD;
    return (size_t)slots * attention_part_floats(s) + (size_t)s->batch;
}

/* Whether row b continues row b - 1's sequence: its context holds the previous row's new
 * token (a speculative step's drafts are consecutive positions of one sequence, each a decode
 * row of its own length). A block being written belongs to one request, so rows of different
 * sequences never match. */
static inline int row_continues(int64_t b, const int64_t *positions, const int64_t *slots,
                                const int32_t *tables, const int32_t *seq_lens,
                                const Shape *s) {
    const int64_t p = positions[b - 1];
    if (slots[b - 1] < 0 || p >= seq_lens[b]) return 0;
    const int64_t block = tables[b * s->table_stride + p / s->block_size];
    return block * s->block_size + p % s->block_size == slots[b - 1];
}

/* Whether some row attends over the previous row's new token (row_continues). */
static inline int rows_share_sequence(const int64_t *positions, const int64_t *slots,
                                      const int32_t *tables, const int32_t *seq_lens,
                                      const Shape *s) {
    for (int64_t b = 1; b < s->batch; b++)
        if (row_continues(b, positions, slots, tables, seq_lens, s)) return 1;
    return 0;
}

/* Rotate-half rotary of one head_dim-wide slice x into dst (dst == x: in place). */
static inline void rotate_half(const float *x, float *dst, const float *c, const float *sn,
                               int64_t d) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < half; j++) {
        float x1 = x[j], x2 = x[j + half];
        dst[j] = x1 * c[j] - x2 * sn[j];
        dst[j + half] = x2 * c[j + half] + x1 * sn[j + half];
    }
}

/* The ranges' partial results of one sequence into out [heads, head_dim]: each range's sums
 * rescaled to the largest max (online softmax's merge), then divided by the total. An empty
 * range (max -FLT_MAX, sum 0) weighs nothing. */
static void merge_parts(const float *parts_base, int64_t parts, int64_t stride, int64_t heads,
                        int64_t d, float *out) {
    for (int64_t h = 0; h < heads; h++) {
        float top = -FLT_MAX;
        for (int64_t p = 0; p < parts; p++) {
            float m = parts_base[p * stride + 2 * heads * d + h];
            top = m > top ? m : top;
        }
        float total = 0.0f, *o = out + h * d;
        for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
        for (int64_t p = 0; p < parts; p++) {
            const float *base = parts_base + p * stride;
            float m = base[2 * heads * d + h], l = base[2 * heads * d + heads + h];
            if (l == 0.0f) continue;
            float w = expf(m - top);
            total += w * l;
            const float *po = base + heads * d + h * d;
            for (int64_t j = 0; j < d; j++) o[j] += w * po[j];
        }
        float inv = 1.0f / total;
        for (int64_t j = 0; j < d; j++) o[j] *= inv;
    }
}

#endif
