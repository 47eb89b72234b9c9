/* The small per-layer ops of a decoder step on the CPU, fp32: RMSNorm (optionally fused
 * with the residual add before it), RoPE in place, SiLU(gate) * up, and the Linear layers
 * for batches of fewer than 32 rows.
 *
 * At batch 1 each of these touches a few KB, and torch spends 10-40 us per call in
 * dispatch and in the ops its CPU rms_norm is decomposed into (pow, mean, add, rsqrt, mul,
 * casts): about 5 ms of a 17 ms int8 decode step for the default model's 30 layers. One
 * C call does each in 1-5 us. Rows are split across the OpenMP runtime torch loaded, and
 * only where there are enough of them to pay for waking the threads (prefill chunks).
 * Semantics: exactly worker/models/llama.py's torch path (tests/engine/test_layer_ops.py).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define PAR_ROWS 16 /* fewer rows than this: one thread (a fork/join costs ~5 us) */

/* sum = x + add (when add is given: the residual stream, written to sum_out), then
 * out = sum * rsqrt(mean(sum^2) + eps) * w.  x, add, sum_out, out: [M, K] (row strides
 * ldx, ldo; add and sum_out share ldx's layout: contiguous [M, K] rows). */
void rms_norm_f32(const float *x, int64_t ldx, const float *add, float *sum_out,
                  const float *w, float *out, int64_t ldo, int64_t M, int64_t K, float eps,
                  int64_t nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M >= PAR_ROWS && nthreads > 1)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *o = out + m * ldo;
        float ss = 0.0f;
        if (add) {
            const float *ar = add + m * K;
            float *sr = sum_out + m * K;
#pragma omp simd reduction(+ : ss)
            for (int64_t k = 0; k < K; k++) {
                const float v = xr[k] + ar[k];
                sr[k] = v;
                ss += v * v;
            }
            xr = sr;
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t k = 0; k < K; k++) ss += xr[k] * xr[k];
        }
        const float r = 1.0f / sqrtf(ss / (float)K + eps);
#pragma omp simd
        for (int64_t k = 0; k < K; k++) o[k] = xr[k] * r * w[k];
    }
}

/* HF Llama's half-split rotation, in place, for H heads of D values per token:
 *     x[:h] <- x[:h] * cos[:h] - x[h:] * sin[:h];  x[h:] <- x[h:] * cos[h:] + x[:h] * sin[h:]
 * x: [T, H, D] with row stride ldx (heads contiguous); cos, sin: [T, D] contiguous. */
void rope_f32(float *x, int64_t ldx, const float *cos, const float *sin, int64_t T, int64_t H,
              int64_t D, int64_t nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= PAR_ROWS && nthreads > 1)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < H; h++) {
            float *a = x + t * ldx + h * D, *b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float lo = a[i], hi = b[i];
                a[i] = lo * c[i] - hi * s[i];
                b[i] = hi * c[half + i] + lo * s[half + i];
            }
        }
    }
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]; gu: [M, 2I] (row stride ldg), out: [M, I]. */
void silu_mul_f32(const float *gu, int64_t ldg, float *out, int64_t M, int64_t I,
                  int64_t nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M >= PAR_ROWS && nthreads > 1)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * ldg, *u = g + I;
        float *o = out + m * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y = x @ w.T + bias for few rows of x (decode): x [M, K] (row stride ldx), w [N, K]
 * row-major (the nn.Linear weight as it is), y [M, N] (row stride ldy). Needs N % 4 == 0
 * and K % 8 == 0. Four output channels at a time (four weight rows streamed together, each
 * x load used four times), two rows of x per pass; output channels split across threads.
 * torch's sgemm reaches 5-14 GB/s of weights at these shapes on the 2-core VMs we measured;
 * this 16-26 GB/s at 1-4 rows (docs/benchmarks.md, "fp32 small-batch Linear"). */
void f32_linear(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n += 4) {
        const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            const int mt = (M - m0) < 2 ? 1 : 2;
            __m256 acc[2][4];
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 8) {
                const __m256 a = _mm256_loadu_ps(w0 + k), b = _mm256_loadu_ps(w1 + k);
                const __m256 c = _mm256_loadu_ps(w2 + k), d = _mm256_loadu_ps(w3 + k);
                for (int i = 0; i < mt; i++) {
                    const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * ldx + k);
                    acc[i][0] = _mm256_fmadd_ps(xv, a, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(xv, b, acc[i][1]);
                    acc[i][2] = _mm256_fmadd_ps(xv, c, acc[i][2]);
                    acc[i][3] = _mm256_fmadd_ps(xv, d, acc[i][3]);
                }
            }
            for (int i = 0; i < mt; i++)
                for (int j = 0; j < 4; j++)
                    y[(m0 + i) * ldy + n + j] = hsum_ps(acc[i][j]) + (bias ? bias[n + j] : 0.0f);
        }
    }
}
