"""Attention of many queries per row (prefills) over float32 keys and values: one C kernel for the CPU.

Why: torch's CPU flash-attention kernel, given a boolean mask, computes every (query, slot) score
and masks it afterwards, so a causal prefill throws away half its work (attention_blocks.py cut
eager calls into query blocks to skip some of it; a compiled graph's call could not). Its products
go to the BLAS's single-precision GEMM, which on AMD hosts runs well below what the packed-panel
kernel reaches on the same cores: 34 ms a layer for a 2000-token SmolLM2 prefill on a Zen 5 host,
about 135 GFLOP/s, where the layer's linear products ran at 470 (README, Measured).

Here one task is one (batch row, KV head, block of Q_BLOCK query positions): the query heads that
share the KV head (GQA's group) are stacked into one tile of rows, scaled once, and go over the
slots their mask rows reach in tiles of KV_BLOCK slots, with the online softmax of flash attention
(a running maximum and sum per row, the output rescaled when the maximum grows):
- scores: the tile's keys are packed as panels of NR slots (head_dim rows of NR floats), and blocks
  of MR query rows multiply a panel as outer products with accumulators in registers, the
  micro-kernel of packed_linear.py;
- mask: each mask row is read once per call for its first and last readable slot and whether every
  slot between is readable; tiles a block's rows cannot read are never computed, a row that reads
  a contiguous stretch is masked by its bounds, any other row slot by slot from the mask;
- values: blocks of MR rows of probabilities multiply the value rows, NR columns at a time, into the
  output tile (in L1 and L2 for the whole task), which is divided by the sums at the end.
Threads (OpenMP, the runtime torch uses) take tasks dynamically, the longest (last) query blocks first.

Tiles start at multiples of KV_BLOCK slots whatever the queries: a query's result depends only on
its own query vector, its mask row, keys and values (slots it cannot read add exact zeros, tiles it
reads none of are skipped; for finite keys and values, as 0 x NaN is NaN), not on which other
queries or batch rows share the call, so a prompt
prefilled in one call or in chunks, alone or beside others, gets the same bits. Results are not
bit-identical to torch's kernel (another summation order and a polynomial exponential, a float's
rounding apart). A query row that may read no slot gets zeros.

The output is written as (batch, seq, q_heads, head_dim) and returned as its (batch, q_heads, seq,
head_dim) view, the layout the output projection reads, so the caller's transpose copies nothing.

A torch custom operator (`corelaunch::prefill_attention`), compiled as C++ against the installed
torch at first use into the per-user cache of workers/native_build.py, called eagerly and from
compiled prefill graphs alike; unavailable (no compiler, CORELAUNCH_PREFILL_ATTENTION=0, a head_dim
that is not a multiple of NR) means F.scaled_dot_product_attention as before.
"""

from __future__ import annotations

import ctypes

import torch

from workers import native_build
from workers.kernels.small_linear import _cpu_identity
from workers.native_build import LibrarySpec, NativeUnavailable

