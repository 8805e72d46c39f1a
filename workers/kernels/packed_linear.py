"""y = x W^T (+ bias) for float32 weights stored as column panels: one C kernel for decode products.

Why: the small-batch kernel (small_linear.py) reads W in its checkpoint layout, rows of K, and
forms dot products: each block of outputs streams several weight rows at once and sums each product
across vector lanes at the end. MKL's GEMM packs the weight anew for every call. At the row counts
of a decode step (1 to 32 running sequences) both stay well below the host's read bandwidth
(README, Measured, machine E).

Here each weight is repacked once, at load, into panels of NR output columns: panel p holds
W[p*NR:(p+1)*NR, :] transposed, K rows of NR contiguous floats (the last panel is padded with
zeros). A block of up to MR rows of x multiplies a panel as outer products: per k, two vector loads
of weights, one broadcast of x[m][k] per row, and MR x NR lanes of multiply-add into accumulators
held in registers. The weights are read strictly in order, with a software prefetch 16 steps ahead
(the hardware prefetcher alone left the 16-row case a third slower), and nothing is summed across
lanes. With 2 to 8 blocks of rows (decode steps of 7 to 48 sequences, 13 to 96 with AVX-512) a
panel goes by in chunks of 64 steps of K: every block multiplies a chunk while it sits in L1, its
accumulators parked in memory between chunks, and the second block prefetches the next chunk, so
that memory reads overlap arithmetic (1.13-1.14x at 16 rows on an AVX2 host, less elsewhere;
README, Measured, machine J). More blocks (prefills) take K whole.

Every output element is the sum over k in the same order whatever the number of rows, so a row's
result does not depend on which other rows share its batch, below UNPACK_MIN_ROWS: products of
that many rows (prefills) take a GEMM library's product on the weight unpacked for the call
(prefill_gemm.py) where one is chosen: it was faster there on Intel hosts (README, Measured,
machines E and M), this kernel on AMD ones with AVX-512 (L, R), which keep it.

The kernel's torch operator (corelaunch::packed_linear_kernel) is compiled as C++ against the
installed torch, so that a call from a compiled graph costs a few microseconds rather than the
tens a Python-bodied operator costs: a SmolLM2 decode step makes 211 of them. Threads (OpenMP,
the runtime torch uses) split the panels; rows are taken ROW_CHUNK at a time.
"""

from __future__ import annotations

import ctypes

import torch

from workers import native_build
from workers.kernels.prefill_gemm import keeps_packed, prefill_linear
from workers.kernels.small_linear import _cpu_identity
from workers.native_build import LibrarySpec, NativeUnavailable

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16   /* floats per vector: 32 registers hold 12 rows x 2 vectors of accumulators */
#define MR 12
#else
#define VL 8    /* 16 registers: 6 rows x 2 vectors */
#define MR 6
#endif
#define NR (2 * VL)
#define PREFETCH_STEPS 16
#define ROW_CHUNK 256
#define CHUNK_STEPS 64          /* steps of K per chunk of a panel: 4 KB of weights (8 KB with AVX-512) */
#define CHUNKED_MAX_BLOCKS 8    /* chunk K for up to this many blocks of rows (48 rows, 96 with AVX-512) */

typedef float vf __attribute__((vector_size(VL * 4)));
static inline vf ld(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, vf v) { memcpy(p, &v, sizeof v); }

int cl_packed_panel_width(void) { return NR; }

/* W (N rows of K, row stride K) -> panels (ceil(N / NR), K, NR), zero past N. */
void cl_pack_panels(const float *w, float *out, long N, long K, int threads) {
    long panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long p = 0; p < panels; p++)
        for (long k = 0; k < K; k++)
            for (long j = 0; j < NR; j++) {
                long n = p * NR + j;
                out[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.f;
            }
}

/* `rows` (<= MR) rows of x against steps k0..k1 of one panel. The accumulators stay in registers
   for those steps and are carried between chunks of K in acc (2 vectors per row): every output is
   still the sum over k in order, so the chunk size never changes a bit of the result. Prefetch:
   `pf` steps ahead of k (0: none). */
