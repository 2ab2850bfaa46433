/* The memory's read floor for one or more threads: the fastest a loop of plain vector loads (256 bytes an iteration
   in independent loads, XOR-folded so nothing is optimized away; AVX-512 where the CPU has it, else AVX2, as on
   AMD Zen 3) streams a 1 GB buffer on transparent huge pages, best of 7 passes per thread count. A decode token that
   reads N MB of weights takes at least N / this. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define T512 __attribute__((target("avx512f")))
#define T256 __attribute__((target("avx2")))

/* XOR of every 8-byte word of p[0, n) over this thread's share of the loop (the caller's parallel region). */
T512 static long fold_512(const char *p, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
#pragma omp for schedule(static)
    for (size_t i = 0; i < n; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 128));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 192));
    }
    return _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
}

T256 static long fold_256(const char *p, size_t n) {
    __m256i a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_si256();
#pragma omp for schedule(static)
    for (size_t i = 0; i < n; i += 256)
        for (int j = 0; j < 8; j++) a[j] = _mm256_xor_si256(a[j], _mm256_load_si256((const __m256i *)(p + i + 32 * j)));
    for (int j = 1; j < 8; j++) a[0] = _mm256_xor_si256(a[0], a[j]);
    return _mm256_extract_epi64(a[0], 0) ^ _mm256_extract_epi64(a[0], 1) ^ _mm256_extract_epi64(a[0], 2) ^
           _mm256_extract_epi64(a[0], 3);
}

int main(int argc, char **argv) {
    const size_t n = (size_t)1 << 30;
    const int max_threads = argc > 1 ? atoi(argv[1]) : 2;
    const int wide = __builtin_cpu_supports("avx512f");
    char *p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 1;
    madvise(p, n, MADV_HUGEPAGE);
    memset(p, 1, n);
    for (int th = 1; th <= max_threads; th++) {
        omp_set_num_threads(th);
        double best = 1e9;
        long sink = 0;
        for (int r = 0; r < 7; r++) {
            double t0 = omp_get_wtime();
            long all = 0;
#pragma omp parallel reduction(^ : all)
            all ^= wide ? fold_512(p, n) : fold_256(p, n);
            double t = omp_get_wtime() - t0;
            best = t < best ? t : best;
            sink += all;
        }
        printf("{\"threads\": %d, \"GB_per_s\": %.1f, \"loads\": \"%s\", \"sink\": %ld}\n", th, n / best / 1e9,
               wide ? "avx512" : "avx2", sink & 1);
    }
    return 0;
}
