/* cpu.c — does this CPU have every instruction-set extension the kernel was compiled for?
 * The library is built with -march=native; on another CPU its SIMD code would die with SIGILL,
 * so Python asks here first. This function itself is compiled for the x86-64 baseline. */
#include <stdio.h>

#include "flashllm.h"

#if defined(__x86_64__) || defined(__i386__)
#define NEED(macro_on, name)                                                            \
    if (macro_on && !__builtin_cpu_supports(name)) {                                    \
        snprintf(missing, n, "%s", name);                                               \
        return FL_EUNSUPPORTED;                                                         \
    }

#if defined(__AVX512F__)
#define HAS_AVX512F 1
#else
#define HAS_AVX512F 0
#endif
#if defined(__AVX512BW__)
#define HAS_AVX512BW 1
#else
#define HAS_AVX512BW 0
#endif
#if defined(__AVX2__)
#define HAS_AVX2 1
#else
#define HAS_AVX2 0
#endif
#if defined(__FMA__)
#define HAS_FMA 1
#else
#define HAS_FMA 0
#endif
#if defined(__F16C__)
#define HAS_F16C 1
#else
#define HAS_F16C 0
#endif
#if defined(__AVX512VL__)
#define HAS_AVX512VL 1
#else
#define HAS_AVX512VL 0
#endif
#if defined(__AVX512VNNI__)
#define HAS_AVX512VNNI 1
#else
#define HAS_AVX512VNNI 0
#endif
#if defined(__AVXVNNI__)
#define HAS_AVXVNNI 1
#else
#define HAS_AVXVNNI 0
#endif

__attribute__((target("arch=x86-64"))) int32_t fl_cpu_check(char *missing, size_t n) {
    if (!missing || n == 0) return FL_EINVAL;
    missing[0] = '\0';
    __builtin_cpu_init();
    NEED(HAS_AVX2, "avx2")
    NEED(HAS_FMA, "fma")
    NEED(HAS_F16C, "f16c")
    NEED(HAS_AVX512F, "avx512f")
    NEED(HAS_AVX512BW, "avx512bw")
    NEED(HAS_AVX512VL, "avx512vl")
    NEED(HAS_AVX512VNNI, "avx512vnni")
    NEED(HAS_AVXVNNI, "avxvnni")
    return FL_OK;
}
#else
int32_t fl_cpu_check(char *missing, size_t n) {
    if (!missing || n == 0) return FL_EINVAL;
    missing[0] = '\0';
    return FL_OK;
}
#endif
