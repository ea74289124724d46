/* CPU decode kernels: attention over paged KV (one query token per sequence, every query head of a
 * GQA group at once, the K/V pages read in place, no gather copy, softmax online), and a whole
 * decoder layer for decode tokens around it (`tandem_decode_layer`, at the end), float32 or with
 * bfloat16 weights and KV (`bf16`: widened to float32 in registers, every value rounded to bf16 where
 * HF's bfloat16 model rounds it, so the two compute the same numbers up to the order of sums).
 * Built and loaded at run time by kernels/attention/cpu_native.py (see its docstring); threads are
 * the caller's OpenMP team (torch's, whose libgomp the process has already loaded).
 *
 * Layouts (row-major):
 *   q          [B, H, D]  rows q_row_stride floats apart, heads D apart
 *   k, v       [num_pages, page_size, KVH, D]
 *   page_table [B, *]     rows pt_stride apart; position p of sequence b is in page
 *                         page_table[b][p / page_size] at slot p % page_size
 *   seq_lens   [B]        positions [0, seq_lens[b]) are attended (at least 1)
 *   out        [B, H, D]  contiguous
 * Query head h reads KV head h / (H / KVH).
 */
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEADS 128
#define MAX_HEAD_DIM 256
#define MAX_HEAD_FLOATS 32768 /* heads x head_dim of one work item: its accumulator, on the stack */
#define BLOCK 32

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

int tandem_max_heads(void) { return MAX_HEADS; }
int tandem_max_head_dim(void) { return MAX_HEAD_DIM; }
int tandem_max_head_floats(void) { return MAX_HEAD_FLOATS; }

/* Row `index` (in elements) of a K or V cache as float32: in place, or (bf16) widened into `tmp`. */
static inline const float *kv_row(const void *cache, int64_t index, int64_t D, int bf16, float *tmp) {
    if (!bf16) return (const float *)cache + index;
    const uint16_t *row = (const uint16_t *)cache + index;
#pragma omp simd
    for (int64_t d = 0; d < D; d++) tmp[d] = bf16_to_f32(row[d]);
    return tmp;
}

/* Query heads [kh0 * group, kh1 * group) of sequence b over its positions [0, len): the K/V heads
 * [kh0, kh1) of each slot lie side by side, so a block's rows are read front to back, once. K/V
 * float32, or bfloat16 (`bf16`: the output rounded to bf16, as HF's bf16 attention returns it). */
static inline __attribute__((always_inline)) void attend_impl(
    const float *q, const void *k, const void *v, const int64_t *pages, int64_t len, float *out, int64_t kh0,
    int64_t kh1, int64_t group, int64_t D, int64_t row_stride, int64_t page_size, float scale, int bf16) {
    const int64_t h0 = kh0 * group, num = (kh1 - kh0) * group; /* query heads [h0, h0 + num) */
    float acc[MAX_HEAD_FLOATS];
    float m[MAX_HEADS], l[MAX_HEADS], s[MAX_HEADS][BLOCK], tmp[MAX_HEAD_DIM];
    int64_t slot[BLOCK];
    for (int64_t h = 0; h < num; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * num * D);
    for (int64_t p0 = 0; p0 < len; p0 += BLOCK) {
        const int64_t n = len - p0 < BLOCK ? len - p0 : BLOCK;
        for (int64_t j = 0; j < n; j++) slot[j] = pages[(p0 + j) / page_size] * page_size + (p0 + j) % page_size;
        for (int64_t j = 0; j < n; j++) {
            for (int64_t kh = kh0; kh < kh1; kh++) {
                const float *kr = kv_row(k, slot[j] * row_stride + kh * D, D, bf16, tmp);
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = (kh - kh0) * group + g;
                    const float *qr = q + (h0 + h) * D;
                    s[h][j] = dot_fixed(qr, kr, D) * scale;
                }
            }
        }
        for (int64_t h = 0; h < num; h++) {
            float block_max = s[h][0];
            for (int64_t j = 1; j < n; j++) block_max = s[h][j] > block_max ? s[h][j] : block_max;
            const float new_max = block_max > m[h] ? block_max : m[h];
            const float keep = m[h] == -INFINITY ? 0.0f : exp_nonpositive(m[h] - new_max);
#pragma omp simd
            for (int64_t j = 0; j < n; j++) s[h][j] = exp_nonpositive(s[h][j] - new_max);
            l[h] = l[h] * keep + sum_fixed(s[h], n);
            m[h] = new_max;
            if (keep != 1.0f) {
                float *a = acc + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] *= keep;
            }
        }
        for (int64_t j = 0; j < n; j++) {
            for (int64_t kh = kh0; kh < kh1; kh++) {
                const float *vr = kv_row(v, slot[j] * row_stride + kh * D, D, bf16, tmp);
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = (kh - kh0) * group + g;
                    const float p = s[h][j];
                    float *a = acc + h * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] += p * vr[d];
                }
            }
        }
    }
    for (int64_t h = 0; h < num; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f; /* no positions: zeros */
        float *o = out + (h0 + h) * D;
        const float *a = acc + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] = bf16 ? rb(a[d] * inv) : a[d] * inv;
    }
}

