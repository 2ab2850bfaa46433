/* The AVX2 one-row int4 loop alone (the vector instructions row1_256 runs per 64 bytes of codes: unpack, VPMADDUBSW,
   VPMADDWD, convert, scale, FMA), streaming a buffer of rows from DRAM with no scales, zeros or x preparation, beside
   a plain load loop over the same buffer, with the software prefetch at several distances. What it tells: how close
   the loop's own instructions let one core stream to the read floor, so that what the kernel loses beyond that is
   in its per-row and per-block work. Interleaved rounds, CPU time of the calling thread, medians.

       cc -O3 research/stream_int4_loop.c -o /tmp/stream && /tmp/stream 1 512   # huge pages, 512 MB */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define T256 __attribute__((target("avx2,fma,f16c")))
#define CH 32 /* 32-byte chunks a row: K = 2048 */
#define ROUNDS 15

int8_t q[CH * 64] __attribute__((aligned(64)));
float sx[CH * 8], sw[CH], out[1 << 20];

static double now_ns(void) {
    struct timespec a;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    return a.tv_sec * 1e9 + a.tv_nsec;
}

T256 static inline __m256i chunk_dot(__m256i v, __m256i q0, __m256i q1) {
    const __m256i mask = _mm256_set1_epi8(15);
    __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, q0), _mm256_maddubs_epi16(hi, q1)),
                             _mm256_set1_epi16(1));
}

T256 static float hsum(__m256 a) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

/* One row a pass, two FMA chains (even and odd chunks), the scale of a chunk pair broadcast once (g = 128). */
#define LOOP(NAME, PREFETCH)                                                                                  \
    T256 __attribute__((noipa)) void NAME(const uint8_t *codes, long rows) {                                  \
        for (long n = 0; n < rows; n++) {                                                                     \
            const uint8_t *w = codes + n * CH * 32;                                                            \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;                                                          \
            for (int c = 0; c < CH; c += 2) {                                                                  \
                PREFETCH;                                                                                      \
                __m256 s = _mm256_broadcast_ss(sw + (c >> 1));                                                 \
                __m256i d = chunk_dot(_mm256_loadu_si256((const void *)(w + c * 32)),                           \
                                      _mm256_loadu_si256((const void *)(q + c * 64)),                          \
                                      _mm256_loadu_si256((const void *)(q + c * 64 + 32)));                    \
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s, _mm256_loadu_ps(sx + c * 8)), a0); \
                d = chunk_dot(_mm256_loadu_si256((const void *)(w + c * 32 + 32)),                              \
                              _mm256_loadu_si256((const void *)(q + c * 64 + 64)),                             \
                              _mm256_loadu_si256((const void *)(q + c * 64 + 96)));                            \
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s, _mm256_loadu_ps(sx + c * 8 + 8)), a1); \
            }                                                                                                  \
            out[n & ((1 << 20) - 1)] = hsum(_mm256_add_ps(a0, a1));                                           \
        }                                                                                                      \
    }

LOOP(no_prefetch, (void)0)
LOOP(l1_2k, _mm_prefetch((const char *)(w + c * 32 + 2048), _MM_HINT_T0))
LOOP(l1_4k, _mm_prefetch((const char *)(w + c * 32 + 4096), _MM_HINT_T0))
LOOP(l2_16k, _mm_prefetch((const char *)(w + c * 32 + 16384), _MM_HINT_T1))

T256 __attribute__((noipa)) void load_only(const uint8_t *codes, long rows) {
    __m256i a = _mm256_setzero_si256(), b = a;
    for (long i = 0; i < rows * CH * 32; i += 64) {
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const void *)(codes + i)));
        b = _mm256_xor_si256(b, _mm256_loadu_si256((const void *)(codes + i + 32)));
    }
    out[0] = hsum(_mm256_castsi256_ps(_mm256_xor_si256(a, b)));
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const int huge = argc > 1 ? atoi(argv[1]) : 1;
    const size_t bytes = (size_t)(argc > 2 ? atoi(argv[2]) : 512) << 20;
    const long rows = (long)(bytes / (CH * 32));
    uint8_t *codes = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (codes == MAP_FAILED) return 1;
    if (huge) madvise(codes, bytes, MADV_HUGEPAGE);
    memset(codes, 0x37, bytes);
    for (int i = 0; i < CH * 64; i++) q[i] = (int8_t)(i % 200 - 100);
    for (int i = 0; i < CH * 8; i++) sx[i] = 1.f;
    for (int i = 0; i < CH; i++) sw[i] = 1.f;
    void (*f[])(const uint8_t *, long) = {load_only, no_prefetch, l1_2k, l1_4k, l2_16k};
    const char *name[] = {"load only", "loop, no prefetch", "loop, L1 +2 KB", "loop, L1 +4 KB", "loop, L2 +16 KB"};
    const int n = sizeof f / sizeof f[0];
    double t[8][ROUNDS];
    for (int r = 0; r < ROUNDS; r++)
        for (int v = 0; v < n; v++) {
            double a = now_ns();
            f[v](codes, rows);
            t[v][r] = now_ns() - a;
        }
    for (int v = 0; v < n; v++) {
        qsort(t[v], ROUNDS, sizeof(double), by_value);
        printf("%-20s %5.1f GB/s median, %5.1f best\n", name[v], bytes / t[v][ROUNDS / 2], bytes / t[v][0]);
    }
    return 0;
}
