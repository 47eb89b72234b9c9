/* Decode attention over the paged KV cache on the CPU (AVX2 + FMA), fp32.
 *
 * One query token per sequence attends to its whole context, read in place from the
 * cache's blocks through the sequence's block table: no gathered copy of K/V, no padding to
 * the longest context of the batch, no length mask. (The torch path copies every decode
 * row's blocks into one padded tensor per layer and runs SDPA with a mask: in the mixed
 * workload that gather and the padded SDPA were a third of the forward.)
 *
 *     q:      [nd, Hq, D]          (row stride q_stride floats)
 *     k, v:   [num_slots, Hkv, D]  slot = block_table[t / bs] * bs + t % bs
 *     tables: [nd, max_blocks] int64; lens: [nd] int64 (context length, >= 1)
 *     out:    [nd, Hq, D]          (row stride out_stride floats)
 *
 * Query head h reads KV head h / (Hq / Hkv) (grouped-query attention, as in HF Llama): the
 * G query heads of one KV head are done together, so each K and V vector is read once per
 * KV head. Work is split over (sequence, KV head) pairs on the OpenMP runtime torch already
 * loaded. Softmax in the usual max-subtracted form. Needs D % 8 == 0 and G <= MAX_GROUP.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 16

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum_ps(acc);
}

/* q . k[j * ldk] for the 8 rows j = 0..7: 8 sums kept apart, then reduced together
 * (hadd tree) into one vector, instead of 8 horizontal sums. */
static inline __m256 dot8(const float *q, const float *k, int64_t ldk, int64_t d) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++)
            a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * ldk + i), a[j]);
    }
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* exp(x) for 8 floats (Cephes' range reduction and polynomial; relative error ~2e-7;
 * x below -87 gives 0, as a softmax wants). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

/* Returns 0, or 1 when a scratch buffer could not be allocated (the caller falls back). */
int paged_decode_attention_f32(const float *q, int64_t q_stride, const float *k,
                               const float *v, const int64_t *tables, int64_t max_blocks,
                               const int64_t *lens, float *out, int64_t out_stride,
                               int64_t nd, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                               float scale, int64_t nthreads) {
    const int64_t group = hq / hkv, ld = hkv * d; /* ld: from one slot's K to the next's */
    if (group > MAX_GROUP || d % 8 != 0) return 1;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t task = 0; task < nd * hkv; task++) {
        const int64_t i = task / hkv, h = task % hkv, len = lens[i];
        const int64_t *table = tables + i * max_blocks;
        const int64_t padded = (len + 7) / 8 * 8;
        float *scores = aligned_alloc(32, sizeof(float) * (size_t)(group * padded));
        if (!scores) {
            failed = 1;
            continue;
        }
        const float *qh = q + i * q_stride + h * group * d;
        /* scores[g, t] = scale * q_g . k_t, block by block (a block's slots are adjacent) */
        for (int64_t t0 = 0; t0 < len; t0 += bs) {
            const int64_t n = (len - t0) < bs ? (len - t0) : bs;
            const float *kb = k + (table[t0 / bs] * bs * hkv + h) * d;
            for (int64_t g = 0; g < group; g++) {
                float *row = scores + g * padded + t0;
                int64_t j = 0;
                for (; j + 8 <= n; j += 8)
                    _mm256_storeu_ps(row + j, _mm256_mul_ps(dot8(qh + g * d, kb + j * ld, ld, d),
                                                            _mm256_set1_ps(scale)));
                for (; j < n; j++) row[j] = dot(qh + g * d, kb + j * ld, d) * scale;
            }
        }
        /* softmax numerators in place; the padding past len is -inf, so exp gives 0 */
        float inv[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            float *row = scores + g * padded;
            for (int64_t t = len; t < padded; t++) row[t] = -INFINITY;
            __m256 mv = _mm256_set1_ps(-INFINITY);
            for (int64_t t = 0; t < padded; t += 8) mv = _mm256_max_ps(mv, _mm256_load_ps(row + t));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
            __m256 sum = _mm256_setzero_ps();
            for (int64_t t = 0; t < padded; t += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(row + t), mx));
                _mm256_store_ps(row + t, e);
                sum = _mm256_add_ps(sum, e);
            }
            inv[g] = 1.0f / hsum_ps(sum);
        }
        /* out_g = sum_t p[g, t] v_t / sum_t p[g, t], 64 columns at a time in registers */
        float *oh = out + i * out_stride + h * group * d;
        for (int64_t g = 0; g < group; g++) {
            const float *p = scores + g * padded;
            for (int64_t c0 = 0; c0 < d; c0 += 64) {
                const int nc = (int)((d - c0) < 64 ? (d - c0) / 8 : 8);
                __m256 acc[8];
                for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
                for (int64_t t0 = 0; t0 < len; t0 += bs) {
                    const int64_t n = (len - t0) < bs ? (len - t0) : bs;
                    const float *vb = v + (table[t0 / bs] * bs * hkv + h) * d + c0;
                    for (int64_t j = 0; j < n; j++) {
                        const __m256 w = _mm256_set1_ps(p[t0 + j]);
                        const float *vt = vb + j * ld;
                        if (nc == 8) {
                            for (int c = 0; c < 8; c++)
                                acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * c), acc[c]);
                        } else {
                            for (int c = 0; c < nc; c++)
                                acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * c), acc[c]);
                        }
                    }
                }
                const __m256 iv = _mm256_set1_ps(inv[g]);
                for (int c = 0; c < nc; c++)
                    _mm256_storeu_ps(oh + g * d + c0 + 8 * c, _mm256_mul_ps(acc[c], iv));
            }
        }
        free(scores);
    }
    return failed;
}