static void attend(const float *q, const float *k, const float *v, const int64_t *pages, int64_t len, float *out,
                   int64_t kh0, int64_t kh1, int64_t group, int64_t D, int64_t row_stride, int64_t page_size,
                   float scale) {
    attend_impl(q, k, v, pages, len, out, kh0, kh1, group, D, row_stride, page_size, scale, 0);
}

static void attend_bf16(const float *q, const uint16_t *k, const uint16_t *v, const int64_t *pages, int64_t len,
                        float *out, int64_t kh0, int64_t kh1, int64_t group, int64_t D, int64_t row_stride,
                        int64_t page_size, float scale) {
    attend_impl(q, k, v, pages, len, out, kh0, kh1, group, D, row_stride, page_size, scale, 1);
}

void tandem_paged_decode_f32(const float *q, int64_t q_row_stride, const float *k, const float *v,
                             const int64_t *page_table, int64_t pt_stride, const int64_t *seq_lens,
                             float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t page_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    /* A work item is a sequence, all its heads (its pages read front to back once); split by K/V
     * head only when there are fewer sequences than threads. */
    const int64_t kv_per_item = batch >= omp_get_max_threads() ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / kv_per_item;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < batch * items_per_seq; item++) {
        const int64_t b = item / items_per_seq, kh0 = (item % items_per_seq) * kv_per_item;
        attend(q + b * q_row_stride, k, v, page_table + b * pt_stride, seq_lens[b], out + b * num_heads * head_dim,
               kh0, kh0 + kv_per_item, group, head_dim, num_kv_heads * head_dim, page_size, scale);
    }
}

/* ---- one decoder layer for decode tokens, one per sequence ------------------------------------ */

#if defined(__AVX2__) && defined(__FMA__)
/* The four lanes' sums of a0..a3 into out[0..3]. */
static inline void sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float *out) {
    const __m256 sum = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1)));
}

/* Sixteen bf16 weights w[0..15] as float32: the even ones (a shift into each 32-bit lane's top half)
 * and the odd ones (the lane with its low half cleared); the X they multiply is paired to match. */
static inline void load_w16(const uint16_t *w, __m256 *even, __m256 *odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_and_ps(_mm256_castsi256_ps(v), _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)));
}

/* *a += w[0..15] . (xe, xo): sixteen bf16 weights against one row of X's paired block. */
static inline void fma_w16(const uint16_t *w, __m256 xe, __m256 xo, __m256 *a) {
    __m256 even, odd;
    load_w16(w, &even, &odd);
    *a = _mm256_fmadd_ps(odd, xo, _mm256_fmadd_ps(even, xe, *a));
}

