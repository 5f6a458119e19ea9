/* SGMV on CPU, fp32 (and, at the end, decode attention over the paged KV cache): out[t] += scale[slot] * B_slot @ (A_slot @ x[t]) per active segment, reading each
 * slot's weights where the memory pool put them.
 *
 * Built by kernels/cpu_native.py with gcc -O3 -march=native -ffast-math and called through ctypes, so
 * one call covers every segment of a projection (no Python per segment). Weights live in one flat buffer
 * (fp32, or bf16 / fp16 for the 16-bit adapter pool; x, out and every sum stay fp32): A of slot s is the row-major [r, d_in] block at w + a_offs[s], B of slot s is stored rank-major
 * ([r, d_out], i.e. B^T) at w + b_offs[s]; offsets are int64 elements and need no alignment. Per segment:
 *   shrink: y[t, j] = A[j, :] . x[t]                     for the segment's tokens, j < rank
 *   expand: out[t, :] += scale * sum_j y[t, j] * B^T[j, :] (rank axpys over contiguous rows)
 * Work and memory traffic are proportional to each slot's real rank; tokens without weights never appear.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define TB 4          /* tokens per register block */
#ifdef __AVX512F__
#define EXPAND_LONG_C 4  /* sgmv_units.h expand_long: 4 tokens x 4 vectors, 16 accumulators of 32 registers */
#else
#define EXPAND_LONG_C 2  /* 8 accumulators of 16 registers */
#endif

/* Loops that call expf: on AVX2 without AVX-512 GCC 12 vectorizes them with libmvec's 4-wide SSE expf unless told
 * 8 lanes (_ZGVdN8v_expf, the AVX2 one; SwiGLU's gate on SmolLM2's 64 x 1536: 176 -> 137 us a call). */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define AVX2_WITHOUT_512 1
#endif
#ifdef AVX2_WITHOUT_512
#define EXP_SIMD _Pragma("omp simd simdlen(8)")
#define EXP_SIMD_REDUCE_SUM _Pragma("omp simd reduction(+:sum) simdlen(8)")
#else
#define EXP_SIMD _Pragma("omp simd")
#define EXP_SIMD_REDUCE_SUM _Pragma("omp simd reduction(+:sum)")
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#define NB 1024  /* expand: output columns per tile; TB x NB fp32 accumulators (16 KB) stay in L1 */

typedef struct {
    const int32_t *starts, *lens, *slots, *ranks;
    const float *x, *scales;
    const void *w;  /* the flat weight buffer: fp32, or bf16 / fp16 (the 16-bit adapter pool) by entry point */
    const int64_t *a_offs, *b_offs;
    float *out, *y;
    int64_t sx, so, sy, d_in, d_out;
} sgmv_args;

/* The SGMV units, once per weight type (sgmv_units.h): fp32, the model's own; bf16 and fp16, the 16-bit
 * adapter pool (inference_worker.lora, LORAFLEET_WORKER_ADAPTER_DTYPE), read at half the bytes and widened to
 * fp32 on the way in. GCC 12 leaves fp16's widening scalar on AVX2 (one vcvtph2ps per element: the SmolLM2
 * fleet ran 30% slower than fp32 that way), and even bf16's shift, which it vectorizes, was redone for every
 * token of a block. So both 16-bit types have their weight loops written 8 at a time (VEC8: F16C's
 * vcvtph2ps, or AVX2's zero-extend and shift), and the expand widens each 8 weights once for the block's
 * tokens (on a 256-token prefill bf16 went from 0.93x fp32's speed to 1.09x). Without F16C, fp16
 * weights are widened one at a time (f16_to_f32): correct, slow. */
static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float f16_to_f32(uint16_t h) {  /* exact: normals, subnormals, zeros, inf and NaN */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    float f;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else {  /* zero or subnormal: man x 2^-24, exact in fp32 */
        f = (float)man * 0x1p-24f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    memcpy(&f, &u, sizeof f);
    return f;
}
#if defined(__AVX__)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif
#define WT float
#define LD(v) (v)
#if defined(__AVX2__) && defined(__FMA__)
#define ROWS8(p) _mm256_loadu_ps(p)
#endif
#if defined(__AVX512F__) && !defined(SEGMENT_LONG_AVX2)  /* -DSEGMENT_LONG_AVX2: the 8-wide paths, for A/Bs */
#define ROWS16 1  /* fp32 weights on AVX-512: a prompt's segments take the 16-wide blocks (sgmv_units.h) */
#endif
#define SFX(name) name##_f32
#include "sgmv_units.h"
#define WT uint16_t
#define LD(v) bf16_to_f32(v)
#if defined(__AVX2__) && defined(__FMA__)
#define VEC8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define ROWS8(p) VEC8(p)
#endif
#define SFX(name) name##_bf16
#include "sgmv_units.h"
#define WT uint16_t
#define LD(v) f16_to_f32(v)
#if defined(__F16C__) && defined(__FMA__)
#define VEC8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define ROWS8(p) VEC8(p)
#endif
#define SFX(name) name##_f16
#include "sgmv_units.h"

/* ---- helper threads -------------------------------------------------------------------------------
 * Where the library is built without OpenMP, the kernels' units run here (parallel_for_team below says why
 * the team comes first). An OpenMP region ends in a barrier that waits for every team thread, including one
 * the scheduler has not run yet on a machine shared with other processes (torch's own parallel ops pay the
 * same); here the calling thread never waits for a helper that has not started: it claims
 * segments from a shared counter like the helpers do, and at the end waits only for segments a helper
 * has actually claimed. A helper that wakes late finds no work and sleeps again. After fork() the
 * child starts a fresh pool on its first parallel call. */
typedef struct {
    void (*run)(const void *args, int64_t unit);
    const void *args;
    int64_t G;           /* units of work */
    atomic_long next;    /* next unclaimed unit */
    atomic_int active;   /* helpers inside this job */
} pool_job_t;

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static pool_job_t *pool_job = NULL;
static long pool_generation = 0;
static int pool_helpers = 0;

static void work_on(pool_job_t *job) {
    for (int64_t g = atomic_fetch_add(&job->next, 1); g < job->G; g = atomic_fetch_add(&job->next, 1))
        job->run(job->args, g);
}

static void *helper_main(void *unused) {
    (void)unused;
    long seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool_mu);
        while (pool_job == NULL || pool_generation == seen) pthread_cond_wait(&pool_cv, &pool_mu);
        pool_job_t *job = pool_job;
        seen = pool_generation;
        atomic_fetch_add(&job->active, 1);  /* under the lock: the caller cannot retire the job now */
        pthread_mutex_unlock(&pool_mu);
        work_on(job);
        atomic_fetch_sub(&job->active, 1);
    }
    return NULL;
}

