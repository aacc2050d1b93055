/* build_isa: which instruction sets this build of the kernels targets. */
#include "common.h"

/* What this build was compiled for (bits: 1 AVX2, 2 FMA, 4 AVX-512F, 8 AVX512-BF16 dot products,
 * 16 the AMX tile path): native.build_isa() reports it, the tests check it against the CPU and
 * against the build switch. */
int build_isa(void) {
    int bits = 0;
#if defined(__AVX2__)
    bits |= 1;
#endif
#if defined(__FMA__)
    bits |= 2;
#endif
#if defined(__AVX512F__)
    bits |= 4;
#endif
#if defined(__AVX512BF16__)
    bits |= 8;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    bits |= 16;
#endif
    return bits;
}