_SOURCE = r"""
#ifndef _GNU_SOURCE
#define _GNU_SOURCE   /* memrchr */
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16   /* floats per vector: 32 registers hold 12 rows x 2 vectors of accumulators */
#define MR 12
#else
#define VL 8    /* 16 registers: 6 rows x 2 vectors */
#define MR 6
#endif
#define NR (2 * VL)
#define Q_BLOCK 64      /* query positions per task (and per query head of its group) */
#define KV_BLOCK 128    /* slots per tile; tiles start at multiples of KV_BLOCK */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
static inline vf ld(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline long lmin(long a, long b) { return a < b ? a : b; }
static inline vf vmax(vf a, vf b) { vi gt = a > b; return (vf)(((vi)a & gt) | ((vi)b & ~gt)); }
static inline void scale_row(float *p, long n, float by) { for (long c = 0; c < n; c += VL) st(p + c, ld(p + c) * by); }
static inline long lmax(long a, long b) { return a > b ? a : b; }

int cl_prefill_attention_width(void) { return NR; }

/* exp(x) for x <= 0 (scores minus their maximum): 2^n exp(r), n = round(x log2 e), r = x - n ln 2
   (ln 2 in two parts), exp(r) by a degree-6 polynomial (relative error about 2e-7). Below -87.3
   (and -inf) the result is exactly 0. */
static inline vf vexp(vf x) {
    const float lo = -87.33654f, shifter = 12582912.f;  /* 1.5 * 2^23: adding it rounds to an integer */
    vi under = x < lo;
    x = (vf)(((vi)x & ~under) | ((vi)((vf){0} + lo) & under));
    vf n = (x * 1.44269504088896341f + shifter) - shifter;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.f);
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)bits) & ~under);
}

/* Per mask row: the first and last slot it may read (last < first when none) and whether it reads
   every slot between them. */
void cl_prefill_mask_rows(const uint8_t *mask, long rows, long slots, int32_t *first, int32_t *last,
                          uint8_t *dense, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < rows; r++) {
        const uint8_t *row = mask + r * slots;
        const uint8_t *f = (const uint8_t *)memchr(row, 1, slots);
        if (!f) { first[r] = 0; last[r] = -1; dense[r] = 1; continue; }
        const uint8_t *l = (const uint8_t *)memrchr(row, 1, slots);
        long count = 0;
        for (const uint8_t *c = f; c <= l; c++) count += *c;
        first[r] = (int32_t)(f - row); last[r] = (int32_t)(l - row); dense[r] = count == l - f + 1;
    }
}

/* Scores of `rows` (<= MR) query rows (head_dim d, row stride d) against one panel of NR slots. */
static inline __attribute__((always_inline)) void scores(int rows, const float *a, long d, const float *panel,
                                                         float *s) {
    vf c0[MR], c1[MR];
    for (int i = 0; i < MR; i++) { c0[i] = (vf){0}; c1[i] = (vf){0}; }
    for (long k = 0; k < d; k++) {
        vf w0 = ld(panel + k * NR), w1 = ld(panel + k * NR + VL);
        for (int i = 0; i < MR; i++)
            if (i < rows) { float x = a[i * d + k]; c0[i] += x * w0; c1[i] += x * w1; }
    }
    for (int i = 0; i < rows; i++) { st(s + i * KV_BLOCK, c0[i]); st(s + i * KV_BLOCK + VL, c1[i]); }
}

/* out[rows][NR] += p[rows][0..n) v[0..n)[NR]: probabilities (row stride KV_BLOCK) times value rows
   (stride vs), summed over slots in order. */
static inline __attribute__((always_inline)) void values(int rows, const float *p, const float *v, long vs,
                                                         long n, float *out, long d) {
    vf c0[MR], c1[MR];
    for (int i = 0; i < MR; i++) {
        if (i < rows) { c0[i] = ld(out + i * d); c1[i] = ld(out + i * d + VL); }
        else { c0[i] = (vf){0}; c1[i] = (vf){0}; }
    }
    for (long j = 0; j < n; j++) {
        vf w0 = ld(v + j * vs), w1 = ld(v + j * vs + VL);
        for (int i = 0; i < MR; i++)
            if (i < rows) { float x = p[i * KV_BLOCK + j]; c0[i] += x * w0; c1[i] += x * w1; }
    }
    for (int i = 0; i < rows; i++) { st(out + i * d, c0[i]); st(out + i * d + VL, c1[i]); }
}

#define BLOCKS(R) \
    static void scores_##R(const float *a, long d, const float *p, float *s) { scores(R, a, d, p, s); } \
    static void values_##R(const float *p, const float *v, long vs, long n, float *o, long d) \
        { values(R, p, v, vs, n, o, d); }
BLOCKS(1) BLOCKS(2) BLOCKS(3) BLOCKS(4) BLOCKS(5) BLOCKS(6)
#if MR == 12
BLOCKS(7) BLOCKS(8) BLOCKS(9) BLOCKS(10) BLOCKS(11) BLOCKS(12)
#endif
typedef void (*scores_fn)(const float *, long, const float *, float *);
typedef void (*values_fn)(const float *, const float *, long, long, float *, long);
static const scores_fn SCORES[MR + 1] = {0, scores_1, scores_2, scores_3, scores_4, scores_5, scores_6
#if MR == 12
    , scores_7, scores_8, scores_9, scores_10, scores_11, scores_12
#endif
};
static const values_fn VALUES[MR + 1] = {0, values_1, values_2, values_3, values_4, values_5, values_6
#if MR == 12
    , values_7, values_8, values_9, values_10, values_11, values_12
#endif
};

/* Tensors: q (batch, q_heads, seq, d) with strides qs[3] (batch, head, position; the last dim
   contiguous), keys and values (batch, kv_heads, slots, d) with strides ks[3] and vs[3], mask rows
   (mask_batches, seq, slots) as bytes, their cl_prefill_mask_rows summaries, and out
   (batch, seq, q_heads, d) contiguous. mask_batches is 1 (one mask for every batch row) or batch. */
int cl_prefill_attention(const float *q, const long *qs, const float *k, const long *ks, const float *v,
                          const long *vs, const uint8_t *mask, long mask_batches, const int32_t *first,
                          const int32_t *last, const uint8_t *dense, float *out, long batch, long q_heads,
                          long kv_heads, long seq, long slots, long d, float scale, int threads) {
    int failed = 0;  /* a thread's buffers could not be allocated: 1 is returned, nothing else is wrong */
    long group = q_heads / kv_heads, qblocks = (seq + Q_BLOCK - 1) / Q_BLOCK;
    long tasks = batch * kv_heads * qblocks, tile_rows = group * Q_BLOCK;
    #pragma omp parallel num_threads(threads)
    {
        float *qt = (float *)malloc(sizeof(float) * tile_rows * d);      /* the queries, scaled */
        float *ot = (float *)malloc(sizeof(float) * tile_rows * d);      /* the output, unnormalized */
        float *st_ = (float *)malloc(sizeof(float) * tile_rows * KV_BLOCK); /* scores, then probabilities */
        float *kt = (float *)malloc(sizeof(float) * KV_BLOCK * d);       /* a tile's keys as panels */
        float *best = (float *)malloc(sizeof(float) * tile_rows), *sum = (float *)malloc(sizeof(float) * tile_rows);
        if (!qt || !ot || !st_ || !kt || !best || !sum) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < tasks; t++) {
            if (!qt || !ot || !st_ || !kt || !best || !sum) continue;
            long qb = qblocks - 1 - t / (batch * kv_heads), b = t % (batch * kv_heads) / kv_heads;
            long kh = t % kv_heads, i0 = qb * Q_BLOCK, n = lmin(Q_BLOCK, seq - i0), m = group * n;
            long mb = mask_batches > 1 ? b : 0;
            const int32_t *fr = first + mb * seq + i0, *la = last + mb * seq + i0;
            const uint8_t *de = dense + mb * seq + i0, *mrows = mask + (mb * seq + i0) * slots;
            long lo = slots, hi = 0;
            for (long i = 0; i < n; i++)
                if (la[i] >= fr[i]) { lo = lmin(lo, fr[i]); hi = lmax(hi, la[i] + 1); }
            for (long g = 0; g < group; g++)
                for (long i = 0; i < n; i++) {
                    const float *src = q + b * qs[0] + (kh * group + g) * qs[1] + (i0 + i) * qs[2];
                    for (long c = 0; c < d; c += VL) st(qt + (g * n + i) * d + c, ld(src + c) * scale);
                }
            memset(ot, 0, sizeof(float) * m * d);
            for (long r = 0; r < m; r++) { best[r] = -INFINITY; sum[r] = 0.f; }
            const float *kb = k + b * ks[0] + kh * ks[1], *vb = v + b * vs[0] + kh * vs[1];
            for (long j0 = lo / KV_BLOCK * KV_BLOCK; j0 < hi; j0 += KV_BLOCK) {
                long js = lmax(j0, lo), je = lmin(j0 + KV_BLOCK, hi);   /* the slots any row may read */
                long cs = (js - j0) / NR * NR, ce = (je - j0 + NR - 1) / NR * NR;  /* panels covering them */
                for (long c = cs; c < ce; c += NR)
                    for (long x = 0; x < d; x++)
                        for (long jj = 0; jj < NR; jj++) {
                            long j = j0 + c + jj;
                            kt[(c / NR * d + x) * NR + jj] = j >= js && j < je ? kb[j * ks[2] + x] : 0.f;
                        }
                for (long r0 = 0; r0 < m; r0 += MR) {
                    int rows = (int)lmin(MR, m - r0);
                    for (long c = cs; c < ce; c += NR)
                        SCORES[rows](qt + r0 * d, d, kt + c / NR * d * NR, st_ + r0 * KV_BLOCK + c);
                }
                for (long r = 0; r < m; r++) {
                    long i = r % n;
                    float *s = st_ + r * KV_BLOCK;
                    long a = lmax(fr[i], js) - j0, e = lmin(la[i] + 1, je) - j0;  /* readable, if dense */
                    if (de[i]) {
                        if (a >= e) { memset(s + cs, 0, sizeof(float) * (ce - cs)); continue; }
                        for (long c = cs; c < a; c++) s[c] = -INFINITY;
                        for (long c = e; c < ce; c++) s[c] = -INFINITY;
                    } else {
                        for (long c = cs; c < ce; c++)
                            if (j0 + c < js || j0 + c >= je || !mrows[i * slots + j0 + c]) s[c] = -INFINITY;
                    }
                    vf tops = (vf){0} - INFINITY;
                    for (long c = cs; c < ce; c += VL) tops = vmax(ld(s + c), tops);
                    float top = -INFINITY;
                    for (int l = 0; l < VL; l++) top = tops[l] > top ? tops[l] : top;
                    if (top == -INFINITY) {  /* nothing readable here, or only NaN scores (kept: torch's NaN) */
                        int nan = 0;
                        for (long c = cs; c < ce; c++) nan |= s[c] != s[c];
                        if (!nan) { memset(s + cs, 0, sizeof(float) * (ce - cs)); continue; }
                        top = NAN;
                    }
                    float was = best[r], now = was > top ? was : top;
                    vf acc = (vf){0};
                    for (long c = cs; c < ce; c += VL) {
                        vf p = vexp(ld(s + c) - now);
                        st(s + c, p);
                        acc += p;
                    }
                    float part = 0.f;
                    for (int l = 0; l < VL; l++) part += acc[l];
                    if (was == -INFINITY) sum[r] = part;
                    else if (now == was) sum[r] += part;
                    else {
                        float alpha = expf(was - now);
                        sum[r] = sum[r] * alpha + part;
                        scale_row(ot + r * d, d, alpha);
                    }
                    best[r] = now;
                }
                for (long r0 = 0; r0 < m; r0 += MR) {
                    int rows = (int)lmin(MR, m - r0);
                    for (long c = 0; c < d; c += NR)
                        VALUES[rows](st_ + r0 * KV_BLOCK + (js - j0), vb + js * vs[2] + c, vs[2], je - js,
                                     ot + r0 * d + c, d);
                }
            }
            for (long g = 0; g < group; g++)
                for (long i = 0; i < n; i++) {
                    long r = g * n + i;
                    float *dst = out + ((b * seq + i0 + i) * q_heads + kh * group + g) * d;
                    float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
                    for (long c = 0; c < d; c += VL) st(dst + c, ld(ot + r * d + c) * inv);
                }
        }
        free(qt); free(ot); free(st_); free(kt); free(best); free(sum);
    }
    return failed;
}
"""

