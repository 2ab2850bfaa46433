/* Whether the second thread's idle time between a decode token's int4 calls could stream the next matrix into the
   caches (docs/cpu-profile.md, Zen 5: "Tried: reading ahead in the gaps"). A synthetic decode layer of the
   Qwen1.5-MoE shape (qkv 6144x2048, o 2048x2048, the shared expert's gate+up beside four routed ones, then the five
   down matrices; fresh copies per layer, so weights come from DRAM) is run as four calls with a gap of busy work on
   the calling thread before each (the Python between the calls), at two threads, three ways:
     0  the kernel's own OpenMP calls (fe_int4_gemm / fe_int4_gemm_grouped, threads = 2), as fate-edge runs today;
     1  a two-thread pool of this file's: the caller and one worker split each call (rows of one matrix in halves;
        a grouped call's largest matrix to the caller, the rest to the worker), one-thread kernel calls each;
     2  the same pool, its worker asked during each gap to read the next call's first ``PF_MB`` of weights (plain
        loads, or PREFETCHT0 / PREFETCHT2), stopped as soon as the call starts.
   Prints one line per round: the layers' total time and the time inside the calls, scaled to 8 layers.
   Usage: gap_prefetch LAYERS GAP_US PF_MB ROUNDS MODE [KIND: 0 loads, 1 T0, 2 T2] */
#define _GNU_SOURCE
#include "quant/native/int4_gemm.c"
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>

#define G 128 /* weights per scale, as the Qwen1.5-MoE stores */

typedef struct {
    uint8_t *codes;
    uint16_t *scale, *zero;
    int n, k;
} matrix;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *huge(size_t n) {
    n = (n + (2 << 20) - 1) & ~(size_t)((2 << 20) - 1);
    void *p = aligned_alloc(2 << 20, n);
    madvise(p, n, MADV_HUGEPAGE);
    memset(p, 1, n);
    return p;
}

static matrix make(int n, int k) {
    matrix m = {huge((size_t)n * k / 2), huge((size_t)n * k / G * 2), huge((size_t)n * k / G * 2), n, k};
    for (size_t i = 0; i < (size_t)n * k / G; i++) m.scale[i] = 0x3c00, m.zero[i] = 0; /* fp16 1.0 and 0 */
    return m;
}

static float x[8192], y[2][200000];

static void rows(const matrix *m, int r0, int r1, float *out) { /* rows [r0, r1) of m, one thread */
    if (r1 > r0)
        fe_int4_gemm(m->codes + (size_t)r0 * m->k / 2, m->scale + (size_t)r0 * m->k / G,
                     m->zero + (size_t)r0 * m->k / G, 0, r1 - r0, m->k, G, x, 0, m->k, 1, out + r0, 0, 1, 2);
}

typedef struct {
    const matrix *ms;
    int count;
} call;

static call job;
static _Atomic int job_seq, job_done, hint_seq, stop_hint;
static const uint8_t *hint_at[24];
static size_t hint_len[24], hint_budget;
static int hint_ranges, kind;
static volatile uint64_t sink;

static int half(const matrix *m) { return (m->n / 2 + 15) & ~15; }

static void caller_share(const call *c) {
    if (c->count == 1) rows(c->ms, 0, half(c->ms), y[0]);
    else rows(&c->ms[0], 0, c->ms[0].n, y[0]);
}

static void worker_share(const call *c) {
    if (c->count == 1) rows(c->ms, half(c->ms), c->ms->n, y[1]);
    else for (int i = 1; i < c->count; i++) rows(&c->ms[i], 0, c->ms[i].n, y[1]);
}

T512 static void read_hint(void) {
    size_t left = hint_budget;
    uint64_t acc = 0;
    for (int r = 0; r < hint_ranges && left; r++) {
        size_t n = hint_len[r] < left ? hint_len[r] : left;
        left -= n;
        for (size_t o = 0; o < n; o += 256) {
            if (atomic_load_explicit(&stop_hint, memory_order_relaxed)) goto out;
            const uint8_t *p = hint_at[r] + o;
            if (kind == 0) {
                __m512i a = _mm512_xor_si512(_mm512_load_si512(p), _mm512_load_si512(p + 64));
                __m512i b = _mm512_xor_si512(_mm512_load_si512(p + 128), _mm512_load_si512(p + 192));
                acc += _mm512_reduce_add_epi64(_mm512_xor_si512(a, b));
            } else {
                for (int q = 0; q < 256; q += 64) {
                    if (kind == 1) _mm_prefetch((const char *)p + q, _MM_HINT_T0);
                    else _mm_prefetch((const char *)p + q, _MM_HINT_T2);
                }
            }
        }
    }
out:
    sink += acc;
}

