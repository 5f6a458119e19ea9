/* SGMV on CPU, fp32: out[t] += scale[slot] * B[slot, :, :r] @ (A[slot, :r, :] @ x[t]) per active segment.
 *
 * Built by kernels/cpu_native.py with gcc -O3 -march=native -ffast-math and called through ctypes, so
 * one call covers every segment of a projection (no Python per segment). Per segment:
 *   shrink: y[t, j] = A[slot, j, :] . x[t]                for the segment's tokens, j < rank
 *   expand: out[t, n] += scale * sum_j y[t, j] * B[n, j]  (gathers for small ranks, row dots above)
 * Work and memory traffic are proportional to each slot's real rank; tokens without adapter never appear.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define TB 4          /* tokens per register block */
#define PREFETCH_ROWS 8  /* B rows read ahead in the expand */
#define GATHER_PREFETCH 32  /* B rows prefetched ahead by the gather expand */
#define GATHER_MAX_RANK 8  /* expand ranks up to this by column gathers; measured faster than rows up to 8 */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static void shrink_unit(const float *x, int64_t sx, const float *arows, int64_t sar, int nrows,
                        float *y, int64_t sy, int64_t len, int64_t d_in) {
    for (int64_t t0 = 0; t0 < len; t0 += TB) {
        int nt = (int)min64(TB, len - t0);
        const float *x0 = x + t0 * sx;
        const float *x1 = x0 + (nt > 1 ? sx : 0);
        const float *x2 = x0 + (nt > 2 ? 2 * sx : 0);
        const float *x3 = x0 + (nt > 3 ? 3 * sx : 0);
        for (int j = 0; j < nrows; j++) {
            const float *ar = arows + j * sar;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
            if (nt == 1) {
                #pragma omp simd reduction(+:s0)
                for (int64_t k = 0; k < d_in; k++) s0 += ar[k] * x0[k];
            } else if (nt == 2) {
                #pragma omp simd reduction(+:s0,s1)
                for (int64_t k = 0; k < d_in; k++) { s0 += ar[k] * x0[k]; s1 += ar[k] * x1[k]; }
            } else {
                #pragma omp simd reduction(+:s0,s1,s2,s3)
                for (int64_t k = 0; k < d_in; k++) {
                    float a = ar[k];
                    s0 += a * x0[k]; s1 += a * x1[k]; s2 += a * x2[k]; s3 += a * x3[k];
                }
            }
            float s[TB] = {s0, s1, s2, s3};
            for (int i = 0; i < nt; i++) y[(t0 + i) * sy + j] = s[i];
        }
    }
}

/* Columns n0..n1 of out for the segment's tokens: one dot product over the real rank per (token, column),
 * B rows read once per block of TB tokens. Rows of B are r_max apart, so for a small rank the reads are
 * strided: prefetch a few rows ahead, since the hardware prefetcher does not follow that stride well. */
__attribute__((unused))  /* the fallback where AVX-512 is missing */
static void expand_unit(const float *y, int64_t sy, const float *b, int64_t sbn, int rank,
                        float *out, int64_t so, int64_t len, int64_t ncols, float scale) {
    for (int64_t t0 = 0; t0 < len; t0 += TB) {
        int nt = (int)min64(TB, len - t0);
        const float *y0 = y + t0 * sy;
        const float *y1 = y0 + (nt > 1 ? sy : 0);
        const float *y2 = y0 + (nt > 2 ? 2 * sy : 0);
        const float *y3 = y0 + (nt > 3 ? 3 * sy : 0);
        float *o0 = out + t0 * so;
        float *o1 = o0 + (nt > 1 ? so : 0);
        float *o2 = o0 + (nt > 2 ? 2 * so : 0);
        float *o3 = o0 + (nt > 3 ? 3 * so : 0);
        for (int64_t n = 0; n < ncols; n++) {
            const float *br = b + n * sbn;
            __builtin_prefetch(br + PREFETCH_ROWS * sbn);
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
            if (nt == 1) {
                #pragma omp simd reduction(+:s0)
                for (int j = 0; j < rank; j++) s0 += br[j] * y0[j];
                o0[n] += scale * s0;
            } else if (nt == 2) {
                #pragma omp simd reduction(+:s0,s1)
                for (int j = 0; j < rank; j++) { s0 += br[j] * y0[j]; s1 += br[j] * y1[j]; }
                o0[n] += scale * s0; o1[n] += scale * s1;
            } else {
                #pragma omp simd reduction(+:s0,s1,s2,s3)
                for (int j = 0; j < rank; j++) {
                    float bv = br[j];
                    s0 += bv * y0[j]; s1 += bv * y1[j]; s2 += bv * y2[j]; s3 += bv * y3[j];
                }
                /* nt == 3 points o3 at o0 with y3 = y0: write o3 first so o0's real sum wins */
                o3[n] += (nt > 3 ? scale * s3 : 0.f);
                o2[n] += (nt > 2 ? scale * s2 : 0.f);
                o1[n] += scale * s1; o0[n] += scale * s0;
            }
        }
    }
}

