/* Fused CPU kernels for SOFT top-k: the whole Newton solve of a row in one call, and the closed-form
 * backward. The CPU counterpart of triton_kernels.py, with the same inputs and the same math as
 * solvers.newton_semi_dual / implicit_backward.implicit_grad (see their docstrings); only the schedule differs:
 * one OpenMP task per row, the row's scores streamed in blocks of BLOCK elements per evaluation, the
 * plan never stored, anchor masses and P^T P accumulated in double, the small Newton system solved in
 * double. Compiled and loaded by cpu_kernels.py (gcc -O3 -march=native -fopenmp).
 *
 * Layouts (row-major, float32 unless said): x (rows, n) raw scores (-inf: excluded), the caller's mask
 * (rows, n) uint8 or NULL, eps (rows,); sorted output (rows, n, k), unsorted (rows, n); info (rows, 2) =
 * iterations, marginal error. Both forwards take only these: per row they check the scores, find the centre
 * x_(k) and the start (one pass over the row before the solve; the paper scaling's temperature in it when
 * asked), normalise the scores as u = clamp((x - centre) / eps, +-bound) (solvers.normalise_scores) and solve;
 * the backwards take the same x and mask and give dL/deps too.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

#define BLOCK 256
#define PAD 16  /* row lengths are padded to a multiple of this (one AVX-512 register of floats) */
/* The solver constants (LOGIT_CLAMP, MAX_STEP, NEAR_FLOOR, SECOND_START_ERROR, RIDGE_ULPS, PLAN_FLOOR,
 * SATURATION, LOG_STEP_FRACTION) are defined once, in solvers.py, and handed to this file as -D flags by
 * cpu_kernels.py, with the status bits (OUT_OF_MEMORY, BAD_NAN, BAD_INF, BAD_SCALE, CAPPED: kernel_interface.py). */
#if !defined(LOGIT_CLAMP) || !defined(MAX_STEP) || !defined(NEAR_FLOOR) || !defined(SECOND_START_ERROR) \
    || !defined(RIDGE_ULPS) || !defined(PLAN_FLOOR) || !defined(SATURATION) || !defined(LOG_STEP_FRACTION) \
    || !defined(OUT_OF_MEMORY) || !defined(BAD_NAN) || !defined(BAD_INF) || !defined(BAD_SCALE) || !defined(CAPPED)
#error "compile with the -D flags of cpu_kernels.py (cpu_kernels.CONSTANTS)"
#endif
#define LOGIT_CLAMP_F ((float)(LOGIT_CLAMP))
#define PLAN_FLOOR_F ((float)(PLAN_FLOOR))
#define FLT_EPS 1.1920928955078125e-07
#define FLT_MAX_F 3.4028234663852886e+38f
#define FLT_TINY 1.1754943508222875e-38  /* the smallest normal float: a floor for divisors */

/* Entry j of a row counts: not masked out, and a score above -inf (so not NaN either). */
static inline int valid_at(const float *x, const uint8_t *mask, int64_t j) {
    return (mask == NULL || mask[j]) && x[j] > -INFINITY;
}

/* e^x for x <= 0: Cephes' expf polynomial (about 1 ulp), written so that gcc vectorises the loops that
 * call it; 0 below -87, where float32 underflows anyway. */
static inline float exp_nonpos(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (floorf would stop gcc from vectorising the loop) */
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;  /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* The sum of PAD lanes, by a tree of halves in separate arrays: gcc's own reduction epilogue adds the lanes
 * one by one, which costs more than the work itself for short rows, and an in-place tree is versioned for
 * aliasing. */
_Static_assert(PAD == 16, "lane_total is written for 16 lanes");
static inline float lane_total(const float *lanes) {
#if defined(__AVX__)
    /* the same additions in the same order, in six vector instructions (gcc spells the tree out lane by lane:
     * four times as many, and short rows do one reduction per anchor pair per evaluation) */
    __m256 h8 = _mm256_add_ps(_mm256_loadu_ps(lanes), _mm256_loadu_ps(lanes + 8));
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));  /* h4[0] + h4[2], h4[1] + h4[3] */
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#else
    float h8[8], h4[4];
    for (int q = 0; q < 8; q++) h8[q] = lanes[q] + lanes[q + 8];
    for (int q = 0; q < 4; q++) h4[q] = h8[q] + h8[q + 4];
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
#endif
}

/* Plan block: pl[l * BLOCK + j] = P_{start+j, l} for the ma active anchors; zero for masked elements
 * (weight wv = 0; also the padding up to a multiple of PAD, so that the loops have no scalar remainder).
 * Logits are running sums of the clamped differences tz[l] - u (solvers._logits). */
static void plan_block(const float *restrict u, const float *restrict wv, int nb, const float *tz, int ma,
                       float *restrict pl, float *restrict zmax, float *restrict inv) {
    for (int j = 0; j < nb; j++) { pl[j] = 0.0f; zmax[j] = 0.0f; }
    for (int l = 1; l < ma; l++) {
        const float t = tz[l];
        const float *prev = pl + (l - 1) * BLOCK;
        float *cur = pl + l * BLOCK;
        for (int j = 0; j < nb; j++) {
            float d = t - u[j];
            d = d < -LOGIT_CLAMP_F ? -LOGIT_CLAMP_F : (d > LOGIT_CLAMP_F ? LOGIT_CLAMP_F : d);
            cur[j] = prev[j] + d;
            zmax[j] = cur[j] > zmax[j] ? cur[j] : zmax[j];
        }
    }
    for (int j = 0; j < nb; j++) inv[j] = 0.0f;
    for (int l = 0; l < ma; l++) {
        float *restrict cur = pl + l * BLOCK;
        for (int j = 0; j < nb; j++) cur[j] = exp_nonpos(cur[j] - zmax[j]);
        for (int j = 0; j < nb; j++) inv[j] += cur[j];
    }
    for (int j = 0; j < nb; j++) inv[j] = wv[j] / inv[j];
    for (int l = 0; l < ma; l++) {
        float *cur = pl + l * BLOCK;
        for (int j = 0; j < nb; j++) cur[j] *= inv[j];
    }
}

/* sum_j p_j q_j over nb (a multiple of PAD) entries, in PAD lanes (lane_total). */
static inline float dot_lanes(const float *restrict p, const float *restrict q, int nb) {
    float lanes[PAD];
    for (int t = 0; t < PAD; t++) lanes[t] = 0.0f;
    for (int j = 0; j < nb; j += PAD) {
#pragma omp simd
        for (int t = 0; t < PAD; t++) lanes[t] += p[j + t] * q[j + t];
    }
    return lane_total(lanes);
}

/* sum_j p_j over nb (a multiple of PAD) entries, in PAD lanes. */
static inline float sum_lanes(const float *restrict p, int nb) {
    float lanes[PAD];
    for (int t = 0; t < PAD; t++) lanes[t] = 0.0f;
    for (int j = 0; j < nb; j += PAD) {
#pragma omp simd
        for (int t = 0; t < PAD; t++) lanes[t] += p[j + t];
    }
    return lane_total(lanes);
}

/* The anchor masses s_a += sum_j P_ja of the ma anchors and P^T P (upper triangle) += sum_j P_ja P_jb of the
 * first ma - 1 (solve_free pins the last: its products are never read), from one plan block of nb entries (a
 * multiple of PAD: the padding is zero). */
static void accumulate(const float *restrict pl, int nb, int ma, int mp, double *restrict s, double *restrict ppt) {
    for (int a = 0; a < ma; a++) {
        const float *pa = pl + a * BLOCK;
        s[a] += sum_lanes(pa, nb);
        for (int b = a; b < ma - 1; b++) ppt[a * mp + b] += dot_lanes(pa, pl + b * BLOCK, nb);
    }
}

/* Per-thread scratch, allocated once per call: the plan block (pl, g, zmax, inv) and thresholds (tz: the
 * solve's current, trial and step; then the row's starting thresholds, their shift and the anchor masses) of
 * the sorted solve; the row's normalised scores u and weights wv; a0, a1: the sigmoids of the unsorted
 * solve's current and trial thresholds. */
typedef struct { float *pl, *zmax, *inv, *g, *u, *wv, *a0, *a1, *tz; double *d; } workspace;

static int64_t padded(int64_t n) { return (n + PAD - 1) / PAD * PAD; }

/* One anchor's marginal error: |mass - target| relative to max(target, 1), 0 for an anchor without a target
 * (solvers._marginal_error). */
static inline double marginal_error(double mass, float target) {
    return target > 0 ? fabs(mass - target) / (target > 1.0f ? target : 1.0) : 0.0;
}

/* Anchor masses s, P^T P (upper triangle) and the max relative marginal error for thresholds tz. */
static double evaluate(const float *u, const float *wv, int64_t n, const float *tz, int ma, int mp,
                       const float *c, double *s, double *ppt, workspace *w) {
    memset(s, 0, sizeof(double) * mp);
    memset(ppt, 0, sizeof(double) * mp * mp);
    int64_t np = padded(n);
    for (int64_t start = 0; start < np; start += BLOCK) {
        int nb = (int)(np - start < BLOCK ? np - start : BLOCK);
        plan_block(u + start, wv + start, nb, tz, ma, w->pl, w->zmax, w->inv);
        accumulate(w->pl, nb, ma, mp, s, ppt);
    }
    double err = 0.0;
    for (int l = 0; l < ma; l++) {
        double e = marginal_error(s[l], c[l]);
        err = e > err ? e : err;
    }
    return err;
}

/* Solve (diag(s) - P^T P + ridge) x = rhs on the free anchors 0..ma-2 (the last active one is pinned);
 * x = 0 elsewhere, and x = 0 if the system is singular (solvers.hessian_solve). */
static void solve_free(const double *s, const double *ppt, const double *rhs, int ma, int mp, double *x,
                       double *a) {
    int f = ma - 1;
    for (int l = 0; l < mp; l++) x[l] = 0.0;
    if (f <= 0) return;
    double scale = 1.0;
    for (int l = 0; l < f; l++) scale = s[l] > scale ? s[l] : scale;
    double ridge = RIDGE_ULPS * FLT_EPS * scale;
    for (int r = 0; r < f; r++) {
        for (int q = 0; q < f; q++) {
            double pq = r <= q ? ppt[r * mp + q] : ppt[q * mp + r];
            a[r * f + q] = (r == q ? s[r] + ridge : 0.0) - pq;
        }
        x[r] = rhs[r];
    }
    for (int q = 0; q < f; q++) {  /* Gaussian elimination with partial pivoting */
        int piv = q;
        for (int r = q + 1; r < f; r++) if (fabs(a[r * f + q]) > fabs(a[piv * f + q])) piv = r;
        if (!(fabs(a[piv * f + q]) > 0.0)) { for (int l = 0; l < mp; l++) x[l] = 0.0; return; }
        if (piv != q) {
            for (int col = 0; col < f; col++) {
                double tmp = a[q * f + col]; a[q * f + col] = a[piv * f + col]; a[piv * f + col] = tmp;
            }
            double tmp = x[q]; x[q] = x[piv]; x[piv] = tmp;
        }
        for (int r = q + 1; r < f; r++) {
            double m = a[r * f + q] / a[q * f + q];
            if (m == 0.0) continue;
            for (int col = q; col < f; col++) a[r * f + col] -= m * a[q * f + col];
            x[r] -= m * x[q];
        }
    }
    for (int q = f - 1; q >= 0; q--) {
        double v = x[q];
        for (int col = q + 1; col < f; col++) v -= a[q * f + col] * x[col];
        x[q] = v / a[q * f + q];
    }
    for (int l = 0; l < f; l++) if (!isfinite(x[l])) { for (int q = 0; q < mp; q++) x[q] = 0.0; return; }
}

/* A normalised score u = clamp((x - centre) / eps, +-bound) (solvers.normalise_scores). */
static inline float normalised(float x, float centre, float eps, float bound) {
    float v = (x - centre) / eps;
    return v < -bound ? -bound : (v > bound ? bound : v);
}

/* The row's normalised scores u and weights wv = 1 on valid elements (not -inf, mask true); both 0 elsewhere,
 * up to the padded length. */
