/* y[M, N] = x[M, K] @ W.T for a group-quantized int4 W (fate-edge's portable expert layout), on int8 dot products.

   W: codes uint8 [N, K/2], byte j = code 2j | code 2j+1 << 4 (quant/pack.py); scale and zero [N, K/g] in fp16, or
   in fp32 (a GGUF's q4_K products d * sc, exact in fp32 only; widened once per row block either way, so the loops
   below see fp32 only); w[n, k] = code * scale + zero for k in group k / g. x is quantized per 32 values to int8
   (scale max|x| / 127, as llama.cpp's q8_0), so sum_k w x = sum_g scale_g * sx * sum_k code * xq  +  sum_g zero_g
   * sum_k x. Codes are unsigned (0..15) and xq signed: exactly what VPDPBUSD (AVX512-VNNI) multiplies and adds, four
   products per 32-bit lane; AVX2 machines get the same sums from VPMADDUBSW + VPMADDWD.

   A chunk is 128 codes (AVX-512: 64 bytes) or 64 (AVX2: 32 bytes). Its low nibbles are the chunk's even k and
   the high nibbles its odd k, so x is deinterleaved per chunk once per call and every 32-bit lane d then covers
   k in [8d, 8d + 8) of the chunk for both halves: one weight group and one x group per lane (g >= 32). */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define XG 32 /* values per activation scale */

typedef struct {
    int8_t *q;      /* [M][K] deinterleaved per chunk: chunk c holds its even k, then its odd k */
    float *lane_sx; /* [M][K/8]: the x scale of each 32-bit lane of each chunk (8 k per lane) */
    float *gsum;    /* [M][K/g padded to 16]: sum of quantized x per weight group (the zero term), zeros after */
} prepared;

/* Where y goes: fp32, or bf16 written straight from the kernels' registers. Narrowing through a temporary fp32 y
   cost the whole y twice over, and a temporary of 1 MiB or more (lm_head at 8 rows: 4.9 MB) was a fresh mapping on
   every call once a store has fixed glibc's mmap threshold (format/store.py): its page faults took 8 rows of
   Qwen's lm_head from 13.7-14.3 ms to 20.0-20.7 on a 2-vCPU Xeon; written directly, 14.0-14.7. */
typedef struct {
    void *p;
    int bf16;
} yout;

/* fp32 -> bf16: round to nearest even, NaN kept a quiet NaN, as torch's .to() does. */
static inline uint16_t bf16_of(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return (bits & 0x7fffffff) > 0x7f800000 ? (uint16_t)((bits >> 16) | 0x40)
                                            : (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static inline void y_put(yout y, size_t at, float v) {
    if (y.bf16)
        ((uint16_t *)y.p)[at] = bf16_of(v);
    else
        ((float *)y.p)[at] = v;
}

/* A matrix's scales and zeros as stored: fp16 (the portable layout), or fp32 where fp16 would round them; and the
   order of its codes' rows (r4, below). */
typedef struct {
    const void *scale, *zero;
    int f32, r4;
} wscales;

/* Codes in rows of four (r4): each group of four rows (all but the last N % 4, which stay as they are) one run of
   64-byte chunks, chunk c of rows 4j..4j+3 side by side, where the portable layout has row after row. The one-row
   kernel reads four rows a pass, chunk by chunk: from the portable layout that is four streams 1 KB apart (K = 2048),
   from this one a single stream. On a 2-vCPU EPYC Zen 5, weights from DRAM, one thread streamed 38-40 GB/s against
   33, two 45-47 against 36-38 in the host's slow state (docs/measured-choices.md). Made at load by fe_int4_rows4
   (quant.native.NativeInt4.interleave_rows). The byte b (< K/2) of row n: */
static inline size_t code_at(int n, size_t b, int K, int N, int r4) {
    if (r4 && n < (N & ~3)) return (size_t)(n >> 2) * 2 * (size_t)K + ((b >> 6) * 4 + (size_t)(n & 3)) * 64 + (b & 63);
    return (size_t)n * (K / 2) + b;
}

/* Bytes from one 64-byte chunk of row n to its next. */
static inline int chunk_stride(int n, int N, int r4) { return r4 && n < (N & ~3) ? 256 : 64; }

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

#define MT 4         /* x rows per pass over a weight row */
#define PREFETCH 4096 /* bytes of weights requested ahead of the ones being multiplied (AVX2, into L1) */
/* AVX-512: 16 KB ahead into L2. On a 2-vCPU Zen 4 (AMD EPYC), one row, once the accumulators stayed in registers
   (tile_512), 4 KB into L1 streamed 8-10 GB/s of CPU time, 8 KB into L2 12-18, 16 KB into L2 12-20 (interleaved
   A/B, research/bench_int4_rows.py) */
#define PREFETCH_512 16384
/* The one-row kernel (tile1_512) on an AMD Zen 5 (family 26; 48 KB L1d): 6 KB ahead into L1 instead, about one and a
   half passes of R1 rows of 2048: on a 2-vCPU EPYC Zen 5, one thread, weights from DRAM, it streamed lm_head and the
   2048-wide matrices faster than 16 KB into L2 or 4, 8 or 12 KB into L1, the experts' 1408-wide down matrices a little
   slower than at 8-12 KB (docs/measured-choices.md). Other CPUs keep what was measured on them: Zen 4 lost with
   prefetches into L1. Non-temporal (NTA): a decode token streams ~60 MB of weights a layer through a 32 MB L3, which
   left nothing else there, so every small operator between the int4 calls (the router's matrix, the KV cache, the
   interpreter's own state) started from DRAM; with NTA the 8-layer Qwen1.5-MoE slice's time outside the int4 calls
   went 4.0-4.2 -> 3.0-3.6 ms a token at one thread, the kernels no slower (docs/cpu-profile.md, Zen 5). */
#define PREFETCH1_L1 6144
/* At one x row, a load of one byte this far ahead of each pass of R1 rows (its value unused). From 4 KB pages the
   prefetch above fell short: a 2-vCPU Zen 4 streamed 17-23 GB/s of CPU time from them against 24-26 from huge pages,
   most likely its prefetches reaching pages the TLB did not hold yet; with the load, which walks the page table for
   a page before the prefetch gets there, 24-27 from either (research/bench_int4_rows.py, docs/cpu-profile.md). A
   loaded model holds its matrices under 4 MB in 4 KB pages (fate_edge.huge_pages.MIN_BYTES): o_proj, each resident
   expert. 16 KB ahead won less; a load every 4 KB (several a pass where rows are longer) lost. */
#define TOUCH_AHEAD 65536
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
/* FE_AVX_VNNI (a second build, quant.native picks it where the CPU has AVX-VNNI): the AVX2 path's int8 dot products
   in VPDPBUSD (Intel since Alder Lake and Sierra Forest, AMD since Zen 5), one instruction where VPMADDUBSW, an int16
   add and VPMADDWD take three. The same integers: the int16 pair sums never saturate (|x code| <= 127, codes <= 15),
   so every output keeps its bits. Its own build because GCC may use AVX-VNNI anywhere a function's target allows it,
   and an AVX2 host without it must never reach such code. */
#ifdef FE_AVX_VNNI
#define T256 __attribute__((target("avx2,fma,f16c,avxvnni")))
#else
#define T256 __attribute__((target("avx2,fma,f16c")))
#endif

/* The int8 scale of a group of 32 x values (max |x| / 127) and its inverse, for a group held in two vectors (a: its
   first 16 values, c: the rest). A group holding a NaN gets a NaN scale, so every output of that row
   is NaN, as a float matmul's would be; max and the int8 rounding alone would turn it into finite garbage. */
T512 static inline float x_scale_512(__m512 a, __m512 c, float *inv) {
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    int nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q);
    float s = nan ? NAN : amax / 127.f;
    *inv = s > 0.f ? 1.f / s : 0.f;
    return s;
}

/* Groups at..at+count of ``src`` (fp16 or fp32) → fp32, zero-padded to a multiple of 16 (the kernels load 16 floats
   past a chunk's first group). */
T512 static void widen_512(const void *src, int f32, size_t at, int count, float *out) {
    for (int j = 0; j < count; j += 16) {
        __mmask16 k = count - j >= 16 ? 0xffff : (__mmask16)((1u << (count - j)) - 1);
        _mm512_storeu_ps(out + j, f32 ? _mm512_maskz_loadu_ps(k, (const float *)src + at + j)
                                      : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)src + at + j)));
    }
}

/* x quantized per 32 values into the row kernel's layout (prepared), 16 at a time. */
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
            float inv, s = x_scale_512(a, c, &inv);
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

