/* CPU decode kernels, float32: attention over paged KV (one query token per sequence, every query
 * head of a GQA group at once, the K/V pages read in place, no gather copy, softmax online), and a
 * whole decoder layer for a few decode tokens around it (`tandem_decode_layer_f32`, at the end).
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

int tandem_max_heads(void) { return MAX_HEADS; }
int tandem_max_head_dim(void) { return MAX_HEAD_DIM; }
int tandem_max_head_floats(void) { return MAX_HEAD_FLOATS; }

/* Query heads [kh0 * group, kh1 * group) of sequence b over its positions [0, len): the K/V heads
 * [kh0, kh1) of each slot lie side by side, so a block's rows are read front to back, once. */
static void attend(const float *q, const float *k, const float *v, const int64_t *pages, int64_t len,
                   float *out, int64_t kh0, int64_t kh1, int64_t group, int64_t D, int64_t row_stride,
                   int64_t page_size, float scale) {
    const int64_t h0 = kh0 * group, num = (kh1 - kh0) * group; /* query heads [h0, h0 + num) */
    float acc[MAX_HEAD_FLOATS];
    float m[MAX_HEADS], l[MAX_HEADS], s[MAX_HEADS][BLOCK];
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
                const float *kr = k + slot[j] * row_stride + kh * D;
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = (kh - kh0) * group + g;
                    const float *qr = q + (h0 + h) * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qr[d] * kr[d];
                    s[h][j] = dot * scale;
                }
            }
        }
        for (int64_t h = 0; h < num; h++) {
            float block_max = s[h][0];
            for (int64_t j = 1; j < n; j++) block_max = s[h][j] > block_max ? s[h][j] : block_max;
            const float new_max = block_max > m[h] ? block_max : m[h];
            const float keep = m[h] == -INFINITY ? 0.0f : exp_nonpositive(m[h] - new_max);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                const float p = exp_nonpositive(s[h][j] - new_max);
                s[h][j] = p;
                sum += p;
            }
            l[h] = l[h] * keep + sum;
            m[h] = new_max;
            if (keep != 1.0f) {
                float *a = acc + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] *= keep;
            }
        }
        for (int64_t j = 0; j < n; j++) {
            for (int64_t kh = kh0; kh < kh1; kh++) {
                const float *vr = v + slot[j] * row_stride + kh * D;
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
        for (int64_t d = 0; d < D; d++) o[d] = a[d] * inv;
    }
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

/* ---- one decoder layer for a few decode tokens, one per sequence ------------------------------ */

/* Y[m, r] (+)= W[r, :] . X[m, :] for rows m < M of X and rows r < N of row-major W [N, K], split over
 * the team by weight rows (call inside a parallel region): four weight rows a pass, so each X row is
 * read once per four weight rows and the weight streams from memory once; for M > 1 the other rows
 * of X find those four weight rows in L1. */
static void matvec_rows(const float *w, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M, int64_t N,
                        int64_t K, int accumulate) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < N; r += 4) {
        const int64_t n = N - r < 4 ? N - r : 4;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * ldx;
            float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int64_t k0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
            if (n == 4) { /* four weight rows against one load of x, four accumulators in flight */
                const float *w0 = w + r * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (; k0 + 8 <= K; k0 += 8) {
                    const __m256 xv = _mm256_loadu_ps(xm + k0);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k0), xv, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k0), xv, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k0), xv, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k0), xv, a3);
                }
                const __m256 sum = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                _mm_storeu_ps(dot, _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1)));
            }
#endif
            for (int64_t i = 0; i < n; i++) {
                const float *wr = w + (r + i) * K;
                float acc = 0.0f;
                for (int64_t k = (n == 4 ? k0 : 0); k < K; k++) acc += wr[k] * xm[k];
                dot[i] += acc;
            }
            float *ym = y + m * ldy + r;
            for (int64_t i = 0; i < n; i++) ym[i] = accumulate ? ym[i] + dot[i] : dot[i];
        }
    }
}

/* out = x / rms(x) * weight (HF LlamaRMSNorm in float32). */
static void rms_norm(const float *x, const float *weight, float *out, int64_t n, float eps) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < n; i++) sq += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sq / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * weight[i];
}