/* In a fork()ed child, the thread that forked (the child's first thread): its OpenMP team is the parent's,
 * whose workers fork() did not copy. Threads the child starts later build teams of their own. */
static int forked_child = 0;
static pthread_t fork_thread;

static void pool_after_fork_in_child(void);
__attribute__((constructor)) static void register_fork_handler(void) {
    pthread_atfork(NULL, NULL, pool_after_fork_in_child);
}

/* In a forked child the helpers do not exist and the lock may have been copied held: start afresh. */
static void pool_after_fork_in_child(void) {
    forked_child = 1;
    fork_thread = pthread_self();
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_cv, NULL);
    pool_job = NULL;
    pool_helpers = 0;
}

static void ensure_helpers(int wanted) {
    pthread_mutex_lock(&pool_mu);
    while (pool_helpers < wanted) {
        pthread_t tid;
        if (pthread_create(&tid, NULL, helper_main, NULL) != 0) break;
        pthread_detach(tid);
        pool_helpers++;
    }
    pthread_mutex_unlock(&pool_mu);
}

/* Units 0..G-1 of run(args, unit) on the calling thread and up to nthreads - 1 helpers. */
static void parallel_for(void (*run)(const void *, int64_t), const void *args, int64_t G, int nthreads) {
    if (nthreads <= 1 || G <= 1) {
        for (int64_t g = 0; g < G; g++) run(args, g);
        return;
    }
    ensure_helpers(nthreads - 1);
    pool_job_t job;
    job.run = run;
    job.args = args;
    job.G = G;
    atomic_init(&job.next, 0);
    atomic_init(&job.active, 0);
    pthread_mutex_lock(&pool_mu);
    pool_job = &job;
    pool_generation++;
    pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);

    work_on(&job);

    pthread_mutex_lock(&pool_mu);
    pool_job = NULL;  /* no helper can join from here on */
    pthread_mutex_unlock(&pool_mu);
    while (atomic_load(&job.active) > 0) sched_yield();  /* only helpers mid-unit */
}

/* ---- the calling thread's OpenMP team -------------------------------------------------------------
 * Both kernels run their units on the calling thread's OpenMP team when the library is built with OpenMP
 * (kernels/cpu_native.py links the libgomp torch has loaded): the engine thread's team, whose workers torch's
 * GEMMs and elementwise ops have just used and which spin between the step's parallel regions, so they take
 * units at once. The helper threads above cannot run while that team spins on the same CPUs, so a kernel on
 * the helpers ran on the calling thread alone (quiet 2-CPU host, SmolLM2's 64-sequence workload, the engine's
 * own passes): decode attention took 14.0 ms a step on the helpers against 8.5 ms on the team; the fleet's
 * 13,230 SGMV calls a pass took 3.0-3.4 s on the helpers, 3.5-3.8 s on one thread and 2.1-2.2 s on the team
 * (SmolLM2 fleet 235-238 -> 245-255 tok/s, passes alternating in one process; mid's fleet within noise).
 * Without OpenMP the helpers take the units, and on the thread that fork()ed a child, in that child: GNU
 * libgomp keeps the parent's team there, whose threads fork() did not copy, and its next region hangs
 * (torch's own parallel ops on that thread do the same). */
static void parallel_for_team(void (*run)(const void *, int64_t), const void *args, int64_t G, int nthreads) {
#ifdef _OPENMP
    if (nthreads > 1 && G > 1 && !(forked_child && pthread_equal(pthread_self(), fork_thread))) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t g = 0; g < G; g++) run(args, g);
        return;
    }
#endif
    parallel_for(run, args, G, nthreads);
}

/* y: scratch [T, sy] fp32, sy >= every rank. w: the flat weight buffer (fp32, or bf16 / fp16 for the _bf16w /
 * _f16w entry points; x and out fp32 in all three); a_offs, b_offs: int64 [S] element offsets of each slot's
 * A and B^T in it. One unit of work is a whole segment (its shrink then its expand), so units never wait on
 * each other. nthreads <= 1 runs on the calling thread only. */
#define SGMV_ENTRY(NAME, UNIT)                                                                                \
    void NAME(int64_t G, const int32_t *starts, const int32_t *lens, const int32_t *slots,                   \
              const int32_t *ranks, const float *x, int64_t sx, const void *w, const int64_t *a_offs,         \
              const int64_t *b_offs, float *out, int64_t so, const float *scales, float *y, int64_t sy,        \
              int64_t d_in, int64_t d_out, int nthreads) {                                                     \
        sgmv_args p = {starts, lens, slots, ranks, x, scales, w, a_offs, b_offs, out, y, sx, so, sy, d_in, d_out}; \
        parallel_for_team(UNIT, &p, G, nthreads);                                                              \
    }
SGMV_ENTRY(sgmv_add_f32, run_segment_f32)
SGMV_ENTRY(sgmv_add_f32_bf16w, run_segment_bf16)
SGMV_ENTRY(sgmv_add_f32_f16w, run_segment_f16)