/* One chunk of ``mt`` x rows against one weight row into ``acc`` (even or odd chunks' accumulators). */
#define TILE_512_CHUNK(c, acc)                                                                                 \
    do {                                                                                                       \
        _mm_prefetch((const char *)(wr + (size_t)(c) * cs + PREFETCH_512), _MM_HINT_T1);                       \
        __m512i v = _mm512_loadu_si512(wr + (size_t)(c) * cs);                                                 \
        __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);         \
        __m512 swv = _mm512_permutexvar_ps(widx, _mm512_loadu_ps(sw + (((c) * 128) >> gshift)));               \
        for (int i = 0; i < mt; i++) {                                                                         \
            const int8_t *q = p->q + (size_t)(m0 + i) * K + (c) * 128;                                         \
            __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q));               \
            d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(q + 64));                                        \
            __m512 s = _mm512_mul_ps(swv, _mm512_loadu_ps(p->lane_sx + (size_t)(m0 + i) * lanes + (c) * 16));  \
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[i]);                                        \
        }                                                                                                      \
    } while (0)

/* ``mt`` (a constant after inlining) x rows against one weight row: accumulators stay in registers. The prefetch:
   at one row the kernel streams weights from DRAM, and the hardware prefetcher alone left it at 5-6 GB/s on a Xeon
   (8-10 GB/s with 4 KB ahead into L1, one thread). */
T512 static inline __attribute__((always_inline)) void tile_512(const uint8_t *wr, const float *sw, int chunks,
                                                                 int gshift, const prepared *p, int m0, int mt,
                                                                 int K, float *out, int cs) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    const __m512i widx = _mm512_srli_epi32(_mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104,
                                                             112, 120), gshift);
    const int lanes = K / 8;
    /* even and odd chunks: two independent FMA chains per x row. Two arrays walked two chunks a step, not one
       indexed by c & 1: a run-time index kept them on the stack, every FMA waiting on the last one's store (GCC 12;
       a 2-vCPU Zen 4 then streamed ~13 cycles per 64 bytes of codes even from L2) */
    __m512 acc0[MT], acc1[MT];
    for (int i = 0; i < mt; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    int c = 0;
    for (; c + 1 < chunks; c += 2) {
        TILE_512_CHUNK(c, acc0);
        TILE_512_CHUNK(c + 1, acc1);
    }
    if (c < chunks) TILE_512_CHUNK(c, acc0);
    for (int i = 0; i < mt; i++) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
}

#define BLOCK 16 /* weight rows per task: their codes (K/2 bytes each) and an x tile stay in L1 */

/* Rows n0..n1 of W against every x row, for one instruction set (WIDEN, TILE, DOT: its helpers; CHUNK: codes
   per chunk): the block's scales and zeros converted once, then each x tile against every row of the block. */
#define ROWS_BODY(WIDEN, TILE, DOT, CHUNK)                                                                     \
    const int groups = K / g, padded = (groups + 15) & ~15, gshift = __builtin_ctz(g), stride = K / 32 + 32;   \
    float sw[BLOCK * stride], zw[BLOCK * stride], out[MT];                                                     \
    for (int n = n0; n < n1; n++) {                                                                            \
        WIDEN(w.scale, w.f32, (size_t)n * groups, groups, sw + (n - n0) * stride);                             \
        WIDEN(w.zero, w.f32, (size_t)n * groups, groups, zw + (n - n0) * stride);                              \
    }                                                                                                          \
    for (int m0 = 0; m0 < M; m0 += MT) {                                                                       \
        int mt = M - m0 < MT ? M - m0 : MT;                                                                    \
        for (int n = n0; n < n1; n++) {                                                                        \
            const uint8_t *wr = codes + code_at(n, 0, K, N, w.r4);                                             \
            const int cs = chunk_stride(n, N, w.r4);                                                           \
            const float *s = sw + (n - n0) * stride;                                                           \
            switch (mt) { /* one constant tile size per case: the accumulators stay in registers */           \
            case 4: TILE(wr, s, K / CHUNK, gshift, p, m0, 4, K, out, cs); break;                               \
            case 3: TILE(wr, s, K / CHUNK, gshift, p, m0, 3, K, out, cs); break;                               \
            case 2: TILE(wr, s, K / CHUNK, gshift, p, m0, 2, K, out, cs); break;                               \
            default: TILE(wr, s, K / CHUNK, gshift, p, m0, 1, K, out, cs); break;                              \
            }                                                                                                  \
            for (int i = 0; i < mt; i++)                                                                       \
                y_put(y, (size_t)(m0 + i) * N + n,                                                             \
                      out[i] + DOT(zw + (n - n0) * stride, p->gsum + (size_t)(m0 + i) * padded, padded));     \
        }                                                                                                      \
    }

#define R1 4 /* weight rows per pass at one x row (2 and 8: a little slower on a 2-vCPU Zen 4) */

/* One x row against ``R1`` weight rows at a time (decode): each chunk's x codes and lane scales are loaded once for
   the R1 rows, where a pass per row loaded three vectors of x for each one of weights. Every row's sums are the ones tile_512 computes at
   mt = 1, in the same order (even and odd chunks apart, added at the end), so its bits do not change. */
