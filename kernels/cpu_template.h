/* How the kernels are written once for both weight dtypes: the templates (cpu_*.inc.c) are
 * real C, included once per dtype with two parameters defined before the #include:
 *
 *     #define SUFFIX bf16
 *     #define T uint16_t
 *     #include "cpu_decode_steps.inc.c"   (defines attend_heads_bf16, ...; #undefs both)
 *
 * SUFFIX names the dtype (bf16: bfloat16 as uint16_t, f32: float); T is its storage type. A
 * template names its functions FN(name) (name_bf16 ...), converts with LOAD / STORE (one value)
 * and LOADV / ROUNDV / STOREV (VW values), the helpers of cpu_decode_simd.h for SUFFIX, and
 * #undefs SUFFIX and T at its end, ready for the next instantiation. Compiler errors and a
 * debugger's lines point into the template itself. */
#ifndef CPU_TEMPLATE_H
#define CPU_TEMPLATE_H

#define TPL_CAT_(a, b) a##b
#define TPL_CAT(a, b) TPL_CAT_(a, b)

/* name_SUFFIX: FN(matvec) is matvec_bf16 in the bf16 instantiation. */
#define FN(name) TPL_CAT(name##_, SUFFIX)

/* SUFFIX's conversions (cpu_decode_simd.h): bf16_load, f32_load, ... */
#define LOAD TPL_CAT(SUFFIX, _load)
#define STORE TPL_CAT(SUFFIX, _store)
#define LOADV TPL_CAT(SUFFIX, _loadv)
#define ROUNDV TPL_CAT(SUFFIX, _roundv)
#define STOREV TPL_CAT(SUFFIX, _storev)

#endif