/* ---- decode attention over the paged KV cache --------------------------------------------------------
 * One query token per sequence, read straight from the pool's pages: no gather of K/V into a contiguous
 * copy first (on CPU the gathers cost more than the attention itself). A layer's pages are
 * [P, 2 KV, bs, hd] fp32 (kv_cache.py: K heads then V heads, each page's head a contiguous bs x hd run).
 * One unit = one sequence, all its KV heads (one page's K and V are then read as one contiguous run), or
 * (sequence, KV head) when a sequence's accumulators would not fit; the g query heads of a KV head (GQA)
 * share every K/V row read. Online softmax block by block (a running max and sum per query head, rescaled
 * once per block), so no score buffer grows with the context. Positions attended: [max(0, len - window),
 * len) with window <= 0 meaning all.
 *
 * Four things make it run near the speed of a plain read of the same pages (measured on this project's
 * 2-CPU AMD EPYC, 64 sequences, every layer's pages from DRAM; SmolLM2 at context 105 / mid at 128, per
 * decode step): 27.4 / 13.2 ms before, 14.3 / 5.8 ms after, against 12.8 / 5.0 ms for the read alone.
 * - One unit per sequence rather than per (sequence, KV head): a page's K and V are read as one run.
 * - While a block is computed, the sequence's next block is prefetched into L2 (prefetcht1: into L1 it
 *   evicted the block being read and gained 10% instead of 40%). Without it the loads wait on DRAM and
 *   compute and memory do not overlap at all. A sequence's last block prefetches the first block of the
 *   sequence its thread will likely take next, `nthreads` units on (a paired A/B of SmolLM2's decode step on
 *   the Zen 4 host, 2026-12-04: 0.915 of the time; 1 unit on 0.985, 3 units on 0.928).
 * - Each block first asks for every line of its page at once (prefetcht0, the page's K and V of all its KV heads,
 *   24 KB for SmolLM2), before its first row is read: the lines otherwise come in as the rows ask for them, a few
 *   misses in flight at a time. SmolLM2's decode step (64 sequences of 38-101 tokens, 30 layers' pages from DRAM, a
 *   /tmp program calling this kernel, processes alternating) on the Zen 5 EPYC host, 2026-12-06: 5.24-5.39 ms
 *   against 6.70-7.08 (three pairs) and 6.14-6.73 against 6.99-7.21 (two more, a slower phase); with the pages in
 *   the caches it costs 10% (3.21 against 2.90 ms), which a decode step, whose pages come from DRAM, does not see.
 * - For head_dim 64 and 128 the block's work runs on 16-float vectors (GCC vector extensions: one zmm on
 *   AVX-512; on AVX2 without it, the 8-float path after them, attn_block_avx2_*) with the query and accumulator vectors in registers: 16 rows' scores are
 *   16 partial-sum vectors reduced together by one transpose-add (45 shuffles and adds for 16 dot
 *   products, not a horizontal reduction each), and P·V adds into register accumulators instead of
 *   loading and storing a memory row per key (1.25-1.45x over the scalar loops, both prefetching).
 * Other head sizes take the scalar loops. */
#define ATTN_MAX_G 64
#define ATTN_MAX_H 256  /* query heads one unit attends */
#define ATTN_MAX_BS 256  /* positions per block */
#define ATTN_MAX_ACC 8192  /* query heads x hd accumulators per unit (32 KB on the stack) */

typedef struct {
    const float *q;          /* [B, KV * g, hd], row stride sq */
    const float *pages;      /* the layer's pages */
    const int64_t *blocks;   /* [B, nb] page ids */
    const int64_t *lens;     /* [B] tokens in the cache, the query's own included */
    float *out;              /* [B, KV * g * hd], row stride so */
    int64_t sq, so, page_stride, nb, kv, g, hd, bs, window;
    float scale, cap;        /* cap: soft-capping of the scores (Gemma 2), 0 none */
    int64_t heads_per_unit;  /* KV heads one unit attends: all of them when their accumulators fit */
    int64_t B, ahead;        /* sequences; how many units on from this one a thread's next unit is (the team's size) */
} attn_args;

/* One query head's running state over the blocks: max m, sum l, accumulators acc[hd]. */
typedef struct { float *m, *l, *acc; } attn_state;

/* Gemma 2's attention logit soft-capping, s = cap * tanh(s / cap), on one head's scaled scores before the softmax
 * (transformers: scores / cap, tanh, * cap, then the mask). tanh(y) = 1 - 2 / (1 + exp(2y)) so that the loop
 * vectorises as the softmax's exp does (2y clamped where exp(2y) would overflow: tanh is 1 there to fp32's last bit);
 * its error is a few fp32 ulps of cap, within the fp32 tolerance the tests hold the scores to. */
static inline void attn_softcap(float *s, int64_t n, float cap) {
    const float inv = 2.f / cap;
    EXP_SIMD
    for (int64_t i = 0; i < n; i++) s[i] = cap - 2.f * cap / (1.f + expf(fminf(s[i] * inv, 88.f)));
}

/* Online softmax of one head's scores s[0, n) against its state: s becomes exp(s - new max); returns the
 * factor the old accumulators and sum are rescaled by (1 when the max did not move). */
static inline float attn_softmax_block(float *s, int64_t n, float *m, float *l, float cap) {
    if (cap > 0.f) attn_softcap(s, n, cap);
    float bm = *m;
    for (int64_t i = 0; i < n; i++) bm = s[i] > bm ? s[i] : bm;
    const float c = expf(*m - bm);
    *m = bm;
    float sum = 0.f;
    EXP_SIMD_REDUCE_SUM
    for (int64_t i = 0; i < n; i++) { s[i] = expf(s[i] - bm); sum += s[i]; }
    *l = *l * c + sum;
    return c;
}

/* Rows lo..hi-1 of one block for g query heads q[g, hd] sharing the K/V head runs K, V [bs, hd]. */
static void attn_block_scalar(const float *q, const float *K, const float *V, int64_t lo, int64_t hi, int64_t g,
                              int64_t hd, float scale, float cap, float *m, float *l, float *acc, const float *Kn,
                              const float *Vn) {
    float s[ATTN_MAX_G * ATTN_MAX_BS] __attribute__((aligned(64)));  /* the block's scores, per query head */
    const int64_t n = hi - lo;
    for (int64_t i = lo; i < hi; i++) {  /* scores: each key row read once for the g query heads */
        const float *k = K + i * hd;
        if (Kn) for (int64_t c = 0; c < hd; c += 16) __builtin_prefetch(Kn + i * hd + c, 0, 2);
        for (int64_t j = 0; j < g; j++) {
            const float *qj = q + j * hd;
            float d = 0.f;
            #pragma omp simd reduction(+:d)
            for (int64_t c = 0; c < hd; c++) d += qj[c] * k[c];
            s[j * n + i - lo] = d * scale;
        }
    }
    for (int64_t j = 0; j < g; j++) {
        float *sj = s + j * n, *accj = acc + j * hd;
        const float c = attn_softmax_block(sj, n, m + j, l + j, cap);
        if (c != 1.f) {
            #pragma omp simd
            for (int64_t c2 = 0; c2 < hd; c2++) accj[c2] *= c;
        }
        for (int64_t i = lo; i < hi; i++) {
            const float pw = sj[i - lo], *v = V + i * hd;
            if (Vn && j == 0) for (int64_t c = 0; c < hd; c += 16) __builtin_prefetch(Vn + i * hd + c, 0, 2);
            #pragma omp simd
            for (int64_t c2 = 0; c2 < hd; c2++) accj[c2] += pw * v[c2];
        }
    }
}

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

