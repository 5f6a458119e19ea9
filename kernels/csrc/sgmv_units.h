/* One segment of SGMV, for one weight element type: included by sgmv_cpu.c once per type, with
 *   WT               the element type of the weight buffer (float; uint16_t for bf16 and for fp16)
 *   LD(v)            one weight as fp32
 *   SFX(name)        the name suffixed with the type (name_f32, name_bf16, name_f16)
 *   VEC8(p)          optional: 8 weights at p widened into an __m256 (bf16 with AVX2, fp16 with F16C); the
 *                    loops over weights are then written with it, 8 at a time, each 8 widened once a block
 *   ROWS8(p)         optional (AVX2 + FMA): 8 weights at p as an __m256, for every type (fp32: a plain load); the
 *                    shrink's row groups and the short segments' expand use it
 * so each copy is plain typed C that the vectorizer handles like the fp32 original (a kind switch inside
 * one function left the expand's loops scalar). x, y, out and every sum are fp32 whatever WT is. The
 * header undefines its parameters at the end, ready for the next type. */

#if defined(ROWS8) && !defined(SHRINK_ONE_ROW)
/* R rows of A against NT tokens at once: R x NT independent accumulators. One row against one token is a single
 * chain of dependent FMAs (4 cycles each on current x86 cores, 8 lanes a step: 2 weights a cycle), so a decode
 * segment's shrink, mostly one or two tokens, ran at that chain's pace, not the loads'; R x NT >= 8 chains keep
 * both FMA ports busy. R and NT are constants where it is called (always_inline), so the accumulators stay in
 * registers. s[r * NT + t] = A[r, :] . x_t. */