static void normalise_row(const float *x, const uint8_t *valid, int64_t n, float centre, float eps, float bound,
                          float *u, float *wv) {
    for (int64_t j = 0; j < n; j++) {
        float v = normalised(x[j], centre, eps, bound);
        int keep = (valid == NULL || valid[j]) && x[j] > -INFINITY;
        u[j] = keep ? v : 0.0f;
        wv[j] = keep ? 1.0f : 0.0f;
    }
    for (int64_t j = n; j < padded(n); j++) { u[j] = 0.0f; wv[j] = 0.0f; }
}

/* The sorted operator's damped Newton solve of one row (solvers.newton_semi_dual) from the starting thresholds
 * tz0 (tz0[l] = t_{l-1}) and the second start's shift, for anchor masses c (ma active anchors of mp); writes
 * the output (n, k) and info. */
static void forward_row(const float *x, const uint8_t *valid, int64_t n, float centre, float eps, float bound,
                        int k, const float *tz0, const float *shift, const float *c, int ma, int mp,
                        double tol, int max_iter, int max_halvings, float *out, float *info, workspace *w) {
    float *u = w->u, *wv = w->wv;
    normalise_row(x, valid, n, centre, eps, bound, u, wv);
    double *s = w->d;
    double *s_t = s + mp, *rhs = s + 2 * mp, *dh = s + 3 * mp, *ppt = s + 6 * mp;
    double *ppt_t = ppt + mp * mp, *mat = ppt_t + mp * mp;
    float *tz = w->tz;
    float *tz_t = tz + mp, *dtz = tz + 2 * mp;
    memcpy(tz, tz0, sizeof(float) * mp);
    double err = evaluate(u, wv, n, tz, ma, mp, c, s, ppt, w);
    /* whether w->pl holds the plan at tz: then a row of one block (most attention rows) has its output */
    int plan_at_tz = 1;
    /* Second starting point (thresholds shifted by log c), kept if it fits the masses better. */
    if (err > SECOND_START_ERROR) {
        for (int l = 0; l < mp; l++) tz_t[l] = tz[l] + shift[l];
        double err2 = evaluate(u, wv, n, tz_t, ma, mp, c, s_t, ppt_t, w);
        plan_at_tz = err2 < err;
        if (err2 < err) {
            err = err2;
            memcpy(tz, tz_t, sizeof(float) * mp);
            memcpy(s, s_t, sizeof(double) * mp);
            memcpy(ppt, ppt_t, sizeof(double) * mp * mp);
        }
    }
    int it = 0;
    while (err > tol && it < max_iter) {
        for (int l = 0; l < mp; l++) rhs[l] = l < ma ? c[l] - s[l] : 0.0;
        solve_free(s, ppt, rhs, ma, mp, dh, mat);
        double big = MAX_STEP;
        for (int l = 0; l < mp; l++) big = fabs(dh[l]) > big ? fabs(dh[l]) : big;
        double alpha = MAX_STEP / big;
        /* A step dh on the potentials moves threshold t_{l-1} = tz[l] by dh_l - dh_{l-1}. */
        for (int l = 0; l < mp; l++) dtz[l] = (l >= 1 && l < ma) ? (float)(dh[l] - dh[l - 1]) : 0.0f;
        int accepted = 0;
        for (int tries = 0; tries < max_halvings; tries++) {
            for (int l = 0; l < mp; l++) tz_t[l] = tz[l] + (float)alpha * dtz[l];
            double err_t = evaluate(u, wv, n, tz_t, ma, mp, c, s_t, ppt_t, w);
            plan_at_tz = err_t < err || err_t <= tol;
            if (err_t < err || err_t <= tol) {
                err = err_t;
                memcpy(tz, tz_t, sizeof(float) * mp);
                memcpy(s, s_t, sizeof(double) * mp);
                memcpy(ppt, ppt_t, sizeof(double) * mp * mp);
                accepted = 1;
                break;
            }
            /* Near convergence, two failed halvings mean the row sits at its float rounding floor. */
            if (err < NEAR_FLOOR && tries >= 1) break;
            alpha *= 0.5;
        }
        it++;
        if (!accepted) break;
    }
    info[0] = (float)it;
    info[1] = (float)err;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int nb = (int)(n - start < BLOCK ? n - start : BLOCK);
        if (!(plan_at_tz && padded(n) <= BLOCK))  /* (evaluate's one block is this one: same call) */
            plan_block(u + start, wv + start, (int)padded(nb), tz, ma, w->pl, w->zmax, w->inv);
        float *o = out + start * k;
        for (int j = 0; j < nb; j++)
            for (int l = 0; l < k; l++) o[j * k + l] = l < ma ? w->pl[l * BLOCK + j] : 0.0f;
    }
}

static int alloc_workspace(workspace *w, int mp, int64_t n) {
    w->pl = malloc(sizeof(float) * (BLOCK * (2 * mp + 2) + 6 * mp + 4 * padded(n > 0 ? n : 1)));
    w->d = malloc(sizeof(double) * (6 * mp + 3 * mp * mp));
    if (!w->pl || !w->d) { free(w->pl); free(w->d); return 0; }
    w->g = w->pl + BLOCK * mp;
    w->zmax = w->g + BLOCK * mp;
    w->inv = w->zmax + BLOCK;
    w->tz = w->inv + BLOCK;
    w->u = w->tz + 6 * mp;
    w->wv = w->u + padded(n > 0 ? n : 1);
    w->a0 = w->wv + padded(n > 0 ? n : 1);
    w->a1 = w->a0 + padded(n > 0 ? n : 1);
    return 1;
}

static void free_workspace(workspace *w) {
    free(w->pl);
    free(w->d);
}

/* Run fn(r, scratch, ctx) for every row over `threads` OpenMP threads, each with its own scratch. Rows differ
 * in their number of iterations: they are handed out dynamically, in chunks big enough that many short rows
 * do not queue on the scheduler, small enough that a few long rows spread. Returns OUT_OF_MEMORY when a
 * thread could not allocate its scratch (its rows are then not done), else 0. Every thread takes part in the loop either
 * way: a worksharing loop must be met by the whole team. Small batches stay on the calling thread. */
typedef void (*row_fn)(int64_t r, workspace *w, const void *ctx);

/* Subnormal floats flushed to zero in the kernels' own threads while they run (FTZ and DAZ on x86; restored on
 * exit: the OpenMP threads may be PyTorch's too). At a small temperature the transport weights of entries far from
 * an anchor, and products of two such weights, fall below the smallest normal float (1.2e-38): computed exactly,
 * every operation on one is a microcode assist, tens of times slower, and they dominated the sorted solve there.
 * Flushed, each is 0 -- a change of at most 1.2e-38 per weight, far below float32 resolution of the masses (>= 1)
 * and of any output that is not itself 0 to working precision. Scores that are themselves subnormal are read as 0
 * too: a change of at most 1.2e-38 / epsilon in a scaled score, below float32 resolution for epsilon >= 1e-30; at a
 * smaller epsilon it can change the output (the PyTorch path, backend="torch", computes it exactly). */
typedef struct { unsigned int saved; } subnormals_off;

static inline subnormals_off flush_subnormals(void) {
    subnormals_off s = {0};
#if defined(__SSE__)
    s.saved = _mm_getcsr();
    _mm_setcsr(s.saved | 0x8040u);  /* FTZ (bit 15) | DAZ (bit 6) */
#endif
    return s;
}

static inline void restore_subnormals(subnormals_off s) {
#if defined(__SSE__)
    _mm_setcsr(s.saved);
#else
    (void)s;
#endif
}

#define PARALLEL_MIN_WORK 4096  /* rows x n below this run on the calling thread: waking a team costs more */

/* (rows: the tasks fn is called for, each of rows_per_task rows of the batch -- GROUP for the grouped solves) */
static int parallel_rows(int64_t rows, int64_t rows_per_task, int64_t n, int mp, int threads, row_fn fn,
                         const void *ctx) {
    int failed = 0;
    if (rows * rows_per_task * (n > 0 ? n : 1) < PARALLEL_MIN_WORK || rows < 2) threads = 1;
    int chunk = (int)(rows / (8 * (int64_t)threads));
    chunk = chunk < 1 ? 1 : (chunk > 64 ? 64 : chunk);
#pragma omp parallel num_threads(threads)
    {
        subnormals_off mode = flush_subnormals();
        workspace w;
        int ok = alloc_workspace(&w, mp, n);
#pragma omp for schedule(dynamic, chunk)
        for (int64_t r = 0; r < rows; r++) {
            if (ok) {
                fn(r, &w, ctx);
            } else {
#pragma omp atomic write
                failed = OUT_OF_MEMORY;
            }
        }
        if (ok) free_workspace(&w);
        restore_subnormals(mode);
    }
    return failed;
}

/* Plan block rebuilt from the sorted output (rest column = 1 - taken where rest_on) and the upstream gradient,
 * both anchors-first: pl[l * BLOCK + j], g[l * BLOCK + j], for the mp anchors; zero where the score x is -inf
 * or the mask false, and where the plan is at or below PLAN_FLOOR (the clamped forward's floor). */
static void output_block(const float *restrict out, const float *restrict gout, const float *x, const uint8_t *mask,
                         int nb, int k, int rest_on, int mp, float *restrict pl, float *restrict g) {
    int np = (int)padded(nb);
    int keep[BLOCK];
    float taken[BLOCK];
    for (int j = 0; j < nb; j++) { keep[j] = valid_at(x, mask, j); taken[j] = 0.0f; }
    /* rank by rank, in vector loops (the ranks sit k floats apart; an excluded entry's lanes are zeroed) */
    for (int l = 0; l < k; l++) {
        float *restrict pr = pl + l * BLOCK, *restrict gr = g + l * BLOCK;
#pragma omp simd
        for (int j = 0; j < nb; j++) {
            float p = out[j * k + l], q = gout[j * k + l];
            taken[j] += p;
            pr[j] = keep[j] & (p > PLAN_FLOOR_F) ? p : 0.0f;
            gr[j] = keep[j] ? q : 0.0f;
        }
        for (int j = nb; j < np; j++) { pr[j] = 0.0f; gr[j] = 0.0f; }
    }
    for (int l = k; l < mp; l++) {
        float *restrict pr = pl + l * BLOCK, *restrict gr = g + l * BLOCK;
        for (int j = 0; j < np; j++) { pr[j] = 0.0f; gr[j] = 0.0f; }
    }
    if (rest_on && k < mp) {
        float *restrict pr = pl + k * BLOCK;
#pragma omp simd
        for (int j = 0; j < nb; j++) {
            float rest = 1.0f - taken[j];
            pr[j] = keep[j] & (rest > PLAN_FLOOR_F) ? rest : 0.0f;
        }
    }
}

/* dL/dx of one row of the sorted operator (implicit_backward.implicit_grad, divided by eps). */
static void backward_row(const float *out, const float *gout, const float *x, const uint8_t *mask, int64_t n, int k,
                         const float *y, int ma, int rest_on, float eps, int mp, float *grad, workspace *w) {
    double *s = w->d;
    double *v = s + mp, *sol = v + mp, *ppt = sol + mp, *mat = ppt + mp * mp;
    memset(s, 0, sizeof(double) * (3 * mp + mp * mp));
    float *gbar = w->zmax, *ybar = w->inv;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int nb = (int)(n - start < BLOCK ? n - start : BLOCK);
        output_block(out + start * k, gout + start * k, x + start, mask ? mask + start : NULL, nb, k, rest_on, mp,
                     w->pl, w->g);
        for (int j = 0; j < nb; j++) gbar[j] = 0.0f;
        for (int l = 0; l < mp; l++)
            for (int j = 0; j < nb; j++) gbar[j] += w->pl[l * BLOCK + j] * w->g[l * BLOCK + j];
        for (int l = 0; l < mp; l++) {
            const float *pa = w->pl + l * BLOCK, *ga = w->g + l * BLOCK;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int j = 0; j < nb; j++) acc += pa[j] * (ga[j] - gbar[j]);
            v[l] += acc;
        }
        accumulate(w->pl, (int)padded(nb), mp, mp, s, ppt);
    }
    solve_free(s, ppt, v, ma, mp, sol, mat);
    float wl[64];
    float *wp = mp <= 64 ? wl : malloc(sizeof(float) * mp);
    for (int l = 0; l < mp; l++) wp[l] = (float)sol[l];
    const float inv_eps = 1.0f / eps;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int nb = (int)(n - start < BLOCK ? n - start : BLOCK);
        if (n > BLOCK)  /* (a row of one block still has it from the first pass) */
            output_block(out + start * k, gout + start * k, x + start, mask ? mask + start : NULL, nb, k, rest_on,
                         mp, w->pl, w->g);
        for (int j = 0; j < nb; j++) ybar[j] = 0.0f;
        for (int l = 0; l < mp; l++)
            for (int j = 0; j < nb; j++) ybar[j] += w->pl[l * BLOCK + j] * y[l];
        float *gr = grad + start;
        for (int j = 0; j < nb; j++) gr[j] = 0.0f;
        for (int l = 0; l < mp; l++) {
            const float *pa = w->pl + l * BLOCK, *ga = w->g + l * BLOCK;
            for (int j = 0; j < nb; j++) gr[j] += pa[j] * (y[l] - ybar[j]) * (ga[j] - wp[l]);
        }
        for (int j = 0; j < nb; j++) gr[j] *= inv_eps;
    }
    if (wp != wl) free(wp);
}

