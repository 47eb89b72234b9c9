/* The small per-layer ops of a decoder step on the CPU, fp32: RMSNorm (optionally fused
 * with the residual add before it), RoPE in place, and SiLU(gate) * up.
 *
 * At batch 1 each of these touches a few KB, and torch spends 10-40 us per call in
 * dispatch and in the ops its CPU rms_norm is decomposed into (pow, mean, add, rsqrt, mul,
 * casts): about 5 ms of a 17 ms int8 decode step for the default model's 30 layers. One
 * C call does each in 1-5 us. Rows are split across the OpenMP runtime torch loaded, and
 * only where there are enough of them to pay for waking the threads (prefill chunks).
 * Semantics: exactly worker/models/llama.py's torch path (tests/test_layer_ops.py).
 */
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
