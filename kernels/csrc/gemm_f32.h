/* fp32 GEMM on weights packed once: out[M, N] = x[M, K] @ W^T (+ bias) (+ out, the residual), for the runner's
 * projections and LM head (inference_worker.model.Projection). Included by sgmv_cpu.c (min64, parallel_for_team).
 *
 * Why our own: at the decode batch (64 rows) oneDNN's packed brgemm ran SmolLM2's projections and LM head at
 * 193-198 GFLOP/s on the Intel Xeon host (bench/limits.py, 2026-12-03 12:01, the model's shapes over 30 distinct
 * weights each), the fastest of torch's three GEMMs per shape at 208-211, and this kernel at 267-270 (mid: 222-240
 * against 254-270). At 512 rows all of them sit near the two cores' FMA peak (SmolLM2 290-299 oneDNN, 283-295
 * here). The difference at 64 rows is the weights' stream: a decode step reads every weight once from DRAM
 * (SmolLM2's 540 MB never fit a cache), and each panel serves only 64 rows, so a panel's first row block waits on
 * memory unless the panel was fetched ahead. Here each panel's row blocks prefetch the NEXT panel into L2, a line
 * at a time spread over the k steps; without that prefetch the same kernel ran at oneDNN's rate (226 against 312
 * GFLOP/s, paired, same process).
 * Layout (gemm_pack_f32): panels of GEMM_NR = 48 output columns; panel p (columns p*48 ...) is the [K, 48] block
 * W[p*48 : p*48 + 48, :]^T, row-major, at wp + p*48*K. The last panel is as wide as what remains rounded up to 16,
 * zero-padded, so the buffer holds K * ceil16(N) floats.
 * Register block: GEMM_MR = 8 rows x 3 vectors of 16 = 24 zmm accumulators; per k, 3 weight loads and 8
 * broadcasts of x feed 24 FMAs. Each output element is one fp32 sum over k in order, then + bias, then + out.
 * Without AVX-512 the entry points say so (gemm_f32_available() == 0) and the runner keeps oneDNN. */

#define GEMM_NV 3                 /* 16-float vectors per panel */
#define GEMM_NR (16 * GEMM_NV)    /* output columns per panel */
#define GEMM_MR 8                 /* rows per register block */
#define GEMM_M_CHUNK 1024         /* rows per pass over the weights (a prefill chunk of 512 and the decode batch in one) */

/* W [N, K] (rows ldw apart) into the panel layout above at wp (K * ceil16(N) floats; the caller allocates them:
 * kernels.cpu_native._gemm_packed_elems). */
void gemm_pack_f32(int64_t N, int64_t K, const float *w, int64_t ldw, float *wp) {
    for (int64_t p0 = 0; p0 < N; p0 += GEMM_NR) {
        int64_t nw = min64(GEMM_NR, N - p0), nwp = (nw + 15) / 16 * 16;
        float *dst = wp + p0 * K;
        for (int64_t k = 0; k < K; k++) {
            for (int64_t j = 0; j < nw; j++) dst[k * nwp + j] = w[(p0 + j) * ldw + k];
            for (int64_t j = nw; j < nwp; j++) dst[k * nwp + j] = 0.0f;
        }
    }
}

#if defined(__AVX512F__)
int gemm_f32_available(void) { return 1; }

/* mr rows of x against one panel of nv vectors (both compile-time at each call site below, so the register
 * block unrolls); the panel's last vector stores only `last` lanes. pf_lines cache lines from pf are prefetched
 * into L2, evenly over the K steps. */
