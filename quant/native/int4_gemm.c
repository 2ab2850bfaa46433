/* y[M, N] = x[M, K] @ W.T for a group-quantized int4 W (fate-edge's portable expert layout), on int8 dot products.

   W: codes uint8 [N, K/2], byte j = code 2j | code 2j+1 << 4 (quant/pack.py); scale and zero fp16 [N, K/g];
   w[n, k] = code * scale + zero for k in group k / g. x is quantized per 32 values to int8 (scale max|x| / 127,
   as llama.cpp's q8_0), so sum_k w x = sum_g scale_g * sx * sum_k code * xq  +  sum_g zero_g * sum_k x.
   Codes are unsigned (0..15) and xq signed: exactly what VPDPBUSD (AVX512-VNNI) multiplies and adds, four
   products per 32-bit lane; AVX2 machines get the same sums from VPMADDUBSW + VPMADDWD.

   A chunk is 128 codes (AVX-512: 64 bytes) or 64 (AVX2: 32 bytes). Its low nibbles are the chunk's even k and
   the high nibbles its odd k, so x is deinterleaved per chunk once per call and every 32-bit lane d then covers
   k in [8d, 8d + 8) of the chunk for both halves: one weight group and one x group per lane (g >= 32). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define XG 32 /* values per activation scale */

typedef struct {
    int8_t *q;      /* [M][K] deinterleaved per chunk: chunk c holds its even k, then its odd k */
    float *lane_sx; /* [M][K/8]: the x scale of each 32-bit lane of each chunk (8 k per lane) */
    float *gsum;    /* [M][K/g padded to 16]: sum of quantized x per weight group (the zero term), zeros after */
} prepared;

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void prepare(const float *x, int M, int K, int g, int chunk, prepared *p) {
    int lanes = K / 8, groups = K / g, half = chunk / 2, padded = (groups + 15) & ~15;
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * K;
        int8_t *qm = p->q + (size_t)m * K;
        float *sx = p->lane_sx + (size_t)m * lanes, *gs = p->gsum + (size_t)m * padded;
        for (int b = 0; b < K / XG; b++) {
            const float *xb = xm + b * XG;
            float amax = 0.f;
            for (int i = 0; i < XG; i++) amax = fmaxf(amax, fabsf(xb[i]));
            float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
            int k0 = b * XG, c0 = k0 - k0 % chunk, r0 = k0 - c0;  /* XG divides chunk: one chunk per x group */
            int8_t *even = qm + c0 + r0 / 2, *odd = qm + c0 + half + r0 / 2;
            int qsum = 0;
            for (int i = 0; i < XG / 2; i++) {
                even[i] = (int8_t)lrintf(xb[2 * i] * inv); /* lrintf: inlined, unlike nearbyintf; same rounding */
                odd[i] = (int8_t)lrintf(xb[2 * i + 1] * inv);
                qsum += even[i] + odd[i];
            }
            for (int l = 0; l < XG / 8; l++) sx[b * (XG / 8) + l] = s;
            /* the zero term takes the quantized x too: the error is then w (x - xq), not (code * scale) (x - xq),
               about 2.5x smaller (codes sit above the zero, their products do not cancel) */
            gs[k0 / g] += s * (float)qsum;
        }
    }
}

#define MT 4         /* x rows per pass over a weight row */
#define PREFETCH 4096 /* bytes of weights requested ahead of the ones being multiplied */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define T256 __attribute__((target("avx2,fma,f16c")))

/* fp16 [count] → fp32, zero-padded to a multiple of 16 (the kernels load 16 floats past a chunk's first group). */
T512 static void halves_512(const uint16_t *h, int count, float *out) {
    for (int j = 0; j < count; j += 16) {
        __mmask16 k = count - j >= 16 ? 0xffff : (__mmask16)((1u << (count - j)) - 1);
        _mm512_storeu_ps(out + j, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, h + j)));
    }
}

