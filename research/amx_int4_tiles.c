/* Does AMX-INT8 beat the int4 kernel's AVX512-VNNI GEMM on a decode batch? A probe, not a kernel: it includes
   quant/native/int4_gemm.c and computes y = x @ W.T both ways on one thread, on random codes (fp16 scales and
   zeros, x with outliers), and reports each one's time and whether every output has the same bits.

   The AMX version keeps the kernel's numbers exactly: x quantized per 32 values (prepare_gemm_512), the weight
   block transposed into 32-bit words (block_512), and each 32-value block's integer dot product scaled and added
   in the same order as gemm_tile_512. Two things make the tiles fit that arithmetic:
   - one TDPBSUD covers 64 k (the tile's full depth) for 8 x rows: tile row i < 8 holds row i's first 32 k (the
     rest zero), row 8 + i its last 32 (the first zero), so each output row is one x block's sum and takes its
     own x scale;
   - the B tile needs no reordering: in a transposed word the low nibbles are k 8j + 0, 2, 4, 6 and the high ones
     k 8j + 1, 3, 5, 7, the order prepare_gemm_512 already gives x. B row 2j is the word's low nibbles, row 2j + 1
     its high ones (an AND, a shift and an AND per 16 columns).
   Variants (-D at build): PER_CHUNK computes and extracts one 64-k chunk at a time; otherwise each 16-column block
   goes in three phases (every B tile of the block unpacked, then every TDPBSUD four tiles at a time, then every
   sum scaled), and SKIP_B / SKIP_T / SKIP_E leave a phase out (the outputs are then wrong; only the times mean
   something). research/amx_int4_tiles.py builds and runs them. Usage: amx_int4_tiles N K G M ROUNDS */
#include "../quant/native/int4_gemm.c"

#include <cpuid.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8")))

typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24, 25), and Linux hands this process the tile state
   (it does so only on request: ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA). */
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return 0;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

TAMX static void amx_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* The A tiles of x rows m0..m0+mt-1: per 64-k chunk, 16 rows of 64 bytes (see the top). */
static void a_tiles(const prepared_gemm *p, int m0, int mt, int K, int8_t *a) {
    memset(a, 0, (size_t)K / 64 * 1024);
    for (int c = 0; c < K / 64; c++)
        for (int i = 0; i < mt; i++) {
            const int8_t *q = p->q + (size_t)(m0 + i) * K + 64 * c;
            memcpy(a + (size_t)c * 1024 + i * 64, q, 32);
            memcpy(a + (size_t)c * 1024 + (8 + i) * 64 + 32, q + 32, 32);
        }
}

/* One chunk's two x blocks, scaled and added to each row's accumulator as gemm_tile_512 adds them. */
TAMX static inline __attribute__((always_inline)) void add_chunk(const int32_t *sums, const float *swt, int gshift,
                                                                 const prepared_gemm *p, int m0, int mt, int c,
                                                                 int xgroups, __m512 *acc) {
    const int b0 = 2 * c, b1 = 2 * c + 1;
    const __m512 s0 = _mm512_loadu_ps(swt + ((b0 * XG) >> gshift) * 16);
    const __m512 s1 = _mm512_loadu_ps(swt + ((b1 * XG) >> gshift) * 16);
    for (int i = 0; i < mt; i++) {
        const float *sx = p->sx + (size_t)(m0 + i) * xgroups;
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + i * 16)),
                                 _mm512_mul_ps(s0, _mm512_set1_ps(sx[b0])), acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + (8 + i) * 16)),
                                 _mm512_mul_ps(s1, _mm512_set1_ps(sx[b1])), acc[i]);
    }
}

