// Vector kernels on contiguous rows, dispatched at run time to the best instruction set the
// CPU has (Highway: SSE4 / AVX2 / AVX-512). One source, no per-ISA copies.
// exp is Highway's contrib Exp (max error 1 ulp, valid for x <= 104 in float32 and
// x <= 706 in float64), except where the argument is <= 0 in float32 (the softmax's shifted
// scores, elu+1): there simd.cc's ExpNonPositive (1.3 ulp, 0 below 2^-126); callers never pass
// -inf or NaN unless a function says so.
#pragma once

#include <cstddef>

namespace linattn {
struct bfloat16;
struct float16;
}  // namespace linattn

namespace linattn::simd {

// max_i x[i]; -inf for n == 0.
float max_value(const float* x, size_t n);
double max_value(const double* x, size_t n);

// x[i] = exp(x[i] - shift) in place; returns the sum of the new values.
float exp_shifted_sum(float* x, size_t n, float shift);
double exp_shifted_sum(double* x, size_t n, double shift);

// x[i] *= a.
void scale(float* x, size_t n, float a);
void scale(double* x, size_t n, double a);

// Softmax of each of `rows` rows of `cols` values (leading dimension ld), in one call:
// x = exp(x − rowmax), then, if inv_sums is null, each row times 1/sum; otherwise the rows stay
// unnormalised and inv_sums[r] = 1/sum (for callers that fold the division into a later
// product). Returns false if a row's max is ±inf or NaN (x is then partly written).
bool softmax_rows(float* x, size_t rows, size_t cols, size_t ld, float* inv_sums = nullptr);
bool softmax_rows(double* x, size_t rows, size_t cols, size_t ld, double* inv_sums = nullptr);

// Softmax down the columns of a rows × cols block (rows >= 1), for softmax over positions of a
// row-major [positions, features] matrix without transposing it: reads scale·src (leading
// dimension ld_src), writes the unnormalised e = exp(scale·src − column max) into dst (rows ×
// cols, contiguous) and inv_sums[c] = 1/Σ_r e[r,c]; P = e·diag(inv_sums). work: 2·cols values,
// of which work[0, cols) holds the column maxima of scale·src on return (efficient_key_state's
// shifts).
// Column sums are blocked (error ~(256 + rows/256)·u). Returns false if a column's max is ±inf
// or NaN.
bool softmax_columns(const float* src, size_t ld_src, float* dst, size_t rows, size_t cols, float scale,
                     float* inv_sums, float* work);
bool softmax_columns(const double* src, size_t ld_src, double* dst, size_t rows, size_t cols,
                     double scale, double* inv_sums, double* work);

// Its backward, in place on g (rows × cols, contiguous, holding dP on entry):
// g = scale·P ∘ (dP − δ), δ_c = Σ_r P[r,c]·dP[r,c], P = e·diag(inv_sums). work: 3·cols values.
void softmax_columns_backward(const float* e, const float* inv_sums, float* g, size_t rows, size_t cols,
                              float scale, float* work);
void softmax_columns_backward(const double* e, const double* inv_sums, double* g, size_t rows,
                              size_t cols, double scale, double* work);

// ds[i] = p[i] * (dp[i] - delta): the softmax backward, dS = P ∘ (dP − rowsum(P∘dP)).
void softmax_grad(float* ds, const float* p, const float* dp, size_t n, float delta);
void softmax_grad(double* ds, const double* p, const double* dp, size_t n, double delta);

// Σ x[i] (in lane-wise partial sums).
float sum(const float* x, size_t n);
double sum(const double* x, size_t n);

// Σ a[i]·b[i].
float dot(const float* a, const float* b, size_t n);
double dot(const double* a, const double* b, size_t n);

// max_i |x[i]|; 0 for n == 0.
float max_abs(const float* x, size_t n);
double max_abs(const double* x, size_t n);

// s[i] = sin(x[i]), c[i] = cos(x[i]); Highway's Sin/Cos: within 3 ulp for |x| <= 39000.
void sin_cos(const float* x, size_t n, float* s, float* c);
void sin_cos(const double* x, size_t n, double* s, double* c);

// out[i] = a[i]·b[i] − c[i]·e[i]; with c == nullptr, out[i] = a[i]·b[i]. out may alias a or b.
void product_difference(const float* a, const float* b, const float* c, const float* e, float* out,
                        size_t n);
void product_difference(const double* a, const double* b, const double* c, const double* e,
                        double* out, size_t n);

// out[i] = a[i] if x[i] > 0, else a[i]·b[i] (0 with b == nullptr): relu(x) is (x, x, null),
// the backward of relu (x, dφ, null) and of elu+1 (x, dφ, φ). Branch-free, unlike the scalar
// loop (whose compare mispredicts on half the entries of random-signed x). out may alias a.
void select_positive(const float* x, const float* a, const float* b, float* out, size_t n);
void select_positive(const double* x, const double* a, const double* b, double* out, size_t n);

// out[i] = elu(x[i]) + 1 = x[i] + 1 if x[i] > 0 else exp(x[i]). out may alias x.
void elu_plus_one(const float* x, float* out, size_t n);
void elu_plus_one(const double* x, double* out, size_t n);

// m[c] = max(m[c], max_r x[r, c]) over `rows` rows of `cols` values (leading dimension ld).
void column_max(const float* x, size_t rows, size_t cols, size_t ld, float* m);
void column_max(const double* x, size_t rows, size_t cols, size_t ld, double* m);

// x[r, c] = exp(x[r, c] − shift[c]) in place (Highway's Exp: arguments up to about 88 in float32,
// 709 in float64; the callers' are <= 0, or <= 10 for chunk_decay's U); an argument of −inf or
// below the lowest finite value gives 0.
void exp_minus_columns(float* x, size_t rows, size_t cols, size_t ld, const float* shift);
void exp_minus_columns(double* x, size_t rows, size_t cols, size_t ld, const double* shift);

// One row: y[c] = x[c] + offset[c], t = max_c y[c], x[c] = exp(y[c] − t); returns t. offset may
// hold −inf (those entries become 0); if every y is −inf the row becomes 0 and −inf is returned.
float exp_row_offset(float* x, size_t cols, const float* offset);
double exp_row_offset(double* x, size_t cols, const double* offset);

// max_i |x[i]| if every x[i] is finite, else NaN; 0 for n == 0.
float finite_max_abs(const float* x, size_t n);
double finite_max_abs(const double* x, size_t n);
float finite_max_abs(const bfloat16* x, size_t n);

// True when every x[i] is finite (no NaN, no ±inf).
bool all_finite(const float* x, size_t n);
bool all_finite(const double* x, size_t n);
bool all_finite(const bfloat16* x, size_t n);

// The 16-bit storage types to and from float32: widening is exact; narrowing rounds to nearest
// even (the one-value to_bfloat16 / to_float16 of low_precision.h, which the tests compare).
void widen(const bfloat16* src, float* dst, size_t n);
void narrow(const float* src, bfloat16* dst, size_t n);
// narrow(), returning whether every value written is finite (a rounding can overflow to inf),
// checked as it is written rather than by a second pass.
bool narrow_finite(const float* src, bfloat16* dst, size_t n);
// dst[r][c] = src[r][c]·factor[r] for r < rows, c < cols (one float32 or float64 multiply), and
// for a bfloat16 dst that product rounded to nearest even as narrow() rounds it: the kernelized
// engine's out_i = num_i / D_i, written straight into a bfloat16 result instead of through a
// float32 block that narrow() then reads again. Returns whether every value written is finite
// (checked while in registers: the caller need not read the result again).
bool scale_rows(const float* src, size_t ld_src, size_t rows, size_t cols, const float* factor, float* dst,
                size_t ld_dst);
bool scale_rows(const double* src, size_t ld_src, size_t rows, size_t cols, const double* factor, double* dst,
                size_t ld_dst);
bool scale_rows(const float* src, size_t ld_src, size_t rows, size_t cols, const float* factor, bfloat16* dst,
                size_t ld_dst);
// rows × cols contiguous values into rows of ld_dst floats (ld_dst >= cols): one call for a block
// of short rows (the engine's [v_j, 1] rows), where a call per row cost more than its widening.
void widen_rows(const bfloat16* src, size_t rows, size_t cols, float* dst, size_t ld_dst);
void widen(const float16* src, float* dst, size_t n);
void narrow(const float* src, float16* dst, size_t n);

// One online-softmax step over a block of score rows (the attention tiles): for each row r with
// count[r] > 0 visible scores s[r][0, count[r]), m' = max(m[r], scale·max s),
// p[r][j] = exp(scale·s[r][j] − m') (float32, or rounded to bfloat16; 0 from count[r] to width),
// l[r] = l[r]·e + Σ exp (taken before any rounding), o[r][0, o_cols) *= e with e = exp(m[r] − m'),
// m[r] = m'. The float32 p may be s itself (ld_p = ld_s). Returns -1, or the first row whose
// scaled maximum is not finite (the caller's error). One call per block, not per row: at short
// sequences the per-row dispatch cost more than the arithmetic.
int64_t online_softmax_step(const float* s, size_t ld_s, size_t rows, const int64_t* count, size_t width,
                            float scale, float* m, float* l, float* o, size_t ld_o, size_t o_cols, bfloat16* p,
                            size_t ld_p);
int64_t online_softmax_step(const float* s, size_t ld_s, size_t rows, const int64_t* count, size_t width,
                            float scale, float* m, float* l, float* o, size_t ld_o, size_t o_cols, float* p,
                            size_t ld_p);
// And the last step: out[r][0, cols) = o[r] / l[r] (o scaled in place; stored as float32 or
// rounded to bfloat16), zeros where l[r] = 0 (the row saw no key). Returns -1, or the first row
// with a non-finite value.
int64_t finish_rows(float* o, size_t ld_o, size_t rows, size_t cols, const float* l, bfloat16* out, size_t ld_out);
int64_t finish_rows(float* o, size_t ld_o, size_t rows, size_t cols, const float* l, float* out, size_t ld_out);

// Gated linear attention's decays (src/linattn/gated/gated.cc). A diagonal block of `rows` rows
// keeps its pairs (j, i), i <= j, packed row after row at j(j+1)/2 + i, `dim` values each.
// e[pair(j, i)] = Π_{i < t <= j} a[t] (1 for i = j), a [rows, dim] the per-step factors.
// b[j][c] = Σ_{t <= j} max(g[t][c], floor) in float64 (a NaN g stays NaN), rows of `width`
// values; and, where `floored` is not null, floored[j][c] = max(g[j][c], floor).
void floored_cumsum(const float* g, size_t rows, size_t width, double floor, double* b, float* floored);
void floored_cumsum(const double* g, size_t rows, size_t width, double floor, double* b, double* floored);
void decay_pairs(const float* a, size_t rows, size_t dim, float* e);
void decay_pairs(const double* a, size_t rows, size_t dim, double* e);
// out[j·ld + i] = Σ_c q[j][c]·k[i][c]·e[pair(j, i)][c] for i <= j < rows.
void decayed_dots(const float* q, const float* k, const float* e, size_t rows, size_t dim, float* out, size_t ld);
void decayed_dots(const double* q, const double* k, const double* e, size_t rows, size_t dim, double* out,
                  size_t ld);
// later false: y[j] += Σ_{i <= j} w[j·ldw + i]·x[i] ⊙ e[pair(j, i)];
// later true:  y[i] += Σ_{j >= i} w[j·ldw + i]·x[j] ⊙ e[pair(j, i)].
void decayed_weigh(const float* w, size_t ldw, const float* x, const float* e, size_t rows, size_t dim, float* y,
                   bool later);
void decayed_weigh(const double* w, size_t ldw, const double* x, const double* e, size_t rows, size_t dim,
                   double* y, bool later);
// out[r·ld_out + c] (=, or += with accumulate) a[r·cols + c]·b[r·cols + c].
void multiply(const float* a, const float* b, size_t rows, size_t cols, float* out, size_t ld_out, bool accumulate);
void multiply(const double* a, const double* b, size_t rows, size_t cols, double* out, size_t ld_out,
              bool accumulate);
// y[r][c] (=, or += with accumulate) x[r][c]·f[c], rows of `cols` values.
void scale_columns(const float* x, size_t rows, size_t cols, const float* f, float* y, bool accumulate);
void scale_columns(const double* x, size_t rows, size_t cols, const double* f, double* y, bool accumulate);

// One step of a recurrence on a state S [rows, cols] (row-major), in two passes over it:
// state_dots: x[c] = Σ_r a[r]·S[r][c] and y[c] = Σ_r b[r]·S[r][c] (Sᵀa and Sᵀb, one pass);
// decay_rank_one: out[r][c] = f[r]·S[r][c] + k[r]·u[c] (out may be S), and whether every value
// written is finite.
void state_dots(const float* S, size_t rows, size_t cols, const float* a, const float* b, float* x, float* y);
void state_dots(const double* S, size_t rows, size_t cols, const double* a, const double* b, double* x, double* y);
bool decay_rank_one(const float* S, size_t rows, size_t cols, const float* f, const float* k, const float* u,
                    float* out);
// out[q·rows + r] = Σ_c x[r][c]·a[q·cols + c] for q < count (x rows × cols, a count × cols,
// row-major): count queries' dots with a block of keys, each key read once for up to four of them.
void row_dots(const float* x, size_t rows, size_t cols, const float* a, size_t count, float* out);
void row_dots(const double* x, size_t rows, size_t cols, const double* a, size_t count, double* out);
// x[q·cols + c] = Σ_r a[q·rows + r]·S[r][c] for q < count (Sᵀa for count weightings a, up to
// four of them per pass over S): the weighted sums a decoding step reads from a state or a window.
void state_dots(const float* S, size_t rows, size_t cols, const float* a, size_t count, float* x);
void state_dots(const double* S, size_t rows, size_t cols, const double* a, size_t count, double* x);
bool decay_rank_one(const double* S, size_t rows, size_t cols, const double* f, const double* k, const double* u,
                    double* out);

// A register-only loop of fused multiply-adds on float vectors, what the benchmarks measure
// the FMA peak with: `iterations` rounds of fma_loop_flops_per_iteration() FLOPs.
float fma_loop(size_t iterations, float seed);
size_t fma_loop_flops_per_iteration();

// Name of the instruction set chosen at run time, e.g. "AVX3" (AVX-512).
const char* target_name();

}  // namespace linattn::simd