static inline __attribute__((always_inline)) void gemm_block(
        int64_t K, const float *x, int64_t ldx, const float *b, float *out, int64_t ldo, const float *bias, int acc,
        __mmask16 last, const char *pf, int64_t pf_lines, const int mr, const int nv) {
    __m512 c[GEMM_MR][GEMM_NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) c[r][v] = _mm512_setzero_ps();
    const int64_t nwp = 16 * nv;
    /* a prefetch every `every` k steps, `burst` lines at a time (more than one only when pf_lines > K) */
    const int64_t every = pf_lines <= 0 ? K + 1 : pf_lines <= K ? K / pf_lines : 1;
    const int64_t burst = pf_lines > K ? (pf_lines + K - 1) / K : 1;
    int64_t pf_i = 0, pf_next = 0;
    for (int64_t k = 0; k < K; k++) {
        __m512 bv[GEMM_NV];
        for (int v = 0; v < nv; v++) bv[v] = _mm512_loadu_ps(b + k * nwp + 16 * v);
        for (int r = 0; r < mr; r++) {
            __m512 a = _mm512_set1_ps(x[r * ldx + k]);
            for (int v = 0; v < nv; v++) c[r][v] = _mm512_fmadd_ps(a, bv[v], c[r][v]);
        }
        if (k == pf_next) {
            for (int64_t j = 0; j < burst && pf_i < pf_lines; j++, pf_i++) _mm_prefetch(pf + 64 * pf_i, _MM_HINT_T1);
            pf_next += every;
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) {
            __mmask16 m = v == nv - 1 ? last : (__mmask16)0xFFFF;
            __m512 s = c[r][v];
            if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, bias + 16 * v));
            if (acc) s = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + r * ldo + 16 * v), s);
            _mm512_mask_storeu_ps(out + r * ldo + 16 * v, m, s);
        }
}

#define GEMM_BLOCK_ARGS K, x, ldx, b, out, ldo, bias, acc, last, pf, pf_lines
#define GEMM_ROWS(NV)                                                                       \
    switch (mr) {                                                                           \
        case 8: gemm_block(GEMM_BLOCK_ARGS, 8, NV); break;                                  \
        case 7: gemm_block(GEMM_BLOCK_ARGS, 7, NV); break;                                  \
        case 6: gemm_block(GEMM_BLOCK_ARGS, 6, NV); break;                                  \
        case 5: gemm_block(GEMM_BLOCK_ARGS, 5, NV); break;                                  \
        case 4: gemm_block(GEMM_BLOCK_ARGS, 4, NV); break;                                  \
        case 3: gemm_block(GEMM_BLOCK_ARGS, 3, NV); break;                                  \
        case 2: gemm_block(GEMM_BLOCK_ARGS, 2, NV); break;                                  \
        default: gemm_block(GEMM_BLOCK_ARGS, 1, NV); break;                                 \
    }

static void gemm_block_any(int64_t K, const float *x, int64_t ldx, const float *b, float *out, int64_t ldo,
                           const float *bias, int acc, __mmask16 last, const char *pf, int64_t pf_lines,
                           int mr, int nv) {
    if (nv == 3) { GEMM_ROWS(3) }
    else if (nv == 2) { GEMM_ROWS(2) }
    else { GEMM_ROWS(1) }
}

#define GEMM_MAX_UNITS 64

typedef struct {
    int64_t M, K, N, ldx, ldo, units;
    const float *x, *wp, *bias;
    float *out;
    int acc;
    _Atomic uint64_t *spans;  /* per unit: its panels not yet claimed, [lo, hi) as hi << 32 | lo */
} gemm_args;

/* Panel p over all M rows; its row blocks prefetch panel `next` (-1: none) into L2. */
static void gemm_panel(const gemm_args *a, int64_t p, int64_t next) {
    const int64_t K = a->K, N = a->N, M = a->M, ldx = a->ldx, ldo = a->ldo;
    const int64_t blocks = (M + GEMM_MR - 1) / GEMM_MR;
    const int64_t p0 = p * GEMM_NR, nw = min64(GEMM_NR, N - p0);
    const int nv = (int)((nw + 15) / 16);
    const __mmask16 last = nw % 16 ? (__mmask16)((1u << (nw % 16)) - 1) : (__mmask16)0xFFFF;
    const float *b = a->wp + p0 * K;
    const float *bias = a->bias ? a->bias + p0 : NULL;
    const char *pf = next >= 0 ? (const char *)(a->wp + next * GEMM_NR * K) : NULL;
    const int64_t next_lines = next >= 0 ? (min64(GEMM_NR, N - next * GEMM_NR) + 15) / 16 * 16 * K * 4 / 64 : 0;
    const int64_t per_block = (next_lines + blocks - 1) / blocks;
    for (int64_t bi = 0; bi < blocks; bi++) {
        const int64_t m0 = bi * GEMM_MR;
        const int mr = (int)min64(GEMM_MR, M - m0);
        const int64_t lo = min64(bi * per_block, next_lines);
        gemm_block_any(K, a->x + m0 * ldx, ldx, b, a->out + m0 * ldo + p0, ldo, bias, a->acc, last,
                       pf ? pf + 64 * lo : NULL, min64(per_block, next_lines - lo), mr, nv);
    }
}