/* prepare() for AVX-512 hosts: the same numbers (cvtps rounds to nearest even, as lrintf does there), 16 at a time. */
T512 static void prepare_512(const float *x, int M, int K, int g, prepared *p) {
    const int lanes = K / 8, padded = (K / g + 15) & ~15;
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * K;
        int8_t *qm = p->q + (size_t)m * K;
        float *sx = p->lane_sx + (size_t)m * lanes, *gs = p->gsum + (size_t)m * padded;
        for (int b = 0; b < K / XG; b++) {
            __m512 a = _mm512_loadu_ps(xm + b * XG), c = _mm512_loadu_ps(xm + b * XG + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
            float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
            __m512 vi = _mm512_set1_ps(inv);
            __m512i qe = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(a, ev, c), vi));
            __m512i qo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(a, od, c), vi));
            int k0 = b * XG, c0 = k0 & ~127, r0 = k0 & 127;
            _mm_storeu_si128((__m128i *)(qm + c0 + r0 / 2), _mm512_cvtsepi32_epi8(qe));
            _mm_storeu_si128((__m128i *)(qm + c0 + 64 + r0 / 2), _mm512_cvtsepi32_epi8(qo));
            _mm_storeu_ps(sx + b * (XG / 8), _mm_set1_ps(s));
            gs[k0 / g] += s * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qe, qo));
        }
    }
}

T512 static float dot_512(const float *a, const float *b, int count) { /* count: a multiple of 16 (zero-padded) */
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < count; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
    return _mm512_reduce_add_ps(acc);
}

/* ``mt`` (a constant after inlining) x rows against one weight row: accumulators stay in registers. */
T512 static inline __attribute__((always_inline)) void tile_512(const uint8_t *wr, const float *sw, int chunks,
                                                                 int gshift, const prepared *p, int m0, int mt,
                                                                 int K, float *out) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    const __m512i widx = _mm512_srli_epi32(_mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104,
                                                             112, 120), gshift);
    const int lanes = K / 8;
    __m512 acc[2][MT];  /* even and odd chunks: two independent FMA chains per x row */
    for (int i = 0; i < mt; i++) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        /* 4 KB ahead: at one row the kernel streams weights from DRAM, and the hardware prefetcher alone left it
           at 5-6 GB/s here (8-10 GB/s with this, one thread) */
        _mm_prefetch((const char *)(wr + c * 64 + PREFETCH), _MM_HINT_T0);
        __m512i v = _mm512_loadu_si512(wr + c * 64);
        __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        __m512 swv = _mm512_permutexvar_ps(widx, _mm512_loadu_ps(sw + ((c * 128) >> gshift)));
        for (int i = 0; i < mt; i++) {
            const int8_t *q = p->q + (size_t)(m0 + i) * K + c * 128;
            __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q));
            d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(q + 64));
            __m512 s = _mm512_mul_ps(swv, _mm512_loadu_ps(p->lane_sx + (size_t)(m0 + i) * lanes + c * 16));
            acc[c & 1][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[c & 1][i]);
        }
    }
    for (int i = 0; i < mt; i++) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][i], acc[1][i]));
}

#define BLOCK 16 /* weight rows per task: their codes (K/2 bytes each) and an x tile stay in L1 */

/* Rows n0..n1 of W against every x row, for one instruction set (HALVES, TILE, DOT: its helpers; CHUNK: codes
   per chunk): the block's scales and zeros converted once, then each x tile against every row of the block. */
#define ROWS_BODY(HALVES, TILE, DOT, CHUNK)                                                                    \
    const int groups = K / g, padded = (groups + 15) & ~15, gshift = __builtin_ctz(g), stride = K / 32 + 32;   \
    float sw[BLOCK * stride], zw[BLOCK * stride], out[MT];                                                     \
    for (int n = n0; n < n1; n++) {                                                                            \
        HALVES(scale + (size_t)n * groups, groups, sw + (n - n0) * stride);                                    \
        HALVES(zero + (size_t)n * groups, groups, zw + (n - n0) * stride);                                     \
    }                                                                                                          \
    for (int m0 = 0; m0 < M; m0 += MT) {                                                                       \
        int mt = M - m0 < MT ? M - m0 : MT;                                                                    \
        for (int n = n0; n < n1; n++) {                                                                        \
            const uint8_t *wr = codes + (size_t)n * (K / 2);                                                   \
            const float *s = sw + (n - n0) * stride;                                                           \
            switch (mt) { /* one constant tile size per case: the accumulators stay in registers */           \
            case 4: TILE(wr, s, K / CHUNK, gshift, p, m0, 4, K, out); break;                                   \
            case 3: TILE(wr, s, K / CHUNK, gshift, p, m0, 3, K, out); break;                                   \
            case 2: TILE(wr, s, K / CHUNK, gshift, p, m0, 2, K, out); break;                                   \
            default: TILE(wr, s, K / CHUNK, gshift, p, m0, 1, K, out); break;                                  \
            }                                                                                                  \
            for (int i = 0; i < mt; i++)                                                                       \
                y[(size_t)(m0 + i) * N + n] =                                                                  \
                    out[i] + DOT(zw + (n - n0) * stride, p->gsum + (size_t)(m0 + i) * padded, padded);        \
        }                                                                                                      \
    }