T512 static inline __attribute__((always_inline)) void tile1_512(const uint8_t *codes, const float *sw, int stride,
                                                                  int chunks, int gshift, const prepared *p, int K,
                                                                  int l1, int rs, int cs, int mt, float *out) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    const __m512i widx = _mm512_srli_epi32(_mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104,
                                                             112, 120), gshift);
    __m512 acc0[R1 * 2], acc1[R1 * 2]; /* even and odd chunks, as tile_512's; [r * mt + i] for x row i */
    for (int r = 0; r < R1 * mt; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
#define TILE1_512_CHUNK(c, acc)                                                                                \
    do {                                                                                                       \
        __m512i q0[2], q1[2];                                                                                  \
        __m512 sx[2];                                                                                          \
        for (int i = 0; i < mt; i++) {                                                                         \
            q0[i] = _mm512_loadu_si512(p->q + (size_t)i * K + (c) * 128);                                      \
            q1[i] = _mm512_loadu_si512(p->q + (size_t)i * K + (c) * 128 + 64);                                 \
            sx[i] = _mm512_loadu_ps(p->lane_sx + (size_t)i * (K / 8) + (c) * 16);                              \
        }                                                                                                      \
        for (int r = 0; r < R1; r++) {                                                                         \
            /* rs, cs: bytes from row to row and chunk to chunk (rows of four: 64 and 256, one stream) */      \
            const uint8_t *wr = codes + (size_t)r * rs + (size_t)(c) * cs;                                     \
            if (l1) /* a constant after inlining: one of the two prefetches is compiled in */                  \
                _mm_prefetch((const char *)(wr + PREFETCH1_L1), _MM_HINT_NTA);                                 \
            else                                                                                               \
                _mm_prefetch((const char *)(wr + PREFETCH_512), _MM_HINT_T1);                                  \
            __m512i v = _mm512_loadu_si512(wr);                                                                \
            __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);     \
            __m512 swv = _mm512_permutexvar_ps(widx, _mm512_loadu_ps(sw + r * stride + (((c) * 128) >> gshift))); \
            for (int i = 0; i < mt; i++) {                                                                     \
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, q0[i]);                            \
                d = _mm512_dpbusd_epi32(d, hi, q1[i]);                                                         \
                acc[r * mt + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(swv, sx[i]), acc[r * mt + i]); \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)
    int c = 0;
    for (; c + 1 < chunks; c += 2) {
        TILE1_512_CHUNK(c, acc0);
        TILE1_512_CHUNK(c + 1, acc1);
    }
    if (c < chunks) TILE1_512_CHUNK(c, acc0);
#undef TILE1_512_CHUNK
    for (int r = 0; r < R1 * mt; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}

/* Whether this CPU is an AMD of family 26 (Zen 5) or later: the one-row kernel's prefetch goes into L1 there
   (PREFETCH1_L1). Asked once; a race between first callers writes the same value. */
static int l1_prefetch_cpu(void) {
    static int known = -1;
    int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (v < 0) {
        unsigned a, b, c, d;
        v = 0;
        __builtin_cpu_init();
        if (__builtin_cpu_is("amd") && __get_cpuid(1, &a, &b, &c, &d)) {
            unsigned family = (a >> 8) & 0xf;
            if (family == 0xf) family += (a >> 20) & 0xff;
            v = family >= 26;
        }
        __atomic_store_n(&known, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* rows_512's one-row loop, with the prefetch ``l1`` picks (a constant in each of its two call sites). Its four rows
   are always one whole group of r4's: n0 is a multiple of BLOCK and the loop stops before N. (A third constant for
   the layout, with a choice of addresses per chunk, took the portable layout's 2048x1408 from 50 to 116 us.) */
#define ROWS1_512_LOOP(l1, mt)                                                                                 \
    for (; n + R1 <= n1; n += R1) {                                                                            \
        const size_t at = (size_t)n * (K / 2) + TOUCH_AHEAD;                                                   \
        if (at < total) /* inside the matrix only: the load may not fault */                                   \
            __asm__ volatile("" : : "r"(*(volatile const uint8_t *)(codes + at)));                             \
        tile1_512(codes + (size_t)n * (K / 2), sw + (n - n0) * stride, stride, K / 128, gshift, p, K, l1, rs, cs,   \
                  mt, out);                                                                                    \
        for (int r = 0; r < R1; r++)                                                                           \
            for (int i = 0; i < mt; i++)                                                                       \
                y_put(y, (size_t)i * N + n + r,                                                                \
                      out[r * mt + i] + dot_512(zw + (n + r - n0) * stride, p->gsum + (size_t)i * padded, padded)); \
    }

/* rows_512 at ``mt`` (a constant after inlining) x rows: one, or two where the codes are in rows of four, whose rows
   ROWS_BODY would read 64 bytes in 256 (the 2048x1408 matrix 93 -> 130 us at one thread). */
T512 static inline __attribute__((always_inline)) void rows_few_512(const uint8_t *codes, wscales w, int n0, int n1,
                                                                     int N, int K, int g, const prepared *p, yout y,
                                                                     const int mt) {
    const int groups = K / g, padded = (groups + 15) & ~15, gshift = __builtin_ctz(g), stride = K / 32 + 32;
    float sw[BLOCK * stride], zw[BLOCK * stride], out[R1 * 2];
    for (int n = n0; n < n1; n++) {
        widen_512(w.scale, w.f32, (size_t)n * groups, groups, sw + (n - n0) * stride);
        widen_512(w.zero, w.f32, (size_t)n * groups, groups, zw + (n - n0) * stride);
    }
    const size_t total = (size_t)N * (K / 2);
    const int l1 = l1_prefetch_cpu();
    int n = n0;
    if (l1 && n1 < N) {
        /* the next block's scales and zeros, non-temporal like the codes: widening them above waited on their
           misses at each block's start, and they too went through the L3 (docs/measured-choices.md) */
        const size_t esz = w.f32 ? 4 : 2, bytes = (size_t)BLOCK * groups * esz, at = (size_t)n1 * groups * esz;
        for (size_t i = 0; i < bytes; i += 64) {
            _mm_prefetch((const char *)w.scale + at + i, _MM_HINT_NTA);
            _mm_prefetch((const char *)w.zero + at + i, _MM_HINT_NTA);
        }
    }
    const int rs = w.r4 ? 64 : K / 2, cs = w.r4 ? 256 : 64;
    if (l1)
        ROWS1_512_LOOP(1, mt)
    else
        ROWS1_512_LOOP(0, mt)
    for (; n < n1; n++) {
        const int cn = chunk_stride(n, N, w.r4);
        tile_512(codes + code_at(n, 0, K, N, w.r4), sw + (n - n0) * stride, K / 128, gshift, p, 0, mt, K, out, cn);
        for (int i = 0; i < mt; i++)
            y_put(y, (size_t)i * N + n, out[i] + dot_512(zw + (n - n0) * stride, p->gsum + (size_t)i * padded, padded));
    }
}

/* Two x rows on codes in rows of four, apart from rows_512's one-row loop: inlined beside it, this variant took the
   portable layout's 2048x1408 from 53 to 62 us at one row and thread (the loop's code placement, most likely). */
T512 static __attribute__((noinline)) void rows_two_512(const uint8_t *codes, wscales w, int n0, int n1, int N, int K,
                                                        int g, const prepared *p, yout y) {
    rows_few_512(codes, w, n0, n1, N, K, g, p, y, 2);
}

T512 static void rows_512(const uint8_t *codes, wscales w, int n0, int n1, int N,
                          int K, int g, const prepared *p, int M, yout y) {
    if (M == 1) {
        rows_few_512(codes, w, n0, n1, N, K, g, p, y, 1);
        return;
    }
    if (M == 2 && w.r4) {
        rows_two_512(codes, w, n0, n1, N, K, g, p, y);
        return;
    }
    ROWS_BODY(widen_512, tile_512, dot_512, 128)
}

/* One group of 32 x values for the AVX2 paths: its scale (as x_scale_512: max |x| / 127, NaN for a group holding a
   NaN, whose codes are then 0) into ``scale``, its int8 codes as int32 into ``qi``, each vector's 4 even k then its 4
   odd k; returns the codes' sum (the zero term's). */
T256 static inline __attribute__((always_inline)) int x_group_256(const float *xb, __m256i qi[4], float *scale) {
    const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], amax = _mm256_setzero_ps(), unord = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        unord = _mm256_or_ps(unord, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    r = _mm_max_ss(r, _mm_movehdup_ps(r));
    const int nan = _mm256_movemask_ps(unord) != 0;
    const float s = nan ? NAN : _mm_cvtss_f32(r) / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
    for (int i = 0; i < 4; i++)
        qi[i] = nan ? _mm256_setzero_si256()
                    : _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_permutevar8x32_ps(v[i], split), _mm256_set1_ps(inv)));
    __m256i t = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    *scale = s;
    return _mm_cvtsi128_si32(h);
}

/* prepare_512's numbers for AVX2 hosts at chunk 64 (a NaN group's scale NaN), 8 at a time: the scalar
   loop it replaces (lrintf per value) took longer than the multiplication itself on a small matrix. */
T256 static void prepare_256(const float *x, int M, int K, int g, prepared *p) {
    const int lanes = K / 8, padded = (K / g + 15) & ~15;
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * K;
        int8_t *qm = p->q + (size_t)m * K;
        float *sx = p->lane_sx + (size_t)m * lanes, *gs = p->gsum + (size_t)m * padded;
        for (int b = 0; b < K / XG; b++) {
            __m256i qi[4];
            float s;
            const int qsum = x_group_256(xm + b * XG, qi, &s);
            const int k0 = b * XG, c0 = k0 - k0 % 64, r0 = k0 - c0;
            /* evens of vectors 0-1 | 2-3 and odds likewise, as int32 in k order */
            __m256i e01 = _mm256_permute2x128_si256(qi[0], qi[1], 0x20), o01 = _mm256_permute2x128_si256(qi[0], qi[1], 0x31);
            __m256i e23 = _mm256_permute2x128_si256(qi[2], qi[3], 0x20), o23 = _mm256_permute2x128_si256(qi[2], qi[3], 0x31);
            /* int32 -> int8 (values within +-127: no saturation); packs work per 128-bit lane, the permutes undo it */
            __m256i e16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(e01, e23), 0xd8);
            __m256i o16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(o01, o23), 0xd8);
            __m256i b8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(e16, o16), 0xd8); /* 16 evens, 16 odds */
            _mm_storeu_si128((__m128i *)(qm + c0 + r0 / 2), _mm256_castsi256_si128(b8));
            _mm_storeu_si128((__m128i *)(qm + c0 + 32 + r0 / 2), _mm256_extracti128_si256(b8, 1));
            for (int l = 0; l < XG / 8; l++) sx[b * (XG / 8) + l] = s;
            /* the zero term takes the quantized x too: the error is then w (x - xq), not (code * scale) (x - xq),
               about 2.5x smaller (codes sit above the zero, their products do not cancel) */
            gs[k0 / g] += s * (float)qsum;
        }
    }
}

T256 static inline __attribute__((always_inline)) void widen_256(const void *src, int f32, size_t at, int count, float *out) {
    int j = 0;
    if (f32) {
        memcpy(out, (const float *)src + at, sizeof(float) * (size_t)count);
        j = count;
    } else {
        const uint16_t *h = (const uint16_t *)src + at;
        for (; j + 8 <= count; j += 8)
            _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
        for (; j < count; j++) out[j] = half_to_float(h[j]);
    }
    for (; j < ((count + 15) & ~15); j++) out[j] = 0.f;
}

T256 static inline float hsum_256(__m256 a) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

T256 static inline __attribute__((always_inline)) float dot_256(const float *a, const float *b, int count) {
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < count; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
    return hsum_256(acc);
}

/* A chunk's weight-scale vector for lane d (k in [64c + 8d, +8)): from g = 64 on one group holds the whole chunk, a
   broadcast; at g = 32 lanes 0-3 and 4-7 fall in two groups. */
T256 static inline __m256 chunk_scales_256(const float *sw, int c, int gshift) {
    if (gshift >= 6) return _mm256_broadcast_ss(sw + ((c * 64) >> gshift));
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(sw + ((c * 64) >> gshift)),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* One chunk's int32 lane sums of codes x xq: VPMADDUBSW's int16 pair sums of the even and odd halves (each below
   2 x 15 x 127), added, then VPMADDWD against ones. */
T256 static inline __m256i chunk_dot_256(__m256i v, __m256i q0, __m256i q1) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    __asm__("" : "+x"(v)); /* the codes once, in a register: GCC otherwise read them from memory again for the low
                              nibbles' AND, a second load of every chunk (same bits either way) */
    __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
#ifdef FE_AVX_VNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, q0), hi, q1);
#else
    __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo, q0), _mm256_maddubs_epi16(hi, q1));
    return _mm256_madd_epi16(d, _mm256_set1_epi16(1));