#ifdef __AVX512F__
/* Small ranks: a per-column dot over a few elements is all overhead (horizontal sums), so gather
 * 16 columns' B[n, j] at a time and accumulate 16 outputs per FMA: work ~ rank x columns / 16. */
static void expand_unit_gather(const float *y, int64_t sy, const float *b, int64_t sbn, int rank,
                               float *out, int64_t so, int64_t len, int64_t ncols, float scale) {
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32((int)sbn));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < len; t0 += TB) {
        int nt = (int)min64(TB, len - t0);
        for (int64_t n0 = 0; n0 < ncols; n0 += 16) {
            int nn = (int)min64(16, ncols - n0);
            __mmask16 m = (__mmask16)((1u << nn) - 1u);
            const float *bb = b + n0 * sbn;
            for (int i = 0; i < 16; i++)  /* rows two blocks ahead: strided rows defeat the hw prefetcher */
                _mm_prefetch((const char *)(bb + (GATHER_PREFETCH + i) * sbn), _MM_HINT_T0);
            __m512 acc[TB];
            for (int t = 0; t < TB; t++) acc[t] = _mm512_setzero_ps();
            for (int j = 0; j < rank; j++) {
                __m512 col = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, bb + j, 4);
                for (int t = 0; t < TB; t++)
                    if (t < nt) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(y[(t0 + t) * sy + j]), col, acc[t]);
            }
            for (int t = 0; t < nt; t++) {
                float *o = out + (t0 + t) * so + n0;
                _mm512_mask_storeu_ps(o, m, _mm512_fmadd_ps(vscale, acc[t], _mm512_maskz_loadu_ps(m, o)));
            }
        }
    }
}

/* Larger ranks: B rows are long enough to stream; one masked FMA per 16 rank elements and token, then
 * one horizontal sum per (token, column). Every line of the row is prefetched a few rows ahead. */
static void expand_unit_rows(const float *y, int64_t sy, const float *b, int64_t sbn, int rank,
                             float *out, int64_t so, int64_t len, int64_t ncols, float scale) {
    const int nchunks = (rank + 15) / 16;
    const __mmask16 last = (rank % 16) ? (__mmask16)((1u << (rank % 16)) - 1u) : (__mmask16)0xFFFF;
    for (int64_t t0 = 0; t0 < len; t0 += TB) {
        int nt = (int)min64(TB, len - t0);
        for (int64_t n = 0; n < ncols; n++) {
            const float *br = b + n * sbn;
            for (int c = 0; c < rank; c += 16)
                _mm_prefetch((const char *)(br + PREFETCH_ROWS * sbn + c), _MM_HINT_T0);
            __m512 s[TB];
            for (int t = 0; t < TB; t++) s[t] = _mm512_setzero_ps();
            for (int c = 0; c < nchunks; c++) {
                __mmask16 m = (c == nchunks - 1) ? last : (__mmask16)0xFFFF;
                __m512 bv = _mm512_maskz_loadu_ps(m, br + 16 * c);
                for (int t = 0; t < TB; t++)
                    if (t < nt) s[t] = _mm512_fmadd_ps(bv, _mm512_maskz_loadu_ps(m, y + (t0 + t) * sy + 16 * c), s[t]);
            }
            for (int t = 0; t < nt; t++) out[(t0 + t) * so + n] += scale * _mm512_reduce_add_ps(s[t]);
        }
    }
}
#endif