static inline __attribute__((always_inline)) void SFX(shrink_block)(const float *const *xs, const WT *ar, int64_t sar,
                                                                  const int R, const int NT, float *s, int64_t d_in,
                                                                  const char **pf, const char *pf_end) {
    __m256 acc[8][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= d_in; k += 8) {
        __m256 xv[4];
        for (int t = 0; t < NT; t++) xv[t] = _mm256_loadu_ps(xs[t] + k);
        if (*pf < pf_end) {  /* one line of B a step: the expand's weights on their way while A is read */
            __builtin_prefetch(*pf);
            *pf += 64;
        }
        for (int r = 0; r < R; r++) {
            const __m256 a = ROWS8(ar + r * sar + k);
            for (int t = 0; t < NT; t++) acc[r][t] = _mm256_fmadd_ps(a, xv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) {
            float v = hsum8(acc[r][t]);
            for (int64_t kk = k; kk < d_in; kk++) v += LD(ar[r * sar + kk]) * xs[t][kk];
            s[r * NT + t] = v;
        }
}

/* Rows in groups of 8 / 4 / 2 for blocks of 1 / 2 / 3-4 tokens (8 chains each), the remainder one at a time.
 * [pf, pf_end): bytes to prefetch while A streams in (the segment's B). Nothing touches B until the expand, so
 * its first lines came in only when the expand asked for them; one line of B fetched ahead per step of the
 * loop (a step reads R/2 lines of A) made the SmolLM2 fleet decode step 3.5% faster on the Intel Xeon host
 * (bench/lora_step.py, paired median 0.963-0.967; two lines a step no better, four 0.986). Prefetching the next
 * segment's A during this one's expand instead was 5% slower: which thread takes it is not known here. */
#define SHRINK_ROWS(R, NT)                                                                                       \
    for (; j + (R) <= nrows; j += (R)) {                                                                         \
        float s[(R) * (NT)];                                                                                     \
        SFX(shrink_block)(xs, arows + j * sar, sar, (R), (NT), s, d_in, &pf, pf_end);                            \
        for (int r = 0; r < (R); r++)                                                                            \
            for (int t = 0; t < (NT); t++) y[(t0 + t) * sy + j + r] = s[r * (NT) + t];                           \
    }
static void SFX(shrink_unit)(const float *x, int64_t sx, const WT *arows, int64_t sar, int nrows, float *y,
                             int64_t sy, int64_t len, int64_t d_in, const char *pf, const char *pf_end) {
    for (int64_t t0 = 0; t0 < len; t0 += TB) {
        const int nt = (int)min64(TB, len - t0);
        const float *xs[4];
        for (int t = 0; t < 4; t++) xs[t] = x + (t0 + (t < nt ? t : 0)) * sx;
        int j = 0;
        switch (nt) {
            case 1: SHRINK_ROWS(8, 1) SHRINK_ROWS(1, 1) break;
            case 2: SHRINK_ROWS(4, 2) SHRINK_ROWS(1, 2) break;
            case 3: SHRINK_ROWS(2, 3) SHRINK_ROWS(1, 3) break;
            default: SHRINK_ROWS(2, 4) SHRINK_ROWS(1, 4) break;
        }
    }
}
#undef SHRINK_ROWS
#else
static void SFX(shrink_unit)(const float *x, int64_t sx, const WT *arows, int64_t sar, int nrows, float *y,
                             int64_t sy, int64_t len, int64_t d_in, const char *pf, const char *pf_end) {
    (void)pf; (void)pf_end;
    for (int64_t t0 = 0; t0 < len; t0 += TB) {
        int nt = (int)min64(TB, len - t0);
        const float *x0 = x + t0 * sx;
        const float *x1 = x0 + (nt > 1 ? sx : 0);
        const float *x2 = x0 + (nt > 2 ? 2 * sx : 0);
        const float *x3 = x0 + (nt > 3 ? 3 * sx : 0);
        for (int j = 0; j < nrows; j++) {
            const WT *ar = arows + j * sar;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#ifdef VEC8
            __m256 v0 = _mm256_setzero_ps(), v1 = v0, v2 = v0, v3 = v0;
            int64_t k = 0;
            for (; k + 8 <= d_in; k += 8) {
                const __m256 a = VEC8(ar + k);
                v0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(x0 + k), v0);
                if (nt > 1) v1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(x1 + k), v1);
                if (nt > 2) v2 = _mm256_fmadd_ps(a, _mm256_loadu_ps(x2 + k), v2);
                if (nt > 3) v3 = _mm256_fmadd_ps(a, _mm256_loadu_ps(x3 + k), v3);
            }
            s0 = hsum8(v0); s1 = hsum8(v1); s2 = hsum8(v2); s3 = hsum8(v3);
            for (; k < d_in; k++) {
                const float a = LD(ar[k]);
                s0 += a * x0[k]; s1 += a * x1[k]; s2 += a * x2[k]; s3 += a * x3[k];
            }
#else
            if (nt == 1) {
                #pragma omp simd reduction(+:s0)
                for (int64_t k = 0; k < d_in; k++) s0 += LD(ar[k]) * x0[k];
            } else if (nt == 2) {
                #pragma omp simd reduction(+:s0,s1)
                for (int64_t k = 0; k < d_in; k++) { float a = LD(ar[k]); s0 += a * x0[k]; s1 += a * x1[k]; }
            } else {
                #pragma omp simd reduction(+:s0,s1,s2,s3)
                for (int64_t k = 0; k < d_in; k++) {
                    float a = LD(ar[k]);
                    s0 += a * x0[k]; s1 += a * x1[k]; s2 += a * x2[k]; s3 += a * x3[k];
                }
            }
#endif
            float s[TB] = {s0, s1, s2, s3};
            for (int i = 0; i < nt; i++) y[(t0 + i) * sy + j] = s[i];
        }
    }
}
#endif

/* B stored rank-major ([r, d_out] rows of B^T): each rank row of B is a contiguous run of output
 * columns, so the expand is a sum of rank axpys streaming exactly rank x d_out weights (measured against
 * a column-major B: 0.6 vs 1.6 ms at r = 4, the layout that keeps mixed ranks proportional). Tiles are
 * wide (4 KB of fp32 per rank row) because each rank row is its own stream: 64-column tiles of a rank-64
 * adapter were 64 concurrent 256-byte streams, which the prefetchers did not follow (measured 2x slower),
 * and on SmolLM2's fleet decode step (29 adapters of ranks 8-32, every projection of 30 layers, weights
 * from DRAM) 1024 columns took 27.5 ms a step against 30.9 at 256 (512-token prefill: 82 against 88 ms);
 * 2048 was no faster. Every projection here but a 7B MLP's is one tile wide: B is read row after row. With ROWS8
 * (AVX2 + FMA, AVX-512) it takes only the last columns short of 8; expand_short and expand_long do the rest. */