/* dL/deps = -sum_i dL/dx_i (x_i - mean x) / eps over the valid entries of a row (implicit_backward.temperature_grad),
 * from sum_i grad_i d_i, sum_i grad_i, sum_i d_i and their count with d_i = x_i - x_ref: x_ref, a valid score of
 * the row (reference_score), keeps a large common offset of the scores from cancelling in the sums. */
static inline float temperature_grad_from_sums(double gx, double gs, double xs, int64_t count, float eps) {
    double mean_d = count > 0 ? xs / (double)count : 0.0;
    return (float)(-(gx - mean_d * gs) / eps);
}

/* The row's first valid score (0 if none): the reference of temperature_grad_from_sums's differences. */
static float reference_score(const float *x, const uint8_t *mask, int64_t n) {
    for (int64_t j = 0; j < n; j++)
        if (valid_at(x, mask, j)) return x[j];
    return 0.0f;
}

/* dL/deps of a row from its finished gradient, in one plain pass (the sorted backward's). */
static float temperature_grad_row(const float *grad, const float *x, const uint8_t *mask, int64_t n, float eps) {
    double gx = 0.0, gs = 0.0, xs = 0.0;
    int64_t count = 0;
    float x_ref = reference_score(x, mask, n);
    for (int64_t j = 0; j < n; j++) {
        if (!valid_at(x, mask, j)) continue;
        double d = (double)x[j] - x_ref;
        gx += grad[j] * d;
        gs += grad[j];
        xs += d;
        count++;
    }
    return temperature_grad_from_sums(gx, gs, xs, count, eps);
}

typedef struct {
    const float *out, *gout, *x, *eps, *y;
    const uint8_t *mask;
    float *grad, *grad_eps;
    int64_t n;
    int k;
    float epsilon;  /* every row's temperature when eps is NULL */
} sorted_backward_args;

static void sorted_backward_task(int64_t r, workspace *w, const void *ctx) {
    const sorted_backward_args *a = ctx;
    int64_t n = a->n;
    int k = a->k;
    const float *x = a->x + r * n;
    const uint8_t *mask = a->mask ? a->mask + r * n : NULL;
    int64_t n_valid = 0;
    for (int64_t j = 0; j < n; j++) n_valid += valid_at(x, mask, j);
    /* the active anchors (solvers.anchor_targets): the ranks with a valid entry each, and the rest if any */
    int ma = (int)(n_valid < k ? n_valid : k) + (n_valid > k);
    float eps = a->eps ? a->eps[r] : a->epsilon;
    backward_row(a->out + r * n * k, a->gout + r * n * k, x, mask, n, k, a->y, ma, n_valid > k, eps, k + 1,
                 a->grad + r * n, w);
    if (a->grad_eps) a->grad_eps[r] = temperature_grad_row(a->grad + r * n, x, mask, n, eps);
}

/* dL/dx of the sorted operator from its output (rows, n, k), the upstream gradient like it, the raw scores x and
 * the caller's mask (or NULL) of the forward and its temperature eps (rows,) -- or, eps NULL, epsilon for every
 * row; dL/deps too unless grad_eps is NULL. Returns OUT_OF_MEMORY when scratch memory could not be allocated,
 * else 0. */
int soft_topk_sorted_backward(const float *out, const float *gout, const uint8_t *mask, const float *x,
                              const float *eps, float *grad, float *grad_eps, int64_t rows, int64_t n, int k,
                              float epsilon, int threads) {
    float *y = malloc(sizeof(float) * (k + 1));
    if (!y) return OUT_OF_MEMORY;
    for (int l = 0; l <= k; l++) y[l] = (float)(k - l) - 0.5f * (float)k;  /* solvers.centred_anchors */
    sorted_backward_args a = {out, gout, x, eps, y, mask, grad, grad_eps, n, k, epsilon};
    int failed = parallel_rows(rows, 1, n, k + 1, threads, sorted_backward_task, &a);
    free(y);
    return failed;
}

/* The largest and smallest valid scores of a row (not -inf, mask true) and where they first occur: the
 * scalar scan. Its branches are taken rarely and predictably enough that it beats branch-free lanes plus a
 * search for the index (measured at 7680 rows x 32). hi = -inf and at 0 when nothing is valid. */
static void row_extremes(const float *xr, const uint8_t *mask, int64_t n, float *hi, float *lo, int64_t *hi_at,
                         int64_t *lo_at) {
    float h = -INFINITY, l = INFINITY;
    int64_t ha = 0, la = 0;
    for (int64_t j = 0; j < n; j++) {
        if (!valid_at(xr, mask, j)) continue;
        float v = xr[j];
        if (v > h) { h = v; ha = j; }
        if (v < l) { l = v; la = j; }
    }
    *hi = h; *lo = l; *hi_at = ha; *lo_at = la;
}

/* ---- the paper scaling's per-row temperature (soft_topk._PaperTemperature, the definition) --------------
 * eps_r = epsilon * M / 2 with M = max_i max(x_i^2, (x_i - K)^2) over the valid elements (not -inf, and mask
 * true where the caller gives one), epsilon itself when M = 0 or nothing is valid; the cost is convex, so M
 * sits at the row's largest or smallest valid score:
 * one pass for both, then at[r] = where M is attained (the first such element) and slope[r] = dEps/dx there.
 * The forwards compute it too, in their own pass over the scores (prepare_row). */

/* eps, at and slope (= d eps / d x_at) of a row from its largest and smallest valid scores hi, lo (hi = -inf:
 * nothing valid) and where they first occur. */
static inline void paper_temperature_of(float hi, float lo, int64_t hi_at, int64_t lo_at, float anchor_top,
                                        float epsilon, float *eps, int64_t *at, float *slope) {
    int any_valid = isfinite(hi);
    if (!any_valid) { hi = 0.0f; lo = 0.0f; }
    float hi_up = hi * hi, hi_down = (hi - anchor_top) * (hi - anchor_top);
    float lo_up = lo * lo, lo_down = (lo - anchor_top) * (lo - anchor_top);
    float cost_hi = hi_up > hi_down ? hi_up : hi_down, cost_lo = lo_up > lo_down ? lo_up : lo_down;
    float slope_hi = hi_up >= hi_down ? 2.0f * hi : 2.0f * (hi - anchor_top);
    float slope_lo = lo_up >= lo_down ? 2.0f * lo : 2.0f * (lo - anchor_top);
    int use_hi = cost_hi >= cost_lo;
    float cost = use_hi ? cost_hi : cost_lo;
    int positive = cost > 0.0f && any_valid;
    *at = use_hi ? hi_at : lo_at;
    *slope = positive ? epsilon / 2.0f * (use_hi ? slope_hi : slope_lo) : 0.0f;
    *eps = positive ? epsilon * cost / 2.0f : epsilon;
}

int soft_topk_paper_temperature(const float *x, const uint8_t *mask, int64_t rows, int64_t n, float anchor_top,
                                float epsilon, float *eps, int64_t *at, float *slope, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float hi, lo;
        int64_t hi_at, lo_at;
        row_extremes(x + r * n, mask ? mask + r * n : NULL, n, &hi, &lo, &hi_at, &lo_at);
        paper_temperature_of(hi, lo, hi_at, lo_at, anchor_top, epsilon, eps + r, at + r, slope + r);
    }
    return 0;
}

/* ---- the unsorted operator: one monotone root per row (solvers.newton_sigmoid_root) --------------------
 * A_i = sigmoid(u_i - tau) with sum_i A_i = k over the valid elements: safeguarded Newton on
 * f(tau) = sum_i sigmoid(u_i - tau) - k (f' = -sum_i a_i, a = A(1 - A)) inside the bracket
 * [u_min + shift, u_max + shift] (shift = log((n-k)/k)), bisecting when a step leaves it; started from the
 * better of tau0 and tau0 + shift. Rows with n_valid <= k are all ones on the valid elements. Sums in double.
 * Rows with 2k > n_valid evaluate f from the unselected side, (n_valid - k) - sum_i sigmoid(tau - u_i) (as
 * solvers.newton_sigmoid_root does, and why). */

/* sigmoid(z) and sigmoid(-z) = 1 - sigmoid(z), each to its own relative precision */
static inline void sigmoid_pair(float z, float *s, float *s_neg) {
    float e = exp_nonpos(z >= 0.0f ? -z : z);  /* e^{-|z|}: never overflows */
    float r = 1.0f / (1.0f + e);                /* one division for both branches */
    *s = z >= 0.0f ? r : e * r;
    *s_neg = z >= 0.0f ? e * r : r;
}

/* sum_i A_i (or, with complement, sum_i (1 - A_i)) and sum_i A_i (1 - A_i) over the valid elements (wv = 1,
 * else 0); A itself goes to a (np entries), so that the last evaluation is the output. Each block of BLOCK
 * elements is summed in PAD float lanes, the blocks in double. */
static void sigmoid_sums(const float *restrict u, const float *restrict wv, int64_t np, float tau, int complement,
                         float *restrict a, double *mass, double *slope) {
    double m = 0.0, s = 0.0;
    for (int64_t start = 0; start < np; start += BLOCK) {
        int64_t end = np - start < BLOCK ? np : start + BLOCK;
        float mb[PAD], sb[PAD];
        for (int q = 0; q < PAD; q++) { mb[q] = 0.0f; sb[q] = 0.0f; }
        for (int64_t j = start; j < end; j += PAD) {
#pragma omp simd
            for (int q = 0; q < PAD; q++) {
                float sq, cq;
                sigmoid_pair(u[j + q] - tau, &sq, &cq);
                float aq = sq * wv[j + q];
                a[j + q] = aq;
                mb[q] += (complement ? cq : sq) * wv[j + q];
                sb[q] += aq * (1.0f - aq);
            }
        }
        m += lane_total(mb);
        s += lane_total(sb);
    }
    *mass = m;
    *slope = s;
}

/* The hard-assignment start between the k-th and (k+1)-th largest normalised scores (solvers.unsorted_start,
 * solvers.hard_boundary): their midpoint, or across a gap wider than 2 * SATURATION the boundary nearest 0 at
 * least SATURATION from both. */
static float hard_threshold(float above, float below) {
    float margin = (float)SATURATION + 8.0f * (float)FLT_EPS * (fabsf(above) + fabsf(below));
    float t = 0.5f * (above + below);
    if (above - below > 2.0f * margin) {
        t = below + margin > 0.0f ? below + margin : 0.0f;
        t = t < above - margin ? t : above - margin;
    }
    return isfinite(t) ? t : 0.0f;
}

/* The scalar state of one row's root search (solvers.newton_sigmoid_root): the bracket [lo, hi] of the root,
 * tau and f(tau) = sum_i A_i - k, the slope sum_i A_i (1 - A_i) there, the second start's offset shift, and
 * what the row's size decides (complement: f from the unselected side, whose mass is unselected = n_valid - k). */
typedef struct {
    float tau, lo, hi, shift;
    double f, slope, scale, log_k, unselected;
    int k, log_step, complement;
} root_state;

/* f from the sums of sigmoid_sums (the selected or, with complement, the unselected side) */
static inline double root_f(int complement, int k, double unselected, double side) {
    return complement ? unselected - side : side - k;
}