/* fma_w16 against two rows of X (into *a and *b), the weights loaded once. */
static inline void fma2_w16(const uint16_t *w, __m256 xe, __m256 xo, __m256 te, __m256 to, __m256 *a, __m256 *b) {
    __m256 even, odd;
    load_w16(w, &even, &odd);
    *a = _mm256_fmadd_ps(odd, xo, _mm256_fmadd_ps(even, xe, *a));
    *b = _mm256_fmadd_ps(odd, to, _mm256_fmadd_ps(even, te, *b));
}

/* *a += w[0..7] * x, *b += w[0..7] * t: eight float32 weights against two rows of X. */
static inline void fma2_w8(const float *w, __m256 x, __m256 t, __m256 *a, __m256 *b) {
    const __m256 wv = _mm256_loadu_ps(w);
    *a = _mm256_fmadd_ps(wv, x, *a);
    *b = _mm256_fmadd_ps(wv, t, *b);
}
#endif

#define M_BLOCK 32 /* rows of X a pass over the weight takes (their rows stay in L2 while it streams) */
#define PAIRED 16 /* a bf16 product's X is stored in blocks of 16: its 8 even elements, then its 8 odd ones */

/* Rows m < M of X (ldx apart) into `paired` [M, K], each block of 16 as load_w16 multiplies it (the
 * last K % 16 elements in place). On the team: call inside a parallel region, then read after. */
static void pair_rows(const float *x, int64_t ldx, float *paired, int64_t M, int64_t K) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *src = x + m * ldx;
        float *dst = paired + m * K;
        int64_t k = 0;
        for (; k + PAIRED <= K; k += PAIRED)
            for (int64_t j = 0; j < PAIRED / 2; j++) {
                dst[k + j] = src[k + 2 * j];
                dst[k + PAIRED / 2 + j] = src[k + 2 * j + 1];
            }
        for (; k < K; k++) dst[k] = src[k];
    }
}