static inline __attribute__((always_inline)) void block(int rows, long pf, const float *x, long ldx,
                                                         const float *panel, long k0, long k1, vf *acc) {
    vf a0[MR], a1[MR];
    for (int i = 0; i < MR; i++) {
        if (i < rows && k0 > 0) { a0[i] = acc[2 * i]; a1[i] = acc[2 * i + 1]; }
        else { a0[i] = (vf){0}; a1[i] = (vf){0}; }
    }
    for (long k = k0; k < k1; k++) {
        if (pf) {
            __builtin_prefetch(panel + (k + pf) * NR);
            __builtin_prefetch(panel + (k + pf) * NR + VL);
        }
        vf w0 = ld(panel + k * NR), w1 = ld(panel + k * NR + VL);
        for (int i = 0; i < MR; i++)
            if (i < rows) { float xv = x[i * ldx + k]; a0[i] += xv * w0; a1[i] += xv * w1; }
    }
    for (int i = 0; i < rows; i++) { acc[2 * i] = a0[i]; acc[2 * i + 1] = a1[i]; }
}

/* Each block size in three prefetch variants: PREFETCH_STEPS ahead, a chunk ahead, none. */
#define BLOCK(R) \
    static void block_##R##_near(const float *x, long ldx, const float *p, long k0, long k1, vf *acc) \
        { block(R, PREFETCH_STEPS, x, ldx, p, k0, k1, acc); } \
    static void block_##R##_next(const float *x, long ldx, const float *p, long k0, long k1, vf *acc) \
        { block(R, CHUNK_STEPS, x, ldx, p, k0, k1, acc); } \
    static void block_##R##_none(const float *x, long ldx, const float *p, long k0, long k1, vf *acc) \
        { block(R, 0, x, ldx, p, k0, k1, acc); }
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)
#if MR == 12
BLOCK(7) BLOCK(8) BLOCK(9) BLOCK(10) BLOCK(11) BLOCK(12)
#endif
typedef void (*block_fn)(const float *, long, const float *, long, long, vf *);
enum { NEAR, NEXT, NONE };
#define VARIANTS(R) {block_##R##_near, block_##R##_next, block_##R##_none}
static const block_fn BLOCKS[MR + 1][3] = {{0, 0, 0}, VARIANTS(1), VARIANTS(2), VARIANTS(3), VARIANTS(4),
    VARIANTS(5), VARIANTS(6)
#if MR == 12
    , VARIANTS(7), VARIANTS(8), VARIANTS(9), VARIANTS(10), VARIANTS(11), VARIANTS(12)
#endif
};

/* y (M x N, row stride N) = x (M x K, row stride ldx) W^T (+ bias), W as cl_pack_panels left it.
   Rows are taken ROW_CHUNK at a time so that they stay in cache while every panel passes over them.
   With a few blocks of rows (a decode step), each panel goes by in chunks of CHUNK_STEPS steps of K
   that every block multiplies in turn while the chunk is in L1: the first block streams it from
   memory, the second prefetches the next chunk, so that the memory reads of one chunk overlap the
   arithmetic of the last. Without chunks, the first block streamed the panel with nothing else to
   do, and the others ran from L2 with memory idle. Many blocks (a prefill) take K whole, which
   measured faster there. */