/* Starts the search of a row with n_valid > k valid elements (solvers.unsorted_start) from its largest valid
 * score top0, its k-th and (k+1)-th largest (above, below), its smallest (lowest) and its normalisation
 * (centre, eps, bound): the bracket is [u_min + shift, u_max + shift] with shift = log((n-k)/k), steps are
 * taken in log space from the tail when k <= LOG_STEP_FRACTION * n_valid, and the starts are the
 * hard-assignment threshold tau0 (returned) and tau0 + shift. log_k (log_pos(k)), log_kf (logf(k)): the same
 * for every row (computed once by the caller). f and slope are set by root_evaluated. */
static float root_start(root_state *st, int k, double log_k, float log_kf, int64_t n_valid, float top0, float above,
                        float below, float lowest, float centre, float eps, float bound) {
    double scale = (double)(k < n_valid - k ? k : n_valid - k);
    st->scale = scale > 1.0 ? scale : 1.0;
    st->log_step = (double)k <= LOG_STEP_FRACTION * (double)n_valid;
    st->log_k = log_k;
    st->k = k;
    st->complement = 2 * (int64_t)k > n_valid;
    st->unselected = (double)(n_valid - k);
    st->shift = logf((float)(n_valid - k)) - log_kf;
    /* normalisation is monotone: the bracket's ends come from the extreme scores */
    st->lo = normalised(lowest, centre, eps, bound) + st->shift;
    st->hi = normalised(top0, centre, eps, bound) + st->shift;
    return hard_threshold(normalised(above, centre, eps, bound), normalised(below, centre, eps, bound));
}

/* log x for x > 0 in double, in operations gcc vectorises (a libm call stops it from vectorising the lanes'
 * step): x = m 2^e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s) with s = (m - 1) / (m + 1), |s| <= 0.172,
 * by its series to s^19 (truncation below 3e-17 relative). -inf for x < DBL_MIN (log's limit at 0; the step
 * then leaves the bracket and bisects). */
static inline double log_pos(double x) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    int64_t e = (int64_t)(bits >> 52) - 1023;
    bits = (bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL;  /* m in [1, 2) */
    double m;
    memcpy(&m, &bits, sizeof m);
    int big = m > 1.4142135623730951;
    m = big ? 0.5 * m : m;
    double ed = (double)(e + big);
    double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double p = 1.0 / 19.0;
    p = p * s2 + 1.0 / 17.0;
    p = p * s2 + 1.0 / 15.0;
    p = p * s2 + 1.0 / 13.0;
    p = p * s2 + 1.0 / 11.0;
    p = p * s2 + 1.0 / 9.0;
    p = p * s2 + 1.0 / 7.0;
    p = p * s2 + 1.0 / 5.0;
    p = p * s2 + 1.0 / 3.0;
    p = p * s2 + 1.0;
    /* ln 2 split in two so that e * LN2_HI is exact */
    double r = ed * 6.93147180369123816490e-01 + (2.0 * s * p + ed * 1.90821492927058770002e-10);
    return x >= 2.2250738585072014e-308 ? r : -INFINITY;
}

/* The next threshold of a row's search from tau, where f = sum_i A_i - k and slope = sum_i A_i (1 - A_i):
 * f's sign narrows the bracket [lo, hi] (f decreases in tau), then the Newton step (in log space, or plain),
 * or bisection when it leaves the bracket. Scalar and branch-free: the row-by-row solve calls it through
 * root_next, the grouped solve on all its lanes at once. */
static inline float root_step(float tau, double f, double slope, int log_step, int k, double log_k,
                              float *restrict lo, float *restrict hi) {
    float l = (f > 0) & (tau > *lo) ? tau : *lo;  /* the root is above */
    float h = (f < 0) & (tau < *hi) ? tau : *hi;
    *lo = l;
    *hi = h;
    double d = slope > FLT_TINY ? slope : FLT_TINY;
    double mass = f + k;
    double log_newton = (log_pos(mass) - log_k) * mass / d, newton = f / d;
    float step = (float)(tau + (log_step ? log_newton : newton));
    /* (a NaN or infinite step fails the comparisons) */
    return (step > l) & (step < h) ? step : 0.5f * (l + h);
}

static inline float root_next(root_state *st) {
    return root_step(st->tau, st->f, st->slope, st->log_step, st->k, st->log_k, &st->lo, &st->hi);
}

/* Moves to threshold tau, where sigmoid_sums gave side and sum_i A_i (1 - A_i) = slope; returns the relative
 * error |f| / min(k, n_valid - k). */
static inline double root_evaluated(root_state *st, float tau, double side, double slope) {
    st->tau = tau;
    st->f = root_f(st->complement, st->k, st->unselected, side);
    st->slope = slope;
    return fabs(st->f) / st->scale;
}

/* The root of one row whose normalised scores u and weights wv (normalise_row) hold more than k valid
 * elements, from the better of tau0 and tau0 + shift (st and tau0 from root_start); writes the row's output
 * and info. a, trial: scratch of padded(n) floats each. */
static void unsorted_solve_row(const float *u, const float *wv, int64_t n, int k, root_state st, float tau0,
                               double tol, int max_iter, float *a, float *trial, float *out, float *info) {
    int64_t np = padded(n);
    float shift = st.shift;
    double mass, slope, mass2, slope2;
    sigmoid_sums(u, wv, np, tau0, st.complement, a, &mass, &slope);
    sigmoid_sums(u, wv, np, tau0 + shift, st.complement, trial, &mass2, &slope2);
    double err = root_evaluated(&st, tau0, mass, slope);
    if (fabs(root_f(st.complement, k, st.unselected, mass2)) < fabs(st.f)) {
        float *t = a; a = trial; trial = t;
        err = root_evaluated(&st, tau0 + shift, mass2, slope2);
    }
    int it = 0;
    int done = err <= tol;
    while (!done && it < max_iter) {
        float next = root_next(&st);
        sigmoid_sums(u, wv, np, next, st.complement, trial, &mass, &slope);
        float *t = a; a = trial; trial = t;  /* every step is taken: its sigmoids are the current ones */
        int stuck = next == st.tau;  /* the step no longer moves tau: the row's rounding floor */
        err = root_evaluated(&st, next, mass, slope);
        it++;
        done = err <= tol || stuck;
    }
    info[0] = (float)it;
    info[1] = (float)err;
    memcpy(out, a, sizeof(float) * n);
}

/* ---- the forwards from the raw scores: what soft_topk.py and backends.Backend.solve prepare with tensor
 * operations for the PyTorch path, done per row (valid: not -inf, and mask true where the caller gives a
 * mask): the checks, the top-(k+1) valid scores, the centre x_(k), the temperature, the normalisation and the
 * start, then the solve. A NaN anywhere in the row, +inf on a valid entry, or an infinite temperature with a
 * range of scores that overflows (kernel_interface.py) sets a flag in *status (BAD_NAN / BAD_INF / BAD_SCALE) and leaves
 * the row unsolved: the caller raises. */
#define TOP_ON_STACK 64
#define SHORT_ROW 256      /* rows up to this length take the branchless top-(k+1) ... */
#define SHORT_ROW_TOP 8    /* ... when k + 1 is at most this */

typedef struct {
    const float *x;
    float *eps;  /* read, or written first when paper is set; NULL: every row's temperature is epsilon */
    const uint8_t *mask;
    float bound, *out, *info;
    int64_t n;
    int k, max_iter, max_halvings;
    double tol;
    int *status;
    int64_t first_row;  /* the row-by-row tasks' rows start here (those before go by groups) */
    int paper;  /* the paper scaling's temperature (paper_temperature_of) is computed here, with at and slope */
    float anchor_top, epsilon;  /* (epsilon: the paper scaling's, or with eps NULL the temperature itself) */
    int64_t *at;
    float *slope;
} forward_args;

/* Row r's temperature: the given (or the paper scaling's, once computed) eps[r], or the constant epsilon. */
static inline float row_eps(const forward_args *a, int64_t r) { return a->eps ? a->eps[r] : a->epsilon; }

/* Sets CAPPED in *status when a solved row stopped at max_iter above tol (what soft_topk warns about; tol = 0 asks
 * for exactly max_iter iterations), from its info (iterations, error; compared in float32, as the caller does). */
static inline void note_capped(const forward_args *a, const float *info) {
    if (a->tol > 0.0 && info[0] >= (float)a->max_iter && info[1] > (float)a->tol) {
#pragma omp atomic update
        *a->status |= CAPPED;
    }
}

/* scan_row's long rows, SCAN_CHUNK elements at a time: the counts, the smallest score and the bad-score bits in one
 * vector pass over the chunk, which also tells whether any of its scores beats the current kk-th largest; only
 * then are the chunk's scores inserted one by one (after the row's first few chunks, rarely). Inlined and called
 * with mask NULL or not, so that the unmasked copy's loop is compiled without the NULL test (gcc does not
 * vectorise it). */
#define SCAN_CHUNK 64
static inline __attribute__((always_inline)) int scan_long_row(const float *restrict x, const uint8_t *restrict mask,
                                                                int64_t n, int kk, float *top, int64_t *n_valid_out,
                                                                float *lowest_out) {
    int64_t n_valid = 0;
    float lowest = INFINITY;
    int bad = 0;
    for (int64_t start = 0; start < n; start += SCAN_CHUNK) {
        int64_t end = n - start < SCAN_CHUNK ? n : start + SCAN_CHUNK;
        float threshold = top[kk - 1];
        int any_above = 0, count = 0;
        float low = INFINITY;
#pragma omp simd reduction(| : bad, any_above) reduction(+ : count) reduction(min : low)
        for (int64_t j = start; j < end; j++) {
            float v = x[j];
            int keep = (mask == NULL || mask[j]) && v > -INFINITY;  /* (false for NaN too) */
            bad |= (v != v) ? BAD_NAN : 0;
            bad |= (keep && v == INFINITY) ? BAD_INF : 0;
            count += keep;
            low = keep && v < low ? v : low;
            any_above |= keep && v > threshold;
        }
        n_valid += count;
        lowest = low < lowest ? low : lowest;
        if (!any_above) continue;
        for (int64_t j = start; j < end; j++) {
            float v = x[j];
            if (!((mask == NULL || mask[j]) && v > top[kk - 1])) continue;  /* (NaN and -inf fail it) */
            int q = kk - 1;
            while (q > 0 && v > top[q - 1]) { top[q] = top[q - 1]; q--; }
            top[q] = v;
        }
    }
    *n_valid_out = n_valid;
    *lowest_out = lowest;
    return bad;
}

/* One pass over a row: its kk largest valid scores in top (decreasing, -inf past the valid ones), its number of
 * valid scores and its smallest; returns the status bits (BAD_NAN, BAD_INF). */
static int scan_row(const float *x, const uint8_t *mask, int64_t n, int kk, float *top, int64_t *n_valid_out,
                    float *lowest_out) {
    for (int q = 0; q < kk; q++) top[q] = -INFINITY;
    int64_t n_valid = 0;
    float lowest = INFINITY;  /* the smallest valid score (the largest is top[0]) */
    int bad = 0;
    if (n <= SHORT_ROW && kk <= SHORT_ROW_TOP) {
        /* Short rows: most elements enter the top, so an insertion's branches mispredict. Instead every
         * element goes into a fixed-width descending array in one vector step: new_q = max(top_q,
         * min(v, top_{q-1})) (top_{-1} = +inf) keeps the larger entries, puts v in its place and shifts
         * the smaller ones down. */
        float tw[SHORT_ROW_TOP];
        for (int q = 0; q < SHORT_ROW_TOP; q++) tw[q] = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            float v = x[j];
            int keep = (mask == NULL || mask[j]) && v > -INFINITY;  /* (false for NaN too) */
            bad |= isnan(v) ? BAD_NAN : 0;
            bad |= (keep && v == INFINITY) ? BAD_INF : 0;
            n_valid += keep;
            lowest = keep && v < lowest ? v : lowest;
            float carry = keep ? v : -INFINITY, next[SHORT_ROW_TOP];
#pragma GCC unroll 16
            for (int q = 0; q < SHORT_ROW_TOP; q++) {  /* from the old entries only: stays in registers */
                float up = q > 0 ? tw[q - 1] : INFINITY;
                float m = carry < up ? carry : up;
                next[q] = tw[q] > m ? tw[q] : m;
            }
#pragma GCC unroll 16
            for (int q = 0; q < SHORT_ROW_TOP; q++) tw[q] = next[q];
        }
        memcpy(top, tw, sizeof(float) * kk);
    } else if (mask == NULL) {
        bad = scan_long_row(x, NULL, n, kk, top, &n_valid, &lowest);
    } else {
        bad = scan_long_row(x, mask, n, kk, top, &n_valid, &lowest);
    }
    *n_valid_out = n_valid;
    *lowest_out = lowest;
    return bad;
}