TAMX static void unpack_b(const uint32_t *wt, int j0, int j1, uint8_t *b) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int j = j0; j < j1; j++) {
        const __m512i v = _mm512_loadu_si512(wt + (size_t)j * 16);
        _mm512_store_si512(b + (size_t)(2 * (j - j0)) * 64, _mm512_and_si512(v, mask));
        _mm512_store_si512(b + (size_t)(2 * (j - j0) + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
    }
}

/* y[m0 .. m0 + mt - 1][n0 .. n0 + 15] from the block in the scratch (fp32 y). */
TAMX static void amx_tile(const uint32_t *wt, const float *swt, const float *zwt, int K, int gshift,
                          const prepared_gemm *p, const int8_t *a, int m0, int mt, float *y, int N, int n0,
                          uint8_t *b, int32_t *sums) {
    const int groups = K >> gshift, xgroups = K / XG, chunks = K / 64;
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
#ifdef PER_CHUNK
    for (int c = 0; c < chunks; c++) {
        unpack_b(wt, 8 * c, 8 * c + 8, b);
        _tile_zero(0);
        _tile_loadd(1, a + (size_t)c * 1024, 64);
        _tile_loadd(2, b, 64);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, sums, 64);
        add_chunk(sums, swt, gshift, p, m0, mt, c, xgroups, acc);
    }
#else
#ifndef SKIP_B
    unpack_b(wt, 0, K / 8, b);
#endif
#ifndef SKIP_T
    int c = 0;
    for (; c + 4 <= chunks; c += 4) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, a + (size_t)c * 1024, 64);
        _tile_loadd(5, b + (size_t)c * 1024, 64);
        _tile_dpbsud(0, 4, 5);
        _tile_loadd(6, a + (size_t)(c + 1) * 1024, 64);
        _tile_loadd(7, b + (size_t)(c + 1) * 1024, 64);
        _tile_dpbsud(1, 6, 7);
        _tile_loadd(4, a + (size_t)(c + 2) * 1024, 64);
        _tile_loadd(5, b + (size_t)(c + 2) * 1024, 64);
        _tile_dpbsud(2, 4, 5);
        _tile_loadd(6, a + (size_t)(c + 3) * 1024, 64);
        _tile_loadd(7, b + (size_t)(c + 3) * 1024, 64);
        _tile_dpbsud(3, 6, 7);
        _tile_stored(0, sums + (size_t)c * 256, 64);
        _tile_stored(1, sums + (size_t)(c + 1) * 256, 64);
        _tile_stored(2, sums + (size_t)(c + 2) * 256, 64);
        _tile_stored(3, sums + (size_t)(c + 3) * 256, 64);
    }
    for (; c < chunks; c++) { /* the chunks past the last four */
        _tile_zero(0);
        _tile_loadd(4, a + (size_t)c * 1024, 64);
        _tile_loadd(5, b + (size_t)c * 1024, 64);
        _tile_dpbsud(0, 4, 5);
        _tile_stored(0, sums + (size_t)c * 256, 64);
    }
#endif
#ifndef SKIP_E
    for (int c = 0; c < chunks; c++) add_chunk(sums + (size_t)c * 256, swt, gshift, p, m0, mt, c, xgroups, acc);
#endif
#endif
    for (int G = 0; G < groups; G++) {
        const __m512 z = _mm512_loadu_ps(zwt + G * 16);
        for (int i = 0; i < mt; i++)
            acc[i] = _mm512_fmadd_ps(z, _mm512_set1_ps(p->gsum[(size_t)(m0 + i) * groups + G]), acc[i]);
    }
    const __mmask16 keep = N - n0 >= 16 ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
    for (int i = 0; i < mt; i++) _mm512_mask_storeu_ps(y + (size_t)(m0 + i) * N + n0, keep, acc[i]);
}

