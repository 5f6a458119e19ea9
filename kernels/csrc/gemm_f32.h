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
 * Layout (gemm_pack_f32): panels of GEMM_NR output columns (AVX-512: 64, AVX2: 48); panel p (columns p*NR ...) is
 * the [K, NR] block W[p*NR : p*NR + NR, :]^T, row-major, at wp + p*NR*K. The last panel is as wide as what remains
 * rounded up to 16, zero-padded, so the buffer holds K * ceil16(N) floats.
 * Register block (AVX-512): GEMM_MR = 7 rows (6 on Zen 5: gemm_mr_init) x 4 vectors of 16 = 28 zmm accumulators, the 4
 * weight vectors of a k step in the other 4 registers and x's 7 values as embedded broadcasts ({1to16}) of the FMAs:
 * per k, 4 weight loads and 7 broadcasts feed 28 FMAs. The block used to be 8 rows x 3 vectors (24 accumulators, 8
 * broadcasts per 24 FMAs); on the Zen 4 EPYC host (2026-12-06, /tmp A/B of the two builds in one process, the models'
 * shapes over one distinct weight a layer) 7 x 4 took 0.926-0.952 of the time at 64 rows and 0.907-0.929 at 576 on
 * mid's shapes, 0.976-0.989 and 0.947-0.973 on SmolLM2's; 6 x 4 0.94-1.0 / 0.91-0.99, 5 x 5 0.97 / 0.95, 4 x 6 and 3 x
 * 8 (fewer broadcasts, more loads) 1.11-1.19. Each output element is one fp32 sum over k in order, then + bias, then +
 * out (AVX2: one such sum per chunk of K, each chunk's added to out in turn).
 * AVX2 with FMA (no AVX-512) takes the same panels in 16-column strips, 6 rows x 2 ymm a block (below). Without
 * either the entry points say so (gemm_f32_available() == 0) and the runner keeps oneDNN. */

#if defined(__AVX512F__)
#define GEMM_NV 4                 /* 16-float vectors per panel */
#else
#define GEMM_NV 3
#endif
#define GEMM_NR (16 * GEMM_NV)    /* output columns per panel */
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* The side stream: memory the caller reads right after this GEMM (the step's LoRA weights of the projections just
 * multiplied), given as byte ranges (offset from a base, length) and prefetched a line at a time over the GEMM's k
 * steps, after the next panel's lines. A GEMM at the decode batch is bound by its FMAs, so the memory it leaves idle
 * brings in what the LoRA kernel would otherwise wait on DRAM for. A cursor walks the ranges in order. */
typedef struct {
    const char *base;
    const int64_t *ranges;  /* [n][2]: byte offset from base, byte length */
    int64_t n, i;           /* ranges, the current one */
    const char *p, *end;    /* the next line to fetch, the current range's end */
    int64_t left;           /* lines still to fetch in this call */
} gemm_side;

static inline __attribute__((always_inline)) void gemm_side_next(gemm_side *s) {
    __builtin_prefetch(s->p, 0, 2);  /* prefetcht1, as the next panel's lines */
    s->p += 64;
    s->left--;
    if (s->p >= s->end) {
        if (++s->i < s->n) {
            s->p = s->base + s->ranges[2 * s->i];
            s->end = s->p + s->ranges[2 * s->i + 1];
        } else {
            s->left = 0;  /* the last range is done */
        }
    }
}

/* The sum over k, then + bias, then + out, in that order whatever a block's row count: -ffast-math lets the compiler
 * regroup (sum + bias) + out as sum + (bias + out) in some of the unrolled copies and not in others, and a row's
 * bits then hung on the size of the block it fell in (seen on the AVX2 build with balanced blocks: a bias and a
 * residual, 13 rows on 1 thread against 3). An empty asm that takes and gives back the value keeps the order. */
#define GEMM_IN_ORDER(v) __asm__("" : "+v"(v))

/* The k loop runs in groups of GEMM_PF_GROUP steps and issues the prefetches between groups, a fixed number of lines
 * after each (the lines spread over the groups, front-loaded where there are fewer lines than groups): branches whose
 * pattern the predictor keeps. Checking at every k step whether a prefetch was due (a branch taken once every few
 * steps, at a period that differs from call to call) cost mispredictions. On the Intel Xeon of model 167 (2026-12-06,
 * the two builds loaded in one process, passes alternating, 9 pairs, the models' shapes over a weight a layer), the
 * grouped loop's speed against the check at every step, paired medians: AVX-512 1.052 (mid) and 1.038 (SmolLM2) at
 * 512 rows, 1.002 and 0.996 at 64; the AVX2 build (-mno-avx512f, same CPU) 1.052 and 1.035 at 512, 1.062 and 1.066
 * at 64. Groups of 8 steps were slower than 16 (unpaired). */
#define GEMM_PF_GROUP 16

static inline __attribute__((always_inline)) int64_t gemm_pf_per_group(int64_t lines, int64_t K) {
    const int64_t groups = K / GEMM_PF_GROUP;
    return groups > 0 && lines > 0 ? (lines + groups - 1) / groups : 0;
}

/* After a group: the next `per` lines of the next panel's prefetch (pf, *pf_i of pf_lines) and `side_per` of the side
 * stream's. */
static inline __attribute__((always_inline)) void gemm_pf_after_group(const char *pf, int64_t pf_lines, int64_t *pf_i,
                                                                      int64_t per, gemm_side *side, int64_t side_per) {
    for (int64_t j = 0; j < per && *pf_i < pf_lines; j++, ++*pf_i) _mm_prefetch(pf + 64 * *pf_i, _MM_HINT_T1);
    for (int64_t j = 0; j < side_per && side->left > 0; j++) gemm_side_next(side);
}

/* A register block's k loop over [0, K) in groups, the prefetches after each (the caller defines GEMM_K_STEP, one k
 * step on `k`, and has pf, pf_lines and side in scope). */
#define GEMM_GROUPED_K_LOOP()                                                                                   \
    do {                                                                                                        \
        const int64_t per = gemm_pf_per_group(pf_lines, K), side_per = gemm_pf_per_group(side->left, K);        \
        int64_t pf_i = 0, k = 0;                                                                                \
        for (; k + GEMM_PF_GROUP <= K; gemm_pf_after_group(pf, pf_lines, &pf_i, per, side, side_per))          \
            for (int g = 0; g < GEMM_PF_GROUP; g++, k++) GEMM_K_STEP;                                            \
        for (; k < K; k++) GEMM_K_STEP;                                                                         \
    } while (0)

/* Lines [lo, lo + n) of the side stream (ranges' lines counted end to end) as a cursor. */
static gemm_side gemm_side_at(const char *base, const int64_t *ranges, int64_t nranges, int64_t lo, int64_t n) {
    gemm_side s = {base, ranges, nranges, 0, NULL, NULL, 0};
    if (!ranges || n <= 0) return s;
    for (; s.i < nranges; s.i++) {
        const int64_t lines = (ranges[2 * s.i + 1] + 63) / 64;
        if (lo < lines) break;
        lo -= lines;
    }
    if (s.i >= nranges) return s;
    s.p = base + ranges[2 * s.i] + 64 * lo;
    s.end = base + ranges[2 * s.i] + ranges[2 * s.i + 1];
    s.left = n;
    return s;
}
#endif

#if defined(__AVX512F__)
#include <cpuid.h>
#define GEMM_NATIVE 1
#define GEMM_MR_MAX 7             /* rows per register block at most */
#define GEMM_MR gemm_mr_rows      /* rows per register block: 7, or 6 on Zen 5 (gemm_mr_init) */
#define GEMM_KC (1 << 30)         /* K in one pass (L2 holds a panel of the widest K here) */
int gemm_f32_available(void) { return 1; }

/* The register block's rows, chosen once when the library loads. 7 x 4 (28 accumulators) was the fastest block on
 * Zen 4 (above); on the Zen 5 EPYC host (family 26, 2026-12-06, the /tmp A/B of builds in one process, passes
 * alternating, 9 pairs, the models' four shapes over a weight a layer) 6 x 4 ran 1.034-1.035x at 64 rows and
 * 1.066-1.072x at 576 (mid, SmolLM2), and 5 x 4 1.024 / 0.962 and 1.072 / 1.084. Each output element's sum is the
 * same whatever the block's rows. LORAFLEET_GEMM_MR (1-7) overrides it, for A/Bs. */
static int gemm_mr_rows = GEMM_MR_MAX;

__attribute__((constructor)) static void gemm_mr_init(void) {
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u  /* AMD */
        && __get_cpuid(1, &a, &b, &c, &d)) {
        const unsigned family = ((a >> 8) & 0xF) + (((a >> 8) & 0xF) == 0xF ? (a >> 20) & 0xFF : 0);
        if (family >= 0x1A) gemm_mr_rows = 6;  /* Zen 5 */
    }
    const char *env = getenv("LORAFLEET_GEMM_MR");
    if (env && env[0] >= '1' && env[0] <= '0' + GEMM_MR_MAX && env[1] == '\0') gemm_mr_rows = env[0] - '0';
}