static inline vf16 vload(const float *p) { vf16 v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf16 v) { memcpy(p, &v, sizeof v); }

/* v[0..15] -> one vector whose lane i is the sum of v[i]'s 16 lanes: four levels of pairwise
 * shuffle-and-add, each halving the vectors and doubling the rows a vector carries. */
static inline vf16 attn_sum16(vf16 *v) {
    static const vi16 lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    static const vi16 hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    static const vi16 lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    static const vi16 hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    static const vi16 lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    static const vi16 hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    static const vi16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    static const vi16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    for (int k = 0; k < 8; k++) v[k] = __builtin_shuffle(v[2 * k], v[2 * k + 1], lo1) + __builtin_shuffle(v[2 * k], v[2 * k + 1], hi1);
    for (int k = 0; k < 4; k++) v[k] = __builtin_shuffle(v[2 * k], v[2 * k + 1], lo2) + __builtin_shuffle(v[2 * k], v[2 * k + 1], hi2);
    for (int k = 0; k < 2; k++) v[k] = __builtin_shuffle(v[2 * k], v[2 * k + 1], lo4) + __builtin_shuffle(v[2 * k], v[2 * k + 1], hi4);
    return __builtin_shuffle(v[0], v[1], lo8) + __builtin_shuffle(v[0], v[1], hi8);
}

static const float attn_zero_row[128] __attribute__((aligned(64)));

/* attn_block_scalar for hd = 16 * HDV and GH query heads (both compile-time: the loops unroll and the
 * query and accumulator vectors live in registers). */
#define ATTN_BLOCK_VEC(HDV, GH)                                                                               \
static void attn_block_##HDV##_##GH(const float *q, const float *K, const float *V, int64_t lo, int64_t hi,   \
                                    float scale, float cap, float *m, float *l, float *acc, const float *Kn,  \
                                    const float *Vn) {                                                        \
    const int64_t hd = 16 * HDV, n = hi - lo;                                                                \
    float s[GH][ATTN_MAX_BS + 16] __attribute__((aligned(64)));                                              \
    vf16 qv[GH][HDV];                                                                                         \
    for (int j = 0; j < GH; j++)                                                                              \
        for (int c = 0; c < HDV; c++) qv[j][c] = vload(q + j * hd + 16 * c);                                  \
    for (int64_t i0 = 0; i0 < n; i0 += 16) {                                                                  \
        vf16 part[GH][16];                                                                                    \
        for (int r = 0; r < 16; r++) {                                                                        \
            const float *k = i0 + r < n ? K + (lo + i0 + r) * hd : attn_zero_row;                             \
            vf16 kv[HDV];                                                                                     \
            for (int c = 0; c < HDV; c++) kv[c] = vload(k + 16 * c);                                          \
            if (Kn) for (int c = 0; c < HDV; c++) __builtin_prefetch(Kn + (lo + i0 + r) * hd + 16 * c, 0, 2);        \
            for (int j = 0; j < GH; j++) {                                                                    \
                vf16 d = qv[j][0] * kv[0];                                                                    \
                for (int c = 1; c < HDV; c++) d += qv[j][c] * kv[c];                                          \
                part[j][r] = d;                                                                               \
            }                                                                                                 \
        }                                                                                                     \
        for (int j = 0; j < GH; j++) vstore(s[j] + i0, attn_sum16(part[j]) * scale);                          \
    }                                                                                                         \
    vf16 av[GH][HDV];                                                                                         \
    for (int j = 0; j < GH; j++) {                                                                            \
        const float c = attn_softmax_block(s[j], n, m + j, l + j, cap);                                            \
        for (int cc = 0; cc < HDV; cc++) av[j][cc] = vload(acc + j * hd + 16 * cc) * c;                       \
    }                                                                                                         \
    for (int64_t i = 0; i < n; i++) {                                                                         \
        vf16 vv[HDV];                                                                                         \
        for (int c = 0; c < HDV; c++) vv[c] = vload(V + (lo + i) * hd + 16 * c);                              \
        if (Vn) for (int c = 0; c < HDV; c++) __builtin_prefetch(Vn + (lo + i) * hd + 16 * c, 0, 2);                  \
        for (int j = 0; j < GH; j++)                                                                          \
            for (int c = 0; c < HDV; c++) av[j][c] += s[j][i] * vv[c];                                        \
    }                                                                                                         \
    for (int j = 0; j < GH; j++)                                                                              \
        for (int c = 0; c < HDV; c++) vstore(acc + j * hd + 16 * c, av[j][c]);                                \
}
#if defined(AVX2_WITHOUT_512) && defined(__FMA__)
#define ATTN_AVX2 1
#else
ATTN_BLOCK_VEC(4, 1) ATTN_BLOCK_VEC(4, 2) ATTN_BLOCK_VEC(4, 3) ATTN_BLOCK_VEC(4, 4)
ATTN_BLOCK_VEC(8, 1) ATTN_BLOCK_VEC(8, 2)
#endif

#ifdef ATTN_AVX2
/* The block on AVX2 without AVX-512 (8-float ymm, 16 registers). The 16-float vectors above are two ymm each
 * there, their shuffles have no AVX2 instruction and the query and partial-sum vectors do not fit the register
 * file: on a 2-CPU AMD EPYC (Zen 1, AVX2 only; 2026-12-02, mid's shapes: 64 sequences, 4 KV heads of 4 query
 * heads, hd 64, context 96, pages from DRAM) the call took 4.7 ms a layer on two threads (2.7 GB/s of pages,
 * against 17 GB/s for a plain read). Here one query head at a time: its hd / 8 query vectors stay in registers
 * and the block's K and V rows come again from L1 for the group's other heads; 4 key rows' dot products run
 * side by side (4 FMA chains, not one) and are reduced together by one hadd transpose (attn_sum4; 8 rows
 * would need one register more than there are for hd 64, and ran 1.76 against 1.56 ms); P.V adds into hd / 8
 * register accumulators. 1.56 ms a layer in the same minutes. */
