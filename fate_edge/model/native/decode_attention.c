/* Attention of decode queries (one position each) over key/value caches on the CPU, for caches in bf16, fp16 or fp32.

   Why: torch's CPU attention runs a bf16 decode query through bf16 GEMMs, which CPUs without AVX512-BF16 emulate
   (a 2-vCPU AVX2 EPYC, one thread: 16 heads x 128 over 512 cached positions 2.9 ms in bf16 against 0.4 ms in fp32;
   a Qwen1.5-MoE decode token at a 2,048-token context spent ~9 ms a layer there). Here each cached row is widened to
   fp32 once (a shift for bf16, F16C for fp16) and every query head of its group takes it from L1, so the cache is
   read once, in its own dtype: the cost is the cache's bytes.

   Row r of ``q`` ([R][Hq][Dk], contiguous) attends to positions starts[r] .. starts[r] + lengths[r] - 1 of
   sequence r's caches (element strides: per sequence kb/vb, 0 where every row reads one cache; per kv head kh/vh;
   per position kp/vp; the last dimension contiguous), or to positions 0 .. length - 1 where starts is NULL; query head h reads kv head h / (Hq / Hkv). Scores, softmax and the weighted sum are fp32 (exp as
   libm's expf), the output [R][Hq][Dv] is rounded once to q's dtype. Dk and Dv: multiples of 8. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

#define T256 __attribute__((target("avx2,fma,f16c")))

T256 static inline __m256 load8(const void *p, int dtype) {
    if (dtype == BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (dtype == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_loadu_ps((const float *)p);
}

T256 static void widen(const void *src, int dtype, int n, float *out) {
    const size_t size = dtype == F32 ? 4 : 2;
    for (int i = 0; i < n; i += 8) _mm256_storeu_ps(out + i, load8((const char *)src + size * i, dtype));
}

T256 static inline float hsum(__m256 a) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

T256 static inline float dot(const float *a, const float *b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    if (i < n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return hsum(_mm256_add_ps(s0, s1));
}

/* fp32 -> bf16 to nearest even (NaN stays a quiet NaN), as torch's .to() rounds. */
static uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (bits & 0x7fffffff) > 0x7f800000 ? (uint16_t)((bits >> 16) | 0x40)
                                            : (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

T256 static void store(const float *in, int n, int dtype, void *out) {
    if (dtype == F32) {
        memcpy(out, in, sizeof(float) * (size_t)n);
    } else if (dtype == F16) {
        for (int i = 0; i < n; i += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)out + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    } else {
        for (int i = 0; i < n; i++) ((uint16_t *)out)[i] = to_bf16(in[i]);
    }
}

/* One (row, kv head): the g query heads of the group against the row's cached positions. ``work``: g * (Dk + Dv + L)
   + max(Dk, Dv) floats. */
T256 static void group(const char *q, int q_dtype, const char *k, const char *v, int kv_dtype, int64_t kp, int64_t vp,
                       int64_t length, int g, int Dk, int Dv, float scale, char *out, int out_dtype, float *work) {
    const size_t qsize = q_dtype == F32 ? 4 : 2, kvsize = kv_dtype == F32 ? 4 : 2;
    float *qf = work, *acc = qf + (size_t)g * Dk, *s = acc + (size_t)g * Dv, *row = s + (size_t)g * length;
    for (int h = 0; h < g; h++) {
        widen(q + qsize * (size_t)h * Dk, q_dtype, Dk, qf + (size_t)h * Dk);
        for (int i = 0; i < Dk; i++) qf[(size_t)h * Dk + i] *= scale;
    }
    for (int64_t j = 0; j < length; j++) {
        widen(k + kvsize * (size_t)(j * kp), kv_dtype, Dk, row);
        for (int h = 0; h < g; h++) s[(size_t)h * length + j] = dot(qf + (size_t)h * Dk, row, Dk);
    }
    for (int h = 0; h < g; h++) { /* softmax: max first, so exp never overflows */
        float *sh = s + (size_t)h * length, m = -INFINITY, sum = 0.f;
        for (int64_t j = 0; j < length; j++) m = sh[j] > m ? sh[j] : m;
        if (m == -INFINITY) m = 0.f; /* every score -inf: the sum is 0 and the output NaN, as torch's is */
        for (int64_t j = 0; j < length; j++) sum += (sh[j] = expf(sh[j] - m));
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < length; j++) sh[j] *= inv;
        memset(acc + (size_t)h * Dv, 0, sizeof(float) * (size_t)Dv);
    }
    for (int64_t j = 0; j < length; j++) {
        widen(v + kvsize * (size_t)(j * vp), kv_dtype, Dv, row);
        for (int h = 0; h < g; h++) {
            const __m256 p = _mm256_set1_ps(s[(size_t)h * length + j]);
            float *a = acc + (size_t)h * Dv;
            for (int i = 0; i < Dv; i += 8)
                _mm256_storeu_ps(a + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(row + i), _mm256_loadu_ps(a + i)));
        }
    }
    const size_t osize = out_dtype == F32 ? 4 : 2;
    for (int h = 0; h < g; h++) store(acc + (size_t)h * Dv, Dv, out_dtype, out + osize * (size_t)h * Dv);
}

/* 1 where this CPU runs the kernel (AVX2, FMA and F16C), else 0. */
int fe_attention_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* Returns 0, -1 for shapes it does not take (the caller uses torch), -2 when out of memory. */
int fe_decode_attention(const void *q, int q_dtype, const void *k, const void *v, int kv_dtype, int64_t kb,
                        int64_t kh, int64_t kp, int64_t vb, int64_t vh, int64_t vp, const int64_t *starts,
                        const int64_t *lengths, int64_t length, int R, int Hq, int Hkv, int Dk, int Dv,
                        float scale, void *out, int threads) {
    if (R <= 0 || Hkv <= 0 || Hq % Hkv || Dk % 8 || Dv % 8 || Dk <= 0 || Dv <= 0) return -1;
    const int g = Hq / Hkv, tasks = R * Hkv;
    int64_t longest = 0, work = 0;
    for (int r = 0; r < R; r++) {
        const int64_t first = starts ? starts[r] : 0, n = starts ? lengths[r] : length;
        if (n <= 0 || first < 0) return -1;
        longest = n > longest ? n : longest;
        work += n;
    }
    const size_t qsize = q_dtype == F32 ? 4 : 2, kvsize = kv_dtype == F32 ? 4 : 2;
    const size_t scratch = (size_t)g * (Dk + Dv + longest) + (Dk > Dv ? Dk : Dv);
    /* threads only where each gets enough cache to read: waking a team costs ~10 us */
    const int nt = threads > 1 && tasks > 1 && work * Hkv * (Dk + Dv) >= (1 << 16) ? threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * scratch);
        failed |= !buf;
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++) { /* every thread reaches the loop's barrier, even one without scratch */
            if (buf) {
                const int r = t / Hkv, h = t % Hkv;
                const int64_t first = starts ? starts[r] : 0, n = starts ? lengths[r] : length;
                group((const char *)q + qsize * ((size_t)r * Hq + (size_t)h * g) * Dk, q_dtype,
                      (const char *)k + kvsize * (size_t)(r * kb + h * kh + first * kp),
                      (const char *)v + kvsize * (size_t)(r * vb + h * vh + first * vp), kv_dtype, kp, vp, n, g, Dk, Dv, scale, (char *)out + qsize * ((size_t)r * Hq + (size_t)h * g) * Dv,
                      q_dtype, buf);
            }
        }
        free(buf);
    }
    return failed ? -2 : 0;
}