void cl_packed_linear(const float *x, long ldx, const float *panels, const float *bias, float *y,
                      long M, long N, long K, int threads) {
    long count = (N + NR - 1) / NR;
    for (long m0 = 0; m0 < M; m0 += ROW_CHUNK) {
        long m1 = m0 + ROW_CHUNK < M ? m0 + ROW_CHUNK : M;
        long blocks = (m1 - m0 + MR - 1) / MR;
        int chunked = blocks > 1 && blocks <= CHUNKED_MAX_BLOCKS;
        long steps = chunked ? CHUNK_STEPS : K;
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (long p = 0; p < count; p++) {
            vf acc[(ROW_CHUNK + MR - 1) / MR][2 * MR];
            const float *panel = panels + p * K * NR;
            long nvalid = N - p * NR < NR ? N - p * NR : NR;
            for (long k0 = 0; k0 < K; k0 += steps) {
                long k1 = k0 + steps < K ? k0 + steps : K;
                for (long b = 0; b < blocks; b++) {
                    long m = m0 + b * MR, rows = m1 - m < MR ? m1 - m : MR;
                    int variant = !chunked || b == 0 ? NEAR : b == 1 ? NEXT : NONE;
                    BLOCKS[rows][variant](x + m * ldx, ldx, panel, k0, k1, acc[b]);
                }
            }
            for (long b = 0; b < blocks; b++) {
                long m = m0 + b * MR, rows = m1 - m < MR ? m1 - m : MR;
                for (long i = 0; i < rows; i++) {
                    float t[NR], *out = y + (m + i) * N + p * NR;
                    st(t, acc[b][2 * i]); st(t + VL, acc[b][2 * i + 1]);
                    for (long j = 0; j < nvalid; j++) out[j] = bias ? t[j] + bias[p * NR + j] : t[j];
                }
            }
        }
    }
}
"""

_OPERATOR_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

/* corelaunch::packed_linear_kernel's CPU kernel, registered with the dispatcher when the library
   loads (a call from Python costs about 3 us here against 11 us for the same body in Python). */
static at::Tensor packed_linear_cpu(const at::Tensor &x, const at::Tensor &panels, int64_t out_features,
                                    const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && panels.dim() == 3
                && panels.is_contiguous() && panels.size(1) > 0 && x.size(-1) == panels.size(1)
                && panels.size(2) == cl_packed_panel_width() && out_features > 0
                && out_features <= panels.size(0) * panels.size(2)
                && out_features > (panels.size(0) - 1) * panels.size(2),
                "packed_linear_kernel takes float32 x (..., K > 0) and panels (count, K, ", cl_packed_panel_width(),
                ") packed by this build for out_features rows; got x ", x.sizes(), " ", x.scalar_type(), ", panels ",
                panels.sizes(), ", out_features ", out_features);
    TORCH_CHECK(!bias.has_value() || bias->numel() == out_features, "packed_linear_kernel: bias has ",
                bias.has_value() ? bias->numel() : 0, " elements, not out_features ", out_features);
    int64_t k = panels.size(1);
    at::Tensor rows = x.contiguous();
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out_features;
    at::Tensor out = at::empty(shape, x.options());
    at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    cl_packed_linear(rows.data_ptr<float>(), k, panels.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                     out.data_ptr<float>(), rows.numel() / k, out_features, k, at::get_num_threads());
    return out;
}

TORCH_LIBRARY_IMPL(corelaunch, CPU, m) { m.impl("packed_linear_kernel", &packed_linear_cpu); }
"""


_KERNEL_FLAGS = ("-O3", "-march=native", "-fopenmp")


def _host_spec() -> LibrarySpec:
    """The kernel with its torch operator, compiled as C++ against this torch."""
    return native_build.torch_operator_spec("corelaunch_packed_linear", _SOURCE, _OPERATOR_SOURCE, _KERNEL_FLAGS,
                                            "the packed-panel linear kernel", _cpu_identity())


NARROW_SPEC = LibrarySpec("corelaunch_packed_linear_narrow", _SOURCE, (*_KERNEL_FLAGS, "-mno-avx512f"),
                          "the packed-panel linear kernel without AVX-512", _cpu_identity())
"""The kernel alone (C, no operator) without AVX-512 (8-float vectors, 6-row blocks), on any host:
tests and the benchmark check both block sets through run_kernel."""

unavailable_reason: str | None = None


def turned_off() -> bool:
    """CORELAUNCH_PACKED_WEIGHTS=0 in this process's environment."""
    return native_build.turned_off("CORELAUNCH_PACKED_WEIGHTS")