/* The rows' top-(k+1) holds kk = min(k + 1, n) scores. */
static inline int top_count(const forward_args *a) { return a->k + 1 < a->n ? a->k + 1 : (int)a->n; }

/* Scores as uint32 keys in the same order (-0.0 just below +0.0): negative floats' bits all flipped,
 * positive ones' sign bit set; and back. */
static inline uint32_t order_key(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

static inline float key_score(uint32_t key) {
    uint32_t bits = key & 0x80000000u ? key & 0x7fffffffu : ~key;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The k-th and (k+1)-th largest valid scores of a row with more than k >= 1 valid ones (ties counted as in a
 * sorted list), in O(n) for any k where scan_row's insertion into a top-(k+1) costs O(n k) (at k = 500 of
 * 1000, four times the rest of the unsorted forward): radix selection on the order keys, 8 bits a pass from
 * the top, each pass over the keys that still share the k-th's prefix (compacted in place in keys, room for
 * n). The (k+1)-th is the k-th again when it is tied, else the largest key dropped below it: the last pass
 * that dropped any (a later pass's keys share more of the k-th's prefix). */
static void select_kth_pair(const float *x, const uint8_t *mask, int64_t n, int k, uint32_t *keys, float *kth,
                            float *next) {
    int64_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        float v = x[j];
        if ((mask == NULL || mask[j]) && v > -INFINITY) keys[m++] = order_key(v);
    }
    int64_t rank = k, above = 0;  /* the k-th is the rank-th largest key left; above: keys dropped above it */
    uint32_t below = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        int64_t hist[256] = {0};
        for (int64_t i = 0; i < m; i++) hist[(keys[i] >> shift) & 255u]++;
        uint32_t b = 255;
        while (rank > hist[b]) {  /* (ends: the keys left hold at least rank) */
            rank -= hist[b];
            above += hist[b];
            b--;
        }
        int64_t left = 0;
        uint32_t dropped = 0;
        int any_dropped = 0;
        for (int64_t i = 0; i < m; i++) {
            uint32_t key = keys[i], digit = (key >> shift) & 255u;
            if (digit == b) keys[left++] = key;
            any_dropped |= digit < b;
            dropped = digit < b && key > dropped ? key : dropped;
        }
        below = any_dropped ? dropped : below;
        m = left;
    }
    *kth = key_score(keys[0]);
    *next = above + m > k ? *kth : key_score(below);  /* above + m keys are >= the k-th */
}

/* An infinite (or NaN) temperature normalises every score to 0 -- the eps -> inf limit -- except where the
 * row's range hi - lo overflows too: inf / inf (kernel_interface.py's BAD_SCALE). */
static inline int overflowing_scale(float eps, float hi, float lo) { return !(eps < INFINITY) && hi - lo == INFINITY; }

/* A row's preparation shared by both forwards: scan_row into top (kk = min(k + 1, n) entries; with keys, the
 * unsorted forward's scratch of n, only the largest, and the k-th and (k+1)-th by select_kth_pair), then,
 * unless the row is bad (its bits go to *status: returns 0), its temperature (the paper scaling's when
 * a->paper), the k-th and (k+1)-th largest valid scores (pair, when more than k are valid) and its centre x_(k)
 * (the smallest valid score when fewer than k are valid; 0 when none). Returns 1 when the row is to be
 * solved. */
static int prepare_row(const forward_args *a, int64_t r, float *top, uint32_t *keys, int64_t *n_valid,
                       float *lowest, float pair[2], float *centre) {
    int64_t n = a->n;
    int k = a->k;
    const float *x = a->x + r * n;
    const uint8_t *mask = a->mask ? a->mask + r * n : NULL;
    int bad = scan_row(x, mask, n, keys ? 1 : top_count(a), top, n_valid, lowest);
    if (bad) {
#pragma omp atomic update
        *a->status |= bad;
        return 0;
    }
    if (*n_valid > k) {
        if (keys) {
            select_kth_pair(x, mask, n, k, keys, &pair[0], &pair[1]);
        } else {
            pair[0] = top[k - 1];
            pair[1] = top[k];
        }
    }
    /* (with n_valid <= k valid scores the k-th largest would be the smallest, top[n_valid - 1]) */
    *centre = *n_valid > k ? pair[0] : (*n_valid > 0 ? *lowest : 0.0f);
    if (a->paper) {
        float hi, lo;
        int64_t hi_at, lo_at;
        row_extremes(x, mask, n, &hi, &lo, &hi_at, &lo_at);
        paper_temperature_of(hi, lo, hi_at, lo_at, a->anchor_top, a->epsilon, a->eps + r, a->at + r, a->slope + r);
    }
    if (overflowing_scale(row_eps(a, r), top[0], *lowest)) {
#pragma omp atomic update
        *a->status |= BAD_SCALE;
        return 0;
    }
    return 1;
}

/* top: room for kk = min(k + 1, n) floats, on the stack when they fit; NULL (with *status's out-of-memory bit
 * set) when they do not fit and malloc fails. */
static float *top_buffer(const forward_args *a, float *stack) {
    int kk = top_count(a);
    float *top = kk <= TOP_ON_STACK ? stack : malloc(sizeof(float) * kk);
    if (!top) {
#pragma omp atomic update
        *a->status |= OUT_OF_MEMORY;
    }
    return top;
}

static void unsorted_forward_task(int64_t r, workspace *w, const void *ctx) {
    const forward_args *a = ctx;
    r += a->first_row;
    int64_t n = a->n, n_valid;
    int k = a->k;
    float *out = a->out + r * n, *info = a->info + 2 * r;
    float top[TOP_ON_STACK], lowest, centre, pair[2];
    /* the k-th and (k+1)-th by selection when the top-(k+1) would not fit on the stack (a0: scratch until the
     * solve) */
    uint32_t *keys = top_count(a) > TOP_ON_STACK ? (uint32_t *)w->a0 : NULL;
    if (prepare_row(a, r, top, keys, &n_valid, &lowest, pair, &centre)) {
        float eps = row_eps(a, r), bound = a->bound;
        normalise_row(a->x + r * n, a->mask ? a->mask + r * n : NULL, n, centre, eps, bound, w->u, w->wv);
        if (n_valid <= k) {  /* nothing to select: every valid element is in */
            for (int64_t j = 0; j < n; j++) out[j] = w->wv[j];
            info[0] = 0.0f;
            info[1] = 0.0f;
        } else {
            root_state st;
            float tau0 = root_start(&st, k, log_pos(k), logf((float)k), n_valid, top[0], pair[0], pair[1], lowest,
                                    centre, eps, bound);
            unsorted_solve_row(w->u, w->wv, n, k, st, tau0, a->tol, a->max_iter, w->a0, w->a1, out, info);
            note_capped(a, info);
        }
    }
}

/* The sorted operator's start of row r from its raw scores: after prepare_row, the k + 1 anchor masses c
 * (solvers.anchor_targets: ranks 0..k-1 hold 1 each while there are valid entries for them, the rest anchor
 * the other n_valid - k), the hard-assignment thresholds between consecutive active anchors
 * (solvers.initial_thresholds) and the second start's shift (solvers.log_mass_shift: only the rest anchor's
 * mass differs from 1), stored shifted: tz0[l] = t_{l-1}. Returns the number of active anchors, or -1 when the
 * row is not to be solved (prepare_row refused it). */
static int sorted_row_start(const forward_args *a, int64_t r, float *top, int64_t *n_valid, float *centre,
                            float *tz0, float *shift, float *c) {
    int k = a->k, mp = k + 1;
    float lowest, pair[2];
    if (!prepare_row(a, r, top, NULL, n_valid, &lowest, pair, centre)) return -1;
    float eps = row_eps(a, r), bound = a->bound;
    int ma = (int)(*n_valid < k ? *n_valid : k) + (*n_valid > k);
    for (int l = 0; l < mp; l++) {
        c[l] = l < k ? (float)(l < *n_valid) : (*n_valid > k ? (float)(*n_valid - k) : 0.0f);
        tz0[l] = l >= 1 && l < ma ? hard_threshold(normalised(top[l - 1], *centre, eps, bound),
                                                   normalised(top[l], *centre, eps, bound)) : 0.0f;
        shift[l] = l == k && *n_valid > k ? logf((float)(*n_valid - k)) : 0.0f;
    }
    return ma;
}

/* Row r of the sorted operator (sorted_row_start, then forward_row); the rows before first_row go by groups
 * (sorted_group_task). */
static void sorted_forward_task(int64_t r, workspace *w, const void *ctx) {
    const forward_args *a = ctx;
    r += a->first_row;
    int64_t n = a->n, n_valid;
    int k = a->k, mp = k + 1;
    float top_stack[TOP_ON_STACK], centre;
    float *top = top_buffer(a, top_stack);
    if (!top) return;
    float *tz0 = w->tz + 3 * mp, *shift = tz0 + mp, *c = shift + mp;
    int ma = sorted_row_start(a, r, top, &n_valid, &centre, tz0, shift, c);
    if (ma >= 0) {
        forward_row(a->x + r * n, a->mask ? a->mask + r * n : NULL, n, centre, row_eps(a, r), a->bound, k, tz0,
                    shift, c, ma, mp, a->tol, a->max_iter, a->max_halvings, a->out + r * n * k, a->info + 2 * r, w);
        note_capped(a, a->info + 2 * r);
    }
    if (top != top_stack) free(top);
}

/* ---- many short rows: GROUP rows at a time, one per SIMD lane --------------------------------------------
 * Attention rows are short (tens of keys) and many: solved one by one, each Newton evaluation is two vectors
 * of work plus a reduction across lanes, and the row's scalar logic does not overlap with anything. Here the
 * GROUP rows' scores are laid out transposed (element j of every row in one vector), so every pass -- the
 * top-(k+1), the normalisation, each evaluation -- runs across the rows with no reduction, and the rows'
 * searches advance together (a converged row keeps its state while the others go on). Same start, steps,
 * stopping rule and outputs as unsorted_forward_task / unsorted_solve_row, row by row. */
#define GROUP 16
#define GROUP_ROW 64  /* rows up to this long, with k + 1 <= SHORT_ROW_TOP, go by groups */

/* sigmoid_sums of every lane at its threshold tau[l] (the unselected side where complement[l]), A in a
 * (transposed: a[j * GROUP + l]) on the lanes where take[l] is nonzero (the others' entries of a are left as
 * they are). */
static void group_sigmoid_sums(const float *restrict ut, const float *restrict wt, int64_t n, const float *tau,
                               const int *complement, const int *take, float *restrict a, double *restrict mass,
                               double *restrict slope) {
    double m[GROUP], sl[GROUP];
    for (int l = 0; l < GROUP; l++) { m[l] = 0.0; sl[l] = 0.0; }
    for (int64_t j = 0; j < n; j++) {
#pragma omp simd
        for (int l = 0; l < GROUP; l++) {
            float sq, cq;
            sigmoid_pair(ut[j * GROUP + l] - tau[l], &sq, &cq);
            float aq = sq * wt[j * GROUP + l];
            a[j * GROUP + l] = take[l] ? aq : a[j * GROUP + l];
            m[l] += (complement[l] ? cq : sq) * wt[j * GROUP + l];
            sl[l] += aq * (1.0f - aq);
        }
    }
    for (int l = 0; l < GROUP; l++) { mass[l] = m[l]; slope[l] = sl[l]; }
}