/* B stored rank-major ([S, r_max, d_out] memory, passed as a transposed view): each rank row of B is a
 * contiguous run of output columns, so the expand is a sum of rank axpys streaming exactly rank x
 * columns floats, whatever r_max is. The layout the CPU path prefers (see kernels/cpu.py). Tiles are
 * wide (1 KB per rank row) because each rank row is its own stream: 64-column tiles of a rank-64 adapter
 * were 64 concurrent 256-byte streams, which the prefetchers did not follow (measured 2x slower). */
#define NB 256  /* output columns per tile: TB x NB fp32 accumulators (4 KB) stay in L1 */
static void expand_unit_rank_major(const float *y, int64_t sy, const float *b, int64_t sbr, int rank,
                                   float *out, int64_t so, int64_t len, int64_t ncols, float scale) {
    for (int64_t t0 = 0; t0 < len; t0 += TB) {
        int nt = (int)min64(TB, len - t0);
        for (int64_t n0 = 0; n0 < ncols; n0 += NB) {
            const int w = (int)min64(NB, ncols - n0);  /* tile width; the last tile may be narrower */
            float acc[TB][NB] __attribute__((aligned(64)));
            for (int t = 0; t < nt; t++) memset(acc[t], 0, (size_t)w * sizeof(float));
            int j = 0;
            for (; j + 4 <= rank; j += 4) {  /* four rank rows per pass: a quarter of the acc traffic */
                const float *b0 = b + j * sbr + n0, *b1 = b0 + sbr, *b2 = b1 + sbr, *b3 = b2 + sbr;
                if (n0 + 2 * NB <= ncols)  /* next tile of these rows: rank streams outrun the hw prefetcher */
                    for (int i = 0; i < NB; i += 16) {
                        __builtin_prefetch(b0 + NB + i); __builtin_prefetch(b1 + NB + i);
                        __builtin_prefetch(b2 + NB + i); __builtin_prefetch(b3 + NB + i);
                    }
                for (int t = 0; t < nt; t++) {
                    const float *yt = y + (t0 + t) * sy + j;
                    float y0 = yt[0], y1 = yt[1], y2 = yt[2], y3 = yt[3];
                    float *at = acc[t];
                    #pragma omp simd
                    for (int i = 0; i < w; i++) at[i] += y0 * b0[i] + y1 * b1[i] + y2 * b2[i] + y3 * b3[i];
                }
            }
            for (; j < rank; j++) {
                const float *bj = b + j * sbr + n0;
                for (int t = 0; t < nt; t++) {
                    float yv = y[(t0 + t) * sy + j];
                    float *at = acc[t];
                    #pragma omp simd
                    for (int i = 0; i < w; i++) at[i] += yv * bj[i];
                }
            }
            for (int t = 0; t < nt; t++) {
                float *o = out + (t0 + t) * so + n0;
                const float *at = acc[t];
                #pragma omp simd
                for (int i = 0; i < w; i++) o[i] += scale * at[i];
            }
        }
    }
}

typedef struct {
    const int32_t *starts, *lens, *slots, *ranks;
    const float *x, *a, *b, *scales;
    float *out, *y;
    int64_t sx, sas, sar, sbs, sbn, sbr, so, sy, d_in, d_out;
} sgmv_args;

/* One segment: its shrink into y, then its expand into out. */
static void run_segment(const sgmv_args *p, int64_t g) {
    float *y = p->y + (int64_t)p->starts[g] * p->sy;  /* [len, r_max] scratch rows of this segment */
    const float *b = p->b + (int64_t)p->slots[g] * p->sbs;
    float *out = p->out + (int64_t)p->starts[g] * p->so;
    float scale = p->scales[p->slots[g]];
    shrink_unit(p->x + (int64_t)p->starts[g] * p->sx, p->sx, p->a + (int64_t)p->slots[g] * p->sas, p->sar,
                p->ranks[g], y, p->sy, p->lens[g], p->d_in);
    if (p->sbr != 1) {  /* rank-major B: rows of the rank axis are contiguous columns */
        expand_unit_rank_major(y, p->sy, b, p->sbr, p->ranks[g], out, p->so, p->lens[g], p->d_out, scale);
        return;
    }
#ifdef __AVX512F__
    if (p->ranks[g] <= GATHER_MAX_RANK)
        expand_unit_gather(y, p->sy, b, p->sbn, p->ranks[g], out, p->so, p->lens[g], p->d_out, scale);
    else
        expand_unit_rows(y, p->sy, b, p->sbn, p->ranks[g], out, p->so, p->lens[g], p->d_out, scale);
#else
    expand_unit(y, p->sy, b, p->sbn, p->ranks[g], out, p->so, p->lens[g], p->d_out, scale);
#endif
}