/* mr rows of x against one panel of nv vectors (both compile-time at each call site below, so the register
 * block unrolls); the panel's last vector stores only `last` lanes. pf_lines cache lines from pf are prefetched
 * into L2 over the K steps (gemm_pf_after_group). */
static inline __attribute__((always_inline)) void gemm_block(
        int64_t K, const float *x, int64_t ldx, const float *b, float *out, int64_t ldo, const float *bias, int acc,
        __mmask16 last, const char *pf, int64_t pf_lines, gemm_side *side, const int mr, const int nv) {
    __m512 c[GEMM_MR_MAX][GEMM_NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) c[r][v] = _mm512_setzero_ps();
    const int64_t nwp = 16 * nv;
#define GEMM_K_STEP                                                                         \
    do {                                                                                    \
        __m512 bv[GEMM_NV];                                                                 \
        for (int v = 0; v < nv; v++) bv[v] = _mm512_loadu_ps(b + k * nwp + 16 * v);        \
        for (int r = 0; r < mr; r++) {                                                      \
            __m512 a = _mm512_set1_ps(x[r * ldx + k]);                                      \
            for (int v = 0; v < nv; v++) c[r][v] = _mm512_fmadd_ps(a, bv[v], c[r][v]);      \
        }                                                                                   \
    } while (0)
    GEMM_GROUPED_K_LOOP();  /* the next panel's lines and the side stream's between groups of k steps */
#undef GEMM_K_STEP
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) {
            __mmask16 m = v == nv - 1 ? last : (__mmask16)0xFFFF;
            __m512 s = c[r][v];
            if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, bias + 16 * v));
            GEMM_IN_ORDER(s);
            if (acc) s = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + r * ldo + 16 * v), s);
            _mm512_mask_storeu_ps(out + r * ldo + 16 * v, m, s);
        }
}