T512 static void rows_512(const uint8_t *codes, const uint16_t *scale, const uint16_t *zero, int n0, int n1, int N,
                          int K, int g, const prepared *p, int M, float *y) {
    ROWS_BODY(halves_512, tile_512, dot_512, 128)
}

T256 static void halves_256(const uint16_t *h, int count, float *out) {
    int j = 0;
    for (; j + 8 <= count; j += 8) _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
    for (; j < count; j++) out[j] = half_to_float(h[j]);
    for (; j < ((count + 15) & ~15); j++) out[j] = 0.f;
}

T256 static float dot_256(const float *a, const float *b, int count) {
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < count; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

T256 static inline __attribute__((always_inline)) void tile_256(const uint8_t *wr, const float *sw, int chunks,
                                                                 int gshift, const prepared *p, int m0, int mt,
                                                                 int K, float *out) {
    const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i steps = _mm256_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56);
    const int lanes = K / 8, g = 1 << gshift;
    __m256 acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        _mm_prefetch((const char *)(wr + c * 32 + PREFETCH), _MM_HINT_T0);
        __m256i v = _mm256_loadu_si256((const __m256i *)(wr + c * 32));
        __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        /* lane d covers k in [64c + 8d, +8): group (64c + 8d) / g; for g = 128 a chunk is half a group */
        __m256i widx = _mm256_srli_epi32(_mm256_add_epi32(_mm256_set1_epi32((c * 64) & (g - 1)), steps), gshift);
        __m256 swv = _mm256_permutevar8x32_ps(_mm256_loadu_ps(sw + ((c * 64) >> gshift)), widx);
        for (int i = 0; i < mt; i++) {
            const int8_t *q = p->q + (size_t)(m0 + i) * K + c * 64;
            __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q)),
                                         _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 32))));
            __m256 s = _mm256_mul_ps(swv, _mm256_loadu_ps(p->lane_sx + (size_t)(m0 + i) * lanes + c * 8));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d, ones)), s, acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) {
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        out[i] = _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
    }
}

T256 static void rows_256(const uint8_t *codes, const uint16_t *scale, const uint16_t *zero, int n0, int n1, int N,
                          int K, int g, const prepared *p, int M, float *y) {
    ROWS_BODY(halves_256, tile_256, dot_256, 64)
}

/* 2: AVX512-VNNI, 1: AVX2, 0: neither (the caller uses another kernel). */
int fe_int4_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

/* Returns 0, or -1 for shapes it does not take (K % 128, g not 32/64/128) or an allocation failure. */
int fe_int4_gemm(const uint8_t *codes, const uint16_t *scale, const uint16_t *zero, int N, int K, int g,
                 const float *x, int M, float *y, int threads, int isa) {
    if (K % 128 || (g != 32 && g != 64 && g != 128) || M <= 0 || N <= 0 || isa <= 0) return -1;
    int chunk = isa == 2 ? 128 : 64;
    prepared p;
    p.q = malloc((size_t)M * K);
    p.lane_sx = malloc(sizeof(float) * (size_t)M * (K / 8));
    p.gsum = calloc((size_t)M * ((K / g + 15) & ~15), sizeof(float));
    if (!p.q || !p.lane_sx || !p.gsum) {
        free(p.q); free(p.lane_sx); free(p.gsum);
        return -1;
    }
    if (isa == 2)
        prepare_512(x, M, K, g, &p);
    else
        prepare(x, M, K, g, chunk, &p);
    const int block = BLOCK;
    int tasks = (N + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int t = 0; t < tasks; t++) {
        int n0 = t * block, n1 = n0 + block < N ? n0 + block : N;
        if (isa == 2)
            rows_512(codes, scale, zero, n0, n1, N, K, g, &p, M, y);
        else
            rows_256(codes, scale, zero, n0, n1, N, K, g, &p, M, y);
    }
    free(p.q); free(p.lane_sx); free(p.gsum);
    return 0;
}