#endif
}

/* ``mt`` x rows against one weight row, even and odd chunks in two FMA chains per row (as tile_512: one chain kept
   each row's FMAs waiting on the last one's latency), added at the end. */
T256 static inline __attribute__((always_inline)) void tile_256(const uint8_t *wr, const float *sw, int chunks,
                                                                 int gshift, const prepared *p, int m0, int mt,
                                                                 int K, float *out, int cs) {
    const int lanes = K / 8;
    __m256 acc0[MT], acc1[MT];
    for (int i = 0; i < mt; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
#define TILE_256_CHUNK(c, acc)                                                                                 \
    do {                                                                                                       \
        const uint8_t *at = wr + (size_t)((c) >> 1) * cs + ((c) & 1) * 32; /* half of a 64-byte chunk */       \
        _mm_prefetch((const char *)(at + PREFETCH), _MM_HINT_T0);                                              \
        __m256i v = _mm256_loadu_si256((const __m256i *)at);                                                   \
        __m256 swv = chunk_scales_256(sw, (c), gshift);                                                        \
        for (int i = 0; i < mt; i++) {                                                                         \
            const int8_t *q = p->q + (size_t)(m0 + i) * K + (c) * 64;                                          \
            __m256i d = chunk_dot_256(v, _mm256_loadu_si256((const __m256i *)q),                               \
                                      _mm256_loadu_si256((const __m256i *)(q + 32)));                          \
            __m256 s = _mm256_mul_ps(swv, _mm256_loadu_ps(p->lane_sx + (size_t)(m0 + i) * lanes + (c) * 8));   \
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[i]);                                        \
        }                                                                                                      \
    } while (0)
    int c = 0;
    for (; c + 1 < chunks; c += 2) {
        TILE_256_CHUNK(c, acc0);
        TILE_256_CHUNK(c + 1, acc1);
    }
    if (c < chunks) TILE_256_CHUNK(c, acc0);
#undef TILE_256_CHUNK
    for (int i = 0; i < mt; i++) out[i] = hsum_256(_mm256_add_ps(acc0[i], acc1[i]));
}

/* One weight row's 64-byte chunk i (at ``w``) against x's (its codes q0-q3 and lane scales x0, x1) into the row's
   two accumulators: row1_256's step, which row4_256 takes for each of its rows, so both keep its products in its
   order. */
T256 static inline __attribute__((always_inline)) void chunk_pair_256(const uint8_t *w, const float *sw, int i,
                                                                       const int gshift, __m256i q0, __m256i q1,
                                                                       __m256i q2, __m256i q3, __m256 x0, __m256 x1,
                                                                       __m256 *acc0, __m256 *acc1) {
    __m256 s0, s1;
    if (gshift == 7) {
        s0 = s1 = _mm256_broadcast_ss(sw + i);
    } else {
        s0 = chunk_scales_256(sw, 2 * i, gshift);
        s1 = chunk_scales_256(sw, 2 * i + 1, gshift);
    }
    __m256i d0 = chunk_dot_256(_mm256_loadu_si256((const __m256i *)w), q0, q1);
    *acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(s0, x0), *acc0);
    __m256i d1 = chunk_dot_256(_mm256_loadu_si256((const __m256i *)(w + 32)), q2, q3);
    *acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(s1, x1), *acc1);
}

/* tile_256 at one x row, written for the compiler: pointers that advance instead of indices, the chunk pair's scales
   taken once where one group spans both chunks (g = 128), K a multiple of 128 (chunk pairs, no tail). The same
   products in the same order as tile_256 at mt = 1, so the same bits. */
T256 static inline __attribute__((always_inline)) float row1_256(const uint8_t *wr, const float *sw, int pairs,
                                                                  const int gshift, const int8_t *q, const float *sx,
                                                                  int cs) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int i = 0; i < pairs; i++, wr += cs, q += 128, sx += 16) {
        _mm_prefetch((const char *)(wr + PREFETCH), _MM_HINT_T0);
        chunk_pair_256(wr, sw, i, gshift, _mm256_loadu_si256((const __m256i *)q),
                       _mm256_loadu_si256((const __m256i *)(q + 32)), _mm256_loadu_si256((const __m256i *)(q + 64)),
                       _mm256_loadu_si256((const __m256i *)(q + 96)), _mm256_loadu_ps(sx), _mm256_loadu_ps(sx + 8),
                       &acc0, &acc1);
    }
    return hsum_256(_mm256_add_ps(acc0, acc1));
}

/* row1_256 for the four rows of one group in rows of four (code_at): the group's chunks are one stream, chunk i of
   row r at 256 i + 64 r, and each chunk of x (its codes and lane scales) is loaded once for the four rows. Every
   row's products, sums and their order are row1_256's, so the same bits. ``sw``: the four rows' widened scales,
   ``stride`` floats apart. */