static void unsorted_group_task(int64_t g, workspace *w, const void *ctx) {
    (void)w;
    const forward_args *a = ctx;
    int64_t n = a->n, r0 = g * GROUP;
    int k = a->k;
    float ut[GROUP_ROW * GROUP], wt[GROUP_ROW * GROUP], cur[GROUP_ROW * GROUP], trial[GROUP_ROW * GROUP];
    float tw[SHORT_ROW_TOP][GROUP], lowest[GROUP], n_valid[GROUP];
    int bad = 0, hi_at[GROUP], lo_at[GROUP];
    /* the scores transposed (raw, in ut for now), which of them are valid, the top-(k+1) of each row (as in
     * unsorted_forward_task's short rows), its smallest valid score and where its extremes first occur */
    for (int q = 0; q < SHORT_ROW_TOP; q++)
        for (int l = 0; l < GROUP; l++) tw[q][l] = -INFINITY;
    for (int l = 0; l < GROUP; l++) { lowest[l] = INFINITY; n_valid[l] = 0.0f; hi_at[l] = 0; lo_at[l] = 0; }
    for (int l = 0; l < GROUP; l++) {  /* row by row: contiguous reads */
        const float *x = a->x + (r0 + l) * n;
        const uint8_t *mask = a->mask ? a->mask + (r0 + l) * n : NULL;
#pragma omp simd reduction(| : bad)
        for (int64_t j = 0; j < n; j++) {
            float v = x[j];
            int keep = (mask == NULL || mask[j]) && v > -INFINITY;
            bad |= (v != v) ? BAD_NAN : 0;
            bad |= (keep && v == INFINITY) ? BAD_INF : 0;
            ut[j * GROUP + l] = v;
            wt[j * GROUP + l] = keep ? 1.0f : 0.0f;
        }
    }
    for (int64_t j = 0; j < n; j++) {
#pragma omp simd
        for (int l = 0; l < GROUP; l++) {
            float v = ut[j * GROUP + l];
            int keep = wt[j * GROUP + l] > 0.0f;
            n_valid[l] += keep ? 1.0f : 0.0f;
            hi_at[l] = keep && v > tw[0][l] ? (int)j : hi_at[l];
            lo_at[l] = keep && v < lowest[l] ? (int)j : lo_at[l];
            lowest[l] = keep && v < lowest[l] ? v : lowest[l];
            float carry = keep ? v : -INFINITY, up = INFINITY;
#pragma GCC unroll 16
            for (int q = 0; q < SHORT_ROW_TOP; q++) {
                float old = tw[q][l];
                float m = carry < up ? carry : up;
                tw[q][l] = old > m ? old : m;
                up = old;
            }
        }
    }
    if (bad) {
#pragma omp atomic update
        *a->status |= bad;
        return;
    }
    /* per row: the centre, the normalised scores, and where its search starts */
    float centre[GROUP], eps[GROUP], tau[GROUP];
    root_state st[GROUP];
    int active[GROUP], it = 0;
    double err[GROUP], mass[GROUP], slope[GROUP], mass2[GROUP], slope2[GROUP];
    for (int l = 0; l < GROUP; l++) {
        int64_t nv = (int64_t)n_valid[l];
        int64_t kth = (nv < k ? nv : k) - 1;
        centre[l] = kth >= 0 ? tw[kth][l] : 0.0f;
        if (a->paper)
            paper_temperature_of(tw[0][l], lowest[l], hi_at[l], lo_at[l], a->anchor_top, a->epsilon, a->eps + r0 + l,
                                 a->at + r0 + l, a->slope + r0 + l);
        eps[l] = row_eps(a, r0 + l);
        active[l] = nv > k;
        if (overflowing_scale(eps[l], tw[0][l], lowest[l])) bad = BAD_SCALE;
    }
    if (bad) {  /* (the whole group is left unsolved: the caller raises) */
#pragma omp atomic update
        *a->status |= bad;
        return;
    }
    float bound = a->bound, log_kf = logf((float)k);
    double log_k = log_pos(k);
    for (int64_t j = 0; j < n; j++) {
#pragma omp simd
        for (int l = 0; l < GROUP; l++) {
            float v = normalised(ut[j * GROUP + l], centre[l], eps[l], bound);
            ut[j * GROUP + l] = wt[j * GROUP + l] > 0.0f ? v : 0.0f;
        }
    }
    for (int l = 0; l < GROUP; l++) {
        err[l] = 0.0;
        if (!active[l]) {  /* nothing to select: a state that no step reads */
            st[l] = (root_state){.scale = 1.0, .log_k = log_k, .k = k};
            tau[l] = 0.0f;
            continue;
        }
        tau[l] = root_start(&st[l], k, log_k, log_kf, (int64_t)n_valid[l], tw[0][l], tw[k - 1][l], tw[k][l],
                            lowest[l], centre[l], eps[l], bound);
    }
    /* the better of the two starts */
    int all[GROUP], complement[GROUP];
    double unselected[GROUP];
    for (int l = 0; l < GROUP; l++) {
        all[l] = 1;
        complement[l] = st[l].complement;
        unselected[l] = st[l].unselected;
    }
    group_sigmoid_sums(ut, wt, n, tau, complement, all, cur, mass, slope);
    float tau2[GROUP];
    for (int l = 0; l < GROUP; l++) tau2[l] = tau[l] + st[l].shift;
    group_sigmoid_sums(ut, wt, n, tau2, complement, all, trial, mass2, slope2);
    int second[GROUP];
    for (int l = 0; l < GROUP; l++) {
        second[l] = 0;
        if (!active[l]) continue;
        err[l] = root_evaluated(&st[l], tau[l], mass[l], slope[l]);
        if (fabs(root_f(complement[l], k, unselected[l], mass2[l])) < fabs(st[l].f)) {
            err[l] = root_evaluated(&st[l], tau2[l], mass2[l], slope2[l]);
            second[l] = 1;
        }
        active[l] = err[l] > a->tol;
    }
    for (int64_t j = 0; j < n; j++) {
#pragma omp simd
        for (int l = 0; l < GROUP; l++) cur[j * GROUP + l] = second[l] ? trial[j * GROUP + l] : cur[j * GROUP + l];
    }
    /* Newton steps, while any row is unconverged, every lane's step at once (root_step, on the lanes' state
     * laid out by field); a row that stopped keeps its threshold and state */
    float lo[GROUP], hi[GROUP], at[GROUP];
    double f[GROUP], sl[GROUP], scale[GROUP];
    int log_step[GROUP], iters[GROUP], any = 0;
    for (int l = 0; l < GROUP; l++) {
        lo[l] = st[l].lo;
        hi[l] = st[l].hi;
        at[l] = st[l].tau;
        f[l] = st[l].f;
        sl[l] = st[l].slope;
        scale[l] = st[l].scale;
        log_step[l] = st[l].log_step;
        iters[l] = 0;
        any |= active[l];
    }
    while (any && it < a->max_iter) {
#pragma omp simd
        for (int l = 0; l < GROUP; l++) {
            float next = root_step(at[l], f[l], sl[l], log_step[l], k, log_k, &lo[l], &hi[l]);
            tau[l] = active[l] ? next : at[l];
        }
        /* a stopped row keeps its sigmoids */
        group_sigmoid_sums(ut, wt, n, tau, complement, active, cur, mass, slope);
        it++;
        any = 0;
#pragma omp simd reduction(| : any)
        for (int l = 0; l < GROUP; l++) {  /* root_evaluated, on the active lanes */
            int on = active[l];
            int stuck = tau[l] == at[l];  /* the row's rounding floor (as in unsorted_solve_row) */
            double fl = root_f(complement[l], k, unselected[l], mass[l]), el = fabs(fl) / scale[l];
            at[l] = tau[l];
            f[l] = on ? fl : f[l];
            sl[l] = on ? slope[l] : sl[l];
            err[l] = on ? el : err[l];
            iters[l] = on ? it : iters[l];
            active[l] = on && !(el <= a->tol || stuck);
            any |= active[l];
        }
    }
    /* outputs: the current sigmoids, or 1 on the valid elements of a row with nothing to select */
    for (int l = 0; l < GROUP; l++) {
        float *out = a->out + (r0 + l) * n, *info = a->info + 2 * (r0 + l);
        int solved = (int64_t)n_valid[l] > k;
        for (int64_t j = 0; j < n; j++) out[j] = solved ? cur[j * GROUP + l] : wt[j * GROUP + l];
        info[0] = solved ? (float)iters[l] : 0.0f;
        info[1] = solved ? (float)err[l] : 0.0f;
        if (solved) note_capped(a, info);
    }
}

/* Returns 0, or the bits of soft_topk_sorted_forward. at and slope NULL: eps (rows,) is the given temperature (or,
 * eps NULL, epsilon for every row); else the paper scaling's (soft_topk_paper_temperature, with anchor_top and
 * epsilon) is computed on the way and written to eps, at and slope. */
int soft_topk_unsorted_forward(const float *x, const uint8_t *mask, float *eps, float bound, float *out,
                               float *info, int64_t rows, int64_t n, int k, double tol, int max_iter,
                               float anchor_top, float epsilon, int64_t *at, float *slope, int threads) {
    int status = 0;
    int kk = k + 1 < n ? k + 1 : (int)n;
    int64_t groups = (n <= GROUP_ROW && kk <= SHORT_ROW_TOP) ? rows / GROUP : 0;
    forward_args a = {x, eps, mask, bound, out, info, n, k, max_iter, 0, tol, &status, groups * GROUP,
                      at != NULL && slope != NULL, anchor_top, epsilon, at, slope};
    if (groups > 0) status |= parallel_rows(groups, GROUP, n, 2, threads, unsorted_group_task, &a);
    if (rows > groups * GROUP)
        status |= parallel_rows(rows - groups * GROUP, 1, n, 2, threads, unsorted_forward_task, &a);
    return status;
}

/* ---- the sorted operator on many short rows: GROUP rows at a time ---------------------------------------
 * At attention's shapes (tens of keys, thousands of rows) forward_row's time goes to scalar work: each
 * evaluation's (k + 1)(k + 4) / 2 sums across PAD lanes, and the Newton system's elimination, whose divisions
 * wait on one another. Here GROUP rows' scores lie transposed, as in the unsorted grouped solve: the plan is
 * computed element by element across the rows (plan_block's arithmetic, so the same plan), its sums accumulate
 * per row with no reduction across lanes, and the GROUP Newton systems are eliminated at once (solve_free's
 * steps, each row with its own pivots). The searches advance together: each row keeps forward_row's start,
 * second start, steps, halvings and stopping rule, and stops on its own. The sums are added in another order
 * than forward_row's (SORTED_GROUP_CHUNK elements in float, then in double), so a row's result agrees with its
 * row-by-row solve to the solver's tolerance, not bit for bit. Rows with at most k valid scores (fewer active
 * anchors) go row by row. */
#define SORTED_GROUP_ANCHORS 8  /* rows up to GROUP_ROW long with k + 1 at most this go by groups */
#define SORTED_GROUP_CHUNK 8
#define SORTED_GROUP_PAIRS (SORTED_GROUP_ANCHORS * (SORTED_GROUP_ANCHORS - 1) / 2)  /* (the free anchors') */

/* Column j of every lane's plan at thresholds tz (plan_block's arithmetic, element by element): p[l][lane] for
 * the ma anchors. */
static inline void group_plan_column(const float *restrict u, const float *restrict wv, float tz[][GROUP], int ma,
                                     float p[][GROUP]) {
    float zmax[GROUP], inv[GROUP];
#pragma omp simd
    for (int q = 0; q < GROUP; q++) { p[0][q] = 0.0f; zmax[q] = 0.0f; inv[q] = 0.0f; }
    for (int l = 1; l < ma; l++) {
#pragma omp simd
        for (int q = 0; q < GROUP; q++) {
            float d = tz[l][q] - u[q];
            d = d < -LOGIT_CLAMP_F ? -LOGIT_CLAMP_F : (d > LOGIT_CLAMP_F ? LOGIT_CLAMP_F : d);
            p[l][q] = p[l - 1][q] + d;
            zmax[q] = p[l][q] > zmax[q] ? p[l][q] : zmax[q];
        }
    }
    for (int l = 0; l < ma; l++) {
#pragma omp simd
        for (int q = 0; q < GROUP; q++) {
            p[l][q] = exp_nonpos(p[l][q] - zmax[q]);
            inv[q] += p[l][q];
        }
    }
#pragma omp simd
    for (int q = 0; q < GROUP; q++) inv[q] = wv[q] / inv[q];
    for (int l = 0; l < ma; l++) {
#pragma omp simd
        for (int q = 0; q < GROUP; q++) p[l][q] *= inv[q];
    }
}