static inline float load_w1(const void *w, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* Y[m, r] = W[r, :] . X[m, :] + bias[r] (bias may be NULL) for rows m < M of X and rows r < N of
 * row-major W [N, K], float32 or (bf16) bfloat16 against X in pair_rows' order; `accumulate`:
 * Y[m, r] += that instead. bf16 rounds as HF's bf16 model does: the product (with its bias) to bf16,
 * then the sum with Y. Split over the team by weight rows (call inside a parallel region): four
 * weight rows a pass against two rows of X at a time, so the weight streams from memory once per
 * M_BLOCK rows of X and every row of X after the first two finds those four weight rows in L1. A
 * row of Y is summed in the same order whatever M is and whichever rows share it (batch-invariant). */
static inline __attribute__((always_inline)) void matvec_impl(const void *w, const float *bias, const float *x,
                                                             int64_t ldx, float *y, int64_t ldy, int64_t M,
                                                             int64_t N, int64_t K, int accumulate, int bf16) {
    for (int64_t m0 = 0; m0 < M; m0 += M_BLOCK)
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < N; r += 4) {
        const int64_t n = N - r < 4 ? N - r : 4, m1 = M - m0 < M_BLOCK ? M : m0 + M_BLOCK;
        for (int64_t m = m0; m < m1; m += 2) {
            const int64_t pair = m1 - m < 2 ? 1 : 2;
            const float *x0 = x + m * ldx, *x1 = x0 + (pair - 1) * ldx;
            float dot[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            int64_t k0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
            if (n == 4 && bf16) { /* 16 weights of each row a step, as even and odd halves */
                const uint16_t *w0 = (const uint16_t *)w + r * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                for (; pair == 1 && k0 + PAIRED <= K; k0 += PAIRED) { /* one row of X, summed as two are */
                    const __m256 ue = _mm256_loadu_ps(x0 + k0), uo = _mm256_loadu_ps(x0 + k0 + 8);
                    _mm_prefetch((const char *)(w0 + 4 * K + 4 * k0), _MM_HINT_T0); /* the next 4 rows */
                    _mm_prefetch((const char *)(w0 + 4 * K + 4 * k0 + 32), _MM_HINT_T0);
                    fma_w16(w0 + k0, ue, uo, &a0);
                    fma_w16(w1 + k0, ue, uo, &a1);
                    fma_w16(w2 + k0, ue, uo, &a2);
                    fma_w16(w3 + k0, ue, uo, &a3);
                }
                for (; k0 + PAIRED <= K; k0 += PAIRED) {
                    const __m256 ue = _mm256_loadu_ps(x0 + k0), uo = _mm256_loadu_ps(x0 + k0 + 8);
                    const __m256 te = _mm256_loadu_ps(x1 + k0), to = _mm256_loadu_ps(x1 + k0 + 8);
                    fma2_w16(w0 + k0, ue, uo, te, to, &a0, &b0);
                    fma2_w16(w1 + k0, ue, uo, te, to, &a1, &b1);
                    fma2_w16(w2 + k0, ue, uo, te, to, &a2, &b2);
                    fma2_w16(w3 + k0, ue, uo, te, to, &a3, &b3);
                }
                sum4(a0, a1, a2, a3, dot[0]);
                sum4(b0, b1, b2, b3, dot[1]);
            } else if (n == 4) { /* float32: 8 weights of each row a step */
                const float *w0 = (const float *)w + r * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                for (; pair == 1 && k0 + 8 <= K; k0 += 8) {
                    const __m256 u = _mm256_loadu_ps(x0 + k0);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k0), u, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k0), u, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k0), u, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k0), u, a3);
                }
                for (; k0 + 8 <= K; k0 += 8) {
                    const __m256 u = _mm256_loadu_ps(x0 + k0), t = _mm256_loadu_ps(x1 + k0);
                    fma2_w8(w0 + k0, u, t, &a0, &b0);
                    fma2_w8(w1 + k0, u, t, &a1, &b1);
                    fma2_w8(w2 + k0, u, t, &a2, &b2);
                    fma2_w8(w3 + k0, u, t, &a3, &b3);
                }
                sum4(a0, a1, a2, a3, dot[0]);
                sum4(b0, b1, b2, b3, dot[1]);
            }
#endif
            for (int64_t p = 0; p < pair; p++) {
                const float *xm = p ? x1 : x0;
                float *ym = y + (m + p) * ldy + r;
                for (int64_t i = 0; i < n; i++) {
                    float acc = 0.0f;
                    for (int64_t k = (n == 4 ? k0 : 0); k < K; k++) {
                        /* bf16 without the vector loop: X's blocks of 16 are paired, undo it */
                        const int64_t j = bf16 && k0 == 0 && k < K - K % PAIRED
                                              ? k - k % PAIRED + (k % 2) * (PAIRED / 2) + (k % PAIRED) / 2
                                              : k;
                        acc += load_w1(w, (r + i) * K + k, bf16) * xm[j];
                    }
                    float v = dot[p][i] + acc + (bias ? bias[r + i] : 0.0f);
                    if (bf16) v = rb(v);
                    ym[i] = !accumulate ? v : bf16 ? rb(ym[i] + v) : ym[i] + v;
                }
            }
        }
    }
#pragma omp barrier
}

/* matvec_impl on the team, X first paired into `paired` (rows M x K floats) where the weights are bf16. */
static inline __attribute__((always_inline)) void matvec(const void *w, const float *bias, const float *x, int64_t ldx,
                                                         float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                                                         int accumulate, int bf16, float *paired) {
    if (bf16) {
        pair_rows(x, ldx, paired, M, K);
        matvec_impl(w, bias, paired, K, y, ldy, M, N, K, accumulate, 1);
    } else {
        matvec_impl(w, bias, x, ldx, y, ldy, M, N, K, accumulate, 0);
    }
}

