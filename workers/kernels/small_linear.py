"""y = x W^T (* scale) (+ bias) for a few rows of x, by a small C kernel: fp32, int8 and fp8 weights.

On the cpu backend float32 weights are packed as column panels and take packed_linear.py instead;
this kernel serves 8-bit weights, and float32 ones only where they are not packed
(CORELAUNCH_PACKED_WEIGHTS=0, or a weight of another backend on the CPU).

Why: a decode step multiplies 1 to 16 rows (the running sequences) by every weight. That is
memory traffic, not arithmetic, and the library paths stream the weights slowly there:
- float32, 2-16 rows: MKL's GEMM (F.linear) reaches a fraction of the host's read bandwidth (it
  packs the weight panel for a large product that never comes); the compiled multiply-and-sum
  that serves one row well (workers/layers.py) gets slower than MKL from about 8 rows;
- int8 / fp8: inductor's generated loops convert the 8-bit weight at 1-2 GB/s, so a quantized
  decode ran at a quarter of float32's speed (README, Measured).
This kernel reads each weight row once per call and multiplies it into every row of x while it is
in cache: a block of 1, 2 or 4 rows of x against 8, 4 or 2 weight rows, eight float lanes per
step (GCC vector extensions, compiled with -march=native for the host's instruction set). Hosts
with AVX-512 have 32 vector registers, not 16, and take wider blocks (2 x 8 and 4 x 4: 16
accumulators, each loaded vector used in more multiplies): 1.09-1.19x faster from 2 to 32 rows
on machine D (README, Measured; benchmarks/small_linear_blocks.py). 8-bit
weights are widened to float in registers: int8 by conversion, fp8 by moving its exponent and
mantissa bits into a float32 and rescaling by a power of two (exact, subnormals included). A
per-channel scale multiplies each output once after its sum. Threads (OpenMP, the same runtime
torch uses) split the output columns.

Results are not bit-identical to F.linear (another summation order); every call of a model goes
through the same path whether compiled or eager, so the two agree with each other.

The kernel is a torch custom operator (`corelaunch::small_linear`), so a compiled graph keeps it
as one call. CORELAUNCH_SMALL_LINEAR=0 turns it off (the library paths are used); without a C
compiler it is off and the library paths run.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import torch

from workers import native_build
from workers.native_build import LibrarySpec, NativeUnavailable

MAX_ROWS = 16
"""Products with at most this many rows of x take the kernel (decode steps of up to 16 sequences)
where the build has 16 vector registers; max_rows() says what the host's build takes."""
WIDE_MAX_ROWS = 32
"""The same with AVX-512's 32 registers and wider blocks, which still beat MKL's GEMM at 24 and 32
rows on machine D (1.13x and 1.09x over a decode step's products; README, Measured)."""

WEIGHT_TYPES = {torch.float32: 0, torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

enum { W_F32 = 0, W_I8 = 1, W_F8E4M3 = 2, W_F8E5M2 = 3 };

static inline v8f load_f32(const float *p) { v8f v; memcpy(&v, p, 32); return v; }

/* 8 weights from row storage at element k, as floats (unscaled). */
static inline v8f load_w(const void *row, long k, int wtype) {
    if (wtype == W_F32) return load_f32((const float *)row + k);
    const uint8_t *b = (const uint8_t *)row + k;
    if (wtype == W_I8) {
        const int8_t *s = (const int8_t *)b;
        v8i i = {s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]};
        return __builtin_convertvector(i, v8f);
    }
    v8u u = {b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]};
    v8u sign = (u & 0x80u) << 24;
    v8f f;
    if (wtype == W_F8E4M3) {  /* exponent bias 7: place e|m at f32 bits 20..26, rescale by 2^(127-7) */
        v8u bits = sign | ((u & 0x7Fu) << 20);
        memcpy(&f, &bits, 32);
        return f * 0x1p120f;
    }
    v8u bits = sign | ((u & 0x7Fu) << 21);  /* e5m2: bias 15, rescale by 2^(127-15) */
    memcpy(&f, &bits, 32);
    return f * 0x1p112f;
}

static inline float load_w1(const void *row, long k, int wtype) {
    if (wtype == W_F32) return ((const float *)row)[k];
    if (wtype == W_I8) return (float)((const int8_t *)row)[k];
    uint32_t u = ((const uint8_t *)row)[k], bits;
    float f;
    if (wtype == W_F8E4M3) { bits = ((u & 0x80u) << 24) | ((u & 0x7Fu) << 20); memcpy(&f, &bits, 4); return f * 0x1p120f; }
    bits = ((u & 0x80u) << 24) | ((u & 0x7Fu) << 21); memcpy(&f, &bits, 4); return f * 0x1p112f;
}