#define GEMM_BLOCK_ARGS K, x, ldx, b, out, ldo, bias, acc, last, pf, pf_lines, side
#define GEMM_ROWS(NV)                                                                       \
    switch (mr) {                                                                           \
        case 7: gemm_block(GEMM_BLOCK_ARGS, 7, NV); break;                                  \
        case 6: gemm_block(GEMM_BLOCK_ARGS, 6, NV); break;                                  \
        case 5: gemm_block(GEMM_BLOCK_ARGS, 5, NV); break;                                  \
        case 4: gemm_block(GEMM_BLOCK_ARGS, 4, NV); break;                                  \
        case 3: gemm_block(GEMM_BLOCK_ARGS, 3, NV); break;                                  \
        case 2: gemm_block(GEMM_BLOCK_ARGS, 2, NV); break;                                  \
        default: gemm_block(GEMM_BLOCK_ARGS, 1, NV); break;                                 \
    }

/* mr rows of x against a whole panel of nw columns (b: its [K, ceil16(nw)] block). */
static void gemm_rows(int64_t K, const float *x, int64_t ldx, const float *b, float *out, int64_t ldo,
                      const float *bias, int acc, int64_t nw, const char *pf, int64_t pf_lines, gemm_side *side,
                      int mr) {
    const int nv = (int)((nw + 15) / 16);
    const __mmask16 last = nw % 16 ? (__mmask16)((1u << (nw % 16)) - 1) : (__mmask16)0xFFFF;
    switch (nv) {
        case 4: GEMM_ROWS(4) break;
        case 3: GEMM_ROWS(3) break;
        case 2: GEMM_ROWS(2) break;
        default: GEMM_ROWS(1) break;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (16 ymm registers): the same panels, each taken as its 16-column strips (one cache line per k step); a
 * register block is 6 rows x one strip, 12 accumulators, 2 weight loads and 6 broadcasts per k (the 6 x 16 block
 * BLIS uses on Haswell and Zen). A row block runs the panel's strips one after another, so its 6 rows of x are
 * reread from L1 while the panel stays in L2; K goes in chunks of at most GEMM_KC = 1024 (gemm_panel), or mid's
 * down projection (K 2816: a 540 KB panel, 67 KB of x a block) overflows Zen 3's 512 KB L2 and 32 KB L1 (mid's
 * GEMMs at 512 rows, paired: 0.86 of the time unchunked; chunks of 512 or 256 were 1.02-1.06 slower than 1024).
 * On the AMD EPYC Zen 3 host (2 CPUs, 2026-12-03, bench/limits.py on the models' shapes): 64 rows SmolLM2 94.7
 * GFLOP/s against 76.9 for the fastest of torch's GEMMs per shape, mid 89.1 against 72.6; 512 rows mid 145-148
 * against 138-141, SmolLM2 level (130-134). The next panel's prefetch matters here too: without it 1.07-1.26x
 * the time at 64 rows (paired); hot in cache one thread runs 77 GFLOP/s, the core's FMA peak. */
#define GEMM_NATIVE 1
#define GEMM_MR 6
#define GEMM_KC 1024
int gemm_f32_available(void) { return 1; }

/* mr rows of x against one 16-column strip (rows nwp floats apart in b), `cols` of which are stored. */
static inline __attribute__((always_inline)) void gemm_strip(
        int64_t K, const float *x, int64_t ldx, const float *b, int64_t nwp, float *out, int64_t ldo,
        const float *bias, int acc, int cols, const char *pf, int64_t pf_lines, gemm_side *side, const int mr) {
    __m256 c[GEMM_MR][2];
    for (int r = 0; r < mr; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
#define GEMM_K_STEP                                                                                    \
    do {                                                                                               \
        const __m256 b0 = _mm256_loadu_ps(b + k * nwp), b1 = _mm256_loadu_ps(b + k * nwp + 8);        \
        for (int r = 0; r < mr; r++) {                                                                 \
            const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);                                     \
            c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);                                                 \
            c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);                                                 \
        }                                                                                              \
    } while (0)
    GEMM_GROUPED_K_LOOP();  /* the next panel's lines and the side stream's between groups of k steps */
#undef GEMM_K_STEP
    if (cols == 16) {
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2; h++) {
                __m256 s = c[r][h];
                if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + 8 * h));
                GEMM_IN_ORDER(s);
                if (acc) s = _mm256_add_ps(_mm256_loadu_ps(out + r * ldo + 8 * h), s);
                _mm256_storeu_ps(out + r * ldo + 8 * h, s);
            }
        return;
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m[2] = {_mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane),
                          _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane)};
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) {
            __m256 s = c[r][h];
            if (bias) s = _mm256_add_ps(s, _mm256_maskload_ps(bias + 8 * h, m[h]));
            GEMM_IN_ORDER(s);
            if (acc) s = _mm256_add_ps(_mm256_maskload_ps(out + r * ldo + 8 * h, m[h]), s);
            _mm256_maskstore_ps(out + r * ldo + 8 * h, m[h], s);
        }
}