/* out = x / rms(x) * weight (HF LlamaRMSNorm: float32; bf16 rounds the normalised x, then the product). */
static inline __attribute__((always_inline)) void rms_norm(const float *x, const float *weight, float *out, int64_t n,
                                                           float eps, int bf16) {
    const float sq = dot_fixed(x, x, n);
    const float inv = 1.0f / sqrtf(sq / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = bf16 ? rb(rb(x[i] * inv) * weight[i]) : x[i] * inv * weight[i];
}

/* HF rotate-half rotary of `heads` heads of size D in place; signed_sin's first half carries the
 * minus sign of rotate_half(x) = [-x2, x1]. bf16: each product and the sum rounded, as HF's. */
static inline __attribute__((always_inline)) void rotate(float *x, int64_t heads, int64_t D, const float *cos,
                                                         const float *signed_sin, int bf16) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *r = x + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float a = r[i], b = r[i + half];
            if (bf16) {
                r[i] = rb(rb(a * cos[i]) + rb(b * signed_sin[i]));
                r[i + half] = rb(rb(b * cos[i + half]) + rb(a * signed_sin[i + half]));
            } else {
                r[i] = a * cos[i] + b * signed_sin[i];
                r[i + half] = b * cos[i + half] + a * signed_sin[i + half];
            }
        }
    }
}

/* The K/V heads of one token into its cache slot: float32 rows, or bf16 rows (values already bf16's). */
static inline void store_kv(void *cache, int64_t slot, const float *t, int64_t n, int bf16) {
    if (!bf16) {
        memcpy((float *)cache + slot * n, t, sizeof(float) * n);
        return;
    }
    uint16_t *row = (uint16_t *)cache + slot * n;
    for (int64_t i = 0; i < n; i++) row[i] = f32_to_bf16(t[i]);
}

/* Scratch floats tandem_decode_layer needs for `rows` tokens. */
int64_t tandem_decode_layer_scratch(int64_t rows, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                                    int64_t head_dim, int64_t inter) {
    const int64_t q_dim = num_heads * head_dim, widest = hidden > q_dim ? (hidden > inter ? hidden : inter)
                                                                       : (q_dim > inter ? q_dim : inter);
    return rows * (hidden + (num_heads + 2 * num_kv_heads) * head_dim + q_dim + 3 * inter + widest);
}

static inline __attribute__((always_inline)) void decode_layer(
    int64_t rows, float *x, int64_t hidden, float eps, const float *in_norm, const void *qkv_w,
    const float *qkv_bias, const void *o_w, const float *o_bias, const float *post_norm, const void *gate_up_w,
    const void *down_w, int64_t inter, const float *cos, const float *signed_sin, void *k_cache, void *v_cache,
    const int64_t *page_table, int64_t pt_stride, const int64_t *seq_len, const int64_t *slot, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale, float *scratch, int bf16) {
    const int64_t D = head_dim, q_dim = num_heads * D, kv_dim = num_kv_heads * D, qkv_rows = q_dim + 2 * kv_dim;
    float *normed = scratch, *qkv = normed + rows * hidden, *attn = qkv + rows * qkv_rows;
    float *gate_up = attn + rows * q_dim, *act = gate_up + rows * 2 * inter, *paired = act + rows * inter;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) rms_norm(x + b * hidden, in_norm, normed + b * hidden, hidden, eps, bf16);
        matvec(qkv_w, qkv_bias, normed, hidden, qkv, qkv_rows, rows, qkv_rows, hidden, 0, bf16, paired);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) {
            float *t = qkv + b * qkv_rows;
            rotate(t, num_heads + num_kv_heads, D, cos + b * D, signed_sin + b * D, bf16);
            store_kv(k_cache, slot[b], t + q_dim, kv_dim, bf16);
            store_kv(v_cache, slot[b], t + q_dim + kv_dim, kv_dim, bf16);
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < rows; b++)
            for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                const float *q = qkv + b * qkv_rows;
                const int64_t *pages = page_table + b * pt_stride, group = num_heads / num_kv_heads;
                if (bf16)
                    attend_bf16(q, k_cache, v_cache, pages, seq_len[b], attn + b * q_dim, kh, kh + 1, group, D, kv_dim,
                                page_size, scale);
                else
                    attend(q, k_cache, v_cache, pages, seq_len[b], attn + b * q_dim, kh, kh + 1, group, D, kv_dim,
                           page_size, scale);
            }
        matvec(o_w, o_bias, attn, q_dim, x, hidden, rows, hidden, q_dim, 1, bf16, paired);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) rms_norm(x + b * hidden, post_norm, normed + b * hidden, hidden, eps, bf16);
        matvec(gate_up_w, NULL, normed, hidden, gate_up, 2 * inter, rows, 2 * inter, hidden, 0, bf16, paired);
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < rows; b++)
            for (int64_t i = 0; i < inter; i++) {
                const float g = gate_up[b * 2 * inter + i], up = gate_up[b * 2 * inter + inter + i];
                const float silu = g / (1.0f + expf(-g));
                act[b * inter + i] = bf16 ? rb(rb(silu) * up) : silu * up;
            }
        matvec(down_w, NULL, act, inter, x, hidden, rows, hidden, inter, 1, bf16, paired);
    }
}