/* Claim a unit's first (front) or last unclaimed panel: 1 and *p, or 0 when none is left. */
static int gemm_claim(_Atomic uint64_t *span, int front, int64_t *p) {
    uint64_t s = atomic_load(span);
    for (;;) {
        const uint32_t lo = (uint32_t)s, hi = (uint32_t)(s >> 32);
        if (lo >= hi) return 0;
        const uint64_t want = front ? ((uint64_t)hi << 32) | (lo + 1) : ((uint64_t)(hi - 1) << 32) | lo;
        if (atomic_compare_exchange_weak(span, &s, want)) {
            *p = front ? lo : hi - 1;
            return 1;
        }
    }
}

/* Unit u: its own run of panels front to back, each prefetching the next while that is still unclaimed; then
 * panels from the back of the other units' runs (each prefetching the one before it), so a thread that started
 * late or ran slower (a shared host) is helped instead of waited for. With fixed halves the two threads of a call
 * had finished a mean 34 us apart, 3.6% of a call (a SmolLM2 base-only pass in the engine, 2026-12-03); stealing
 * gained 0.5% in a paired A/B of a forward's GEMMs (0.995 at 64 and at 576 rows), within what one host can show. */
static void gemm_unit(const void *vp, int64_t u) {
    const gemm_args *a = (const gemm_args *)vp;
    int64_t p;
    while (gemm_claim(&a->spans[u], 1, &p)) {
        const uint64_t s = atomic_load(&a->spans[u]);
        gemm_panel(a, p, (uint32_t)s < (uint32_t)(s >> 32) ? p + 1 : -1);
    }
    for (int64_t d = 1; d < a->units; d++) {
        _Atomic uint64_t *span = &a->spans[(u + d) % a->units];
        while (gemm_claim(span, 0, &p)) {
            const uint64_t s = atomic_load(span);
            gemm_panel(a, p, (uint32_t)s < (uint32_t)(s >> 32) ? p - 1 : -1);
        }
    }
}

/* out[M, N] = x[M, K] @ W^T (+ bias[N]) (+ out when acc) with W packed by gemm_pack_f32; x's and out's rows
 * contiguous, ldx / ldo apart. The panels are split into `nthreads` contiguous runs, one per team thread,
 * which steal from each other's ends once their own is done (gemm_unit). */
void gemm_f32(int64_t M, int64_t K, int64_t N, const float *x, int64_t ldx, const float *wp, const float *bias,
              float *out, int64_t ldo, int acc, int nthreads) {
    const int64_t panels = (N + GEMM_NR - 1) / GEMM_NR;
    const int64_t units = min64(min64(panels, nthreads > 1 ? nthreads : 1), GEMM_MAX_UNITS);
    _Atomic uint64_t spans[GEMM_MAX_UNITS];
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_M_CHUNK) {
        for (int64_t u = 0; u < units; u++)
            atomic_init(&spans[u], ((uint64_t)((u + 1) * panels / units) << 32) | (uint64_t)(u * panels / units));
        gemm_args a = {min64(GEMM_M_CHUNK, M - m0), K, N, ldx, ldo, units, x + m0 * ldx, wp, bias,
                       out + m0 * ldo, acc, spans};
        parallel_for_team(gemm_unit, &a, units, nthreads);
    }
}
#else
int gemm_f32_available(void) { return 0; }
void gemm_f32(int64_t M, int64_t K, int64_t N, const float *x, int64_t ldx, const float *wp, const float *bias,
              float *out, int64_t ldo, int acc, int nthreads) {
    (void)M; (void)K; (void)N; (void)x; (void)ldx; (void)wp; (void)bias; (void)out; (void)ldo; (void)acc;
    (void)nthreads;
}
#endif