/* HF rotate-half rotary of `heads` heads of size D in place; signed_sin's first half carries the
 * minus sign of rotate_half(x) = [-x2, x1]. */
static void rotate(float *x, int64_t heads, int64_t D, const float *cos, const float *signed_sin) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *r = x + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float a = r[i], b = r[i + half];
            r[i] = a * cos[i] + b * signed_sin[i];
            r[i + half] = b * cos[i + half] + a * signed_sin[i + half];
        }
    }
}

static void add_bias(float *t, const float *bias, int64_t n) {
    if (bias)
        for (int64_t i = 0; i < n; i++) t[i] += bias[i];
}

/* Scratch floats tandem_decode_layer_f32 needs for `rows` tokens. */
int64_t tandem_decode_layer_scratch(int64_t rows, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                                    int64_t head_dim, int64_t inter) {
    return rows * (hidden + (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim + 3 * inter);
}

/* x [rows, hidden] <- decoder layer(x), in place, for one new token of each of `rows` sequences:
 * row b's K/V written to slot slot[b], its attention over positions [0, seq_len[b]) of its pages
 * page_table[b] (rows pt_stride apart). cos, signed_sin [rows, D]. Weights row-major as HF stores
 * them (qkv [(H + 2 KVH) D, hidden] with q, k, v stacked; gate_up [2 inter, hidden]); qkv_bias and
 * o_bias may be NULL. Lengths and slots are read here, not by the caller (no host sync). */
void tandem_decode_layer_f32(int64_t rows, float *x, int64_t hidden, float eps, const float *in_norm,
                             const float *qkv_w, const float *qkv_bias, const float *o_w, const float *o_bias,
                             const float *post_norm, const float *gate_up_w, const float *down_w, int64_t inter,
                             const float *cos, const float *signed_sin, float *k_cache, float *v_cache,
                             const int64_t *page_table, int64_t pt_stride, const int64_t *seq_len, const int64_t *slot,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t page_size,
                             float scale, float *scratch) {
    const int64_t D = head_dim, q_dim = num_heads * D, kv_dim = num_kv_heads * D, qkv_rows = q_dim + 2 * kv_dim;
    float *normed = scratch, *qkv = normed + rows * hidden, *attn = qkv + rows * qkv_rows;
    float *gate_up = attn + rows * q_dim, *act = gate_up + rows * 2 * inter;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) rms_norm(x + b * hidden, in_norm, normed + b * hidden, hidden, eps);
        matvec_rows(qkv_w, normed, hidden, qkv, qkv_rows, rows, qkv_rows, hidden, 0);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) {
            float *t = qkv + b * qkv_rows;
            add_bias(t, qkv_bias, qkv_rows);
            rotate(t, num_heads + num_kv_heads, D, cos + b * D, signed_sin + b * D);
            memcpy(k_cache + slot[b] * kv_dim, t + q_dim, sizeof(float) * kv_dim);
            memcpy(v_cache + slot[b] * kv_dim, t + q_dim + kv_dim, sizeof(float) * kv_dim);
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < rows; b++)
            for (int64_t kh = 0; kh < num_kv_heads; kh++)
                attend(qkv + b * qkv_rows, k_cache, v_cache, page_table + b * pt_stride, seq_len[b], attn + b * q_dim,
                       kh, kh + 1, num_heads / num_kv_heads, D, kv_dim, page_size, scale);
        matvec_rows(o_w, attn, q_dim, x, hidden, rows, hidden, q_dim, 1);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) {
            float *xb = x + b * hidden;
            add_bias(xb, o_bias, hidden);
            rms_norm(xb, post_norm, normed + b * hidden, hidden, eps);
        }
        matvec_rows(gate_up_w, normed, hidden, gate_up, 2 * inter, rows, 2 * inter, hidden, 0);
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < rows; b++)
            for (int64_t i = 0; i < inter; i++) {
                const float g = gate_up[b * 2 * inter + i];
                act[b * inter + i] = g / (1.0f + expf(-g)) * gate_up[b * 2 * inter + inter + i];
            }
        matvec_rows(down_w, act, inter, x, hidden, rows, hidden, inter, 1);
    }
}