TAMX static void amx_gemm(const uint8_t *codes, wscales w, int N, int K, int g, const float *x, int M, float *y) {
    prepared_gemm p;
    const int groups = K / g, gshift = __builtin_ctz(g), passes = (M + 7) / 8;
    const size_t words = (size_t)K / 8 * 16 * 4, tiles = (size_t)K / 64 * 1024;
    p.q = malloc((size_t)M * K);
    p.sx = malloc(sizeof(float) * (size_t)M * (K / XG));
    p.gsum = malloc(sizeof(float) * (size_t)M * groups);
    uint8_t *scratch = aligned_alloc(64, (words + sizeof(float) * 2 * 16 * (size_t)groups + 63) & ~(size_t)63);
    int8_t *a = aligned_alloc(64, tiles * passes);
    uint8_t *b = aligned_alloc(64, (size_t)K * 16);
    int32_t *sums = aligned_alloc(64, tiles);
    float *swt = (float *)(scratch + words), *zwt = swt + 16 * (size_t)groups;
    prepare_gemm_512(x, M, K, g, &p);
    for (int s = 0; s < passes; s++) a_tiles(&p, 8 * s, M - 8 * s < 8 ? M - 8 * s : 8, K, a + tiles * s);
    amx_configure();
    for (int n0 = 0; n0 < N; n0 += 16) {
        block_512(codes, w, n0, N, K, g, (uint32_t *)scratch, swt, zwt);
        for (int s = 0; s < passes; s++)
            amx_tile((uint32_t *)scratch, swt, zwt, K, gshift, &p, a + tiles * s, 8 * s,
                     M - 8 * s < 8 ? M - 8 * s : 8, y, N, n0, b, sums);
    }
    _tile_release();
    free(p.q); free(p.sx); free(p.gsum); free(scratch); free(a); free(b); free(sums);
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    double d = *(const double *)a - *(const double *)b;
    return (d > 0) - (d < 0);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s N K G M ROUNDS\n", argv[0]);
        return 2;
    }
    const int N = atoi(argv[1]), K = atoi(argv[2]), g = atoi(argv[3]), M = atoi(argv[4]), rounds = atoi(argv[5]);
    if (fe_int4_isa() != 2 || !amx_usable()) {
        printf("no AMX-INT8 here (or the kernel has no AVX512-VNNI, or Linux refused the tile state)\n");
        return 3;
    }
    if (K % 128 || N % 16 || (g != 32 && g != 64 && g != 128) || M < 1 || rounds < 1) {
        fprintf(stderr, "N a multiple of 16, K of 128, G 32, 64 or 128\n");
        return 2;
    }
    const size_t groups = (size_t)N * (K / g);
    uint8_t *codes = malloc((size_t)N * K / 2);
    uint16_t *scale = malloc(2 * groups), *zero = malloc(2 * groups);
    float *x = malloc(sizeof(float) * (size_t)M * K), *y0 = malloc(sizeof(float) * (size_t)M * N);
    float *y1 = malloc(sizeof(float) * (size_t)M * N);
    double *t0 = malloc(sizeof(double) * rounds), *t1 = malloc(sizeof(double) * rounds);
    srand(1);
    for (size_t i = 0; i < (size_t)N * K / 2; i++) codes[i] = (uint8_t)rand();
    for (size_t i = 0; i < groups; i++) {
        scale[i] = (uint16_t)(0x2000 + (rand() & 0x3ff)); /* fp16 ~0.008 */
        zero[i] = (uint16_t)(0xa000 + (rand() & 0x3ff));  /* fp16 ~-0.008 */
    }
    for (size_t i = 0; i < (size_t)M * K; i++) x[i] = (rand() / (float)RAND_MAX - 0.5f) * (i % 97 ? 1.f : 20.f);
    for (int r = 0; r < rounds; r++) { /* interleaved, the VNNI GEMM first */
        double a = seconds();
        fe_int4_gemm(codes, scale, zero, 0, N, K, g, x, 0, K, M, y0, 0, 1, 2);
        double b = seconds();
        amx_gemm(codes, (wscales){scale, zero, 0}, N, K, g, x, M, y1);
        t0[r] = b - a;
        t1[r] = seconds() - b;
    }
    size_t differ = 0;
    for (size_t i = 0; i < (size_t)M * N; i++) differ += memcmp(y0 + i, y1 + i, 4) != 0;
    qsort(t0, rounds, sizeof(double), by_value);
    qsort(t1, rounds, sizeof(double), by_value);
    printf("{\"vnni_ms\": %.3f, \"amx_ms\": %.3f, \"outputs\": %zu, \"differing\": %zu}\n", 1e3 * t0[rounds / 2],
           1e3 * t1[rounds / 2], (size_t)M * N, differ);
    return 0;
}