static void SFX(expand_unit_rank_major)(const float *y, int64_t sy, const WT *b, int64_t sbr, int rank,
                                        float *out, int64_t so, int64_t len, int64_t ncols, float scale) {
    const int line = 64 / (int)sizeof(WT);  /* elements per cache line */
    for (int64_t t0 = 0; t0 < len; t0 += TB) {
        int nt = (int)min64(TB, len - t0);
        for (int64_t n0 = 0; n0 < ncols; n0 += NB) {
            const int w = (int)min64(NB, ncols - n0);  /* tile width; the last tile may be narrower */
            float acc[TB][NB] __attribute__((aligned(64)));
            for (int t = 0; t < nt; t++) memset(acc[t], 0, (size_t)w * sizeof(float));
            int j = 0;
            for (; j + 4 <= rank; j += 4) {  /* four rank rows per pass: a quarter of the acc traffic */
                const WT *w0 = b + j * sbr + n0, *w1 = w0 + sbr, *w2 = w1 + sbr, *w3 = w2 + sbr;
                if (n0 + 2 * NB <= ncols)  /* next tile of these rows: rank streams outrun the hw prefetcher */
                    for (int i = 0; i < NB; i += line) {
                        __builtin_prefetch(w0 + NB + i); __builtin_prefetch(w1 + NB + i);
                        __builtin_prefetch(w2 + NB + i); __builtin_prefetch(w3 + NB + i);
                    }
#ifdef VEC8
                {  /* each 8 weights of the four rows widened once, then used by every token of the block */
                    const float *yb = y + t0 * sy + j;
                    int i = 0;
                    for (; i + 8 <= w; i += 8) {
                        const __m256 q0 = VEC8(w0 + i), q1 = VEC8(w1 + i), q2 = VEC8(w2 + i), q3 = VEC8(w3 + i);
                        for (int t = 0; t < nt; t++) {
                            const float *yt = yb + t * sy;
                            __m256 v = _mm256_load_ps(acc[t] + i);
                            v = _mm256_fmadd_ps(_mm256_broadcast_ss(yt), q0, v);
                            v = _mm256_fmadd_ps(_mm256_broadcast_ss(yt + 1), q1, v);
                            v = _mm256_fmadd_ps(_mm256_broadcast_ss(yt + 2), q2, v);
                            v = _mm256_fmadd_ps(_mm256_broadcast_ss(yt + 3), q3, v);
                            _mm256_store_ps(acc[t] + i, v);
                        }
                    }
                    for (; i < w; i++) {
                        const float a0 = LD(w0[i]), a1 = LD(w1[i]), a2 = LD(w2[i]), a3 = LD(w3[i]);
                        for (int t = 0; t < nt; t++) {
                            const float *yt = yb + t * sy;
                            acc[t][i] += yt[0] * a0 + yt[1] * a1 + yt[2] * a2 + yt[3] * a3;
                        }
                    }
                    continue;
                }
#endif
                for (int t = 0; t < nt; t++) {
                    const float *yt = y + (t0 + t) * sy + j;
                    float y0 = yt[0], y1 = yt[1], y2 = yt[2], y3 = yt[3];
                    float *at = acc[t];
                    #pragma omp simd
                    for (int i = 0; i < w; i++)
                        at[i] += y0 * LD(w0[i]) + y1 * LD(w1[i]) + y2 * LD(w2[i]) + y3 * LD(w3[i]);
                }
            }
            for (; j < rank; j++) {
                const WT *wj = b + j * sbr + n0;
#ifdef VEC8
                {  /* as above, one rank row */
                    int i = 0;
                    for (; i + 8 <= w; i += 8) {
                        const __m256 q = VEC8(wj + i);
                        for (int t = 0; t < nt; t++)
                            _mm256_store_ps(acc[t] + i, _mm256_fmadd_ps(_mm256_broadcast_ss(y + (t0 + t) * sy + j), q,
                                                                        _mm256_load_ps(acc[t] + i)));
                    }
                    for (; i < w; i++) {
                        const float a = LD(wj[i]);
                        for (int t = 0; t < nt; t++) acc[t][i] += y[(t0 + t) * sy + j] * a;
                    }
                    continue;
                }
#endif
                for (int t = 0; t < nt; t++) {
                    float yv = y[(t0 + t) * sy + j];
                    float *at = acc[t];
                    #pragma omp simd
                    for (int i = 0; i < w; i++) at[i] += yv * LD(wj[i]);
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

#if defined(ROWS8)
/* The expand of a 1- or 2-token segment (a decode step's usual one), C x 8 output columns at a time: their sums
 * stay in registers over every rank row and go to out once, instead of through the L1 tile above, whose
 * load-add-store per rank pass and final pass over out held a decode step's expand back (bench/lora_step.py,
 * SmolLM2 fleet decode step on an Intel Xeon host: paired median 0.973-0.976 from DRAM, 0.924 cached). C x NT = 8
 * chains of FMAs where the width allows. Rank rows are read as rank short streams, as the tile above reads them.
 * A width short of 64 (one token) or 32 (two) goes in blocks of 48, 32, 16 and 8 columns: a fused GEMM's panel on
 * AVX2 is 48 columns, which one chain of FMAs at a time (8 columns) held to the FMA's latency (the Zen 3 host,
 * 2026-12-07, SmolLM2's fleet: the fused calls' expand 1.16-1.24 s a pass, summed over the threads, against
 * 0.92-1.02 with the blocks). Each output element's sum is the same whatever its block. */
static inline __attribute__((always_inline)) void SFX(expand_cols)(const float *y, int64_t sy, const WT *b,
        int64_t sbr, int rank, float *out, int64_t so, const int NT, const int C, int64_t c, float scale) {
    __m256 acc[4][8];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < C; k++) acc[t][k] = _mm256_setzero_ps();
    for (int j = 0; j < rank; j++) {
        const WT *bj = b + j * sbr + c;
        __m256 yv[4];
        for (int t = 0; t < NT; t++) yv[t] = _mm256_broadcast_ss(y + t * sy + j);
        for (int k = 0; k < C; k++) {
            const __m256 q = ROWS8(bj + 8 * k);
            for (int t = 0; t < NT; t++) acc[t][k] = _mm256_fmadd_ps(yv[t], q, acc[t][k]);
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < C; k++) {
            float *o = out + t * so + c + 8 * k;
            _mm256_storeu_ps(o, _mm256_fmadd_ps(sc, acc[t][k], _mm256_loadu_ps(o)));
        }
}

/* Columns [0, c) of a segment of len <= 2 tokens, 8 at a time; returns c (the rest, under 8, is the tile's). */
static int64_t SFX(expand_short)(const float *y, int64_t sy, const WT *b, int64_t sbr, int rank, float *out,
                                 int64_t so, int64_t len, int64_t ncols, float scale) {
    int64_t c = 0;
    if (len == 1) {
        for (; c + 64 <= ncols; c += 64) SFX(expand_cols)(y, sy, b, sbr, rank, out, so, 1, 8, c, scale);
        if (c + 48 <= ncols) SFX(expand_cols)(y, sy, b, sbr, rank, out, so, 1, 6, c, scale), c += 48;
        if (c + 32 <= ncols) SFX(expand_cols)(y, sy, b, sbr, rank, out, so, 1, 4, c, scale), c += 32;
        if (c + 16 <= ncols) SFX(expand_cols)(y, sy, b, sbr, rank, out, so, 1, 2, c, scale), c += 16;
        if (c + 8 <= ncols) SFX(expand_cols)(y, sy, b, sbr, rank, out, so, 1, 1, c, scale), c += 8;
    } else {
        for (; c + 32 <= ncols; c += 32) SFX(expand_cols)(y, sy, b, sbr, rank, out, so, 2, 4, c, scale);
        if (c + 16 <= ncols) SFX(expand_cols)(y, sy, b, sbr, rank, out, so, 2, 2, c, scale), c += 16;
        if (c + 8 <= ncols) SFX(expand_cols)(y, sy, b, sbr, rank, out, so, 2, 1, c, scale), c += 8;
    }
    return c;
}

/* Columns [0, c) of a longer segment (a prompt's), returns c. Column tiles outer, blocks of 4 tokens inner: a tile's
 * rank rows (EXPAND_LONG_C x 8 columns) stay in L1 while every token block of the segment adds them up in registers,
 * and out is read and written once. The L1 tile above loads and stores its accumulators for every four rank rows and
 * reloads each rank row for every token. bench/lora_step.py on the Intel Xeon host (2026-12-04, SmolLM2's fleet,
 * builds alternating): a 512-token prefill chunk's LoRA term 0.892 of the tile's time from DRAM (109.6 against
 * 123.0 ms best), 0.854 cached; a decode step's (segments of 3+ tokens: the popular adapters') 0.977. */
static inline __attribute__((always_inline)) void SFX(expand_tokens)(const float *y, int64_t sy, const WT *b,
        int64_t sbr, int rank, float *out, int64_t so, int64_t len, const int C, int64_t c, float scale) {
    int64_t t = 0;
    for (; t + 4 <= len; t += 4) SFX(expand_cols)(y + t * sy, sy, b, sbr, rank, out + t * so, so, 4, C, c, scale);
    for (; t + 2 <= len; t += 2) SFX(expand_cols)(y + t * sy, sy, b, sbr, rank, out + t * so, so, 2, C, c, scale);
    for (; t < len; t++) SFX(expand_cols)(y + t * sy, sy, b, sbr, rank, out + t * so, so, 1, C, c, scale);
}
static int64_t SFX(expand_long)(const float *y, int64_t sy, const WT *b, int64_t sbr, int rank, float *out,
                                int64_t so, int64_t len, int64_t ncols, float scale) {
    int64_t c = 0;
    for (; c + 8 * EXPAND_LONG_C <= ncols; c += 8 * EXPAND_LONG_C)
        SFX(expand_tokens)(y, sy, b, sbr, rank, out, so, len, EXPAND_LONG_C, c, scale);
    for (; c + 8 <= ncols; c += 8) SFX(expand_tokens)(y, sy, b, sbr, rank, out, so, len, 1, c, scale);
    return c;
}
#endif

#if defined(ROWS16)
/* fp32 weights on AVX-512, a segment of 3 or more tokens (a prompt's, or a popular adapter's in a decode step): the
 * shrink and the expand as register-blocked small GEMMs on 16-float vectors. The 8-wide paths above ran a
 * 512-token prefill chunk's LoRA term (SmolLM2's fleet, bench/lora_step.py --prefill) at 75 ms cached against 81 ms
 * from DRAM on the Zen 4 host: bound by their arithmetic (2 x-vector and weight loads per FMA pair for the shrink,
 * 4 broadcasts and 4 loads per 16 ymm FMAs for the expand), not by the 322 MB they read.
 *
 * Shrink: R = 4 rows of A x NT = 6 tokens, 24 zmm accumulators; per 16 k, 4 loads of A and 6 of x feed 24 FMAs;
 * each sum is reduced once at the end. [pf, pf_end): the segment's B, a line a step, as in shrink_block. */
static inline __attribute__((always_inline)) void SFX(shrink_block16)(const float *x, int64_t sx, const WT *ar,
        int64_t sar, const int R, const int NT, float *y, int64_t sy, int64_t d_in, const char **pf,
        const char *pf_end) {
    __m512 acc[4][6];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= d_in; k += 16) {
        __m512 a[4];
        for (int r = 0; r < R; r++) a[r] = _mm512_loadu_ps(ar + r * sar + k);
        if (*pf < pf_end) {
            __builtin_prefetch(*pf);
            *pf += 64;
        }
        for (int t = 0; t < NT; t++) {
            const __m512 xv = _mm512_loadu_ps(x + t * sx + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(a[r], xv, acc[r][t]);
        }
    }
    if (k < d_in) {  /* the last d_in % 16 columns, masked */
        const __mmask16 m = (__mmask16)((1u << (d_in - k)) - 1);
        __m512 a[4];
        for (int r = 0; r < R; r++) a[r] = _mm512_maskz_loadu_ps(m, ar + r * sar + k);
        for (int t = 0; t < NT; t++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * sx + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(a[r], xv, acc[r][t]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < R; r++) y[t * sy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

#define SHRINK16_ROWS(NT)                                                                                       \
    {                                                                                                           \
        int j = 0;                                                                                              \
        for (; j + 4 <= nrows; j += 4)                                                                          \
            SFX(shrink_block16)(xt, sx, arows + j * sar, sar, 4, (NT), y + t0 * sy + j, sy, d_in, &pf, pf_end); \
        for (; j < nrows; j++)                                                                                  \
            SFX(shrink_block16)(xt, sx, arows + j * sar, sar, 1, (NT), y + t0 * sy + j, sy, d_in, &pf, pf_end); \
    }
static void SFX(shrink_long16)(const float *x, int64_t sx, const WT *arows, int64_t sar, int nrows, float *y,
                               int64_t sy, int64_t len, int64_t d_in, const char *pf, const char *pf_end) {
    for (int64_t t0 = 0; t0 < len; t0 += 6) {
        const float *xt = x + t0 * sx;
        switch ((int)min64(6, len - t0)) {
            case 6: SHRINK16_ROWS(6) break;
            case 5: SHRINK16_ROWS(5) break;
            case 4: SHRINK16_ROWS(4) break;
            case 3: SHRINK16_ROWS(3) break;
            case 2: SHRINK16_ROWS(2) break;
            default: SHRINK16_ROWS(1) break;
        }
    }
}
#undef SHRINK16_ROWS

/* Expand: NT = 4 tokens x C = 6 vectors (96 output columns), 24 zmm accumulators over every rank row (4 broadcasts
 * of y and 6 loads of B feed 24 FMAs), added to out once: out += scale * acc, as expand_cols does. A column tile's
 * rank rows (r x 96 floats) stay in L1 while the segment's token blocks run over them. `m`: the lanes of the last
 * vector that are stored (a tile ending mid-vector). */
static inline __attribute__((always_inline)) void SFX(expand_cols16)(const float *y, int64_t sy, const WT *b,
        int64_t sbr, int rank, float *out, int64_t so, const int NT, const int C, int64_t c, float scale,
        __mmask16 m) {
    __m512 acc[4][6];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < C; k++) acc[t][k] = _mm512_setzero_ps();
    for (int j = 0; j < rank; j++) {
        const WT *bj = b + j * sbr + c;
        __m512 q[6];
        for (int k = 0; k < C; k++) q[k] = _mm512_maskz_loadu_ps(k == C - 1 ? m : (__mmask16)0xFFFF, bj + 16 * k);
        for (int t = 0; t < NT; t++) {
            const __m512 yv = _mm512_set1_ps(y[t * sy + j]);
            for (int k = 0; k < C; k++) acc[t][k] = _mm512_fmadd_ps(yv, q[k], acc[t][k]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < C; k++) {
            const __mmask16 mk = k == C - 1 ? m : (__mmask16)0xFFFF;
            float *o = out + t * so + c + 16 * k;
            _mm512_mask_storeu_ps(o, mk, _mm512_fmadd_ps(sc, acc[t][k], _mm512_maskz_loadu_ps(mk, o)));
        }
}

#define EXPAND16_TOKENS(C)                                                                                       \
    {                                                                                                            \
        int64_t t = 0;                                                                                           \
        for (; t + 4 <= len; t += 4) SFX(expand_cols16)(y + t * sy, sy, b, sbr, rank, out + t * so, so, 4, (C), c, scale, m); \
        switch ((int)(len - t)) {                                                                                \
            case 3: SFX(expand_cols16)(y + t * sy, sy, b, sbr, rank, out + t * so, so, 3, (C), c, scale, m); break; \
            case 2: SFX(expand_cols16)(y + t * sy, sy, b, sbr, rank, out + t * so, so, 2, (C), c, scale, m); break; \
            case 1: SFX(expand_cols16)(y + t * sy, sy, b, sbr, rank, out + t * so, so, 1, (C), c, scale, m); break; \
            default: break;                                                                                      \
        }                                                                                                        \
    }
/* Every column of a segment of len > 2 tokens: tiles of 96 columns, then one of the 1-5 vectors left (its last
 * masked where ncols % 16 != 0). */
static void SFX(expand_long16)(const float *y, int64_t sy, const WT *b, int64_t sbr, int rank, float *out,
                               int64_t so, int64_t len, int64_t ncols, float scale) {
    int64_t c = 0;
    __mmask16 m = (__mmask16)0xFFFF;
    for (; c + 96 <= ncols; c += 96) EXPAND16_TOKENS(6)
    if (c < ncols) {
        const int64_t left = ncols - c;
        if (left % 16) m = (__mmask16)((1u << (left % 16)) - 1);
        switch ((int)((left + 15) / 16)) {
            case 5: EXPAND16_TOKENS(5) break;
            case 4: EXPAND16_TOKENS(4) break;
            case 3: EXPAND16_TOKENS(3) break;
            case 2: EXPAND16_TOKENS(2) break;
            default: EXPAND16_TOKENS(1) break;
        }
    }
}
#undef EXPAND16_TOKENS
#endif

/* A segment's shrink: y[t, :rank] = A x_t for its len tokens (A: rank rows of d_in at a), prefetching [pf, pf_end)
 * on the way (the segment's B, or nothing). */
static void SFX(segment_shrink)(const float *x, int64_t sx, const WT *a, int64_t d_in, int rank, float *y,
                                int64_t sy, int64_t len, const char *pf, const char *pf_end) {
#if defined(ROWS16)
    if (len > 2) {
        SFX(shrink_long16)(x, sx, a, d_in, rank, y, sy, len, d_in, pf, pf_end);
        return;
    }
#endif
    SFX(shrink_unit)(x, sx, a, d_in, rank, y, sy, len, d_in, pf, pf_end);
}

/* A segment's expand over ncols output columns: out[t, :ncols] += scale * y[t, :rank] B, with b and out at the first
 * of those columns and sbr B's row stride (the projection's d_out): the whole width (run_segment), or one GEMM
 * panel's columns of it (gemm_f32.h, the LoRA term fused into a decode step's GEMM). */
static void SFX(segment_expand)(const float *y, int64_t sy, const WT *b, int64_t sbr, int rank, float *out,
                                int64_t so, int64_t len, int64_t ncols, float scale) {
#if defined(ROWS16)
    if (len > 2) {
        SFX(expand_long16)(y, sy, b, sbr, rank, out, so, len, ncols, scale);
        return;
    }
#endif
    int64_t c = 0;  /* columns done */
#if defined(ROWS8)
    if (len <= 2) c = SFX(expand_short)(y, sy, b, sbr, rank, out, so, len, ncols, scale);
#ifndef EXPAND_LONG_TILE  /* -DEXPAND_LONG_TILE: the L1 tile for every column, for A/Bs in bench/lora_step.py */
    else c = SFX(expand_long)(y, sy, b, sbr, rank, out, so, len, ncols, scale);
#endif
#endif
    if (c < ncols) SFX(expand_unit_rank_major)(y, sy, b + c, sbr, rank, out + c, so, len, ncols - c, scale);
}

/* One segment: its shrink into y (B prefetched on the way), then its expand into out. */
static void SFX(run_segment)(const void *args, int64_t g) {
    const sgmv_args *p = (const sgmv_args *)args;
    const WT *w = (const WT *)p->w;
    const int64_t slot = p->slots[g], start = p->starts[g], len = p->lens[g];
    const int rank = p->ranks[g];
    float *y = p->y + start * p->sy;  /* [len, >= rank] scratch rows of this segment */
    const WT *b = w + p->b_offs[slot];
    SFX(segment_shrink)(p->x + start * p->sx, p->sx, w + p->a_offs[slot], p->d_in, rank, y, p->sy, len,
                        (const char *)b, (const char *)(b + (size_t)rank * (size_t)p->d_out));
    SFX(segment_expand)(y, p->sy, b, p->d_out, rank, p->out + start * p->so, p->so, len, p->d_out, p->scales[slot]);
}

#undef WT
#undef LD
#undef SFX
#undef VEC8
#undef ROWS8
#undef ROWS16
