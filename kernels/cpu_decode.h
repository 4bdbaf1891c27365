/* The interface of cpu_decode.c, the library kernels/cpu_native.py builds and calls through
 * ctypes: the layouts the Python side fills in (cpu_native.py LAYER_FIELDS and SHAPE_FIELDS,
 * in this order) and the exported functions, for T = bfloat16 (_bf16, as uint16_t) and
 * float32 (_f32). cpu_quant.c's forward takes the same Shape. */
#ifndef CPU_DECODE_H
#define CPU_DECODE_H

#include <stdint.h>

/* Per-layer pointers, in this order (see cpu_native.py LAYER_FIELDS). */
enum { P_LN1, P_WQKV, P_BQKV, P_WO, P_LN2, P_WGU, P_WDOWN, P_KCACHE, P_VCACHE, P_COUNT };

/* Shapes, in this order (see cpu_native.py SHAPE_FIELDS). */
typedef struct {
    int64_t batch, layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    int64_t block_size, table_stride, threads;
} Shape;

/* The whole decode forward (cpu_decode_forward.inc.c): `shape` a Shape, `layer_ptrs` P_COUNT
 * pointers a layer; hidden [batch, hidden] holds the token embeddings on entry, logits
 * [batch, vocab] receive the LM head's output. `lora` (a descriptor, cpu_lora.h) and
 * `lora_slots` (each row's adapter slot, -1: the base model) add the adapter rows' low-rank
 * updates after each projection; NULL: none. Returns 0, or -1 if out of memory. */
int decode_forward_bf16(const int64_t *shape, const int64_t *layer_ptrs,
                        const uint16_t *final_norm, const uint16_t *lm_head,
                        const float *cos_table, const float *sin_table, const int64_t *positions,
                        const int64_t *slots, const int32_t *tables, const int32_t *seq_lens,
                        float eps, float scale, float *hidden, float *logits,
                        const int64_t *lora, const int32_t *lora_slots);
int decode_forward_f32(const int64_t *shape, const int64_t *layer_ptrs, const float *final_norm,
                       const float *lm_head, const float *cos_table, const float *sin_table,
                       const int64_t *positions, const int64_t *slots, const int32_t *tables,
                       const int32_t *seq_lens, float eps, float scale, float *hidden,
                       float *logits, const int64_t *lora, const int32_t *lora_slots);

/* The bf16 forward over tile-packed weights (cpu_decode_tiles.inc.c): the arguments of
 * decode_forward_bf16, every product's weight tile-packed (appliance.cpu.tile_weights), its
 * products on AMX tiles or in AVX-512-BF16 vectors, as the build targets: tiles_compiled() is
 * 1 (AMX), 2 (AVX-512-BF16) or 0 (neither: never call it). AMX needs amx_request_tiles() to
 * have returned 0 (Linux granted the tile state) first. */
int decode_forward_tiles_bf16(const int64_t *shape, const int64_t *layer_ptrs,
                              const uint16_t *final_norm, const uint16_t *lm_head,
                              const float *cos_table, const float *sin_table,
                              const int64_t *positions, const int64_t *slots,
                              const int32_t *tables, const int32_t *seq_lens, float eps,
                              float scale, float *hidden, float *logits, const int64_t *lora,
                              const int32_t *lora_slots);
int tiles_compiled(void);
int amx_request_tiles(void);

/* Decode attention alone, for the torch path: q/out [batch, heads, head_dim] in T, or float32
 * queries and output over a T cache (_f32q). Returns 0, or -1 if out of memory. */
int paged_decode_attention_bf16(const int64_t *shape, const uint16_t *q, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *tables,
                                const int32_t *seq_lens, float scale, uint16_t *out);
int paged_decode_attention_f32(const int64_t *shape, const float *q, const float *k_cache,
                               const float *v_cache, const int32_t *tables,
                               const int32_t *seq_lens, float scale, float *out);
int paged_decode_attention_f32q_bf16(const int64_t *shape, const float *q,
                                     const uint16_t *k_cache, const uint16_t *v_cache,
                                     const int32_t *tables, const int32_t *seq_lens, float scale,
                                     float *out);
int paged_decode_attention_f32q_f32(const int64_t *shape, const float *q, const float *k_cache,
                                    const float *v_cache, const int32_t *tables,
                                    const int32_t *seq_lens, float scale, float *out);

/* A prefill chunk's causal attention over its one sequence's paged bf16 cache
 * (cpu_prefill_attention.inc.c): q/out [n, heads, head_dim], the queries at positions start ..
 * start+n-1, `table` the sequence's blocks. Where prefill_attention_compiled() is 1
 * (AVX-512-BF16). Returns 0, -1 if out of memory, -2 for a head size it does not take. */
int prefill_attention_bf16(const int64_t *shape, const uint16_t *q, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int32_t *table, int64_t start,
                           int64_t n, float scale, uint16_t *out);
int prefill_attention_compiled(void);

/* Element-wise steps of the torch forward (cpu_decode_ops.inc.c). */
void add_rms_norm_bf16(uint16_t *x, const uint16_t *add, const uint16_t *weight, uint16_t *out,
                       int64_t rows, int64_t hidden, float eps, int64_t threads);
void add_rms_norm_f32(float *x, const float *add, const float *weight, float *out, int64_t rows,
                      int64_t hidden, float eps, int64_t threads);
void rotary_bf16(uint16_t *x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim,
                 const float *cos_table, const float *sin_table, const int64_t *positions,
                 int64_t threads);
void rotary_f32(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim,
                const float *cos_table, const float *sin_table, const int64_t *positions,
                int64_t threads);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                   int64_t threads);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int64_t threads);

#endif