/* mr rows of x against a whole panel of nw columns (b: its [K, ceil16(nw)] block), strip by strip; the
 * prefetch's lines are shared out over the strips. */
static void gemm_rows(int64_t K, const float *x, int64_t ldx, const float *b, float *out, int64_t ldo,
                      const float *bias, int acc, int64_t nw, const char *pf, int64_t pf_lines, gemm_side *side,
                      int mr) {
    const int nv = (int)((nw + 15) / 16);
    const int64_t nwp = 16 * nv, per = (pf_lines + nv - 1) / nv;
    for (int v = 0; v < nv; v++) {
        const int cols = (int)min64(16, nw - 16 * v);
        const int64_t lo = min64(v * per, pf_lines), n = min64(per, pf_lines - lo);
        const char *p = pf ? pf + 64 * lo : NULL;
        const float *bb = bias ? bias + 16 * v : NULL;
        /* the side stream's lines of this row block, shared out over its strips */
        gemm_side part = *side;
        part.left = min64((side->left + nv - 1 - v) / (nv - v), side->left);
        side->left -= part.left;
#define GEMM_STRIP(MR) gemm_strip(K, x, ldx, b + 16 * v, nwp, out + 16 * v, ldo, bb, acc, cols, p, n, &part, MR)
        switch (mr) {  /* each row count its own unrolled copy */
            case 6: GEMM_STRIP(6); break;
            case 5: GEMM_STRIP(5); break;
            case 4: GEMM_STRIP(4); break;
            case 3: GEMM_STRIP(3); break;
            case 2: GEMM_STRIP(2); break;
            default: GEMM_STRIP(1); break;
        }
#undef GEMM_STRIP
        side->i = part.i, side->p = part.p, side->end = part.end;
        side->left += part.left;
    }
}
#endif

#if defined(GEMM_NATIVE)
#define GEMM_MAX_UNITS 64

/* The panels of a width of N columns (the last one narrower where N is not a multiple of GEMM_NR) */
static inline int64_t gemm_panels(int64_t N) { return (N + GEMM_NR - 1) / GEMM_NR; }

/* K in chunks of at most GEMM_KC (even sizes): a chunk's rows of x stay in L1 and its part of the panel in L2 */
static inline int64_t gemm_k_chunks(int64_t K) { return K > GEMM_KC ? (K + GEMM_KC - 1) / GEMM_KC : 1; }

/* The LoRA term fused into a decode step's GEMM (gemm_lora_f32): one projection of the GEMM's group (q, k, v of the
 * fused q/k/v GEMM, gate and up of gate/up, or the GEMM's only one), its columns [col0, col0 + d_out) of out, its
 * short segments as sgmv_add_f32 takes them and its fp32 shrink scratch y [M, sy]. The layout is the int64 rows of
 * kernels.cpu.FusedLoraGroup. */
typedef struct {
    int64_t col0, d_out, G;
    const int32_t *starts, *lens, *slots, *ranks;
    const int64_t *a_offs, *b_offs;  /* [S] element offsets of each slot's A and B^T in the layer's buffer */
    float *y;
} gemm_lora_proj;

typedef struct {
    const gemm_lora_proj *projs;
    int64_t nproj, sy;
    const float *w;       /* the layer's flat fp32 adapter buffer */
    const float *scales;  /* [S] */
} gemm_lora;

typedef struct {
    int64_t M, K, N, ldx, ldo, units;
    const float *x, *wp, *bias;
    float *out;
    int acc;
    const gemm_lora *lora;      /* the fused LoRA term's expand after each panel (gemm_lora_f32), or NULL */
    int64_t row0;               /* the step's row that x's and out's row 0 are (a row split's part; else 0) */
    const char *side_base;      /* the side stream (gemm_side), or NULL */
    const int64_t *side_ranges;
    int64_t side_n, side_lines, side_calls;  /* ranges, their lines, the row-block calls they spread over */
    _Atomic uint64_t *spans;  /* per unit: its panels not yet claimed, [lo, hi) as hi << 32 | lo */
} gemm_args;

/* Segment g of projection q clipped to rows [r0, r1) of the step: its first row *t0 and row count (0: none there). */
static inline int64_t gemm_lora_seg_rows(const gemm_lora_proj *q, int64_t g, int64_t r0, int64_t r1, int64_t *t0) {
    const int64_t s0 = q->starts[g], s1 = min64(s0 + q->lens[g], r1);
    *t0 = s0 > r0 ? s0 : r0;
    return s1 > *t0 ? s1 - *t0 : 0;
}

