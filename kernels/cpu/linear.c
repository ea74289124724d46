/* A linear layer over a row-major float32 or bfloat16 weight (`tandem_linear`): bf16 matmuls on CPUs
 * without bf16 dot products (kernels/model/packed_linear.py). */
#include "matvec.h"

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