/* evaluate for every lane: anchor masses s[l][lane], P^T P (upper triangle of the first ma - 1 anchors, as
 * accumulate, ppt[a * mp + b][lane]) and the max relative marginal error err[lane] at thresholds tz, from the
 * transposed scores ut and weights wt. */
static void group_evaluate(const float *restrict ut, const float *restrict wt, int64_t n, float tz[][GROUP],
                           int ma, int mp, float c[][GROUP], double s[][GROUP], double ppt[][GROUP],
                           double *err) {
    float p[SORTED_GROUP_ANCHORS][GROUP], fs[SORTED_GROUP_ANCHORS][GROUP], fp[SORTED_GROUP_PAIRS][GROUP];
    for (int l = 0; l < mp; l++)
        for (int q = 0; q < GROUP; q++) s[l][q] = 0.0;
    for (int l = 0; l < mp * mp; l++)
        for (int q = 0; q < GROUP; q++) ppt[l][q] = 0.0;
    memset(fs, 0, sizeof fs);
    memset(fp, 0, sizeof fp);
    for (int64_t start = 0; start < n; start += SORTED_GROUP_CHUNK) {
        int64_t end = n - start < SORTED_GROUP_CHUNK ? n : start + SORTED_GROUP_CHUNK;
        for (int64_t j = start; j < end; j++) {
            group_plan_column(ut + j * GROUP, wt + j * GROUP, tz, ma, p);
            for (int x = 0, pair = 0; x < ma; x++) {
#pragma omp simd
                for (int q = 0; q < GROUP; q++) fs[x][q] += p[x][q];
                for (int y = x; y < ma - 1; y++, pair++) {
#pragma omp simd
                    for (int q = 0; q < GROUP; q++) fp[pair][q] += p[x][q] * p[y][q];
                }
            }
        }
        for (int x = 0, pair = 0; x < ma; x++) {  /* the chunk's float sums into double */
#pragma omp simd
            for (int q = 0; q < GROUP; q++) { s[x][q] += fs[x][q]; fs[x][q] = 0.0f; }
            for (int y = x; y < ma - 1; y++, pair++) {
#pragma omp simd
                for (int q = 0; q < GROUP; q++) { ppt[x * mp + y][q] += fp[pair][q]; fp[pair][q] = 0.0f; }
            }
        }
    }
    for (int q = 0; q < GROUP; q++) {
        double e = 0.0;
        for (int l = 0; l < ma; l++) {
            double d = marginal_error(s[l][q], c[l][q]);
            e = d > e ? d : e;
        }
        err[q] = e;
    }
}

/* solve_free for every lane: (diag(s) - P^T P + ridge) x = rhs on the free anchors 0..ma-2, the same
 * elimination with each lane's own pivots; x = 0 on a lane whose system is singular or whose solution is not
 * finite, and past the free anchors. */
static void group_solve(double s[][GROUP], double ppt[][GROUP], double rhs[][GROUP], int ma, int mp,
                        double x[][GROUP]) {
    enum { F = SORTED_GROUP_ANCHORS - 1 };
    int f = ma - 1;
    double a[F][F][GROUP], scale[GROUP];
    int singular[GROUP];
    for (int l = 0; l < mp; l++)
        for (int q = 0; q < GROUP; q++) x[l][q] = 0.0;
    if (f <= 0) return;
    for (int q = 0; q < GROUP; q++) {
        scale[q] = 1.0;
        singular[q] = 0;
    }
    for (int l = 0; l < f; l++)
        for (int q = 0; q < GROUP; q++) scale[q] = s[l][q] > scale[q] ? s[l][q] : scale[q];
    for (int r = 0; r < f; r++) {
        for (int col = 0; col < f; col++) {
            const double *pq = r <= col ? ppt[r * mp + col] : ppt[col * mp + r];
#pragma omp simd
            for (int q = 0; q < GROUP; q++)
                a[r][col][q] = (r == col ? s[r][q] + RIDGE_ULPS * FLT_EPS * scale[q] : 0.0) - pq[q];
        }
        for (int q = 0; q < GROUP; q++) x[r][q] = rhs[r][q];
    }
    for (int col = 0; col < f; col++) {  /* Gaussian elimination with partial pivoting, per lane */
        double piv[GROUP], best[GROUP], m[GROUP];  /* (the pivot's row as a double: one vector type) */
#pragma omp simd
        for (int q = 0; q < GROUP; q++) { piv[q] = col; best[q] = fabs(a[col][col][q]); }
        for (int r = col + 1; r < f; r++) {
#pragma omp simd
            for (int q = 0; q < GROUP; q++) {
                double v = fabs(a[r][col][q]);
                piv[q] = v > best[q] ? r : piv[q];
                best[q] = v > best[q] ? v : best[q];
            }
        }
        for (int q = 0; q < GROUP; q++) singular[q] |= !(best[q] > 0.0);
        for (int r = col + 1; r < f; r++) {  /* row col <-> row piv, where piv is r */
            for (int c2 = 0; c2 < f; c2++) {
#pragma omp simd
                for (int q = 0; q < GROUP; q++) {
                    double top = a[col][c2][q], other = a[r][c2][q];
                    a[col][c2][q] = piv[q] == r ? other : top;
                    a[r][c2][q] = piv[q] == r ? top : other;
                }
            }
#pragma omp simd
            for (int q = 0; q < GROUP; q++) {
                double top = x[col][q], other = x[r][q];
                x[col][q] = piv[q] == r ? other : top;
                x[r][q] = piv[q] == r ? top : other;
            }
        }
        for (int r = col + 1; r < f; r++) {
#pragma omp simd
            for (int q = 0; q < GROUP; q++) m[q] = a[r][col][q] / a[col][col][q];
            for (int c2 = col; c2 < f; c2++) {
#pragma omp simd
                for (int q = 0; q < GROUP; q++) a[r][c2][q] -= m[q] * a[col][c2][q];
            }
#pragma omp simd
            for (int q = 0; q < GROUP; q++) x[r][q] -= m[q] * x[col][q];
        }
    }
    for (int r = f - 1; r >= 0; r--) {
        for (int c2 = r + 1; c2 < f; c2++) {
#pragma omp simd
            for (int q = 0; q < GROUP; q++) x[r][q] -= a[r][c2][q] * x[c2][q];
        }
#pragma omp simd
        for (int q = 0; q < GROUP; q++) x[r][q] /= a[r][r][q];
    }
    for (int l = 0; l < f; l++)
        for (int q = 0; q < GROUP; q++) singular[q] |= !isfinite(x[l][q]);
    for (int l = 0; l < mp; l++) {
#pragma omp simd
        for (int q = 0; q < GROUP; q++) x[l][q] = singular[q] ? 0.0 : x[l][q];
    }
}

/* The lanes where take[lane] move to their trial point: thresholds, masses, P^T P and error. */
static void group_take(const int *take, int mp, float tz[][GROUP], float tz_t[][GROUP], double s[][GROUP],
                       double s_t[][GROUP], double ppt[][GROUP], double ppt_t[][GROUP], double *err,
                       const double *err_t) {
    for (int l = 0; l < mp; l++) {
#pragma omp simd
        for (int q = 0; q < GROUP; q++) {
            tz[l][q] = take[q] ? tz_t[l][q] : tz[l][q];
            s[l][q] = take[q] ? s_t[l][q] : s[l][q];
        }
    }
    for (int l = 0; l < mp * mp; l++) {
#pragma omp simd
        for (int q = 0; q < GROUP; q++) ppt[l][q] = take[q] ? ppt_t[l][q] : ppt[l][q];
    }
#pragma omp simd
    for (int q = 0; q < GROUP; q++) err[q] = take[q] ? err_t[q] : err[q];
}

/* GROUP rows of the sorted operator from row g * GROUP (forward_row's search on every lane at once). */
static void sorted_group_task(int64_t g, workspace *w, const void *ctx) {
    const forward_args *a = ctx;
    int64_t n = a->n, r0 = g * GROUP;
    int k = a->k, mp = k + 1;
    float ut[GROUP_ROW * GROUP], wt[GROUP_ROW * GROUP];
    float tz[SORTED_GROUP_ANCHORS][GROUP], tz_t[SORTED_GROUP_ANCHORS][GROUP], dtz[SORTED_GROUP_ANCHORS][GROUP];
    float shift[SORTED_GROUP_ANCHORS][GROUP], c[SORTED_GROUP_ANCHORS][GROUP];
    float plan[GROUP_ROW * SORTED_GROUP_ANCHORS][GROUP];
    double s[SORTED_GROUP_ANCHORS][GROUP], s_t[SORTED_GROUP_ANCHORS][GROUP];
    double rhs[SORTED_GROUP_ANCHORS][GROUP], dh[SORTED_GROUP_ANCHORS][GROUP];
    double ppt[SORTED_GROUP_ANCHORS * SORTED_GROUP_ANCHORS][GROUP];
    double ppt_t[SORTED_GROUP_ANCHORS * SORTED_GROUP_ANCHORS][GROUP];
    double err[GROUP], err_t[GROUP], alpha[GROUP];
    int in[GROUP], take[GROUP], active[GROUP], searching[GROUP], accepted[GROUP], tries[GROUP], it[GROUP];
    int any = 0;
    /* each row's start (sorted_row_start), its normalised scores transposed into the lanes */
    for (int q = 0; q < GROUP; q++) {
        int64_t r = r0 + q, n_valid;
        float top[TOP_ON_STACK], centre, tz0[SORTED_GROUP_ANCHORS], sh[SORTED_GROUP_ANCHORS];
        float cq[SORTED_GROUP_ANCHORS];
        const uint8_t *valid = a->mask ? a->mask + r * n : NULL;
        int ma = sorted_row_start(a, r, top, &n_valid, &centre, tz0, sh, cq);
        in[q] = ma == mp;
        if (ma >= 0 && ma < mp) {  /* fewer active anchors: row by row */
            forward_row(a->x + r * n, valid, n, centre, row_eps(a, r), a->bound, k, tz0, sh, cq, ma, mp, a->tol,
                        a->max_iter, a->max_halvings, a->out + r * n * k, a->info + 2 * r, w);
            note_capped(a, a->info + 2 * r);
        }
        if (in[q]) {
            normalise_row(a->x + r * n, valid, n, centre, row_eps(a, r), a->bound, w->u, w->wv);
            for (int64_t j = 0; j < n; j++) { ut[j * GROUP + q] = w->u[j]; wt[j * GROUP + q] = w->wv[j]; }
        } else {  /* (weights 0: the lane's sums stay harmless) */
            for (int64_t j = 0; j < n; j++) { ut[j * GROUP + q] = 0.0f; wt[j * GROUP + q] = 0.0f; }
        }
        for (int l = 0; l < mp; l++) {
            tz[l][q] = in[q] ? tz0[l] : 0.0f;
            shift[l][q] = in[q] ? sh[l] : 0.0f;
            c[l][q] = in[q] ? cq[l] : 0.0f;
        }
        any |= in[q];
    }
    if (!any) return;
    group_evaluate(ut, wt, n, tz, mp, mp, c, s, ppt, err);
    /* second starting point (thresholds shifted by log c), kept by the rows it fits better */
    int second = 0;
    for (int q = 0; q < GROUP; q++) second |= in[q] && err[q] > SECOND_START_ERROR;
    if (second) {
        for (int l = 0; l < mp; l++)
            for (int q = 0; q < GROUP; q++) tz_t[l][q] = tz[l][q] + shift[l][q];
        group_evaluate(ut, wt, n, tz_t, mp, mp, c, s_t, ppt_t, err_t);
        for (int q = 0; q < GROUP; q++) take[q] = in[q] && err[q] > SECOND_START_ERROR && err_t[q] < err[q];
        group_take(take, mp, tz, tz_t, s, s_t, ppt, ppt_t, err, err_t);
    }
    int going = 0;
    for (int q = 0; q < GROUP; q++) {
        it[q] = 0;
        active[q] = in[q] && err[q] > a->tol && a->max_iter > 0;
        going |= active[q];
    }
    while (going) {
        for (int l = 0; l < mp; l++)
            for (int q = 0; q < GROUP; q++) rhs[l][q] = c[l][q] - s[l][q];
        group_solve(s, ppt, rhs, mp, mp, dh);
        int trying = 0;
        for (int q = 0; q < GROUP; q++) {
            double big = MAX_STEP;
            for (int l = 0; l < mp; l++) big = fabs(dh[l][q]) > big ? fabs(dh[l][q]) : big;
            alpha[q] = MAX_STEP / big;
            /* a step dh on the potentials moves threshold t_{l-1} = tz[l] by dh_l - dh_{l-1} */
            for (int l = 0; l < mp; l++) dtz[l][q] = l >= 1 ? (float)(dh[l][q] - dh[l - 1][q]) : 0.0f;
            tries[q] = 0;
            accepted[q] = 0;
            searching[q] = active[q] && a->max_halvings > 0;  /* (none allowed: the step is not tried) */
            trying |= active[q];
        }
        while (trying) {
            for (int l = 0; l < mp; l++)
                for (int q = 0; q < GROUP; q++) tz_t[l][q] = tz[l][q] + (float)alpha[q] * dtz[l][q];
            group_evaluate(ut, wt, n, tz_t, mp, mp, c, s_t, ppt_t, err_t);
            trying = 0;
            for (int q = 0; q < GROUP; q++) {
                take[q] = searching[q] && (err_t[q] < err[q] || err_t[q] <= a->tol);
                if (!searching[q]) continue;
                if (take[q]) {
                    accepted[q] = 1;
                    searching[q] = 0;
                } else if (err[q] < NEAR_FLOOR && tries[q] >= 1) {  /* the row's float rounding floor */
                    searching[q] = 0;
                } else {
                    alpha[q] *= 0.5;
                    searching[q] = ++tries[q] < a->max_halvings;
                }
                trying |= searching[q];
            }
            group_take(take, mp, tz, tz_t, s, s_t, ppt, ppt_t, err, err_t);
        }
        going = 0;
        for (int q = 0; q < GROUP; q++) {
            if (!active[q]) continue;
            it[q]++;
            active[q] = accepted[q] && err[q] > a->tol && it[q] < a->max_iter;
            going |= active[q];
        }
    }
    for (int q = 0; q < GROUP; q++) {  /* (rows of row-by-row lanes already have theirs) */
        if (!in[q]) continue;
        float *info = a->info + 2 * (r0 + q);
        info[0] = (float)it[q];
        info[1] = (float)err[q];
        note_capped(a, info);
    }
    /* the plans at the solutions, then each row's output written in one contiguous sweep */
    for (int64_t j = 0; j < n; j++) group_plan_column(ut + j * GROUP, wt + j * GROUP, tz, mp, plan + j * mp);
    for (int q = 0; q < GROUP; q++) {
        if (!in[q]) continue;
        float *o = a->out + (r0 + q) * n * k;
        for (int64_t j = 0; j < n; j++)
            for (int l = 0; l < k; l++) o[j * k + l] = plan[j * mp + l][q];
    }
}

