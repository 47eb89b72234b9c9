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
 *
 * Layout: the weight is packed once at load (quant.pack, in torch) as [N/4][K/16][4][16]:
 * the 16 columns of four output channels lie in one 64-byte line, so each thread reads one
 * contiguous stream. Read row by row ([N, K]), four rows of 576 bytes are four streams of 9
 * lines each, too short for the hardware prefetcher: 7-11 GB/s against 20-40 GB/s packed
 * (docs/benchmarks.md, "int8 kernel, packed weights"). Where AVX512-VNNI is there (built
 * with -march=native), vpdpwssd fuses the madd and the add.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MT 2        /* rows of x per pass over a weight block (registers: 2 x 4 sums) */
#define KCHUNK 2048 /* columns summed in int32 before moving to fp32 */
#define CH 16       /* columns per packed chunk: 4 channels x 16 = one 64-byte line */
#define XQ_STACK 8192 /* int16 x values kept on the stack (no malloc per decode call) */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT(acc, x, w) _mm256_dpwssd_epi32((acc), (x), (w))
#else
#define DOT(acc, x, w) _mm256_add_epi32((acc), _mm256_madd_epi16((x), (w)))
#endif

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
    int16_t stack_q[XQ_STACK];
    float stack_s[MT * 32];
    const int heap = M * K > XQ_STACK || M > MT * 32;
    int16_t *xq = heap ? aligned_alloc(32, ((M * K * sizeof(int16_t) + 31) / 32) * 32) : stack_q;
    float *xs = heap ? malloc(M * sizeof(float)) : stack_s;
    if (heap && (!xq || !xs)) {
        free(xq);
        free(xs);
        return 1;
    }
    quantize_rows(x, ldx, xq, xs, M, K);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n += 4) {
        const int8_t *wb = w + n * K; /* this group's packed chunks, contiguous */
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
                for (int64_t k = k0; k < k1; k += CH) {
                    const int8_t *c = wb + k * 4;
                    _mm_prefetch((const char *)(c + 512), _MM_HINT_T0);
                    const __m256i a = widen16(c), b = widen16(c + CH);
                    const __m256i e = widen16(c + 2 * CH), d = widen16(c + 3 * CH);
                    for (int i = 0; i < mt; i++) {
                        const __m256i xv =
                            _mm256_loadu_si256((const __m256i *)(xq + (m0 + i) * K + k));
                        acc[i][0] = DOT(acc[i][0], xv, a);
                        acc[i][1] = DOT(acc[i][1], xv, b);
                        acc[i][2] = DOT(acc[i][2], xv, e);
                        acc[i][3] = DOT(acc[i][3], xv, d);
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
    if (heap) {
        free(xq);
        free(xs);
    }
    return 0;
}

/* out[n, k] = w[n, k] * scale[n], row-major [N, K], from the packed weight: the fp32
 * weight, for batches large enough that a blocked sgemm beats the integer path. */
void int8_dequant_f32(const int8_t *w, const float *scale, float *out, int64_t N, int64_t K,
                      int64_t nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t n = 0; n < N; n += 4) {
        for (int64_t k = 0; k < K; k += CH) {
            const int8_t *c = w + n * K + k * 4;
            for (int j = 0; j < 4; j++) {
                const __m256 s = _mm256_set1_ps(scale[n + j]);
                float *o = out + (n + j) * K + k;
                for (int h = 0; h < CH; h += 8) {
                    const __m128i q = _mm_loadl_epi64((const __m128i *)(c + j * CH + h));
                    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                    _mm256_storeu_ps(o + h, _mm256_mul_ps(f, s));
                }
            }
        }
    }
}