static inline float hsum(v8f v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* MB rows of x against NB rows of w: y[m][n] = (sum_k x[m][k] w[n][k]) * scale + bias */
#define DEFINE_BLOCK(MB, NB)                                                                              \
static void block_##MB##x##NB(const float *x, long ldx, const char *w, long wrow, int wtype, long K,         \
                              const float *scale, int per_channel, const float *bias, float *y, long ldy,     \
                              long m0, long n0, long nc) {                                                    \
    v8f acc[MB][NB];                                                                                      \
    for (int i = 0; i < MB; i++) for (int j = 0; j < NB; j++) acc[i][j] = (v8f){0};                        \
    long K8 = K & ~7L;                                                                                    \
    for (long k = 0; k < K8; k += 8) {                                                                    \
        v8f wv[NB];                                                                                       \
        for (int j = 0; j < NB; j++) wv[j] = j < nc ? load_w(w + (n0 + j) * wrow, k, wtype) : (v8f){0};   \
        for (int i = 0; i < MB; i++) {                                                                    \
            v8f xv = load_f32(x + (m0 + i) * ldx + k);                                                    \
            for (int j = 0; j < NB; j++) acc[i][j] += xv * wv[j];                                         \
        }                                                                                                 \
    }                                                                                                     \
    for (int i = 0; i < MB; i++)                                                                          \
        for (int j = 0; j < nc; j++) {                                                                    \
            float s = hsum(acc[i][j]);                                                                    \
            for (long k = K8; k < K; k++) s += x[(m0 + i) * ldx + k] * load_w1(w + (n0 + j) * wrow, k, wtype); \
            if (scale) s *= scale[per_channel ? n0 + j : 0];                                               \
            y[(m0 + i) * ldy + n0 + j] = bias ? s + bias[n0 + j] : s;                                      \
        }                                                                                                 \
}

DEFINE_BLOCK(1, 8)
#if defined(__AVX512F__) && defined(__AVX512VL__)
/* 32 vector registers (256-bit ones need AVX-512VL): blocks of 16 accumulators (each loaded vector feeds 2-4 multiplies, not 1-2). */
DEFINE_BLOCK(2, 8)
DEFINE_BLOCK(4, 4)
#define PAIR_NB 8
#define QUAD_NB 4
#define block_pair block_2x8
#define block_quad block_4x4
#else
/* 16 vector registers: blocks of 8 accumulators. */
DEFINE_BLOCK(2, 4)
DEFINE_BLOCK(4, 2)
#define PAIR_NB 4
#define QUAD_NB 2
#define block_pair block_2x4
#define block_quad block_4x2
#endif

#define NCHUNK 8

#if defined(__AVX512F__) && defined(__AVX512VL__)
int cl_small_linear_wide(void) { return 1; }
#else
int cl_small_linear_wide(void) { return 0; }
#endif

/* y (M x N, row stride N) = x (M x K, row stride ldx) W^T (* scale) (+ bias); W is N rows of K
   elements of wtype, contiguous. Threads split N in chunks of NCHUNK rows. */