static inline __m128 attn_sum4(const __m256 *v) {  /* lane i = the sum of v[i]'s 8 lanes, i < 4 */
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#define ATTN_BLOCK_AVX2(HDV)                                                                            \
static void attn_block_avx2_##HDV(const float *q, const float *K, const float *V, int64_t lo, int64_t hi,     \
                                  float scale, float cap, float *m, float *l, float *acc, const float *Kn,    \
                                  const float *Vn) {                                                          \
    const int64_t hd = 8 * HDV, n = hi - lo;                                                                 \
    float s[ATTN_MAX_BS + 8] __attribute__((aligned(32)));                                                   \
    __m256 qv[HDV];                                                                                           \
    for (int c = 0; c < HDV; c++) qv[c] = _mm256_loadu_ps(q + 8 * c);                                         \
    const __m256 sc = _mm256_set1_ps(scale);                                                                  \
    for (int64_t i0 = 0; i0 < n; i0 += 4) {                                                                   \
        __m256 part[4];                                                                                       \
        const float *k[4];                                                                                    \
        for (int r = 0; r < 4; r++) {                                                                         \
            k[r] = i0 + r < n ? K + (lo + i0 + r) * hd : attn_zero_row;                                       \
            if (Kn && i0 + r < n)                                                                             \
                for (int c = 0; c < HDV; c += 2) __builtin_prefetch(Kn + (lo + i0 + r) * hd + 8 * c, 0, 2);   \
            part[r] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k[r]));                                            \
        }                                                                                                     \
        for (int c = 1; c < HDV; c++)  /* the rows' chains side by side: FMA latency, not a chain, sets the pace */ \
            for (int r = 0; r < 4; r++) part[r] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k[r] + 8 * c), part[r]); \
        _mm_store_ps(s + i0, _mm_mul_ps(attn_sum4(part), _mm256_castps256_ps128(sc)));                        \
    }                                                                                                         \
    const __m256 cf = _mm256_set1_ps(attn_softmax_block(s, n, m, l, cap));                                         \
    __m256 av[HDV];                                                                                           \
    for (int c = 0; c < HDV; c++) av[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), cf);                    \
    for (int64_t i = 0; i < n; i++) {                                                                         \
        const float *v = V + (lo + i) * hd;                                                                   \
        if (Vn) for (int c = 0; c < HDV; c += 2) __builtin_prefetch(Vn + (lo + i) * hd + 8 * c, 0, 2);        \
        const __m256 p = _mm256_set1_ps(s[i]);                                                                \
        for (int c = 0; c < HDV; c++) av[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), av[c]);          \
    }                                                                                                         \
    for (int c = 0; c < HDV; c++) _mm256_storeu_ps(acc + 8 * c, av[c]);                                       \
}
ATTN_BLOCK_AVX2(8) ATTN_BLOCK_AVX2(16)
#endif

/* One block of one KV head for its g query heads, on the vector path when hd is 64 or 128. */
static void attn_block(const float *q, const float *K, const float *V, int64_t lo, int64_t hi, int64_t g,
                       int64_t hd, float scale, float cap, float *m, float *l, float *acc, const float *Kn,
                       const float *Vn) {
    typedef void (*block_fn)(const float *, const float *, const float *, int64_t, int64_t, float, float, float *, float *,
                             float *, const float *, const float *);
    if (hd == 64 || hd == 128) {
#ifdef ATTN_AVX2
        const block_fn one = hd == 64 ? attn_block_avx2_8 : attn_block_avx2_16;
        for (int64_t j = 0; j < g; j++)  /* the first head's pass prefetches the next block */
            one(q + j * hd, K, V, lo, hi, scale, cap, m + j, l + j, acc + j * hd, j ? NULL : Kn, j ? NULL : Vn);
#else
        static const block_fn by_heads64[] = {attn_block_4_1, attn_block_4_2, attn_block_4_3, attn_block_4_4};
        static const block_fn by_heads128[] = {attn_block_8_1, attn_block_8_2};
        const block_fn *fns = hd == 64 ? by_heads64 : by_heads128;
        const int64_t most = hd == 64 ? 4 : 2;
        for (int64_t j = 0; j < g; j += most) {  /* query heads in register-sized groups; K/V rows stay in L1 */
            const int64_t gh = g - j < most ? g - j : most;
            fns[gh - 1](q + j * hd, K, V, lo, hi, scale, cap, m + j, l + j, acc + j * hd, j ? NULL : Kn, j ? NULL : Vn);
        }
#endif
        return;
    }
    attn_block_scalar(q, K, V, lo, hi, g, hd, scale, cap, m, l, acc, Kn, Vn);
}

static void attn_unit(const void *args, int64_t unit) {
    const attn_args *a = (const attn_args *)args;
    const int64_t per = a->heads_per_unit, units_per_seq = a->kv / per;
    const int64_t b = unit / units_per_seq, h0 = (unit % units_per_seq) * per, g = a->g, hd = a->hd, bs = a->bs;
    const int64_t len = a->lens[b];
    const int64_t start = a->window > 0 && len > a->window ? len - a->window : 0;
    float m[ATTN_MAX_H], l[ATTN_MAX_H];
    float acc[ATTN_MAX_ACC] __attribute__((aligned(64)));
    for (int64_t j = 0; j < per * g; j++) { m[j] = -3.0e38f; l[j] = 0.f; }
    memset(acc, 0, (size_t)(per * g * hd) * sizeof(float));
    for (int64_t t0 = start - start % bs; t0 < len; t0 += bs) {
        const float *page = a->pages + a->blocks[b * a->nb + t0 / bs] * a->page_stride;
        const float *next = t0 + bs < len ? a->pages + a->blocks[b * a->nb + t0 / bs + 1] * a->page_stride : NULL;
        /* the sequence's last block: prefetch the first block of the sequence this thread is likely to take next
         * (units go out one at a time, in order, to the team's threads), which otherwise starts on a DRAM wait */
        if (!next && per == a->kv && b + a->ahead < a->B) {
            const int64_t b2 = b + a->ahead, len2 = a->lens[b2];
            const int64_t start2 = a->window > 0 && len2 > a->window ? len2 - a->window : 0;
            next = a->pages + a->blocks[b2 * a->nb + start2 / bs] * a->page_stride;
        }
        const int64_t lo = (start > t0 ? start : t0) - t0, hi = min64(len, t0 + bs) - t0;
        if (per == a->kv)  /* the whole page's lines asked for at once, before its first row is read */
            for (int64_t off = 0; off < 2 * a->kv * bs * a->hd; off += 16) _mm_prefetch((const char *)(page + off),
                                                                                        _MM_HINT_T0);
        for (int64_t h = h0; h < h0 + per; h++) {
            const int64_t j0 = (h - h0) * g;
            attn_block(a->q + b * a->sq + h * g * hd, page + h * bs * hd, page + (a->kv + h) * bs * hd, lo, hi, g,
                       hd, a->scale, a->cap, m + j0, l + j0, acc + j0 * hd, next ? next + h * bs * hd : NULL,
                       next ? next + (a->kv + h) * bs * hd : NULL);
        }
    }
    float *o = a->out + b * a->so + h0 * g * hd;
    for (int64_t j = 0; j < per * g; j++) {
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        #pragma omp simd
        for (int64_t c = 0; c < hd; c++) o[j * hd + c] = acc[j * hd + c] * inv;
    }
}