_OPERATOR_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

/* corelaunch::prefill_attention's CPU kernel, registered with the dispatcher when the library loads. */
static at::Tensor prefill_attention_cpu(const at::Tensor &q, const at::Tensor &keys, const at::Tensor &values,
                                        const at::Tensor &mask, double scale) {
    TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes() && mask.dim() == 4
                && q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat
                && values.scalar_type() == at::kFloat && mask.scalar_type() == at::kBool
                && keys.size(1) > 0 && q.size(1) % keys.size(1) == 0 && keys.size(0) == q.size(0)
                && q.size(3) == keys.size(3) && q.size(3) > 0 && q.size(3) % cl_prefill_attention_width() == 0
                && mask.size(1) == 1 && (mask.size(0) == 1 || mask.size(0) == q.size(0))
                && mask.size(2) == q.size(2) && mask.size(3) == keys.size(2),
                "prefill_attention takes float32 q (batch, q_heads, seq, head_dim), keys and values (batch, "
                "kv_heads, slots, head_dim) with q_heads a multiple of kv_heads and head_dim of ",
                cl_prefill_attention_width(), ", and a bool mask (1 or batch, 1, seq, slots); got q ", q.sizes(), " ",
                q.scalar_type(), ", keys ", keys.sizes(), " ", keys.scalar_type(), ", values ", values.sizes(), " ",
                values.scalar_type(), ", mask ", mask.sizes(), " ", mask.scalar_type());
    int64_t batch = q.size(0), q_heads = q.size(1), seq = q.size(2), d = q.size(3);
    int64_t kv_heads = keys.size(1), slots = keys.size(2), mask_batches = mask.size(0);
    at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
    at::Tensor kc = keys.stride(3) == 1 ? keys : keys.contiguous();
    at::Tensor vc = values.stride(3) == 1 ? values : values.contiguous();
    at::Tensor m = mask.contiguous();
    at::Tensor out = at::empty({batch, seq, q_heads, d}, q.options());
    if (out.numel() == 0) return out.transpose(1, 2);
    int threads = at::get_num_threads();
    at::Tensor bounds = at::empty({2, mask_batches * seq}, q.options().dtype(at::kInt));
    at::Tensor dense = at::empty({mask_batches * seq}, q.options().dtype(at::kByte));
    cl_prefill_mask_rows((const uint8_t *)m.data_ptr<bool>(), mask_batches * seq, slots, bounds[0].data_ptr<int32_t>(),
                         bounds[1].data_ptr<int32_t>(), dense.data_ptr<uint8_t>(), threads);
    long qs[3] = {(long)qc.stride(0), (long)qc.stride(1), (long)qc.stride(2)};
    long ks[3] = {(long)kc.stride(0), (long)kc.stride(1), (long)kc.stride(2)};
    long vs[3] = {(long)vc.stride(0), (long)vc.stride(1), (long)vc.stride(2)};
    int failed = cl_prefill_attention(qc.data_ptr<float>(), qs, kc.data_ptr<float>(), ks, vc.data_ptr<float>(), vs,
                         (const uint8_t *)m.data_ptr<bool>(), mask_batches, bounds[0].data_ptr<int32_t>(),
                         bounds[1].data_ptr<int32_t>(), dense.data_ptr<uint8_t>(), out.data_ptr<float>(), batch,
                         q_heads, kv_heads, seq, slots, d, (float)scale, threads);
    TORCH_CHECK(!failed, "prefill_attention: out of memory for a thread's working buffers");
    return out.transpose(1, 2);
}

