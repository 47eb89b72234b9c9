/* Applies xgrammar's packed token bitmask to fp32 logits in place, on the CPU.
 *
 * Bit t % 32 of word t / 32 of a row's mask is 1 when token t is allowed; a disallowed
 * token's logit becomes -inf. Words that allow everything are skipped (no memory touched),
 * words that allow nothing are written without being read, so a row costs at most one
 * write pass instead of the read + write of a generic select. Rows run in parallel on
 * the OpenMP runtime that torch already loaded (same soname, same thread pool).
 */
#include <math.h>
#include <stdint.h>

void apply_bitmask_f32(float *logits, int64_t logits_stride, const int32_t *bitmask,
                       int64_t mask_stride, int64_t rows, int64_t vocab) {
    const float neg = -INFINITY;
    const int64_t words = vocab / 32;
#pragma omp parallel for if (rows >= 4) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *row = logits + r * logits_stride;
        const uint32_t *m = (const uint32_t *)(bitmask + r * mask_stride);
        for (int64_t w = 0; w < words; w++) {
            uint32_t x = m[w];
            if (x == 0xFFFFFFFFu) continue;
            float *p = row + w * 32;
            if (x == 0) {
                for (int k = 0; k < 32; k++) p[k] = neg;
            } else {
                for (int k = 0; k < 32; k++)
                    if (!((x >> k) & 1u)) p[k] = neg;
            }
        }
        for (int64_t t = words * 32; t < vocab; t++)
            if (!((m[t >> 5] >> (t & 31)) & 1u)) row[t] = neg;
    }
}