/* Returns 0, or -1 when the shapes are beyond the kernel's fixed bounds (the caller then gathers). */
int paged_decode_attention_f32(int64_t B, const float *q, int64_t sq, const float *pages, int64_t page_stride,
                               const int64_t *blocks, int64_t nb, const int64_t *lens, float *out, int64_t so,
                               int64_t kv, int64_t g, int64_t hd, int64_t bs, int64_t window, float scale,
                               float cap, int nthreads) {
    if (g < 1 || g > ATTN_MAX_G || hd < 1 || g * hd > ATTN_MAX_ACC || bs < 1 || bs > ATTN_MAX_BS) return -1;
    const int64_t per = kv * g * hd <= ATTN_MAX_ACC && kv * g <= ATTN_MAX_H ? kv : 1;
    attn_args a = {q, pages, blocks, lens, out, sq, so, page_stride, nb, kv, g, hd, bs, window, scale, cap, per, B,
                   nthreads > 1 ? nthreads : 1};
    parallel_for_team(attn_unit, &a, B * (kv / per), nthreads);
    return 0;
}

/* ---- prefill attention over the paged KV cache ---------------------------------------------------------
 * A prompt chunk of n query tokens of one sequence, after `start` positions already in the cache (issue 46: a
 * long prompt read a few tokens a step beside other tenants' decodes). Row i attends positions
 * [max(0, start + i + 1 - window), start + i] (causal; its own key was written before the call). Without this the
 * runner gathered the K/V of every earlier position into a contiguous copy each layer (advanced indexing, then a
 * permute), which for a 4-token chunk at position 6,000 of SmolLM2 made a step cost 4.6x a lone decode step,
 * against 1.5x for one more decode row at that context (2026-12-07, the 2-vCPU Zen 3 guest, loaded).
 * One unit = (KV head, a tile of consecutive rows): the unit walks the pages once and, per page, runs each of its
 * rows' g query heads over the page's rows that row may see (attn_block, the decode kernel's block: the page's
 * K and V of that head stay in L1 across the tile's rows). Tiles are cut so that there are about two units a
 * thread when the chunk is short, and so that a tile's accumulators fit on the stack. */
typedef struct {
    const float *q;          /* [n, KV * g, hd], row stride sq */
    const float *pages;
    const int64_t *blocks;   /* [nb] the sequence's page ids */
    float *out;              /* [n, KV * g * hd], row stride so */
    int64_t n, start, sq, so, page_stride, kv, g, hd, bs, window, tile, tiles;
    float scale, cap;
} prefill_attn_args;

#define PREFILL_MAX_STATES 512  /* rows x query heads of one tile */

static void prefill_attn_unit(const void *args, int64_t unit) {
    const prefill_attn_args *a = (const prefill_attn_args *)args;
    const int64_t h = unit / a->tiles, r0 = (unit % a->tiles) * a->tile;
    const int64_t r1 = min64(a->n, r0 + a->tile), g = a->g, hd = a->hd, bs = a->bs;
    float m[PREFILL_MAX_STATES], l[PREFILL_MAX_STATES];
    float acc[ATTN_MAX_ACC] __attribute__((aligned(64)));
    for (int64_t j = 0; j < (r1 - r0) * g; j++) { m[j] = -3.0e38f; l[j] = 0.f; }
    memset(acc, 0, (size_t)((r1 - r0) * g * hd) * sizeof(float));
    const int64_t first_len = a->start + r0 + 1, last_len = a->start + r1;
    const int64_t lowest = a->window > 0 && first_len > a->window ? first_len - a->window : 0;
    for (int64_t t0 = lowest - lowest % bs; t0 < last_len; t0 += bs) {
        const float *page = a->pages + a->blocks[t0 / bs] * a->page_stride;
        const float *K = page + h * bs * hd, *V = page + (a->kv + h) * bs * hd;
        const float *next = t0 + bs < last_len ? a->pages + a->blocks[t0 / bs + 1] * a->page_stride : NULL;
        for (int64_t r = r0; r < r1; r++) {
            const int64_t len = a->start + r + 1;
            const int64_t from = a->window > 0 && len > a->window ? len - a->window : 0;
            const int64_t lo = (from > t0 ? from : t0) - t0, hi = min64(len, t0 + bs) - t0;
            if (hi <= lo) continue;
            const int64_t j0 = (r - r0) * g;
            attn_block(a->q + r * a->sq + h * g * hd, K, V, lo, hi, g, hd, a->scale, a->cap, m + j0, l + j0, acc + j0 * hd,
                       next && r == r0 ? next + h * bs * hd : NULL, next && r == r0 ? next + (a->kv + h) * bs * hd : NULL);
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        float *o = a->out + r * a->so + h * g * hd;
        for (int64_t j = 0; j < g; j++) {
            const int64_t s = (r - r0) * g + j;
            const float inv = l[s] > 0.f ? 1.f / l[s] : 0.f;
            #pragma omp simd
            for (int64_t c = 0; c < hd; c++) o[j * hd + c] = acc[s * hd + c] * inv;
        }
    }
}

/* Returns 0, or -1 when the shapes are beyond the kernel's fixed bounds (the caller then gathers). */
int paged_prefill_attention_f32(int64_t n, const float *q, int64_t sq, const float *pages, int64_t page_stride,
                                const int64_t *blocks, int64_t start, float *out, int64_t so, int64_t kv, int64_t g,
                                int64_t hd, int64_t bs, int64_t window, float scale, float cap, int nthreads) {
    if (n < 1 || start < 0 || g < 1 || g > ATTN_MAX_G || hd < 1 || g * hd > ATTN_MAX_ACC || g > PREFILL_MAX_STATES
        || bs < 1 || bs > ATTN_MAX_BS) return -1;
    int64_t most = ATTN_MAX_ACC / (g * hd);
    if (most * g > PREFILL_MAX_STATES) most = PREFILL_MAX_STATES / g;
    const int64_t threads = nthreads > 1 ? nthreads : 1;
    const int64_t want_tiles = (2 * threads + kv - 1) / kv;  /* about two units a thread */
    int64_t tile = (n + want_tiles - 1) / want_tiles;
    if (tile > most) tile = most;
    if (tile < 1) tile = 1;
    const int64_t tiles = (n + tile - 1) / tile;
    prefill_attn_args a = {q, pages, blocks, out, n, start, sq, so, page_stride, kv, g, hd, bs, window, tile, tiles,
                           scale, cap};
    parallel_for_team(prefill_attn_unit, &a, kv * tiles, nthreads);
    return 0;
}

/* ---- RMSNorm -------------------------------------------------------------------------------------------
 * out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)), fp32, in transformers' LlamaRMSNorm order (normalise,
 * then scale by the weight). torch ran it as six ops (pow, mean, add, rsqrt, mul, mul), each a pass over
 * the rows and an OpenMP region: 80-130 us a call inside a SmolLM2 decode step against ~10 here. Rows go
 * over the team in two units a thread from NORM_ROPE_TEAM_MIN elements (a decode step's), else run on the
 * calling thread. */
typedef struct {
    const float *x, *w;
    float *out;
    int64_t sx, so, d, rows_per_unit, T;
    float eps;
} rms_args;

static void rms_unit(const void *args, int64_t unit) {
    const rms_args *a = (const rms_args *)args;
    const int64_t t1 = min64(a->T, (unit + 1) * a->rows_per_unit), d = a->d;
    for (int64_t t = unit * a->rows_per_unit; t < t1; t++) {
        const float *x = a->x + t * a->sx;
        float *o = a->out + t * a->so;
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int64_t c = 0; c < d; c++) ss += x[c] * x[c];
        const float inv = 1.f / sqrtf(ss / (float)d + a->eps);
        #pragma omp simd
        for (int64_t c = 0; c < d; c++) o[c] = a->w[c] * (x[c] * inv);
    }
}

