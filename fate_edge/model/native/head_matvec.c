/* Per-head matrix-vector products over bf16, fp16 or fp32 weights on the CPU, computed in fp32.

   Why: MLA's absorbed decode (model/mla.py, attend) multiplies each head's block of kv_b_proj by a
   vector from both sides at every token. torch runs those as batched bf16 GEMMs, which CPUs without AVX512-BF16
   emulate: DeepSeek-V2-Lite's 16 key blocks of 128 x 512 took 1.6 ms a layer on a 2-vCPU AVX2 EPYC (one thread),
   and widening them to fp32 first 0.65 ms (a 4 MB copy, then a GEMV over it). Here each weight is read once in its
   own dtype and widened in registers (a shift for bf16, F16C for fp16): the cost is the block's bytes.

   Head h's block is w + h * head_stride, its row r at + r * row_stride, its columns contiguous (element strides).
   For each of ``vectors`` vectors b (a batch's decode rows: the block is read from memory once for all of them):
   mode 0 (x W): out[b][h][c] = sum_r x[b][h][r] w_h[r][c], x [B][H][rows], out [B][H][cols];
   mode 1 (W x): out[b][h][r] = sum_c w_h[r][c] x[b][h][c], x [B][H][cols], out [B][H][rows].
   x and out are fp32, contiguous; cols a multiple of 8. A vector's arithmetic does not depend on the others. */
#include <immintrin.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

#define T256 __attribute__((target("avx2,fma,f16c")))
#define CHUNK 8 /* accumulators of mode 0: 64 columns at a time */

T256 static inline __m256 load8(const char *p, int dtype) {
    if (dtype == BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (dtype == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_loadu_ps((const float *)p);
}

T256 static inline float hsum(__m256 a) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

/* x W for one head: the block's rows weighted by x and summed, CHUNK x 8 columns at a time in registers; the
   chunk's rows (rows x 128 bytes in bf16) stay in L1 for the next vector. ``xs``/``os``: vector strides. */
T256 static void x_w(const float *x, int64_t xs, int vectors, const char *w, int dtype, size_t size, int64_t rs,
                     int rows, int cols, float *out, int64_t os) {
    for (int c0 = 0; c0 < cols; c0 += 8 * CHUNK) {
        const int nc = (cols - c0) / 8 < CHUNK ? (cols - c0) / 8 : CHUNK;
        for (int b = 0; b < vectors; b++) {
            const float *xb = x + (size_t)b * xs;
            __m256 acc[CHUNK];
            for (int c = 0; c < CHUNK; c++) acc[c] = _mm256_setzero_ps();
            for (int r = 0; r < rows; r++) {
                const __m256 xr = _mm256_set1_ps(xb[r]);
                const char *row = w + size * ((size_t)r * rs + c0);
                for (int c = 0; c < nc; c++) acc[c] = _mm256_fmadd_ps(load8(row + size * 8 * c, dtype), xr, acc[c]);
            }
            for (int c = 0; c < nc; c++) _mm256_storeu_ps(out + (size_t)b * os + c0 + 8 * c, acc[c]);
        }
    }
}

/* W x for one head: a dot product per row and vector, two accumulators; the row stays in L1 for the next vector. */
T256 static void w_x(const float *x, int64_t xs, int vectors, const char *w, int dtype, size_t size, int64_t rs,
                     int rows, int cols, float *out, int64_t os) {
    for (int r = 0; r < rows; r++) {
        const char *row = w + size * (size_t)r * rs;
        for (int b = 0; b < vectors; b++) {
            const float *xb = x + (size_t)b * xs;
            __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
            int c = 0;
            for (; c + 16 <= cols; c += 16) {
                s0 = _mm256_fmadd_ps(load8(row + size * c, dtype), _mm256_loadu_ps(xb + c), s0);
                s1 = _mm256_fmadd_ps(load8(row + size * (c + 8), dtype), _mm256_loadu_ps(xb + c + 8), s1);
            }
            if (c < cols) s0 = _mm256_fmadd_ps(load8(row + size * c, dtype), _mm256_loadu_ps(xb + c), s0);
            out[(size_t)b * os + r] = hsum(_mm256_add_ps(s0, s1));
        }
    }
}

/* 1 where this CPU runs the kernel (AVX2, FMA and F16C), else 0. */
int fe_head_matvec_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* Returns 0, or -1 for shapes it does not take (the caller uses torch). */
int fe_head_matvec(int mode, const float *x, int vectors, int heads, int rows, int cols, const void *w, int dtype,
                   int64_t head_stride, int64_t row_stride, float *out, int threads) {
    if ((mode != 0 && mode != 1) || vectors <= 0 || heads <= 0 || rows <= 0 || cols <= 0 || cols % 8) return -1;
    const size_t size = dtype == F32 ? 4 : 2;
    const int in = mode == 0 ? rows : cols, outs = mode == 0 ? cols : rows;
    const int64_t xs = (int64_t)heads * in, os = (int64_t)heads * outs; /* one vector's x and out, all heads */
    /* threads only where each gets enough weights to read: waking a team costs ~10 us */
    const int nt = threads > 1 && heads > 1 && (int64_t)heads * rows * cols >= (1 << 18) ? threads : 1;
    /* guided: the thread that arrives first takes more heads (a late worker, no wait); each head is one thread's */
#pragma omp parallel for schedule(guided) num_threads(nt) if (nt > 1)
    for (int h = 0; h < heads; h++) {
        const char *wh = (const char *)w + size * (size_t)h * head_stride;
        if (mode == 0)
            x_w(x + (size_t)h * in, xs, vectors, wh, dtype, size, row_stride, rows, cols, out + (size_t)h * outs, os);
        else
            w_x(x + (size_t)h * in, xs, vectors, wh, dtype, size, row_stride, rows, cols, out + (size_t)h * outs, os);
    }
    return 0;
}