T256 static inline __attribute__((always_inline)) void row4_256(const uint8_t *wr, const float *sw, int stride,
                                                                 int pairs, const int gshift, const int8_t *q,
                                                                 const float *sx, float *out) {
    __m256 acc0[4], acc1[4];
    for (int r = 0; r < 4; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int i = 0; i < pairs; i++, wr += 256, q += 128, sx += 16) {
        _mm_prefetch((const char *)(wr + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(wr + PREFETCH + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(wr + PREFETCH + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(wr + PREFETCH + 192), _MM_HINT_T0);
        const __m256i q0 = _mm256_loadu_si256((const __m256i *)q), q1 = _mm256_loadu_si256((const __m256i *)(q + 32));
        const __m256i q2 = _mm256_loadu_si256((const __m256i *)(q + 64));
        const __m256i q3 = _mm256_loadu_si256((const __m256i *)(q + 96));
        const __m256 x0 = _mm256_loadu_ps(sx), x1 = _mm256_loadu_ps(sx + 8);
        for (int r = 0; r < 4; r++)
            chunk_pair_256(wr + 64 * r, sw + r * stride, i, gshift, q0, q1, q2, q3, x0, x1, &acc0[r], &acc1[r]);
    }
    for (int r = 0; r < 4; r++) out[r] = hsum_256(_mm256_add_ps(acc0[r], acc1[r]));
}

/* AVX2's rows for a group size ``g`` that is a constant after inlining (the switch in rows_256): each chunk's scale
   address is then a constant shift, where a run-time one cost a variable shift, a sign extension and a branch per
   chunk and row (about as many scalar instructions as vector ones). One x row takes its weight rows one at a time:
   on a 2-vCPU Zen 3 four rows a pass (rows_512's R1, which loads each chunk of x once for them) streamed about a
   quarter slower from DRAM than one, the four interleaved streams most likely costing the hardware prefetcher more
   than the shared loads save, though it was ahead on matrices held in L2 (docs/measured-choices.md). In rows of
   four the four rows are one stream, so there they go four at a time (row4_256), each x row in turn over a group
   still in L1 (ROWS_BODY would read each of its rows 64 bytes in 256). Which layout an AVX2 host keeps is
   rows_of_four_pay's: on a Zen 5 made to run this path rows of four streamed as fast or faster at one x row, 1-8%
   slower at two, and a decode token took the same time either way, so the portable one until an AVX2 host measures
   otherwise (docs/cpu-profile.md). */
T256 static inline __attribute__((always_inline)) void rows_g_256(const uint8_t *codes, wscales w, int n0, int n1,
                                                                   int N, int K, const int g, const prepared *p,
                                                                   int M, yout y) {
    if (M == 1 || w.r4) {
        const int groups = K / g, padded = (groups + 15) & ~15, gshift = __builtin_ctz(g), stride = K / 32 + 32;
        float sw[BLOCK * stride], zw[BLOCK * stride];
        for (int n = n0; n < n1; n++) {
            widen_256(w.scale, w.f32, (size_t)n * groups, groups, sw + (n - n0) * stride);
            widen_256(w.zero, w.f32, (size_t)n * groups, groups, zw + (n - n0) * stride);
        }
        const size_t total = (size_t)N * (K / 2);
        int n = n0;
        /* rows of four: whole groups (n0 is a multiple of BLOCK), each x row in turn on a group still in L1 */
        for (; w.r4 && n + 4 <= n1 && n + 4 <= (N & ~3); n += 4) {
            const size_t at = (size_t)n * (K / 2) + TOUCH_AHEAD;
            if (at < total) __asm__ volatile("" : : "r"(*(volatile const uint8_t *)(codes + at)));
            for (int m = 0; m < M; m++) {
                float sums[4];
                row4_256(codes + code_at(n, 0, K, N, 1), sw + (n - n0) * stride, stride, K / 128, gshift,
                         p->q + (size_t)m * K, p->lane_sx + (size_t)m * (K / 8), sums);
                for (int r = 0; r < 4; r++)
                    y_put(y, (size_t)m * N + n + r,
                          sums[r] + dot_256(zw + (n + r - n0) * stride, p->gsum + (size_t)m * padded, padded));
            }
        }
        for (; n < n1; n++) {
            const size_t at = (size_t)n * (K / 2) + TOUCH_AHEAD;
            if ((n - n0) % 4 == 0 && at < total) /* as rows_512, once per 4 rows; inside the matrix only */
                __asm__ volatile("" : : "r"(*(volatile const uint8_t *)(codes + at)));
            for (int m = 0; m < M; m++) {
                const float sum = row1_256(codes + code_at(n, 0, K, N, w.r4), sw + (n - n0) * stride, K / 128, gshift,
                                           p->q + (size_t)m * K, p->lane_sx + (size_t)m * (K / 8),
                                           chunk_stride(n, N, w.r4));
                y_put(y, (size_t)m * N + n, sum + dot_256(zw + (n - n0) * stride, p->gsum + (size_t)m * padded, padded));
            }
        }
        return;
    }
    ROWS_BODY(widen_256, tile_256, dot_256, 64)
}

T256 static void rows_256(const uint8_t *codes, wscales w, int n0, int n1, int N,
                          int K, int g, const prepared *p, int M, yout y) {
    switch (g) {
    case 32: rows_g_256(codes, w, n0, n1, N, K, 32, p, M, y); return;
    case 64: rows_g_256(codes, w, n0, n1, N, K, 64, p, M, y); return;
    default: rows_g_256(codes, w, n0, n1, N, K, 128, p, M, y); return;
    }
}

/* Prefill (several x rows): a register-tiled GEMM. Each 32-bit lane of a vector is one weight row, so a lane's
   int32 sum runs over a whole x group (32 k: eight VPDPBUSD) before one float conversion, where the row kernel
   above converts every 8 k; weights are unpacked once per MT_GEMM x rows. A lane's four bytes are the portable
   layout's 32-bit word for k in [8j, 8j + 8): low nibbles the even k, high nibbles the odd k, so the weights need
   only a transpose of 32-bit words (16 rows x 16 words at a time, per block, into a scratch that stays in L1/L2)
   and x is deinterleaved per 8 values (4 even, then 4 odd: each half one broadcast 32-bit word). */

#define MT_GEMM 8    /* x rows per pass over a block of 16 weight rows */

typedef struct {
    int8_t *q;     /* [M][K]: per 8 k, the 4 even then the 4 odd values */
    float *sx;     /* [M][K/32]: x scale per group of 32 */
    float *gsum;   /* [M][K/g]: sum of the dequantized x per weight group (the zero term) */
} prepared_gemm;

T512 static void prepare_gemm_512(const float *x, int M, int K, int g, prepared_gemm *p) {
    const int groups = K / g;
    /* output position i of a group of 32 takes input 8t + 2i' (i' = i % 8 < 4) or 8t + 2(i' - 4) + 1 */
    const __m512i lo_idx = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const __m512i hi_idx = _mm512_setr_epi32(16, 18, 20, 22, 17, 19, 21, 23, 24, 26, 28, 30, 25, 27, 29, 31);
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * K;
        int8_t *qm = p->q + (size_t)m * K;
        float *sx = p->sx + (size_t)m * (K / XG), *gs = p->gsum + (size_t)m * groups;
        for (int G = 0; G < groups; G++) gs[G] = 0.f;
        for (int b = 0; b < K / XG; b++) {
            __m512 a = _mm512_loadu_ps(xm + b * XG), c = _mm512_loadu_ps(xm + b * XG + 16);
            float inv, s = x_scale_512(a, c, &inv);
            __m512 vi = _mm512_set1_ps(inv);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(a, lo_idx, c), vi));
            __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(a, hi_idx, c), vi));
            _mm_storeu_si128((__m128i *)(qm + b * XG), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(qm + b * XG + 16), _mm512_cvtsepi32_epi8(q1));
            sx[b] = s;
            gs[b * XG / g] += s * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
    }
}

/* The first half of a transpose of 32-bit words, for either vector width (P: the intrinsics' prefix): afterwards each
   128-bit lane of r[4a + b] holds word b of that lane's 4 words in rows 4a..4a+3 (a 4 x 4 transpose per lane). */
#define TRANSPOSE_4X4_IN_LANES(r, t, n, P)                                                                     \
    for (int i = 0; i < n; i += 2) {                                                                           \
        t[i] = P##_unpacklo_epi32(r[i], r[i + 1]);                                                             \
        t[i + 1] = P##_unpackhi_epi32(r[i], r[i + 1]);                                                         \
    }                                                                                                          \
    for (int i = 0; i < n; i += 4) {                                                                           \
        r[i] = P##_unpacklo_epi64(t[i], t[i + 2]);                                                             \
        r[i + 1] = P##_unpackhi_epi64(t[i], t[i + 2]);                                                         \
        r[i + 2] = P##_unpacklo_epi64(t[i + 1], t[i + 3]);                                                     \
        r[i + 3] = P##_unpackhi_epi64(t[i + 1], t[i + 3]);                                                     \
    }

/* 16 x 16 transpose of 32-bit words: r[i] holds row i's words; afterwards r[j] holds word j of rows 0..15. */
T512 static inline __attribute__((always_inline)) void transpose16_512(__m512i r[16]) {
    __m512i t[16];
    TRANSPOSE_4X4_IN_LANES(r, t, 16, _mm512)
    /* now r[4a + b] holds, in its 128-bit lane L, word 4L + b of rows 4a..4a+3: move the 128-bit lanes across a */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* Rows n0..n0+15 (rows past N read as zero) into the scratch: words [K/8][16], scales and zeros [K/g][16] fp32. */
T512 static void block_512(const uint8_t *codes, wscales w, int n0, int N, int K,
                           int g, uint32_t *wt, float *swt, float *zwt) {
    const int words = K / 8, groups = K / g, valid = N - n0 < 16 ? N - n0 : 16;
    const int next = N - n0 - 16 <= 0 ? 0 : N - n0 - 16 < 16 ? N - n0 - 16 : 16;
    for (int j0 = 0; j0 < words; j0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < valid ? _mm512_loadu_si512(codes + code_at(n0 + i, 4 * (size_t)j0, K, N, w.r4))
                             : _mm512_setzero_si512();
        /* the next block's same bytes into L2 meanwhile: they land while this block computes (without it, each block
           waited on DRAM with the multiplier idle: 8 rows of Qwen's lm_head 16.8-17.5 ms, with it 13.6-14.3) */
        for (int i = 0; i < next; i++)
            _mm_prefetch((const char *)(codes + code_at(n0 + 16 + i, 4 * (size_t)j0, K, N, w.r4)), _MM_HINT_T1);
        transpose16_512(r);
        for (int j = 0; j < 16; j++) _mm512_storeu_si512(wt + (size_t)(j0 + j) * 16, r[j]);
    }
    /* scales and zeros: each row's groups to fp32 (16 at a time), then 16 x 16 transposes into group-major */
    for (int G0 = 0; G0 < groups; G0 += 16) {
        const int count = groups - G0 < 16 ? groups - G0 : 16;
        const __mmask16 k = (__mmask16)((1u << count) - 1);
        for (int which = 0; which < 2; which++) {
            const void *src = which ? w.zero : w.scale;
            float *dst = which ? zwt : swt;
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const size_t at = (size_t)(n0 + i) * groups + G0;
                r[i] = i >= valid ? _mm512_setzero_si512()
                       : w.f32    ? _mm512_maskz_loadu_epi32(k, (const float *)src + at)
                                  : _mm512_castps_si512(_mm512_cvtph_ps(
                                     _mm256_maskz_loadu_epi16(k, (const uint16_t *)src + at)));
            }
            transpose16_512(r);
            for (int G = 0; G < count; G++) _mm512_storeu_si512(dst + (size_t)(G0 + G) * 16, r[G]);
        }
    }
}

/* bf16_of on 16 lanes (the tiled GEMM's bf16 y, the experts' SiLU product). */
T512 static inline __m256i bf16_of_512(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)),
                                                   _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))),
                                  16);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* ``mt`` (a constant after inlining) x rows from m0 against the block in the scratch: y[m0 + i][n0 .. n0 + 15]. */