/* x [rows, hidden] <- decoder layer(x), in place, for one new token of each of `rows` sequences:
 * row b's K/V written to slot slot[b], its attention over positions [0, seq_len[b]) of its pages
 * page_table[b] (rows pt_stride apart). cos, signed_sin [rows, D]. Matrices row-major as HF stores
 * them (qkv [(H + 2 KVH) D, hidden] with q, k, v stacked; gate_up [2 inter, hidden]), float32, or with
 * `bf16` bfloat16 like the K/V cache (x, norms, biases, cos and sin float32 always: under bf16 they
 * hold bf16 values); qkv_bias and o_bias may be NULL. Lengths and slots are read here, not by the
 * caller (no host sync). */
void tandem_decode_layer(int64_t rows, float *x, int64_t hidden, float eps, const float *in_norm, const void *qkv_w,
                         const float *qkv_bias, const void *o_w, const float *o_bias, const float *post_norm,
                         const void *gate_up_w, const void *down_w, int64_t inter, const float *cos,
                         const float *signed_sin, void *k_cache, void *v_cache, const int64_t *page_table,
                         int64_t pt_stride, const int64_t *seq_len, const int64_t *slot, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale, float *scratch,
                         int bf16) {
    if (bf16)
        decode_layer(rows, x, hidden, eps, in_norm, qkv_w, qkv_bias, o_w, o_bias, post_norm, gate_up_w, down_w, inter,
                     cos, signed_sin, k_cache, v_cache, page_table, pt_stride, seq_len, slot, num_heads, num_kv_heads,
                     head_dim, page_size, scale, scratch, 1);
    else
        decode_layer(rows, x, hidden, eps, in_norm, qkv_w, qkv_bias, o_w, o_bias, post_norm, gate_up_w, down_w, inter,
                     cos, signed_sin, k_cache, v_cache, page_table, pt_stride, seq_len, slot, num_heads, num_kv_heads,
                     head_dim, page_size, scale, scratch, 0);
}

/* y [M, N] = x [M, K] (rows ldx apart) @ W [N, K]^T + bias (may be NULL), W float32 or (bf16)
 * bfloat16 (each result then rounded to bf16 once, as torch's bf16 matmul and HF's bf16 lm_head give
 * theirs), on the caller's team. `scratch`: M x K floats (bf16; may be NULL for float32). */
void tandem_linear(int64_t M, const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t N,
                   int64_t K, int bf16, float *scratch) {
#pragma omp parallel
    {
        if (bf16)
            matvec(w, bias, x, ldx, y, N, M, N, K, 0, 1, scratch);
        else
            matvec(w, bias, x, ldx, y, N, M, N, K, 0, 0, scratch);
    }
}