static void *worker(void *unused) {
    (void)unused;
    int seen = 0, hinted = 0;
    for (;;) {
        int s = atomic_load(&job_seq);
        if (s < 0) return NULL;
        if (s != seen) {
            seen = s;
            worker_share(&job);
            atomic_store(&job_done, s);
        } else if (atomic_load(&hint_seq) != hinted) {
            hinted = atomic_load(&hint_seq);
            read_hint();
        } else {
            _mm_pause();
        }
    }
}

static void hint(const call *c) { /* codes, then scales and zeros, of each matrix in turn */
    hint_ranges = 0;
    for (int i = 0; i < c->count && hint_ranges + 3 <= 24; i++) {
        const matrix *m = &c->ms[i];
        hint_at[hint_ranges] = m->codes, hint_len[hint_ranges++] = (size_t)m->n * m->k / 2;
        hint_at[hint_ranges] = (const uint8_t *)m->scale, hint_len[hint_ranges++] = (size_t)m->n * m->k / G * 2;
        hint_at[hint_ranges] = (const uint8_t *)m->zero, hint_len[hint_ranges++] = (size_t)m->n * m->k / G * 2;
    }
    atomic_store(&stop_hint, 0);
    atomic_fetch_add(&hint_seq, 1);
}

static void pool_call(const call *c) {
    atomic_store(&stop_hint, 1);
    job = *c;
    int s = atomic_fetch_add(&job_seq, 1) + 1;
    caller_share(c);
    while (atomic_load(&job_done) != s) _mm_pause();
}

static void openmp_call(const call *c) {
    if (c->count == 1) {
        const matrix *m = c->ms;
        fe_int4_gemm(m->codes, m->scale, m->zero, 0, m->n, m->k, G, x, 0, m->k, 1, y[0], 0, 2, 2);
        return;
    }
    int64_t t[13 * 8];
    for (int i = 0; i < c->count; i++) {
        const matrix *m = &c->ms[i];
        int64_t row[13] = {(intptr_t)m->codes, (intptr_t)m->scale, (intptr_t)m->zero, 0, m->n, m->k, G,
                           (intptr_t)x, 0, m->k, 1, (intptr_t)(y[0] + 20000 * i), 0};
        memcpy(t + 13 * i, row, sizeof row);
    }
    fe_int4_gemm_grouped(c->count, t, 2, 2);
}

static char busy[1 << 20];

static void gap(double us) { /* the interpreter's work between two calls: time on the caller, a little memory */
    double end = now() + us * 1e-6;
    for (int i = 0; now() < end; i += 7) busy[(size_t)i * 64 % sizeof busy]++;
}

int main(int argc, char **argv) {
    if (argc < 6 || fe_int4_isa() != 2) {
        fprintf(stderr, "usage: gap_prefetch LAYERS GAP_US PF_MB ROUNDS MODE [KIND] (AVX512-VNNI hosts)\n");
        return 2;
    }
    int layers = atoi(argv[1]), rounds = atoi(argv[4]), mode = atoi(argv[5]);
    double gap_us = atof(argv[2]);
    hint_budget = (size_t)(atof(argv[3]) * 1e6);
    kind = argc > 6 ? atoi(argv[6]) : 0;
    for (int i = 0; i < 8192; i++) x[i] = (float)(i % 13) * 0.01f;
    matrix(*layer)[12] = malloc(sizeof(matrix[12]) * layers);
    for (int l = 0; l < layers; l++) {
        layer[l][0] = make(6144, 2048), layer[l][1] = make(2048, 2048), layer[l][2] = make(11264, 2048);
        for (int e = 0; e < 4; e++) layer[l][3 + e] = make(2816, 2048), layer[l][8 + e] = make(2048, 1408);
        layer[l][7] = make(2048, 5632);
    }
    pthread_t w;
    if (mode) pthread_create(&w, NULL, worker, NULL);
    const int first[4] = {0, 1, 2, 7}, count[4] = {1, 1, 5, 5};
    for (int r = 0; r < rounds; r++) {
        double total = now(), inside = 0;
        for (int l = 0; l < layers; l++)
            for (int c = 0; c < 4; c++) {
                call k = {&layer[l][first[c]], count[c]};
                if (mode == 2) hint(&k);
                gap(gap_us);
                double t0 = now();
                if (mode) pool_call(&k);
                else openmp_call(&k);
                inside += now() - t0;
            }
        total = now() - total;
        printf("{\"mode\": %d, \"kind\": %d, \"per_8_layers_ms\": %.3f, \"in_calls_ms\": %.3f}\n", mode, kind,
               total * 8e3 / layers, inside * 8e3 / layers);
    }
    if (mode) {
        atomic_store(&job_seq, -1);
        pthread_join(w, NULL);
    }
    return 0;
}
