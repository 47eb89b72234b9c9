/* Int8-weight linear layer on the CPU (AVX2): fp32 in, fp32 out.
 *
 *     y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]  (+ bias[n])
 *     x: [M, K] fp32 (row stride ldx), w: [N, K] int8, scale/bias: [N] fp32,
 *     y: [M, N] fp32 (row stride ldy)
 *
 * Decode is bound by reading weights, so the weights are read as one byte each. Widening
 * every weight to fp32 (cvtepi8_epi32 + cvtepi32_ps + fma: 3 uops per 8 weights) was
 * compute-bound at about half the memory bandwidth on this CPU, so instead each row of x
 * is first rounded to int16 with one scale per row (x_q = round(x * 32767 / max|x|): a
 * relative error of at most 1.5e-5 of the row's largest value, far below the int8 weight
 * error) and the products are integer: cvtepi8_epi16 + madd_epi16 + add_epi32, 3 uops per
 * 16 weights. int32 sums are moved to fp32 every KCHUNK columns, so they cannot overflow
 * (KCHUNK / 8 * 127 * 32767 < 2^31). Four output channels are computed together (their
 * sums are independent chains and every x load is reused four times), for MT rows of x
 * per pass over a weight block. Output channels are split across the OpenMP runtime torch
 * already loaded (same soname, same thread pool). Needs N % 4 == 0 and K % 16 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MT 2        /* rows of x per pass over a weight block (registers: 2 x 4 sums) */
#define KCHUNK 2048 /* columns summed in int32 before moving to fp32 */

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i widen16(const int8_t *p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

/* x [M, K] fp32 -> xq [M, K] int16 and xs [M] (x ~= xq * xs) */
static void quantize_rows(const float *x, int64_t ldx, int16_t *xq, float *xs, int64_t M,
                          int64_t K) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * ldx;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(row[k]));
        const float s = amax > 0.0f ? amax / 32767.0f : 1.0f;
        const float inv = 1.0f / s;
        xs[m] = s;
        for (int64_t k = 0; k < K; k++) xq[m * K + k] = (int16_t)lrintf(row[k] * inv);
    }
}

int int8_linear_f32(const float *x, int64_t ldx, const int8_t *w, const float *scale,
                    const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                    int64_t nthreads) {
    int16_t *xq = aligned_alloc(32, ((M * K * sizeof(int16_t) + 31) / 32) * 32);
    float *xs = malloc(M * sizeof(float));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return 1;
    }
    quantize_rows(x, ldx, xq, xs, M, K);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n += 4) {
        const int8_t *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = (M - m0) < MT ? (int)(M - m0) : MT;
            __m256 fsum[MT][4];
            for (int i = 0; i < MT; i++)
                for (int j = 0; j < 4; j++) fsum[i][j] = _mm256_setzero_ps();
            for (int64_t k0 = 0; k0 < K; k0 += KCHUNK) {
                const int64_t k1 = (k0 + KCHUNK) < K ? (k0 + KCHUNK) : K;
                __m256i acc[MT][4];
                for (int i = 0; i < MT; i++)
                    for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
                for (int64_t k = k0; k < k1; k += 16) {
                    const __m256i a = widen16(w0 + k), b = widen16(w1 + k);
                    const __m256i c = widen16(w2 + k), d = widen16(w3 + k);
                    for (int i = 0; i < mt; i++) {
                        const __m256i xv =
                            _mm256_loadu_si256((const __m256i *)(xq + (m0 + i) * K + k));
                        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(xv, a));
                        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(xv, b));
                        acc[i][2] = _mm256_add_epi32(acc[i][2], _mm256_madd_epi16(xv, c));
                        acc[i][3] = _mm256_add_epi32(acc[i][3], _mm256_madd_epi16(xv, d));
                    }
                }
                for (int i = 0; i < mt; i++)
                    for (int j = 0; j < 4; j++)
                        fsum[i][j] = _mm256_add_ps(fsum[i][j], _mm256_cvtepi32_ps(acc[i][j]));
            }
            for (int i = 0; i < mt; i++) {
                float *out = y + (m0 + i) * ldy + n;
                const float s = xs[m0 + i];
                for (int j = 0; j < 4; j++)
                    out[j] = hsum_ps(fsum[i][j]) * s * scale[n + j] + (bias ? bias[n + j] : 0.0f);
            }
        }
    }
    free(xq);
    free(xs);
    return 0;
}

/* out[n, k] = w[n, k] * scale[n]: the fp32 weight, for batches large enough that a
 * blocked sgemm beats the integer path. */
void int8_dequant_f32(const int8_t *w, const float *scale, float *out, int64_t N, int64_t K,
                      int64_t nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n++) {
        const __m256 s = _mm256_set1_ps(scale[n]);
        for (int64_t k = 0; k < K; k += 8) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(w + n * K + k));
            _mm256_storeu_ps(out + n * K + k,
                             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s));
        }
    }
}