void cl_small_linear(const float *x, long ldx, const void *w, int wtype, const float *scale, int per_channel,
                     const float *bias, float *y, long M, long N, long K, int threads) {
    long wrow = K * (wtype == W_F32 ? 4 : 1);
    long chunks = (N + NCHUNK - 1) / NCHUNK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < chunks; c++) {
        long n_start = c * NCHUNK, n_stop = n_start + NCHUNK < N ? n_start + NCHUNK : N;
        long m = 0;
        for (; m + 4 <= M; m += 4)
            for (long n = n_start; n < n_stop; n += QUAD_NB)
                block_quad(x, ldx, (const char *)w, wrow, wtype, K, scale, per_channel, bias, y, N, m, n,
                           n_stop - n < QUAD_NB ? n_stop - n : QUAD_NB);
        for (; m + 2 <= M; m += 2)
            for (long n = n_start; n < n_stop; n += PAIR_NB)
                block_pair(x, ldx, (const char *)w, wrow, wtype, K, scale, per_channel, bias, y, N, m, n,
                           n_stop - n < PAIR_NB ? n_stop - n : PAIR_NB);
        for (; m < M; m++)
            block_1x8(x, ldx, (const char *)w, wrow, wtype, K, scale, per_channel, bias, y, N, m, n_start,
                      n_stop - n_start);
    }
}
"""


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and flags (a cache shared by several hosts
    keeps one library per kind of CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.processor() or platform.machine()


SPEC = LibrarySpec("corelaunch_small_linear", _SOURCE, ("-O3", "-march=native", "-fopenmp"),
                   "the small-batch linear kernel", _cpu_identity())
NARROW_SPEC = replace(SPEC, stem="corelaunch_small_linear_narrow", flags=SPEC.flags + ("-mno-avx512f",))
"""The same source without AVX-512: the 16-register blocks, on any host (a test and a benchmark
compare it with the host's build)."""


@native_build.once_per_process
def _library() -> ctypes.CDLL | None:
    """The loaded kernel, or None when it is turned off or cannot be built (the reason is kept in
    `unavailable_reason`)."""
    global unavailable_reason
    if native_build.turned_off("CORELAUNCH_SMALL_LINEAR"):
        unavailable_reason = "turned off by CORELAUNCH_SMALL_LINEAR=0"
        return None
    try:
        return build_and_load(SPEC)
    except NativeUnavailable as err:
        unavailable_reason = str(err)
        return None


def build_and_load(spec: LibrarySpec) -> ctypes.CDLL:
    """Build (once per source, flags and CPU) and load a kernel library; raises NativeUnavailable."""
    lib = native_build.build_and_load(spec)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.cl_small_linear.argtypes = [p, i64, p, i32, p, i32, p, p, i64, i64, i64, i32]
    lib.cl_small_linear.restype = None
    lib.cl_small_linear_wide.argtypes, lib.cl_small_linear_wide.restype = [], ctypes.c_int
    return lib


unavailable_reason: str | None = None


def available() -> bool:
    """Whether the library is built and loaded (built now if needed). A constant to torch.compile
    once mark_constants_for_tracing() has run: evaluated once while tracing, never a graph break."""
    return _library() is not None


def max_rows() -> int:
    """The most rows of x the host's build takes (WIDE_MAX_ROWS with the AVX-512 blocks, else
    MAX_ROWS); 0 when the kernel is unavailable. A constant to torch.compile, as available() is."""
    lib = _library()
    return 0 if lib is None else WIDE_MAX_ROWS if lib.cl_small_linear_wide() else MAX_ROWS


def mark_constants_for_tracing() -> None:
    """Tells torch.compile to take available() and max_rows() as constants (usable() calls them in
    every traced linear). Done here, by whoever is about to compile (workers/compiled.py), rather
    than by decorators: those would import torch._dynamo with this module, about 2 s of start-up
    on a 2-core host for every eager rank, which never compiles."""
    import torch._dynamo

    for fn in (available, max_rows):
        torch._dynamo.assume_constant_result(fn)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel runs x W^T: float32 x of at most max_rows() rows on the CPU, a 2-D weight
    of a supported dtype, and the library available."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in WEIGHT_TYPES and available()
            and x.numel() // max(1, x.shape[-1]) <= max_rows())


def small_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """(..., in) x (out, in) -> (..., out), times scale ((out, 1) or (1,)) and plus bias (out,).

    The operator only while torch.compile traces: run eagerly, torch wraps a Python operator's
    kernel so that its first call imports the whole of torch._dynamo (2-3 s of CPU on a 2-core
    host), which an eager rank never needs."""
    if torch.compiler.is_compiling():
        return torch.ops.corelaunch.small_linear(x, weight, scale, bias)
    return _run_library_kernel(x, weight, scale, bias)


@torch.library.custom_op("corelaunch::small_linear", mutates_args=())
def _small_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    return _run_library_kernel(x, weight, scale, bias)


def _run_library_kernel(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                        bias: torch.Tensor | None) -> torch.Tensor:
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the small-batch linear kernel is unavailable: {unavailable_reason}")
    return run_kernel(lib, x, weight, scale, bias)


def run_kernel(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
               bias: torch.Tensor | None) -> torch.Tensor:
    """small_linear through a given build of the library (the op's body; tests run other builds).
    The C code reads raw pointers: anything but what it reads is refused here (a bfloat16 x was read
    as float32, twice its bytes, and faulted at the end of a page)."""
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in WEIGHT_TYPES and weight.device.type == "cpu" and x.shape[-1] == weight.shape[1]):
        raise ValueError(f"small_linear takes float32 x (..., in) on the CPU and a 2-D CPU weight (out, in) of "
                         f"{', '.join(map(str, WEIGHT_TYPES))}; got x {tuple(x.shape)} {x.dtype} on {x.device}, "
                         f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device}")
    n, k = weight.shape
    if scale is not None and scale.numel() not in (1, n):
        raise ValueError(f"small_linear's scale has {scale.numel()} elements; it takes 1 or out ({n})")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"small_linear's bias has {bias.numel()} elements; it takes out ({n})")
    rows = x.reshape(-1, k).contiguous()
    weight = weight.contiguous()
    scale = None if scale is None else scale.reshape(-1).to(torch.float32).contiguous()
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    lib.cl_small_linear(rows.data_ptr(), k, weight.data_ptr(), WEIGHT_TYPES[weight.dtype],
                        None if scale is None else scale.data_ptr(), int(scale is not None and scale.numel() > 1),
                        None if bias is None else bias.data_ptr(), out.data_ptr(), rows.shape[0], n, k,
                        torch.get_num_threads())
    return out.view(*x.shape[:-1], n)


@_small_linear.register_fake
def _small_linear_shape(x, weight, scale, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