/* Rows per unit of a row-wise kernel over `elems` floats: two units a thread from `team_min` elements on, else
 * all T rows in one unit (which parallel_for_team runs on the calling thread). */
static int64_t rows_two_units_a_thread(int64_t T, int64_t elems, int64_t team_min, int nthreads) {
    return elems >= team_min && nthreads > 1 ? (T + 2 * nthreads - 1) / (2 * nthreads) : (T > 0 ? T : 1);
}

#define TEAM_MIN_ELEMS (1 << 20)  /* argmax_rows_f32: below this many elements one thread is faster than a team */
/* RMSNorm and RoPE + KV write: a decode step's 64 rows go over the team from here on. They follow a GEMM, whose team
 * still spins, and their data sits in the two cores' caches in halves. Paired in one process (SmolLM2, the Zen 4 host,
 * 2026-12-04, 4 rounds, thread count alternating by pass), a base-only pass's decode calls took 0.05-0.16 / 0.06-0.10 s
 * on the team against 0.18-0.25 / 0.12-0.16 s on one thread, as they ran before (fleet passes alike). */
#define NORM_ROPE_TEAM_MIN (1 << 14)

void rms_norm_f32(int64_t T, int64_t d, const float *x, int64_t sx, const float *w, float *out, int64_t so,
                  float eps, int nthreads) {
    const int64_t per = rows_two_units_a_thread(T, T * d, NORM_ROPE_TEAM_MIN, nthreads);
    rms_args a = {x, w, out, sx, so, d, per, T, eps};
    parallel_for_team(rms_unit, &a, (T + per - 1) / per, nthreads);
}

/* ---- RoPE and the KV write, in one pass -----------------------------------------------------------------
 * For each new token t: its H query and KV key heads (the first (H + KV) * hd values of qkv row t) rotated
 * the Hugging Face way, out = x * cos + rotate_half(x) * sin with rotate_half's sign folded into sin_signed
 * ([-sin, sin]), into qk[t] ([H + KV, hd], contiguous); the rotated keys and the values (the next KV * hd
 * values of the row) are also stored in the layer's pages at the token's flat row (page row / bs, offset
 * row % bs; a page is [2, KV, bs, hd]: K heads, then V heads). torch ran this as eight ops a layer (a cat, a
 * mul, an addcmul, a floor-divide, a remainder and two index_puts): 5.5-8.5 ms of a SmolLM2 decode step.
 * Tokens go over the team as RMSNorm's rows do (NORM_ROPE_TEAM_MIN). */
typedef struct {
    const float *qkv, *cos, *sin;
    float *qk, *pages;
    const int64_t *rows;
    int64_t sqkv, scs, H, KV, hd, page_stride, bs, tokens_per_unit, T;
} rope_args;

static void rope_unit(const void *args, int64_t unit) {
    const rope_args *a = (const rope_args *)args;
    const int64_t hd = a->hd, half = hd / 2, heads = a->H + a->KV;
    const int64_t t1 = min64(a->T, (unit + 1) * a->tokens_per_unit);
    for (int64_t t = unit * a->tokens_per_unit; t < t1; t++) {
        const float *x = a->qkv + t * a->sqkv, *cs = a->cos + t * a->scs, *sn = a->sin + t * a->scs;
        float *o = a->qk + t * heads * hd;
        float *page = a->pages + (a->rows[t] / a->bs) * a->page_stride;
        const int64_t off = a->rows[t] % a->bs;
        for (int64_t j = 0; j < heads; j++) {
            const float *xj = x + j * hd;
            float *oj = o + j * hd;
            #pragma omp simd
            for (int64_t c = 0; c < half; c++) oj[c] = xj[c] * cs[c] + xj[c + half] * sn[c];
            #pragma omp simd
            for (int64_t c = half; c < hd; c++) oj[c] = xj[c] * cs[c] + xj[c - half] * sn[c];
            if (j >= a->H) {  /* a key head: into its page row */
                memcpy(page + ((j - a->H) * a->bs + off) * hd, oj, (size_t)hd * sizeof(float));
                memcpy(page + ((a->KV + j - a->H) * a->bs + off) * hd, x + (heads + j - a->H) * hd,
                       (size_t)hd * sizeof(float));  /* and its value head */
            }
        }
    }
}