TORCH_LIBRARY_IMPL(corelaunch, CPU, m) { m.impl("prefill_attention", &prefill_attention_cpu); }
"""

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")


def _host_spec() -> LibrarySpec:
    """The kernel with its torch operator, compiled as C++ against this torch."""
    return native_build.torch_operator_spec("corelaunch_prefill_attention", _SOURCE, _OPERATOR_SOURCE, _FLAGS,
                                            "the prefill attention kernel", _cpu_identity())


NARROW_SPEC = LibrarySpec("corelaunch_prefill_attention_narrow", _SOURCE, (*_FLAGS, "-mno-avx512f"),
                          "the prefill attention kernel without AVX-512", _cpu_identity())
"""The kernel alone (C, no operator) without AVX-512 (8-float vectors, 6-row blocks), on any host:
tests check both block sets through run_kernel."""


def build_kernel(spec: LibrarySpec) -> ctypes.CDLL:
    """Build (once per source, flags and CPU) and load a kernel-only library; raises NativeUnavailable."""
    lib = native_build.build_and_load(spec)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.cl_prefill_attention_width.argtypes, lib.cl_prefill_attention_width.restype = [], i32
    lib.cl_prefill_mask_rows.argtypes, lib.cl_prefill_mask_rows.restype = [p, i64, i64, p, p, p, i32], None
    lib.cl_prefill_attention.argtypes = [p, p, p, p, p, p, p, i64, p, p, p, p, i64, i64, i64, i64, i64, i64,
                                         ctypes.c_float, i32]
    lib.cl_prefill_attention.restype = i32
    return lib


def run_kernel(lib: ctypes.CDLL, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    """What the operator computes, through a given build (its arguments unchecked: tests)."""
    batch, q_heads, seq, d = q.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    q, keys, values = (t if t.stride(3) == 1 else t.contiguous() for t in (q, keys, values))
    mask = mask.contiguous()
    threads = torch.get_num_threads()
    rows = mask.shape[0] * seq
    first, last = torch.empty(rows, dtype=torch.int32), torch.empty(rows, dtype=torch.int32)
    dense = torch.empty(rows, dtype=torch.uint8)
    lib.cl_prefill_mask_rows(mask.data_ptr(), rows, slots, first.data_ptr(), last.data_ptr(), dense.data_ptr(),
                             threads)
    strides = [(ctypes.c_long * 3)(*t.stride()[:3]) for t in (q, keys, values)]
    out = torch.empty((batch, seq, q_heads, d))
    failed = lib.cl_prefill_attention(q.data_ptr(), strides[0], keys.data_ptr(), strides[1], values.data_ptr(),
                                      strides[2], mask.data_ptr(), mask.shape[0], first.data_ptr(), last.data_ptr(),
                                      dense.data_ptr(), out.data_ptr(), batch, q_heads, kv_heads, seq, slots, d, scale,
                                      threads)
    if failed:
        raise MemoryError("prefill_attention: out of memory for a thread's working buffers")
    return out.transpose(1, 2)


unavailable_reason: str | None = None


@native_build.once_per_process
def _host_build():
    """The host's library, or why it cannot be built: tried once per process (a second copy loaded
    would register the operator's kernel again)."""
    try:
        return build_kernel(_host_spec())
    except NativeUnavailable as err:
        return str(err)


