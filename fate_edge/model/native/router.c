/* A MoE layer's softmax router on the CPU in one call: the gate's logits (rows x [M][H] against a float32 gate W
   [E][H]), the softmax over the E experts, the top k and, where the model asks, their weights renormalised.

   Why: torch takes five operators for it (linear, softmax, topk, and a sum and a division to renormalise), and in a
   decode step each starts cold, after a matmul streamed tens of MB through the caches: 44 us a layer on a Zen 5 at
   one thread for Qwen1.5-MoE's 60 x 2048 gate, where the arithmetic is a few microseconds.

   Bits: each logit is a float32 dot product summed in this kernel's own order (four accumulators of 8 lanes a row,
   added pairwise at the end), not torch's, so the weights may differ from torch's in their last bits; but a
   row's bits never depend on which other rows it is computed with, so a token is routed the same way alone, in a
   batch or in a prompt. The softmax is torch's order of operations (the max subtracted, exp, the sum, a division)
   in float32 with libm's expf. The top k are taken largest first; where the k-th and the next value are equal (or
   anything is NaN) the choice is torch.topk's business, so the call returns 1 and the caller routes with torch. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define T256 __attribute__((target("avx2,fma")))
#define ROWS 2       /* rows of x per pass over the gate: each gate row loaded once for two rows' dot products */
#define MAX_K 64     /* the most experts a row may pick */
#define MAX_E 4096   /* the most experts a gate may have */

enum { F32 = 0, BF16 = 1 };

int fe_router_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* Row m of x widened to float32 into ``out`` [H] (H a multiple of 8; bf16 to float32 is exact). */
T256 static void widen(const void *x, int dtype, int64_t m, int64_t H, float *out) {
    if (dtype == F32) {
        memcpy(out, (const float *)x + m * H, sizeof(float) * (size_t)H);
        return;
    }
    const uint16_t *src = (const uint16_t *)x + m * H;
    for (int64_t j = 0; j < H; j += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + j)));
        _mm256_storeu_ps(out + j, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
}

T256 static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* logits[r][e] for ``rows`` widened rows xs[r] (H a multiple of 8). Each row has four accumulators (a decode row's
   single chain of FMAs waited on their latency: 15 us for a 60 x 2048 gate), walked the same way whatever ``rows``
   is, so a row's sums do not depend on the rows beside it. */
T256 static void logits_block(const float *xs, int rows, const float *w, int E, int64_t H, float *logits) {
    for (int e = 0; e < E; e++) {
        const float *we = w + (int64_t)e * H;
        __m256 acc[ROWS][4];
        for (int r = 0; r < ROWS; r++)
            for (int a = 0; a < 4; a++) acc[r][a] = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 32 <= H; j += 32) {
            const __m256 w0 = _mm256_loadu_ps(we + j), w1 = _mm256_loadu_ps(we + j + 8);
            const __m256 w2 = _mm256_loadu_ps(we + j + 16), w3 = _mm256_loadu_ps(we + j + 24);
            for (int r = 0; r < rows; r++) {
                const float *x = xs + r * H + j;
                acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w1, acc[r][1]);
                acc[r][2] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w2, acc[r][2]);
                acc[r][3] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w3, acc[r][3]);
            }
        }
        for (; j < H; j += 8) {
            const __m256 wv = _mm256_loadu_ps(we + j);
            for (int r = 0; r < rows; r++) acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + r * H + j), wv, acc[r][0]);
        }
        for (int r = 0; r < rows; r++)
            logits[r * E + e] = hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
    }
}

/* One row's logits [E] → its k experts' weights and ids; 1 where a tie at the k-th place or a NaN leaves the choice
   to torch. */
static int pick(const float *logit, int E, int k, int renorm, float *out_w, int64_t *out_idx) {
    float p[MAX_E], m = -INFINITY;
    for (int e = 0; e < E; e++) {
        if (isnan(logit[e])) return 1;
        m = logit[e] > m ? logit[e] : m;
    }
    float sum = 0.f;
    for (int e = 0; e < E; e++) {
        p[e] = expf(logit[e] - m);
        sum += p[e];
    }
    for (int e = 0; e < E; e++) p[e] /= sum;
    /* the k + 1 largest, largest first (a tie keeps the lower id first) */
    float top[MAX_K + 1];
    int ids[MAX_K + 1], n = 0;
    const int want = k < E ? k + 1 : k;
    for (int e = 0; e < E; e++) {
        if (n == want && !(p[e] > top[n - 1])) continue;
        int at = n < want ? n++ : want - 1;
        while (at > 0 && p[e] > top[at - 1]) {
            top[at] = top[at - 1];
            ids[at] = ids[at - 1];
            at--;
        }
        top[at] = p[e];
        ids[at] = e;
    }
    for (int i = 1; i < n; i++)
        if (top[i] == top[i - 1]) return 1; /* equal values: torch.topk's order or choice, not ours */
    float total = 0.f;
    for (int i = 0; i < k; i++) total += top[i];
    for (int i = 0; i < k; i++) {
        out_w[i] = renorm ? top[i] / total : top[i];
        out_idx[i] = ids[i];
    }
    return 0;
}

/* Rows x [M][H] (``x_dtype``: 0 float32, 1 bf16) through the float32 gate w [E][H] → out_w [M][k] float32 and out_idx
   [M][k] int64. Returns 0, 1 where some row's choice is torch's (a tie or a NaN: nothing usable is written), -1 for
   shapes it does not take, -2 out of memory. */
T256 int fe_route_softmax(const void *x, int x_dtype, int64_t M, int64_t H, const float *w, int E, int k, int renorm,
                          float *out_w, int64_t *out_idx, int threads) {
    if (M <= 0 || H <= 0 || H % 8 || E <= 0 || E > MAX_E || k <= 0 || k > E || k > MAX_K) return -1;
    const int64_t blocks = (M + ROWS - 1) / ROWS;
    const int nt = threads > 1 && M >= 4 * ROWS ? threads : 1; /* a decode row: no team to wake */
    int status = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : status)
    {
        float *xs = malloc(sizeof(float) * (size_t)(ROWS * H + ROWS * E));
        if (!xs) status |= 2;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!xs) continue;
            float *logits = xs + ROWS * H;
            const int64_t m0 = b * ROWS;
            const int rows = M - m0 < ROWS ? (int)(M - m0) : ROWS;
            for (int r = 0; r < rows; r++) widen(x, x_dtype, m0 + r, H, xs + r * H);
            logits_block(xs, rows, w, E, H, logits);
            for (int r = 0; r < rows; r++)
                status |= pick(logits + r * E, E, k, renorm, out_w + (m0 + r) * k, out_idx + (m0 + r) * k);
        }
        free(xs);
    }
    return status & 2 ? -2 : status & 1;
}