/* Returns 0, or -1 (nothing written) when a row lies outside the layer's num_pages pages. */
int rope_kv_write_f32(int64_t T, const float *qkv, int64_t sqkv, int64_t H, int64_t KV, int64_t hd,
                      const float *cos, const float *sin, int64_t scs, float *qk, float *pages, int64_t page_stride,
                      int64_t num_pages, const int64_t *rows, int64_t bs, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (rows[t] < 0 || rows[t] >= num_pages * bs) return -1;
    const int64_t per = rows_two_units_a_thread(T, T * (H + 2 * KV) * hd, NORM_ROPE_TEAM_MIN, nthreads);
    rope_args a = {qkv, cos, sin, qk, pages, rows, sqkv, scs, H, KV, hd, page_stride, bs, per, T};
    parallel_for_team(rope_unit, &a, (T + per - 1) / per, nthreads);
    return 0;
}

/* ---- SwiGLU's gate --------------------------------------------------------------------------------------
 * out[t, c] = silu(gu[t, c]) * gu[t, n + c] = gu[t, c] / (1 + exp(-gu[t, c])) * gu[t, n + c], fp32, for the
 * fused gate/up GEMM's output (gate columns, then up columns). torch ran it as two ops (silu, then mul_),
 * each its own OpenMP region and its own pass over the rows. exp's argument is capped at 88 (exp(88) < FLT_MAX):
 * -ffast-math divides by way of a reciprocal whose refinement turns 1 / inf into NaN, where the cap gives the
 * ~0 torch gives for a gate far below zero. Rows in chunks over the team from SWIGLU_TEAM_MIN
 * elements (an exp per element repays a team sooner than RMSNorm's multiply-adds), else on the calling thread. */
typedef struct {
    const float *gu;
    float *out;
    int64_t sg, so, n, rows_per_unit, T;
} swiglu_args;

static void swiglu_unit(const void *args, int64_t unit) {
    const swiglu_args *a = (const swiglu_args *)args;
    const int64_t t1 = min64(a->T, (unit + 1) * a->rows_per_unit), n = a->n;
    for (int64_t t = unit * a->rows_per_unit; t < t1; t++) {
        const float *g = a->gu + t * a->sg, *u = g + n;
        float *o = a->out + t * a->so;
        EXP_SIMD
        for (int64_t c = 0; c < n; c++) o[c] = g[c] / (1.f + expf(fminf(-g[c], 88.f))) * u[c];
    }
}

#define SWIGLU_TEAM_MIN (1 << 16)

void swiglu_f32(int64_t T, int64_t n, const float *gu, int64_t sg, float *out, int64_t so, int nthreads) {
    const int64_t per = rows_two_units_a_thread(T, T * n, SWIGLU_TEAM_MIN, nthreads);
    swiglu_args a = {gu, out, sg, so, n, per, T};
    parallel_for_team(swiglu_unit, &a, (T + per - 1) / per, nthreads);
}

/* GeGLU's gate with the tanh GELU (Gemma: gelu_pytorch_tanh), gelu(g) * u: 0.5 g (1 + tanh(z)) with
 * z = sqrt(2 / pi) (g + 0.044715 g^3), written as g / (1 + exp(-2z)) (the same function) so that it vectorises as
 * SwiGLU's sigmoid does. */
static void geglu_unit(const void *args, int64_t unit) {
    const swiglu_args *a = (const swiglu_args *)args;
    const int64_t t1 = min64(a->T, (unit + 1) * a->rows_per_unit), n = a->n;
    const float k2 = -2.f * 0.7978845608028654f;
    for (int64_t t = unit * a->rows_per_unit; t < t1; t++) {
        const float *g = a->gu + t * a->sg, *u = g + n;
        float *o = a->out + t * a->so;
        EXP_SIMD
        for (int64_t c = 0; c < n; c++) {
            const float x = g[c], z = k2 * (x + 0.044715f * x * x * x);
            o[c] = x / (1.f + expf(fminf(z, 88.f))) * u[c];
        }
    }
}

void geglu_tanh_f32(int64_t T, int64_t n, const float *gu, int64_t sg, float *out, int64_t so, int nthreads) {
    const int64_t per = rows_two_units_a_thread(T, T * n, SWIGLU_TEAM_MIN, nthreads);
    swiglu_args a = {gu, out, sg, so, n, per, T};
    parallel_for_team(geglu_unit, &a, (T + per - 1) / per, nthreads);
}

/* ---- greedy pick: each row's first index of its largest value ------------------------------------------
 * torch.argmax's last-dim reduction tracks an index beside every lane's value: 1.3-1.4 ms for a decode step's
 * 64 rows of SmolLM2's 49,152 logits on this project's 2-CPU host, of the ~3.5 ms a step spent outside the
 * forward; this takes 0.47-0.52 ms from a cold cache. Here each row is two vector passes: its max, then the first position holding it (the row is still
 * in L2). A row holding a NaN has no defined answer here (-ffast-math); sampling fails such rows before it
 * reads their token (sampling.non_finite_rows), and the index returned is then still inside the row. */
typedef struct {
    const float *x;
    int64_t *out;
    int64_t sx, n, rows_per_unit, T;
} argmax_args;

static void argmax_unit(const void *args, int64_t unit) {
    const argmax_args *a = (const argmax_args *)args;
    const int64_t t1 = min64(a->T, (unit + 1) * a->rows_per_unit), n = a->n;
    for (int64_t t = unit * a->rows_per_unit; t < t1; t++) {
        const float *x = a->x + t * a->sx;
        float m = x[0];
        #pragma omp simd reduction(max:m)
        for (int64_t c = 0; c < n; c++) m = x[c] > m ? x[c] : m;
        int64_t at = 0;
        for (int64_t c0 = 0; c0 < n; c0 += 64) {  /* the first 64-wide block holding m, then its first lane */
            const int64_t c1 = min64(n, c0 + 64);
            int hit = 0;
            #pragma omp simd reduction(|:hit)
            for (int64_t c = c0; c < c1; c++) hit |= x[c] == m;
            if (!hit) continue;
            for (at = c0; at < c1 - 1 && x[at] != m; at++) {}
            break;
        }
        a->out[t] = at;
    }
}

void argmax_rows_f32(int64_t T, int64_t n, const float *x, int64_t sx, int64_t *out, int nthreads) {
    const int64_t per = rows_two_units_a_thread(T, T * n, TEAM_MIN_ELEMS, nthreads);  /* a decode step's: 3 M */
    argmax_args a = {x, out, sx, n, per, T};
    parallel_for_team(argmax_unit, &a, (T + per - 1) / per, nthreads);
}

/* ---- the projections' fp32 GEMM on packed weights (gemm_f32.h) ---------------------------------- */
#include "gemm_f32.h"
