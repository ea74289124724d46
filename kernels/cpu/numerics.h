/* What every CPU kernel shares: e^x, bfloat16 conversions, and sums in a fixed order.
 * Included by each kernel's source (the .c files beside it); all of it static inline. */
#ifndef TANDEM_CPU_NUMERICS_H
#define TANDEM_CPU_NUMERICS_H

#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* e^x for x <= 0 (a score minus the running max), float32 to ~2 ulp: 2^n * e^r, |r| <= ln2/2, with
 * the Cephes polynomial. Inline and branch-free, so loops over it vectorise. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* bfloat16 is the top half of a float32: widening is exact; narrowing rounds to nearest even (as
 * torch does; NaN stays NaN). `rb` is a float32 rounded to bf16's precision, kept as a float32. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float rb(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Sums in one fixed order whatever the instruction set the file is built for (AVX2's 8 lanes or
 * AVX-512's 16 would otherwise split a `simd reduction` differently, and the bits of every later value
 * with it): element i goes to partial sum i % LANES, each partial sum in index order (a vector of any
 * width runs them side by side, unchanged), then the partial sums pairwise in a fixed tree. */
#define LANES 16

static inline float lanes_total(float *part) {
    for (int half = LANES / 2; half > 0; half /= 2)
        for (int i = 0; i < half; i++) part[i] += part[i + half];
    return part[0];
}

/* sum of a[i] * b[i], i in [0, n) */
static inline float dot_fixed(const float *a, const float *b, int64_t n) {
    float part[LANES] = {0.0f};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
#pragma omp simd
        for (int j = 0; j < LANES; j++) part[j] += a[i + j] * b[i + j];
    }
    for (int j = 0; i + j < n; j++) part[j] += a[i + j] * b[i + j];
    return lanes_total(part);
}

/* sum of a[i], i in [0, n) */
static inline float sum_fixed(const float *a, int64_t n) {
    float part[LANES] = {0.0f};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
#pragma omp simd
        for (int j = 0; j < LANES; j++) part[j] += a[i + j];
    }
    for (int j = 0; i + j < n; j++) part[j] += a[i + j];
    return lanes_total(part);
}

#endif