/* ---- helper threads -------------------------------------------------------------------------------
 * Why not OpenMP: on a machine shared with other processes, an OpenMP region ends in a barrier that
 * waits for every team thread, including one the scheduler has not run yet (measured: tens of ms per
 * call under load). Here the calling thread never waits for a helper that has not started: it claims
 * segments from a shared counter like the helpers do, and at the end waits only for segments a helper
 * has actually claimed. A helper that wakes late finds no work and sleeps again. After fork() the
 * child starts a fresh pool on its first parallel call. */
typedef struct {
    sgmv_args p;
    int64_t G;
    atomic_long next;    /* next unclaimed segment */
    atomic_int active;   /* helpers inside this job */
} sgmv_job;

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static sgmv_job *pool_job = NULL;
static long pool_generation = 0;
static int pool_helpers = 0;

static void work_on(sgmv_job *job) {
    for (int64_t g = atomic_fetch_add(&job->next, 1); g < job->G; g = atomic_fetch_add(&job->next, 1))
        run_segment(&job->p, g);
}

static void *helper_main(void *unused) {
    (void)unused;
    long seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool_mu);
        while (pool_job == NULL || pool_generation == seen) pthread_cond_wait(&pool_cv, &pool_mu);
        sgmv_job *job = pool_job;
        seen = pool_generation;
        atomic_fetch_add(&job->active, 1);  /* under the lock: the caller cannot retire the job now */
        pthread_mutex_unlock(&pool_mu);
        work_on(job);
        atomic_fetch_sub(&job->active, 1);
    }
    return NULL;
}

static void pool_after_fork_in_child(void);
static void register_fork_handler(void) { pthread_atfork(NULL, NULL, pool_after_fork_in_child); }

/* In a forked child the helpers do not exist and the lock may have been copied held: start afresh. */
static void pool_after_fork_in_child(void) {
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_cv, NULL);
    pool_job = NULL;
    pool_helpers = 0;
}

static void ensure_helpers(int wanted) {
    static pthread_once_t registered = PTHREAD_ONCE_INIT;
    pthread_once(&registered, register_fork_handler);
    pthread_mutex_lock(&pool_mu);
    while (pool_helpers < wanted) {
        pthread_t tid;
        if (pthread_create(&tid, NULL, helper_main, NULL) != 0) break;
        pthread_detach(tid);
        pool_helpers++;
    }
    pthread_mutex_unlock(&pool_mu);
}

/* y: scratch [T, sy] fp32. One unit of work is a whole segment (its shrink then its expand), so units
 * never wait on each other. nthreads <= 1 runs on the calling thread only. */
void sgmv_add_f32(int64_t G, const int32_t *starts, const int32_t *lens, const int32_t *slots,
                  const int32_t *ranks, const float *x, int64_t sx, const float *a, int64_t sas,
                  int64_t sar, const float *b, int64_t sbs, int64_t sbn, int64_t sbr, float *out,
                  int64_t so, const float *scales, float *y, int64_t sy, int64_t d_in, int64_t d_out,
                  int nthreads) {
    /* B strides: sbs per slot, sbn per output column, sbr per rank element; exactly one of sbn, sbr is 1 */
    sgmv_args p = {starts, lens, slots, ranks, x, a, b, scales, out, y,
                   sx, sas, sar, sbs, sbn, sbr, so, sy, d_in, d_out};
    if (nthreads <= 1 || G <= 1) {
        for (int64_t g = 0; g < G; g++) run_segment(&p, g);
        return;
    }
    ensure_helpers(nthreads - 1);
    sgmv_job job;
    job.p = p;
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
    while (atomic_load(&job.active) > 0) sched_yield();  /* only helpers mid-segment */
}