T512 static inline __attribute__((always_inline)) void gemm_tile_512(const uint32_t *wt, const float *swt,
                                                                      const float *zwt, int K, int gshift,
                                                                      const prepared_gemm *p, int m0, int mt,
                                                                      yout y, int N, int n0) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    const int groups = K >> gshift, xgroups = K / XG;
    __m512 acc[MT_GEMM];
    const int8_t *xq[MT_GEMM];
    for (int i = 0; i < mt; i++) {
        acc[i] = _mm512_setzero_ps();
        xq[i] = p->q + (size_t)(m0 + i) * K;
    }
    for (int b = 0; b < xgroups; b++) {
        __m512i ae[MT_GEMM]; /* one chain per x row: 8 rows keep the multiplier busy, and registers stay free */
        for (int i = 0; i < mt; i++) ae[i] = _mm512_setzero_si512();
        for (int jj = 0; jj < 4; jj++) {
            const int j = 4 * b + jj;
            __m512i v = _mm512_loadu_si512(wt + (size_t)j * 16);
            __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            for (int i = 0; i < mt; i++) {
                int32_t e, o;
                memcpy(&e, xq[i] + 8 * j, 4);
                memcpy(&o, xq[i] + 8 * j + 4, 4);
                ae[i] = _mm512_dpbusd_epi32(ae[i], lo, _mm512_set1_epi32(e));
                ae[i] = _mm512_dpbusd_epi32(ae[i], hi, _mm512_set1_epi32(o));
            }
        }
        __m512 s = _mm512_loadu_ps(swt + ((b * XG) >> gshift) * 16);
        for (int i = 0; i < mt; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ae[i]),
                                     _mm512_mul_ps(s, _mm512_set1_ps(p->sx[(size_t)(m0 + i) * xgroups + b])), acc[i]);
    }
    for (int G = 0; G < groups; G++) {
        __m512 z = _mm512_loadu_ps(zwt + G * 16);
        for (int i = 0; i < mt; i++)
            acc[i] = _mm512_fmadd_ps(z, _mm512_set1_ps(p->gsum[(size_t)(m0 + i) * groups + G]), acc[i]);
    }
    const __mmask16 keep = N - n0 >= 16 ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
    for (int i = 0; i < mt; i++) {
        const size_t at = (size_t)(m0 + i) * N + n0;
        if (y.bf16) {
            _mm256_mask_storeu_epi16((uint16_t *)y.p + at, keep, bf16_of_512(acc[i]));
        } else {
            _mm512_mask_storeu_ps((float *)y.p + at, keep, acc[i]);
        }
    }
}

/* Row blocks t0..t1 of W (WIDTH rows each) against every x row, for one instruction set (BLOCK, TILE: its helpers;
   MT: x rows per tile): each block laid into the scratch once, then every x tile against it. The switch gives each
   tile size its own constant mt, so the accumulators stay in registers (sizes above MT are never reached). */
#define GEMM_ROWS_BODY(BLOCK, TILE, WIDTH, MT)                                                                 \
    const int gshift = __builtin_ctz(g);                                                                       \
    for (int t = t0; t < t1; t++) {                                                                            \
        const int n0 = t * WIDTH;                                                                              \
        BLOCK(codes, w, n0, N, K, g, wt, swt, zwt);                                                             \
        for (int m0 = 0; m0 < M; m0 += MT) {                                                                   \
            switch (M - m0 < MT ? M - m0 : MT) {                                                               \
            case 8: TILE(wt, swt, zwt, K, gshift, p, m0, 8 <= MT ? 8 : 1, y, N, n0); break;                   \
            case 7: TILE(wt, swt, zwt, K, gshift, p, m0, 7 <= MT ? 7 : 1, y, N, n0); break;                   \
            case 6: TILE(wt, swt, zwt, K, gshift, p, m0, 6 <= MT ? 6 : 1, y, N, n0); break;                   \
            case 5: TILE(wt, swt, zwt, K, gshift, p, m0, 5 <= MT ? 5 : 1, y, N, n0); break;                   \
            case 4: TILE(wt, swt, zwt, K, gshift, p, m0, 4, y, N, n0); break;                                  \
            case 3: TILE(wt, swt, zwt, K, gshift, p, m0, 3, y, N, n0); break;                                  \
            case 2: TILE(wt, swt, zwt, K, gshift, p, m0, 2, y, N, n0); break;                                  \
            default: TILE(wt, swt, zwt, K, gshift, p, m0, 1, y, N, n0); break;                                 \
            }                                                                                                  \
        }                                                                                                      \
    }

T512 static void gemm_rows_512(const uint8_t *codes, wscales w, int t0, int t1,
                               int N, int K, int g, const prepared_gemm *p, int M, yout y, uint32_t *wt,
                               float *swt, float *zwt) {
    GEMM_ROWS_BODY(block_512, gemm_tile_512, 16, MT_GEMM)
}

/* The same GEMM on AVX2 (AMD hosts without AVX-512): 8 weight rows a vector; VPMADDUBSW's int16 pair sums of a
   whole x group stay below 2^15 (8 x 2 x 15 x 127 = 30480), so one VPMADDWD per group turns them into int32. */

#define MT_GEMM_256 4 /* x rows per pass: 16 ymm registers hold 2 per row and the weights */

/* prepare_gemm_512's numbers for AVX2 hosts (a NaN group's scale NaN), 8 at a time: each 8 x values
   permuted to their 4 even then 4 odd, which is the layout itself. */
T256 static void prepare_gemm_256(const float *x, int M, int K, int g, prepared_gemm *p) {
    const int groups = K / g;
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' per-lane interleave */
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * K;
        int8_t *qm = p->q + (size_t)m * K;
        float *sx = p->sx + (size_t)m * (K / XG), *gs = p->gsum + (size_t)m * groups;
        for (int G = 0; G < groups; G++) gs[G] = 0.f;
        for (int b = 0; b < K / XG; b++) {
            __m256i qi[4];
            float s;
            const int qsum = x_group_256(xm + b * XG, qi, &s);
            __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
            _mm256_storeu_si256((__m256i *)(qm + b * XG), _mm256_permutevar8x32_epi32(b8, order));
            sx[b] = s;
            gs[b * XG / g] += s * (float)qsum;
        }
    }
}

/* 8 x 8 transpose of 32-bit words, as transpose16_512. */
T256 static inline __attribute__((always_inline)) void transpose8_256(__m256i r[8]) {
    __m256i t[8];
    TRANSPOSE_4X4_IN_LANES(r, t, 8, _mm256)
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}

T256 static void block_256(const uint8_t *codes, wscales w, int n0, int N, int K,
                           int g, uint32_t *wt, float *swt, float *zwt) {
    const int words = K / 8, groups = K / g, valid = N - n0 < 8 ? N - n0 : 8;
    for (int j0 = 0; j0 < words; j0 += 8) {
        __m256i r[8];
        for (int i = 0; i < 8; i++)
            r[i] = i < valid ? _mm256_loadu_si256((const __m256i *)(codes + code_at(n0 + i, 4 * (size_t)j0, K, N,
                                                                                         w.r4)))
                             : _mm256_setzero_si256();
        transpose8_256(r);
        for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(wt + (size_t)(j0 + j) * 8), r[j]);
    }
    for (int G0 = 0; G0 < groups; G0 += 8) { /* as block_512: per row to fp32, then 8 x 8 transposes */
        const int count = groups - G0 < 8 ? groups - G0 : 8;
        for (int which = 0; which < 2; which++) {
            const void *src = which ? w.zero : w.scale;
            float *dst = which ? zwt : swt;
            const size_t size = w.f32 ? 4 : 2;
            __m256i r[8];
            for (int i = 0; i < 8; i++) {
                union { uint16_t h[8]; float f[8]; } row = {{0}}; /* f: room for 8 fp32 groups, or h: 8 fp16 */
                if (i < valid)
                    memcpy(&row, (const char *)src + ((size_t)(n0 + i) * groups + G0) * size, size * (size_t)count);
                r[i] = _mm256_castps_si256(w.f32 ? _mm256_loadu_ps(row.f)
                                                 : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)row.h)));
            }
            transpose8_256(r);
            for (int G = 0; G < count; G++) _mm256_storeu_si256((__m256i *)(dst + (size_t)(G0 + G) * 8), r[G]);
        }
    }
}

#ifdef FE_AVX_VNNI
#define GROUP_SUM_256(a, ones) ((void)(ones), (a))
#else
#define GROUP_SUM_256(a, ones) _mm256_madd_epi16((a), (ones))
#endif