/* Whether projection q of the fused term has segments under columns [lo, hi), and which of them: *c0, *c1. */
static inline int gemm_lora_cols(const gemm_lora_proj *q, int64_t lo, int64_t hi, int64_t *c0, int64_t *c1) {
    *c0 = lo > q->col0 ? lo : q->col0;
    *c1 = hi < q->col0 + q->d_out ? hi : q->col0 + q->d_out;
    return q->G > 0 && *c0 < *c1;
}

/* The side stream of a fused panel: (byte offset from the adapter buffer, bytes) of each B rank row's slice under
 * columns [lo, hi), projection by projection, segment by segment, in the order the panel's expand reads them, into a
 * buffer of the calling thread's (grown as needed, kept for its next panels); returns the count, *lines their lines. */
static __thread int64_t *gemm_lora_ranges_buf;
static __thread int64_t gemm_lora_ranges_cap;

static int64_t gemm_lora_ranges(const gemm_lora *L, int64_t lo, int64_t hi, int64_t r0, int64_t r1,
                                const int64_t **ranges, int64_t *lines) {
    int64_t n = 0, rows = 0, t0;
    for (int64_t pi = 0; pi < L->nproj; pi++) {
        const gemm_lora_proj *q = &L->projs[pi];
        int64_t c0, c1;
        if (!gemm_lora_cols(q, lo, hi, &c0, &c1)) continue;
        for (int64_t g = 0; g < q->G; g++) rows += gemm_lora_seg_rows(q, g, r0, r1, &t0) ? q->ranks[g] : 0;
    }
    if (rows > gemm_lora_ranges_cap) {
        int64_t *grown = (int64_t *)realloc(gemm_lora_ranges_buf, (size_t)rows * 2 * sizeof(int64_t));
        if (!grown) {  /* no room for the list: the panel runs without the side stream */
            *lines = 0;
            return 0;
        }
        gemm_lora_ranges_buf = grown;
        gemm_lora_ranges_cap = rows;
    }
    int64_t *r = gemm_lora_ranges_buf;
    *lines = 0;
    for (int64_t pi = 0; pi < L->nproj; pi++) {
        const gemm_lora_proj *q = &L->projs[pi];
        int64_t c0, c1;
        if (!gemm_lora_cols(q, lo, hi, &c0, &c1)) continue;
        const int64_t bytes = (c1 - c0) * (int64_t)sizeof(float), row_lines = (bytes + 63) / 64;
        for (int64_t g = 0; g < q->G; g++) {
            if (!gemm_lora_seg_rows(q, g, r0, r1, &t0)) continue;
            int64_t off = (q->b_offs[q->slots[g]] + c0 - q->col0) * (int64_t)sizeof(float);
            for (int64_t j = 0; j < q->ranks[g]; j++, n++, off += q->d_out * (int64_t)sizeof(float)) {
                r[2 * n] = off;
                r[2 * n + 1] = bytes;
            }
            *lines += q->ranks[g] * row_lines;
        }
    }
    *ranges = r;
    return n;
}

/* The fused term's expand under one panel's columns [p0, p0 + nw) and rows [r0, r1) of the step, into out (the
 * panel just stored there; its row 0 is the step's row r0). A segment cut by r0 or r1 is expanded in pieces: each
 * output element gets the same sum either way (over the rank in order, then scaled and added). */
static void gemm_lora_expand(const gemm_lora *L, float *out, int64_t ldo, int64_t p0, int64_t nw, int64_t r0,
                             int64_t r1) {
    for (int64_t pi = 0; pi < L->nproj; pi++) {
        const gemm_lora_proj *q = &L->projs[pi];
        int64_t c0, c1;
        if (!gemm_lora_cols(q, p0, p0 + nw, &c0, &c1)) continue;
        for (int64_t g = 0; g < q->G; g++) {
            const int64_t slot = q->slots[g];
            int64_t start;
            const int64_t len = gemm_lora_seg_rows(q, g, r0, r1, &start);
            if (!len || q->ranks[g] <= 0) continue;
            segment_expand_f32(q->y + start * L->sy, L->sy, L->w + q->b_offs[slot] + (c0 - q->col0), q->d_out,
                               q->ranks[g], out + (start - r0) * ldo + c0, ldo, len, c1 - c0, L->scales[slot]);
        }
    }
}