/* The sorted operator's forward (out (rows, n, k)). Returns 0, or bits: OUT_OF_MEMORY (scratch memory could not be
 * allocated), BAD_NAN, BAD_INF, BAD_SCALE (a row refused, left unsolved), CAPPED (a row stopped at max_iter above
 * tol). at and slope NULL: eps (rows,) is the given temperature (or, eps NULL, epsilon for every row); else the
 * paper scaling's (with anchor_top and epsilon) is computed on the way and written to eps, at and slope. */
int soft_topk_sorted_forward(const float *x, const uint8_t *mask, float *eps, float bound, float *out, float *info,
                             int64_t rows, int64_t n, int k, double tol, int max_iter, int max_halvings,
                             float anchor_top, float epsilon, int64_t *at, float *slope, int threads) {
    int status = 0;
    int64_t groups = (n <= GROUP_ROW && k + 1 <= SORTED_GROUP_ANCHORS) ? rows / GROUP : 0;
    forward_args a = {x, eps, mask, bound, out, info, n, k, max_iter, max_halvings, tol, &status, groups * GROUP,
                      at != NULL && slope != NULL, anchor_top, epsilon, at, slope};
    if (groups > 0) status |= parallel_rows(groups, GROUP, n, k + 1, threads, sorted_group_task, &a);
    if (rows > groups * GROUP)
        status |= parallel_rows(rows - groups * GROUP, 1, n, k + 1, threads, sorted_forward_task, &a);
    return status;
}

/* dL/dx = a_i (G_i - sum_j G_j a_j / sum_j a_j) / eps, a = A(1 - A) on the valid elements
 * (implicit_backward.sigmoid_grad): tau's dependence on x gives the second term. With x given, also
 * dL/deps = -sum_i dL/dx_i (x_i - mean x) / eps over the valid elements (implicit_backward.temperature_grad), and
 * with at and slope (the paper scaling: eps depends on x_at only, d eps / d x_at = slope) its share of dL/dx,
 * dL/deps * slope added at at (soft_topk._add_paper_temperature_grad, the slope clamped to the float range). */
typedef struct {
    const float *out, *gout, *eps, *x;
    const uint8_t *mask;
    float *grad, *grad_eps;
    int64_t n;
    float epsilon;  /* every row's temperature when eps is NULL */
    const int64_t *at;
    const float *slope;
} unsorted_backward_args;

/* The sums below run over blocks of BLOCK elements in PAD float lanes (lane_total), the blocks in double; a
 * row's tail (n not a multiple of PAD) goes to lane 0. */

/* grad_i = a_i = out_i (1 - out_i), and sum_i G_i a_i, sum_i a_i. Excluded entries have out = 0 exactly,
 * hence a = 0: no mask needed. */
static void sigmoid_grad_sums(const float *restrict out, const float *restrict g, int64_t n, float *restrict grad,
                              double *num, double *den) {
    *num = 0.0;
    *den = 0.0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t end = n - start < BLOCK ? n : start + BLOCK, j = start;
        float nb[PAD], db[PAD];
        for (int q = 0; q < PAD; q++) { nb[q] = 0.0f; db[q] = 0.0f; }
        for (; j + PAD <= end; j += PAD) {
#pragma omp simd
            for (int q = 0; q < PAD; q++) {
                float aq = out[j + q] * (1.0f - out[j + q]);
                grad[j + q] = aq;
                nb[q] += g[j + q] * aq;
                db[q] += aq;
            }
        }
        for (; j < end; j++) {
            float aq = out[j] * (1.0f - out[j]);
            grad[j] = aq;
            nb[0] += g[j] * aq;
            db[0] += aq;
        }
        *num += lane_total(nb);
        *den += lane_total(db);
    }
}

/* grad_i <- a_i (G_i - mean_g) / eps (a_i in grad), and for dL/deps the valid entries' sum_i grad_i d_i,
 * sum_i grad_i, sum_i d_i and their count, with d_i = x_i - x_ref. Inlined and called with mask NULL or not,
 * so that the unmasked copy's loop is compiled without the NULL test (gcc does not vectorise that test). */
static inline __attribute__((always_inline)) void centred_grad_sums(
        float *restrict grad, const float *restrict g, const float *restrict x, const uint8_t *restrict mask,
        int64_t n, float mean_g, float inv_eps, float x_ref, double *gx, double *gs, double *xs, int64_t *count) {
    double sums[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t full = n / PAD * PAD;
    for (int64_t start = 0; start < full; start += BLOCK) {
        int64_t end = full - start < BLOCK ? full : start + BLOCK;
        float gxb[PAD], gsb[PAD], xsb[PAD], nvb[PAD];
        for (int q = 0; q < PAD; q++) { gxb[q] = 0.0f; gsb[q] = 0.0f; xsb[q] = 0.0f; nvb[q] = 0.0f; }
        for (int64_t j = start; j < end; j += PAD) {
#pragma omp simd
            for (int q = 0; q < PAD; q++) {
                float gq = grad[j + q] * (g[j + q] - mean_g) * inv_eps;
                grad[j + q] = gq;
                /* Arithmetic instead of selects, which gcc does not if-convert here: kw = 1 on the entries that
                 * count, else 0, and d = kw * (x - x_ref) with -inf clamped first (-inf * 0 would be NaN). */
                float kw = (float)(x[j + q] > -INFINITY), shifted = x[j + q] - x_ref;
                if (mask != NULL) kw *= (float)mask[j + q];
                float dq = kw * (shifted > -FLT_MAX_F ? shifted : -FLT_MAX_F);
                gxb[q] += gq * dq;
                gsb[q] += gq * kw;
                xsb[q] += dq;
                nvb[q] += kw;
            }
        }
        sums[0] += lane_total(gxb);
        sums[1] += lane_total(gsb);
        sums[2] += lane_total(xsb);
        sums[3] += lane_total(nvb);
    }
    for (int64_t j = full; j < n; j++) {  /* the row's tail */
        float gq = grad[j] * (g[j] - mean_g) * inv_eps;
        grad[j] = gq;
        if (!valid_at(x, mask, j)) continue;
        sums[0] += (double)gq * (x[j] - x_ref);
        sums[1] += gq;
        sums[2] += x[j] - x_ref;
        sums[3] += 1.0;
    }
    *gx = sums[0];
    *gs = sums[1];
    *xs = sums[2];
    *count = (int64_t)sums[3];
}

/* *grad += grad_eps * slope, the slope clamped to the float range (where eps overflowed, dL/deps is 0 and 0 * inf
 * would be NaN): rounded as the PyTorch path rounds it, a product then a sum (no fused multiply-add). */
__attribute__((optimize("fp-contract=off")))
static void add_temperature_share(float *grad, float grad_eps, float slope) {
    float s = slope > FLT_MAX_F ? FLT_MAX_F : (slope < -FLT_MAX_F ? -FLT_MAX_F : slope);
    float share = grad_eps * s;
    *grad = *grad + share;
}

static void unsorted_backward_task(int64_t r, workspace *w, const void *ctx) {
    (void)w;
    const unsorted_backward_args *a = ctx;
    int64_t n = a->n;
    const float *out = a->out + r * n, *g = a->gout + r * n;
    const uint8_t *mask = a->mask ? a->mask + r * n : NULL;
    const float *x = a->x ? a->x + r * n : NULL;
    float *grad = a->grad + r * n;
    double num, den;
    sigmoid_grad_sums(out, g, n, grad, &num, &den);
    float mean_g = (float)(num / (den > FLT_TINY ? den : FLT_TINY));
    float eps = a->eps ? a->eps[r] : a->epsilon, inv_eps = 1.0f / eps;
    if (x == NULL) {
        for (int64_t j = 0; j < n; j++) grad[j] = grad[j] * (g[j] - mean_g) * inv_eps;
        return;
    }
    /* dL/deps from sums taken in the gradient's own pass (temperature_grad_from_sums) */
    float x_ref = reference_score(x, mask, n);
    double gx, gs, xs;
    int64_t count;
    if (mask) {
        centred_grad_sums(grad, g, x, mask, n, mean_g, inv_eps, x_ref, &gx, &gs, &xs, &count);
    } else {
        centred_grad_sums(grad, g, x, NULL, n, mean_g, inv_eps, x_ref, &gx, &gs, &xs, &count);
    }
    float grad_eps = temperature_grad_from_sums(gx, gs, xs, count, eps);
    if (a->grad_eps) a->grad_eps[r] = grad_eps;
    if (a->at) add_temperature_share(grad + a->at[r], grad_eps, a->slope[r]);
}

/* mask: the caller's (rows, n) mask or NULL (-inf scores are excluded in any case). eps NULL: every row's temperature
 * is epsilon. x NULL: no dL/deps (grad_eps, at and slope unused); else dL/deps goes to grad_eps unless it is NULL,
 * and with at and slope also into grad. */
int soft_topk_unsorted_backward(const float *out, const float *gout, const uint8_t *mask, const float *eps,
                                const float *x, float *grad, float *grad_eps, int64_t rows, int64_t n, float epsilon,
                                const int64_t *at, const float *slope, int threads) {
    unsorted_backward_args a = {out, gout, eps, x, mask, grad, grad_eps, n, epsilon, at, slope};
    return parallel_rows(rows, 1, n, 2, threads, unsorted_backward_task, &a);
}