def _library() -> ctypes.CDLL | None:
    """The host's build, loaded (which registers the operator's CPU kernel), or None when it is turned
    off or cannot be built (the reason kept in `unavailable_reason`)."""
    global unavailable_reason
    lib, unavailable_reason = native_build.load_unless_turned_off("CORELAUNCH_PREFILL_ATTENTION", _host_build)
    return lib


def available() -> bool:
    """Whether the operator's CPU kernel is built and registered (built now if needed). A constant
    to torch.compile (workers/compiled.py marks it before tracing)."""
    return _library() is not None


def width() -> int:
    """NR of the host's build: head_dim must be a multiple of it (0 when the kernel is unavailable)."""
    lib = _library()
    return lib.cl_prefill_attention_width() if lib is not None else 0


def covers(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether a model's prefills of this head_dim and compute dtype take the kernel on the CPU
    (float32, the kernel available and tiling the head_dim)."""
    return dtype == torch.float32 and available() and head_dim % width() == 0


def usable(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether an attention call takes the kernel: several float32 queries per row on the CPU over
    float32 keys of as many batch rows, one mask or one per batch row, head_dim a multiple of the
    build's panel width. A graph traced without mark_constants_for_tracing (a torch.compile other
    than workers/compiled.py's) keeps torch's attention: tracing into available() would break it."""
    if torch.compiler.is_compiling() and not _marked_for_tracing:
        return False
    return (q.device.type == "cpu" and q.dtype == keys.dtype == values.dtype == torch.float32
            and q.dim() == keys.dim() == mask.dim() == 4 and values.shape == keys.shape
            and q.shape[2] > 1 and keys.shape[0] == q.shape[0] and keys.shape[3] == q.shape[3]
            and keys.shape[1] > 0 and q.shape[1] % keys.shape[1] == 0 and mask.dtype == torch.bool
            and mask.shape[0] in (1, q.shape[0]) and mask.shape[1] == 1 and mask.shape[2] == q.shape[2]
            and mask.shape[3] == keys.shape[2] and available() and q.shape[3] % width() == 0)


# Schema and shape function here, so that torch.compile can trace the operator before anything is
# built; its CPU kernel is C++ in the library, registered when _host_build() loads it.
_OPS = torch.library.Library("corelaunch", "FRAGMENT")
_OPS.define("prefill_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor")


@torch.library.register_fake("corelaunch::prefill_attention")
def _prefill_attention_shape(q, keys, values, mask, scale):
    batch, q_heads, seq, d = q.shape
    return q.new_empty((batch, seq, q_heads, d)).transpose(1, 2)


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, where mask) v as (batch, q_heads, seq, head_dim): q (batch, q_heads, seq,
    head_dim), keys and values (batch, kv_heads, slots, head_dim), mask (1 or batch, 1, seq, slots)."""
    if not torch.compiler.is_compiling() and not available():  # loading the library registers the kernel
        raise RuntimeError(f"the prefill attention kernel is unavailable: {unavailable_reason}")
    return torch.ops.corelaunch.prefill_attention(q, keys, values, mask, scale)


_marked_for_tracing = False
"""Whether mark_constants_for_tracing ran in this process (usable() asks while traced)."""


def mark_constants_for_tracing() -> None:
    """Tells torch.compile to take available() and width() as constants (usable() calls them in
    every traced prefill attention)."""
    import torch._dynamo

    global _marked_for_tracing
    torch._dynamo.assume_constant_result(available)
    torch._dynamo.assume_constant_result(width)
    _marked_for_tracing = True