/* Panel p over all M rows; its row blocks prefetch panel `next` (-1: none) into L2. */
static void gemm_panel(const gemm_args *a, int64_t p, int64_t next) {
    const int64_t K = a->K, N = a->N, M = a->M, ldx = a->ldx, ldo = a->ldo;
    /* row blocks of GEMM_MR rows at most, their sizes within one of each other (64 rows: 4 of 7 and 6 of 6, not
     * 9 of 7 and one of 1); each output element's sum is the same whatever block it falls in */
    const int64_t blocks = (M + GEMM_MR - 1) / GEMM_MR;
    const int64_t mr_lo = blocks ? M / blocks : 0, mr_extra = blocks ? M % blocks : 0;
    const int64_t p0 = p * GEMM_NR, nw = min64(GEMM_NR, N - p0);
    const float *b = a->wp + p0 * K;
    const float *bias = a->bias ? a->bias + p0 : NULL;
    const char *pf = next >= 0 ? (const char *)(a->wp + next * GEMM_NR * K) : NULL;
    const int64_t next_lines = next >= 0 ? (min64(GEMM_NR, N - next * GEMM_NR) + 15) / 16 * 16 * K * 4 / 64 : 0;
    const int64_t chunks = gemm_k_chunks(K), kc = K > 0 ? (K + chunks - 1) / chunks : 1;
    const int64_t calls = blocks * chunks, per_call = (next_lines + calls - 1) / calls;
    const int64_t nwp = (nw + 15) / 16 * 16;
    int64_t call = 0;
    /* this panel's share of the side stream: the lines of its calls at their place among all the GEMM's calls */
    gemm_side side = {0};
    if (a->lora) {  /* a fused LoRA term: this panel's own expand slices, read right after */
        const int64_t *ranges = NULL;
        int64_t lines = 0;
        const int64_t n = gemm_lora_ranges(a->lora, p0, p0 + nw, a->row0, a->row0 + M, &ranges, &lines);
        side = gemm_side_at((const char *)a->lora->w, ranges, n, 0, lines);
    } else if (a->side_lines > 0) {
        const int64_t first = p * calls, lo = first * a->side_lines / a->side_calls;
        side = gemm_side_at(a->side_base, a->side_ranges, a->side_n, lo,
                            (first + calls) * a->side_lines / a->side_calls - lo);
    }
    const int64_t side_total = side.left;
    for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += kc) {  /* once at K = 0: out gets the bias (or stays out) */
        const int64_t kn = min64(kc, K - k0);
        for (int64_t bi = 0; bi < blocks; bi++, call++) {
            const int64_t m0 = bi * mr_lo + min64(bi, mr_extra);
            const int mr = (int)(mr_lo + (bi < mr_extra));
            const int64_t lo = min64(call * per_call, next_lines);
            side.left = side_total * (call + 1) / calls - side_total * call / calls;
            gemm_rows(kn, a->x + m0 * ldx + k0, ldx, b + k0 * nwp, a->out + m0 * ldo + p0, ldo, k0 ? NULL : bias,
                      k0 ? 1 : a->acc, nw, pf ? pf + 64 * lo : NULL, min64(per_call, next_lines - lo), &side, mr);
        }
    }
    if (a->lora) gemm_lora_expand(a->lora, a->out, ldo, p0, nw, a->row0, a->row0 + M);
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

/* The call's rows [r0, r1) as a call of their own (a row split's part). */
static gemm_args gemm_rows_part(const gemm_args *a, int64_t r0, int64_t r1) {
    gemm_args part = *a;
    part.M = r1 - r0;
    part.x = a->x + r0 * a->ldx;
    part.out = a->out + r0 * a->ldo;
    part.row0 = a->row0 + r0;
    return part;
}

/* Unit u of a row split: rows [u * M / units, (u + 1) * M / units) against every panel, front to back, each
 * prefetching the next (and a fused LoRA term's expand of those rows after each). Taken where the panels do not share
 * out evenly over the threads and the rows share out better (gemm_split_rows): SmolLM2's q/k/v (N 960) and its o and
 * down projections (N 576) are 15 and 9 panels of 64 columns, so of two threads one would multiply a panel more than
 * the other while that one waited. Each thread then reads every panel (the weights' reads twice over, the second
 * mostly from L3). On the Zen 4 host (2026-12-06, builds alternating in one process, SmolLM2's shapes over 30 weights
 * each) a 576-row prefill step's GEMMs took 0.965-0.973 of the panel split's time. At the decode batch (64 rows) it
 * gained nothing while its halves were whole blocks of 7 (35 and 29 rows); with the rows halved (32 and 32, blocks of
 * 7, 7, 6, 6, 6) and balanced blocks in gemm_panel, the four SmolLM2 GEMMs of a layer at 64 rows ran 1.058x (paired
 * median of 9, 1.026-1.067) and mid's 1.037x (its panels share out evenly: that is the blocks alone). Unit 0 carries
 * the side stream, spread over its own calls. Since 2026-12-06 it runs only where a side stream or a fused LoRA term
 * rides on the GEMM; elsewhere gemm_mixed_unit takes that work with each panel read by one thread. */
static void gemm_row_unit(const void *vp, int64_t u) {
    const gemm_args *a = (const gemm_args *)vp;
    const int64_t panels = gemm_panels(a->N);
    const int64_t r0 = u * a->M / a->units, r1 = (u + 1) * a->M / a->units;
    if (r0 >= r1) return;
    gemm_args part = gemm_rows_part(a, r0, r1);
    part.side_lines = u == 0 ? a->side_lines : 0;
    part.side_calls = panels * ((part.M + GEMM_MR - 1) / GEMM_MR) * gemm_k_chunks(a->K);
    for (int64_t p = 0; p < panels; p++) gemm_panel(&part, p, p + 1 < panels ? p + 1 : -1);
}