T256 static inline __attribute__((always_inline)) void gemm_tile_256(const uint32_t *wt, const float *swt,
                                                                      const float *zwt, int K, int gshift,
                                                                      const prepared_gemm *p, int m0, int mt,
                                                                      yout y, int N, int n0) {
    const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int groups = K >> gshift, xgroups = K / XG;
    __m256 acc[MT_GEMM_256];
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < xgroups; b++) {
        __m256i a16[MT_GEMM_256]; /* with AVX-VNNI int32 sums */
        for (int i = 0; i < mt; i++) a16[i] = _mm256_setzero_si256();
        for (int jj = 0; jj < 4; jj++) {
            const int j = 4 * b + jj;
            __m256i v = _mm256_loadu_si256((const __m256i *)(wt + (size_t)j * 8));
            __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            for (int i = 0; i < mt; i++) {
                int32_t e, o;
                const int8_t *q = p->q + (size_t)(m0 + i) * K + 8 * j;
                memcpy(&e, q, 4);
                memcpy(&o, q + 4, 4);
#ifdef FE_AVX_VNNI /* the group's same integers (two chains a row, even and odd k, were no faster) */
                a16[i] = _mm256_dpbusd_avx_epi32(a16[i], lo, _mm256_set1_epi32(e));
                a16[i] = _mm256_dpbusd_avx_epi32(a16[i], hi, _mm256_set1_epi32(o));
#else
                a16[i] = _mm256_add_epi16(a16[i], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(e)));
                a16[i] = _mm256_add_epi16(a16[i], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(o)));
#endif
                /* the sum in a register here: without it GCC reassociates the group's 32 products per tile into one
                   tree, computing them all first and spilling most to the stack (exact either way: int16 adds wrap) */
                __asm__("" : "+x"(a16[i]));
            }
        }
        __m256 s = _mm256_loadu_ps(swt + ((b * XG) >> gshift) * 8);
        for (int i = 0; i < mt; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(GROUP_SUM_256(a16[i], ones)),
                                     _mm256_mul_ps(s, _mm256_set1_ps(p->sx[(size_t)(m0 + i) * xgroups + b])), acc[i]);
    }
    for (int G = 0; G < groups; G++) {
        __m256 z = _mm256_loadu_ps(zwt + G * 8);
        for (int i = 0; i < mt; i++)
            acc[i] = _mm256_fmadd_ps(z, _mm256_set1_ps(p->gsum[(size_t)(m0 + i) * groups + G]), acc[i]);
    }
    for (int i = 0; i < mt; i++) {
        const size_t at = (size_t)(m0 + i) * N + n0;
        if (!y.bf16 && N - n0 >= 8) {
            _mm256_storeu_ps((float *)y.p + at, acc[i]);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, acc[i]);
            for (int c = 0; c < 8 && c < N - n0; c++) y_put(y, at + c, tmp[c]);
        }
    }
}

T256 static void gemm_rows_256(const uint8_t *codes, wscales w, int t0, int t1,
                               int N, int K, int g, const prepared_gemm *p, int M, yout y, uint32_t *wt,
                               float *swt, float *zwt) {
    GEMM_ROWS_BODY(block_256, gemm_tile_256, 8, MT_GEMM_256)
}

/* The tiled GEMM for either instruction set: x prepared once, then each thread a contiguous run of row blocks
   (as schedule(static) would split them), with its own scratch for the block being multiplied. */
static int gemm_tiled(const uint8_t *codes, wscales w, int N, int K, int g,
                      const float *x, int M, yout y, int threads, int isa) {
    prepared_gemm p;
    const int width = isa == 2 ? 16 : 8, groups = K / g, tasks = (N + width - 1) / width;
    p.q = malloc((size_t)M * K);
    p.sx = malloc(sizeof(float) * (size_t)M * (K / XG));
    p.gsum = malloc(sizeof(float) * (size_t)M * groups);
    const size_t words = (size_t)K / 8 * width * 4, scratch = words + sizeof(float) * 2 * width * (size_t)groups;
    int failed = !p.q || !p.sx || !p.gsum;
    if (!failed) {
        if (isa == 2)
            prepare_gemm_512(x, M, K, g, &p);
        else
            prepare_gemm_256(x, M, K, g, &p);
        int nt = threads > 1 && tasks > 1 ? (threads < tasks ? threads : tasks) : 1;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
        {
            uint8_t *buf = aligned_alloc(64, (scratch + 63) & ~(size_t)63);
            if (!buf) {
                failed = 1;
            } else {
#ifdef _OPENMP
                int me = omp_get_thread_num(), all = omp_get_num_threads();
#else
                int me = 0, all = 1;
#endif
                int t0 = (int)((long)tasks * me / all), t1 = (int)((long)tasks * (me + 1) / all);
                float *swt = (float *)(buf + words), *zwt = swt + width * (size_t)groups;
                if (isa == 2)
                    gemm_rows_512(codes, w, t0, t1, N, K, g, &p, M, y, (uint32_t *)buf, swt, zwt);
                else
                    gemm_rows_256(codes, w, t0, t1, N, K, g, &p, M, y, (uint32_t *)buf, swt, zwt);
                free(buf);
            }
        }
    }
    free(p.q); free(p.sx); free(p.gsum);
    return failed ? -1 : 0;
}

/* From how many x rows on the tiled GEMM beats the row kernel, timed on 1408x2048 to 4096x14336 matrices at one
   thread (research/bench_kernels.py): AVX-512 from 3 rows (1.1-1.9x at 3-4 rows, 1.7-3.1x at 16-64),
   AVX2 from 8 (1.1-1.3x at 8, 1.4-1.7x at 16-64). 0: these defaults; fe_int4_set_gemm_min_rows overrides them. */
static int gemm_min_rows = 0;

void fe_int4_set_gemm_min_rows(int rows) { gemm_min_rows = rows; }

/* 2: AVX512-VNNI, 1: AVX2, 0: neither (the caller uses another kernel). */
int fe_int4_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
        return 2;
#ifdef FE_AVX_VNNI
    if (!__builtin_cpu_supports("avxvnni")) return 0;
#endif
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

/* fe_int4_gemm on fp32 x and y: the row kernel for few rows, the tiled GEMM from gemm_min_rows on. */
static int gemm_f32(const uint8_t *codes, wscales w, int N, int K, int g,
                    const float *x, int M, yout y, int threads, int isa) {
    if (M >= (gemm_min_rows > 0 ? gemm_min_rows : isa == 2 ? 3 : 8))
        return gemm_tiled(codes, w, N, K, g, x, M, y, threads, isa);
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
        prepare_256(x, M, K, g, &p);
    const int block = BLOCK;
    int tasks = (N + block - 1) / block;
    /* guided: a worker that wakes late (it slept through the Python between calls) takes fewer blocks instead of
       the thread that came first waiting for its half, in long runs of rows while much is left (few shared-counter
       steps, the next block prefetched is mostly the thread's own); each row is still one thread's: the same bits */
#pragma omp parallel for schedule(guided) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int t = 0; t < tasks; t++) {
        int n0 = t * block, n1 = n0 + block < N ? n0 + block : N;
        if (isa == 2)
            rows_512(codes, w, n0, n1, N, K, g, &p, M, y);
        else
            rows_256(codes, w, n0, n1, N, K, g, &p, M, y);
    }
    free(p.q); free(p.lane_sx); free(p.gsum);
    return 0;
}

/* bf16 -> fp32 is exact. */
static void bf16_to_f32(const uint16_t *in, size_t count, float *out) {
    for (size_t i = 0; i < count; i++) {
        uint32_t bits = (uint32_t)in[i] << 16;
        memcpy(out + i, &bits, 4);
    }
}

/* y[M, N] = x[M, kx] @ W.T for W [N, K] whose columns past kx are zero (a matrix padded to K, a multiple of 128);
   x and y are fp32, or bf16 where x_bf16 / y_bf16 say so. Widening and padding happen here in one pass and the
   kernels write a bf16 y themselves, so a bf16 model pays no tensor conversions around each call. ``flags``: 1 for
   fp32 scales and zeros (else fp16), 2 for codes in rows of four (r4, code_at). Returns 0, or -1 for shapes it does
   not take (K % 128, kx > K, g not 32/64/128) or an allocation failure. */
int fe_int4_gemm(const uint8_t *codes, const void *scale, const void *zero, int flags, int N, int K, int g,
                 const void *x, int x_bf16, int kx, int M, void *y, int y_bf16, int threads, int isa) {
    if (K % 128 || (g != 32 && g != 64 && g != 128) || kx <= 0 || kx > K || M <= 0 || N <= 0 || isa <= 0) return -1;
    const int copy = x_bf16 || kx != K;
    float *xf = copy ? malloc(sizeof(float) * (size_t)M * K) : (float *)x;
    int rc = -1;
    if (xf) {
        for (int m = 0; copy && m < M; m++) {
            float *row = xf + (size_t)m * K;
            if (x_bf16)
                bf16_to_f32((const uint16_t *)x + (size_t)m * kx, kx, row);
            else
                memcpy(row, (const float *)x + (size_t)m * kx, sizeof(float) * kx);
            memset(row + kx, 0, sizeof(float) * (size_t)(K - kx));
        }
        rc = gemm_f32(codes, (wscales){scale, zero, flags & 1, (flags >> 1) & 1}, N, K, g, xf, M, (yout){y, y_bf16},
                      threads, isa);
    }
    if (copy) free(xf);
    return rc;
}

