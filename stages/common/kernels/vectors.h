/* Vector helpers of spa's native kernels (attention.c, sample.c): AVX2 and FMA, eight float32
 * lanes; float32 or bfloat16 in memory, float32 arithmetic. */
#ifndef SPA_VECTORS_H
#define SPA_VECTORS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The sum of x's eight lanes. */
static inline float sum8(__m256 x) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

/* exp(x) for x <= 0 (scores minus their maximum), as Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2,
 * exp(r) as 1 + r + r^2 p(r) with Cephes' degree-5 p, and 2^n put into the exponent bits. Relative
 * error about 2 float ulps; x below -87.3 (and -inf) gives 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    const __m256 r2 = _mm256_mul_ps(r, r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256 two_to_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
    return _mm256_and_ps(_mm256_mul_ps(p, two_to_n), keep);
}

/* Eight float32, or bfloat16 (bf16 = 1), elements from p as float32: a bfloat16 is a float32's upper
 * 16 bits. */
static inline __m256 load8(const char *p, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p);
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Element d of p as float32, as load8. */
static inline float element_at(const char *p, int d, int bf16) {
    if (!bf16) return ((const float *)p)[d];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[d] << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Eight float32 rounded to bfloat16, to nearest with ties to even (as PyTorch rounds; no NaN
 * reaches here). */
static inline __m128i rounded_to_bf16(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounding = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
    const __m256i upper = _mm256_srli_epi32(_mm256_add_epi32(bits, rounding), 16);
    /* 32 -> 16 bits within each 128-bit lane (exact: each is below 2^16), then the lanes' halves joined */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(upper, upper), 0x08));
}

#endif