/* Unit u of a mixed split: the panels x `units` row parts as panels x units items, panel-major (item i: panel
 * i / units, rows [h * M / units, (h + 1) * M / units) for h = i % units), unit u taking items [u * panels, (u + 1) *
 * panels): whole panels, and where a run starts or ends inside a panel, that panel's rows of its parts. Every thread
 * multiplies the same share as in the row split, but reads only its own panels' weights, plus one panel both read
 * (two threads, 9 panels: panels 0-3 and the first half of 4's rows, then the other half and 5-8). Taken instead of
 * the row split where no side stream rides on the GEMM: with the row split each thread read every panel, and at the
 * decode batch a small GEMM's weights then came in no faster than its arithmetic went (the Intel Xeon of model 167,
 * 2026-12-06, SmolLM2's shapes at 64 rows over 400 weights from DRAM: o 178.6 -> 219.5 GFLOP/s, q/k/v 188.3 -> 222.7,
 * down 192.1 -> 230.7; from L2 the row split ran 252-273). Each output element's sum is the same either way. */
static void gemm_mixed_unit(const void *vp, int64_t u) {
    const gemm_args *a = (const gemm_args *)vp;
    const int64_t th = a->units, panels = gemm_panels(a->N);
    const int64_t i1 = (u + 1) * panels;
    for (int64_t i = u * panels; i < i1;) {
        const int64_t p = i / th, h = i % th;
        const int64_t h1 = min64(th, h + (i1 - i));  /* this unit's parts of panel p: [h, h1) */
        const int64_t next = i + (h1 - h) < i1 ? p + 1 : -1;
        if (h == 0 && h1 == th) {
            gemm_panel(a, p, next);
        } else {
            const int64_t r0 = h * a->M / th, r1 = h1 * a->M / th;
            const gemm_args part = gemm_rows_part(a, r0, r1);
            if (r1 > r0) gemm_panel(&part, p, next);
        }
        i += h1 - h;
    }
}

/* Whether `rows` split over `th` threads keep them busier than `panels` panels do: each side's largest share in
 * row-block calls (a thread's rows in blocks of at most GEMM_MR x every panel, against every row block x a thread's
 * panels). */
static int gemm_split_rows(int64_t panels, int64_t rows, int64_t th) {
    if (th < 2 || panels % th == 0) return 0;
    const int64_t blocks = (rows + GEMM_MR - 1) / GEMM_MR, share = ((rows + th - 1) / th + GEMM_MR - 1) / GEMM_MR;
    return panels * share < blocks * ((panels + th - 1) / th);
}

/* The panels in `units` contiguous runs, one a thread (gemm_unit claims and steals from them). */
static void gemm_spans_init(_Atomic uint64_t *spans, int64_t panels, int64_t units) {
    for (int64_t u = 0; u < units; u++)
        atomic_init(&spans[u], ((uint64_t)((u + 1) * panels / units) << 32) | (uint64_t)(u * panels / units));
}

/* out[M, N] = x[M, K] @ W^T (+ bias[N]) (+ out when acc) with W packed by gemm_pack_f32; x's and out's rows
 * contiguous, ldx / ldo apart. The panels are split into `nthreads` contiguous runs, one per team thread,
 * which steal from each other's ends once their own is done (gemm_unit); where the panels do not share out evenly
 * and the rows do, each thread takes whole panels and the rows of one shared panel (gemm_mixed_unit), or with a
 * side stream, its rows of every panel (gemm_row_unit). side_ranges [side_n][2] (byte offset from side_base,
 * byte length), or NULL: memory to prefetch while multiplying (gemm_side). */
void gemm_f32(int64_t M, int64_t K, int64_t N, const float *x, int64_t ldx, const float *wp, const float *bias,
              float *out, int64_t ldo, int acc, int nthreads, const char *side_base, const int64_t *side_ranges,
              int64_t side_n) {
    const int64_t panels = gemm_panels(N);
    int64_t side_lines = 0;
    for (int64_t i = 0; side_ranges && i < side_n; i++) side_lines += (side_ranges[2 * i + 1] + 63) / 64;
    /* spread over the first pass's calls (one pass over the weights up to GEMM_M_CHUNK rows) */
    const int64_t side_calls = panels * ((min64(GEMM_M_CHUNK, M) + GEMM_MR - 1) / GEMM_MR) * gemm_k_chunks(K);
    const int64_t th = min64(nthreads > 1 ? nthreads : 1, GEMM_MAX_UNITS);
    _Atomic uint64_t spans[GEMM_MAX_UNITS];
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_M_CHUNK) {
        const int64_t rows = min64(GEMM_M_CHUNK, M - m0);
        const int by_rows = gemm_split_rows(panels, rows, th);
        const int64_t units = by_rows ? th : min64(panels, th), pass_side = m0 ? 0 : side_lines;
        if (!by_rows) gemm_spans_init(spans, panels, units);
        gemm_args a = {rows, K, N, ldx, ldo, units, x + m0 * ldx, wp, bias,
                       out + m0 * ldo, acc, NULL, 0, side_base, side_ranges, side_n, pass_side, side_calls, spans};
        /* a row split's shares with each panel read by one thread (mixed), unless a side stream rides on this pass */
        parallel_for_team(!by_rows ? gemm_unit : pass_side ? gemm_row_unit : gemm_mixed_unit, &a, units, nthreads);
    }
}