def _library() -> ctypes.CDLL | None:
    """The host's build, loaded (which registers the operator's CPU kernel), or None when it is
    turned off or cannot be built (the reason is kept in `unavailable_reason`)."""
    global unavailable_reason
    lib, unavailable_reason = native_build.load_unless_turned_off("CORELAUNCH_PACKED_WEIGHTS", _host_build)
    return lib


@native_build.once_per_process
def _host_build() -> ctypes.CDLL | str:
    """The host's library, or why it cannot be built: tried once per process (a second copy loaded
    would register the operator's kernel again)."""
    try:
        return build_and_load(_host_spec())
    except NativeUnavailable as err:
        return str(err)


def build_and_load(spec: LibrarySpec) -> ctypes.CDLL:
    """Build (once per source, flags and CPU) and load the library; raises NativeUnavailable."""
    lib = native_build.build_and_load(spec)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.cl_pack_panels.argtypes, lib.cl_pack_panels.restype = [p, p, i64, i64, i32], None
    lib.cl_packed_linear.argtypes = [p, i64, p, p, p, i64, i64, i64, i32]
    lib.cl_packed_linear.restype = None
    lib.cl_packed_panel_width.argtypes, lib.cl_packed_panel_width.restype = [], ctypes.c_int
    return lib


def available() -> bool:
    """Whether the library is built and loaded (built now if needed)."""
    return _library() is not None


def pack(weight: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """A float32 (N, K) weight as panels (ceil(N / NR), K, NR) for `lib` (the host's build by default)."""
    lib = lib or _library()
    if lib is None:
        raise RuntimeError(f"the packed-panel kernel is unavailable: {unavailable_reason}")
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"packing takes a 2-D float32 CPU weight, not {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    n, k = weight.shape
    width = lib.cl_packed_panel_width()
    weight = weight.contiguous()
    panels = torch.empty(((n + width - 1) // width, k, width), dtype=torch.float32)
    lib.cl_pack_panels(weight.data_ptr(), panels.data_ptr(), n, k, torch.get_num_threads())
    return panels


def unpack(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The (out_features, K) weight back from its panels (a copy; for checks and tests)."""
    count, k, width = panels.shape
    return panels.permute(0, 2, 1).reshape(count * width, k)[:out_features].contiguous()


UNPACK_MIN_ROWS = 1024
"""Products of at least this many rows (prefills) unpack the weight into a temporary for the prefill
GEMM where one is chosen over this kernel (prefill_gemm.py: on Intel CPUs, and AMD ones without
AVX-512): there MKL's GEMM was faster than this kernel (machines E and M; on machines L and R this
kernel was the faster), and one copy of the weight costs a few percent of such a product."""


def run_kernel(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, out_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """(..., K) x panels -> (..., out_features) through a given build (the op's body; tests run others)."""
    k = panels.shape[1]
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty((rows.shape[0], out_features), dtype=torch.float32)
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    lib.cl_packed_linear(rows.data_ptr(), k, panels.data_ptr(), None if bias is None else bias.data_ptr(),
                         out.data_ptr(), rows.shape[0], out_features, k, torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)


# The operator's schema and its shape function live here, so that torch.compile can trace it before
# anything is built; its CPU kernel is C++, in the library (_OPERATOR_SOURCE), registered when
# _library() loads it. A model is only packed after that (workers/packed_weight.py).
_OPS = torch.library.Library("corelaunch", "FRAGMENT")
_OPS.define("packed_linear_kernel(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor")


@torch.library.register_fake("corelaunch::packed_linear_kernel")
def _packed_linear_shape(x, panels, out_features, bias):
    return x.new_empty((*x.shape[:-1], out_features))


def packed_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) with W packed by `pack`: one operator call in a compiled graph. Products of
    UNPACK_MIN_ROWS rows or more (prefills) take prefill_linear on the weight unpacked for the call
    where the prefill GEMM chosen is not the packed kernel itself (prefill_gemm.py)."""
    if x.numel() // x.shape[-1] >= UNPACK_MIN_ROWS and not keeps_packed():
        return prefill_linear(x, unpack(panels, out_features), bias)
    return torch.ops.corelaunch.packed_linear_kernel(x, panels, out_features, bias)
