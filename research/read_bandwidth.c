/* The memory's read floor for one or more threads: the fastest a loop of plain AVX-512 loads (4 independent 64-byte
   loads an iteration, XOR-folded so nothing is optimized away) streams a 1 GB buffer on transparent huge pages,
   best of 7 passes per thread count. A decode token that reads N MB of weights takes at least N / this. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

int main(int argc, char **argv) {
    const size_t n = (size_t)1 << 30;
    const int max_threads = argc > 1 ? atoi(argv[1]) : 2;
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
            __m512i all = _mm512_setzero_si512();
#pragma omp parallel
            {
                __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
#pragma omp for schedule(static)
                for (size_t i = 0; i < n; i += 256) {
                    a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
                    a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 64));
                    a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 128));
                    a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 192));
                }
#pragma omp critical
                all = _mm512_xor_si512(all, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
            }
            double t = omp_get_wtime() - t0;
            best = t < best ? t : best;
            sink += _mm512_reduce_add_epi64(all);
        }
        printf("{\"threads\": %d, \"GB_per_s\": %.1f, \"sink\": %ld}\n", th, n / best / 1e9, sink & 1);
    }
    return 0;
}