/* The fused term's shrink, one (projection, segment) a unit: y[t] = A x_t. */
typedef struct {
    const gemm_lora *L;
    const float *x;
    int64_t ldx, K;
} gemm_lora_shrink_args;

static void gemm_lora_shrink_unit(const void *vp, int64_t u) {
    const gemm_lora_shrink_args *s = (const gemm_lora_shrink_args *)vp;
    const gemm_lora *L = s->L;
    int64_t pi = 0;
    while (u >= L->projs[pi].G) u -= L->projs[pi++].G;
    const gemm_lora_proj *q = &L->projs[pi];
    const int64_t start = q->starts[u];
    if (q->lens[u] <= 0 || q->ranks[u] <= 0) return;
    segment_shrink_f32(s->x + start * s->ldx, s->ldx, L->w + q->a_offs[q->slots[u]], s->K, q->ranks[u],
                       q->y + start * L->sy, L->sy, q->lens[u], NULL, NULL);
}

/* gemm_f32 (no side stream) and the LoRA term of the GEMM's projections in one call, for a decode step: every
 * segment's shrink first (x is the GEMM's input), then the GEMM with each panel's expand right after the panel, by
 * the thread that stored it, its B slices prefetched into L2 during the panel's k steps. A decode step's GEMM is
 * bound by its FMAs and leaves the memory bus mostly idle, while the LoRA term after it (sgmv_add_f32) is bound by
 * its reads: fused, the expand's reads (B, over half of a projection's LoRA bytes where d_out >= d_in) come in
 * while the GEMM multiplies. Each output element gets the same sums in the same order as gemm_f32 then sgmv_add_f32:
 * the GEMM's value stored, then + scale x the expand's sum. The panels split over the threads, or the rows where they
 * share out better (gemm_split_rows: each thread expands its own rows of each panel, a segment cut in two by the
 * split expanded in two pieces); M <= GEMM_M_CHUNK. Returns 0, or -1 (nothing done) when M is larger. */
int gemm_lora_f32(int64_t M, int64_t K, int64_t N, const float *x, int64_t ldx, const float *wp, const float *bias,
                  float *out, int64_t ldo, int acc, int nthreads, const gemm_lora_proj *projs, int64_t nproj,
                  const float *lw, const float *scales, int64_t sy) {
    if (M > GEMM_M_CHUNK) return -1;
    const gemm_lora L = {projs, nproj, sy, lw, scales};
    int64_t units = 0;
    for (int64_t pi = 0; pi < nproj; pi++) units += projs[pi].G;
    const gemm_lora_shrink_args sa = {&L, x, ldx, K};
    if (units) parallel_for_team(gemm_lora_shrink_unit, &sa, units, nthreads);
    const int64_t panels = gemm_panels(N);
    const int64_t th = min64(nthreads > 1 ? nthreads : 1, GEMM_MAX_UNITS);
    const int by_rows = gemm_split_rows(panels, M, th);
    const int64_t gu = by_rows ? th : min64(panels, th);
    _Atomic uint64_t spans[GEMM_MAX_UNITS];
    if (!by_rows) gemm_spans_init(spans, panels, gu);
    gemm_args a = {M, K, N, ldx, ldo, gu, x, wp, bias, out, acc, units ? &L : NULL, 0, NULL, NULL, 0, 0, 1, spans};
    parallel_for_team(by_rows ? gemm_row_unit : gemm_unit, &a, gu, nthreads);
    return 0;
}
#else
int gemm_f32_available(void) { return 0; }
int gemm_lora_f32(int64_t M, int64_t K, int64_t N, const float *x, int64_t ldx, const float *wp, const float *bias,
                  float *out, int64_t ldo, int acc, int nthreads, const void *projs, int64_t nproj, const float *lw,
                  const float *scales, int64_t sy) {
    (void)M; (void)K; (void)N; (void)x; (void)ldx; (void)wp; (void)bias; (void)out; (void)ldo; (void)acc;
    (void)nthreads; (void)projs; (void)nproj; (void)lw; (void)scales; (void)sy;
    return -1;
}
void gemm_f32(int64_t M, int64_t K, int64_t N, const float *x, int64_t ldx, const float *wp, const float *bias,
              float *out, int64_t ldo, int acc, int nthreads, const char *side_base, const int64_t *side_ranges,
              int64_t side_n) {
    (void)M; (void)K; (void)N; (void)x; (void)ldx; (void)wp; (void)bias; (void)out; (void)ldo; (void)acc;
    (void)nthreads; (void)side_base; (void)side_ranges; (void)side_n;
}
#endif