/* ``G`` independent fe_int4_gemm calls (a MoE layer's experts, each on its own rows), one thread each: the threads
   share out whole matrices (dynamic: rows per matrix differ) instead of splitting each one, so a step of many small
   expert GEMMs pays one parallel region, not one (and a barrier) per matrix. ``table``: per call, 13 int64 fields in
   fe_int4_gemm's argument order (codes, scale, zero, flags, N, K, g, x, x_bf16, kx, M, y, y_bf16). Fewer
   calls than threads: each call is split across the threads instead. Returns 0, or -1 if any call failed. */
int fe_int4_gemm_grouped(int G, const int64_t *table, int threads, int isa) {
    int failed = 0;
    const int across = threads > 1 && G >= threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (across) reduction(| : failed)
    for (int i = 0; i < G; i++) {
        const int64_t *a = table + 13 * (size_t)i;
        failed |= fe_int4_gemm((const uint8_t *)(intptr_t)a[0], (const void *)(intptr_t)a[1],
                               (const void *)(intptr_t)a[2], (int)a[3], (int)a[4], (int)a[5], (int)a[6],
                               (const void *)(intptr_t)a[7], (int)a[8], (int)a[9], (int)a[10], (void *)(intptr_t)a[11],
                               (int)a[12], across ? 1 : threads, isa) != 0;
    }
    return failed ? -1 : 0;
}

/* ---- a MoE layer's SiLU-gated experts in one call ------------------------------------------------------------
 * dst[m, j] = silu(gate[m, j]) * up[m, j] on bf16 rows of gate and up that each start ``stride`` values after the
 * last (one first-stage output [gate | up], or two). ``silu``: torch's bf16 silu of every bf16 value (65,536
 * entries and one more, the gathers read 4 bytes), so the activation has torch's bits by construction; the product
 * is torch's bf16 multiply: both widened exactly, one float product, rounded to nearest even (bf16_of). */
static void glu_rows_scalar(const uint16_t *gate, const uint16_t *up, int64_t stride, int64_t I, int64_t M,
                            uint16_t *dst, const uint16_t *silu, int64_t j0) {
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gate + m * stride, *u = up + m * stride;
        for (int64_t j = j0; j < I; j++) {
            uint32_t a = (uint32_t)silu[g[j]] << 16, b = (uint32_t)u[j] << 16;
            float fa, fb;
            memcpy(&fa, &a, 4);
            memcpy(&fb, &b, 4);
            dst[m * I + j] = bf16_of(fa * fb);
        }
    }
}

T512 static void glu_rows_512(const uint16_t *gate, const uint16_t *up, int64_t stride, int64_t I, int64_t M,
                              uint16_t *dst, const uint16_t *silu) {
    const int64_t body = I & ~(int64_t)15;
    const __m512i low = _mm512_set1_epi32(0xffff);
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gate + m * stride, *u = up + m * stride;
        uint16_t *d = dst + m * I;
        for (int64_t j = 0; j < body; j += 16) {
            __m512i gi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + j)));
            __m512i a = _mm512_slli_epi32(_mm512_and_si512(_mm512_i32gather_epi32(gi, silu, 2), low), 16);
            __m512i b = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(u + j))), 16);
            __m512 p = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b));
            _mm256_storeu_si256((__m256i *)(d + j), bf16_of_512(p));
        }
    }
    if (body < I) glu_rows_scalar(gate, up, stride, I, M, dst, silu, body);
}

T256 static void glu_rows_256(const uint16_t *gate, const uint16_t *up, int64_t stride, int64_t I, int64_t M,
                              uint16_t *dst, const uint16_t *silu) {
    const int64_t body = I & ~(int64_t)7;
    const __m256i low = _mm256_set1_epi32(0xffff), bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gate + m * stride, *u = up + m * stride;
        uint16_t *d = dst + m * I;
        for (int64_t j = 0; j < body; j += 8) {
            __m256i gi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + j)));
            __m256i a = _mm256_slli_epi32(_mm256_and_si256(_mm256_i32gather_epi32((const int *)silu, gi, 2), low), 16);
            __m256i b = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(u + j))), 16);
            __m256 p = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b));
            __m256i bits = _mm256_castps_si256(p);
            __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(_mm256_add_epi32(bits, bias), _mm256_and_si256(_mm256_srli_epi32(bits, 16), one)), 16);
            __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
            r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(bits, 16), quiet), nan);
            /* 8 x 32-bit lanes (each < 65,536) to 8 x 16 bits: pack within lanes, then gather the two halves */
            __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
            _mm_storeu_si128((__m128i *)(d + j), _mm256_castsi256_si128(packed));
        }
    }
    if (body < I) glu_rows_scalar(gate, up, stride, I, M, dst, silu, body);
}

/* A MoE layer's experts on their bf16 rows in one call: the ``n_first`` first-stage matrices (each expert's gate
   and up, fused or apart: rows of fe_int4_gemm_grouped's table ``first``), then each expert's activation (``glu``,
   6 int64 per expert: where its gate and its up start, their row stride, the intermediate size I, the rows M, and
   where the activation goes, [M, I] contiguous), then the ``n_down`` down matrices (``down``). The same bits as
   the two grouped calls with torch's ``silu(gate) * up`` between them, without a trip through Python per stage.
   Returns 0, or -1. */
int fe_int4_glu_grouped(int n_first, const int64_t *first, int n_glu, const int64_t *glu, int n_down,
                        const int64_t *down, const uint16_t *silu, int threads, int isa) {
    if (fe_int4_gemm_grouped(n_first, first, threads, isa) != 0) return -1;
    for (int i = 0; i < n_glu; i++) {
        const int64_t *a = glu + 6 * (size_t)i;
        const uint16_t *gate = (const uint16_t *)(intptr_t)a[0], *up = (const uint16_t *)(intptr_t)a[1];
        uint16_t *dst = (uint16_t *)(intptr_t)a[5];
        if (isa == 2)
            glu_rows_512(gate, up, a[2], a[3], a[4], dst, silu);
        else if (isa == 1)
            glu_rows_256(gate, up, a[2], a[3], a[4], dst, silu);
        else
            glu_rows_scalar(gate, up, a[2], a[3], a[4], dst, silu, 0);
    }
    return fe_int4_gemm_grouped(n_down, down, threads, isa);
}

/* ---- codes in rows of four (code_at) ---------------------------------------------------------------------------
 * The codes [N][K/2] rewritten in place from the portable layout to rows of four (to_r4 = 1) or back (0), one group
 * of four rows at a time through a scratch of its 2K bytes; the last N % 4 rows stay as they are. Returns 0, or -1
 * for K not a multiple of 128 or no memory for the scratch. */
int fe_int4_rows4(uint8_t *codes, int N, int K, int to_r4) {
    if (K <= 0 || K % 128 || N < 0) return -1;
    const size_t row = (size_t)K / 2, chunks = row / 64;
    uint8_t *tmp = malloc(4 * row);
    if (!tmp) return -1;
    for (int n = 0; n + 4 <= N; n += 4) {
        uint8_t *grp = codes + (size_t)n * row;
        memcpy(tmp, grp, 4 * row);
        for (size_t c = 0; c < chunks; c++)
            for (size_t r = 0; r < 4; r++) { /* chunk c of row r: here in the portable layout, there in rows of four */
                const size_t portable = r * row + c * 64, four = (c * 4 + r) * 64;
                memcpy(grp + (to_r4 ? four : portable), tmp + (to_r4 ? portable : four), 64);
            }
    }
    free(tmp);
    return 0;
}

/* ---- the store layout from llama.cpp's q4_0 blocks (GGUF convert) ----------------------------------------------
 * A q4_0 block is an fp16 scale and 16 bytes: byte i holds weight i in its low nibble and weight i + 16 in its
 * high one. The portable layout packs weights 2j and 2j + 1 into byte j (low nibble first). This writes the 16
 * packed bytes of each of ``nblocks`` consecutive blocks (18 bytes each) to ``out``; the scales stay to the caller.
 */
void fe_q4_0_codes(const uint8_t *blocks, int64_t nblocks, uint8_t *out) {
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *q = blocks + 18 * b + 2;
        uint8_t *o = out + 16 * b;
        for (int j = 0; j < 8; j++) {
            o[j] = (uint8_t)((q[2 * j] & 0x0F) | ((q[2 * j + 1] & 0x0F) << 4));
            o[8 + j] = (uint8_t)((q[2 * j] >> 4) | (q[2 * j + 1] & 0xF0));
        }
    }
}
