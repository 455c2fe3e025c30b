"""Products of a few fp32 rows with int8 weights on CPUs with AVX2, in a small C++ kernel of
sfi's own.

Why a kernel of our own: a one-token decode step's time is its weights' bytes over the memory
bandwidth, so int8 weights pay only if the product reads them near bandwidth. Where the CPU has
AVX-512, inductor's compiled reduction does (:mod:`sfi.weights.reduction`); with AVX2 alone it loads
the int8 weights through a partial-vector copy and reads about 1.3-1.5 GB/s, and PyTorch's own
int8 weight-only kernels are slower than fp32 (``docs/eval/weight-formats.md``). This kernel
rounds each row of ``x`` to int16 (``q = round(x / s)``, ``|q| <= 16383``: at most 1/32766 of
the row's largest value off per element, far below the int8 weights' own rounding), multiplies
sixteen weights at a time with ``vpmaddwd`` into int32 sums (flushed to fp32 every 4,096
inputs, so they cannot overflow), and splits the output rows over ATen's threads: rows of
2,048 inputs and more four at a time, shorter rows one at a time, so that the weights are
read as one stream (which of the two was faster for Qwen2.5-0.5B's shapes on a 2-core Zen 3
EPYC: ``scripts/weight_products.py``). :func:`reference_product` is the same product
in PyTorch, unrounded: the tests hold the kernel to it (:func:`close`).

It is built on first use with ``torch.utils.cpp_extension`` (a C++ compiler, and ninja, a
dependency of sfi; about a minute, once per Python environment: the build is kept in sfi's
cache folder) and used only where it builds, passes a check product and the CPU has AVX2 and
no AVX-512 (:func:`available`, :func:`why_not`); elsewhere the compiled reduction runs. To
the compiler it is one operator (``torch.ops.sfi.int8_gemv``) that a compiled step calls as it
is.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

from sfi.cache_folder import cache_root
from sfi.notices import notice_once

#: set to ``0`` to run the compiled reduction instead of the kernel
ENV_SWITCH = "SFI_INT8_KERNEL"
#: seconds after which the build folder's lock is taken for a dead build's: a build takes about
#: a minute, and ``torch.utils.cpp_extension`` waits for a lock with no end
STALE_LOCK_S = 600.0

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

// x rounded to int16 (q = round(x / sx), |q| <= 16383, per input row), the
// products summed as int32 by vpmaddwd sixteen weights at a time, flushed to float every
// 4096 inputs (|sum| < 2^31), times sx and scale[o]
inline __m256i widen16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
}
// the eight lanes' sum in int64: each lane is below 2^30 between flushes, their sum may not be
inline int64_t hsum_i(__m256i v) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256((__m256i*)lanes, v);
  int64_t s = 0;
  for (int k = 0; k < 8; ++k) s += lanes[k];
  return s;
}
constexpr int64_t FLUSH = 4096;

// one output row at a time, four sums over consecutive 16-input chunks, the row 1 KB ahead
// prefetched: the weights read as one stream, for short rows (under LONG_ROW inputs), where
// four rows at a time make four short streams that the CPU's prefetcher follows poorly
void rows_i8_one(const int16_t* xq, const float* sx, int64_t R, int64_t in, const int8_t* w,
                 const float* scale, int64_t o0, int64_t o1, int64_t out, float* y) {
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* wo = w + o * in;
    for (int64_t r = 0; r < R; ++r) {
      const int16_t* xr = xq + r * in;
      float s = 0;
      for (int64_t c0 = 0; c0 < in; c0 += FLUSH) {
        const int64_t c1 = std::min(in, c0 + FLUSH);
        __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
        __m256i a2 = _mm256_setzero_si256(), a3 = _mm256_setzero_si256();
        int64_t i = c0;
#define SFI_MADD(a, j) a = _mm256_add_epi32(a, _mm256_madd_epi16( \
          widen16(wo + (j)), _mm256_loadu_si256((const __m256i*)(xr + (j)))));
        for (; i + 64 <= c1; i += 64) {
          if (r == 0) _mm_prefetch((const char*)(wo + 1024 + i), _MM_HINT_T0);
          SFI_MADD(a0, i) SFI_MADD(a1, i + 16) SFI_MADD(a2, i + 32) SFI_MADD(a3, i + 48)
        }
        for (; i + 16 <= c1; i += 16) SFI_MADD(a0, i)
#undef SFI_MADD
        int64_t t = hsum_i(a0) + hsum_i(a1) + hsum_i(a2) + hsum_i(a3);
        for (; i < c1; ++i) t += (int64_t)wo[i] * xr[i];
        s += (float)t;
      }
      y[r * out + o] = s * sx[r] * scale[o];
    }
  }
}

// long rows (LONG_ROW inputs and more): four output rows at a time over one x load, the same
// place in the next four rows prefetched; the last out % 4 rows one at a time
void rows_i8(const int16_t* xq, const float* sx, int64_t R, int64_t in, const int8_t* w,
             const float* scale, int64_t o0, int64_t o1, int64_t out, float* y) {
  int64_t o = o0;
  for (; o + 4 <= o1; o += 4) {
    const int8_t* wr[4] = {w + o * in, w + (o + 1) * in, w + (o + 2) * in, w + (o + 3) * in};
    const int64_t ahead = 4 * in;  // the same place in the next four rows
    for (int64_t r = 0; r < R; ++r) {
      const int16_t* xr = xq + r * in;
      float s[4] = {0, 0, 0, 0};
      for (int64_t c0 = 0; c0 < in; c0 += FLUSH) {
        const int64_t c1 = std::min(in, c0 + FLUSH);
        __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
        __m256i a2 = _mm256_setzero_si256(), a3 = _mm256_setzero_si256();
        int64_t i = c0;
#define SFI_STEP(j) { \
          __m256i xv = _mm256_loadu_si256((const __m256i*)(xr + (j))); \
          a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(widen16(wr[0] + (j)), xv)); \
          a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(widen16(wr[1] + (j)), xv)); \
          a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(widen16(wr[2] + (j)), xv)); \
          a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(widen16(wr[3] + (j)), xv)); }
        if (r == 0) {  // the first row reads the weights from memory: prefetch the next block's
          for (; i + 64 <= c1; i += 64) {
            for (int k = 0; k < 4; ++k)
              _mm_prefetch((const char*)(wr[k] + ahead + i), _MM_HINT_T0);
            SFI_STEP(i) SFI_STEP(i + 16) SFI_STEP(i + 32) SFI_STEP(i + 48)
          }
        }
        for (; i + 16 <= c1; i += 16) SFI_STEP(i)
#undef SFI_STEP
        int64_t t[4] = {hsum_i(a0), hsum_i(a1), hsum_i(a2), hsum_i(a3)};
        for (; i < c1; ++i)
          for (int k = 0; k < 4; ++k) t[k] += (int64_t)wr[k][i] * xr[i];
        for (int k = 0; k < 4; ++k) s[k] += (float)t[k];
      }
      float* yr = y + r * out + o;
      for (int k = 0; k < 4; ++k) yr[k] = s[k] * sx[r] * scale[o + k];
    }
  }
  rows_i8_one(xq, sx, R, in, w, scale, o, o1, out, y);  // the last rows
}

constexpr int64_t LONG_ROW = 2048;

}  // namespace

torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scale.device().is_cpu(),
              "sfi::int8_gemv runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(),
              "w must be a contiguous [out, in] int8 matrix");
  const int64_t out = w.size(0), in = w.size(1);
  TORCH_CHECK(x.size(-1) == in, "x's last dimension must be w's in");
  auto flat = x.reshape({-1, in}).contiguous();
  const int64_t R = flat.size(0);
  auto y = torch::empty({R, out}, x.options());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == out, "scale: [out] fp32");
  auto scale_c = scale.contiguous();
  const float* scale_ptr = scale_c.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // long rows four at a time in tasks of 64 rows; short rows one at a time in tasks of 256
  const bool long_rows = in >= LONG_ROW;
  const int64_t block = long_rows ? 64 : 256, blocks = (out + block - 1) / block;
  // each input row rounded to int16: |q| <= 16383, so that two products and 256 sums of
  // them stay within int32 between flushes
  // in one pass per row here rather than as five ATen operators per product: a decode step
  // makes about 170 of these products
  std::vector<int16_t> xq(R * in);
  std::vector<float> sx(R);
  const float* xp = flat.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    float largest = 1e-30f;
    for (int64_t i = 0; i < in; ++i) largest = std::max(largest, std::fabs(xp[r * in + i]));
    sx[r] = largest / 16383.0f;
    for (int64_t i = 0; i < in; ++i)
      xq[r * in + i] = (int16_t)std::nearbyint(xp[r * in + i] / sx[r]);
  }
  const int16_t* xqp = xq.data();
  const float* sxp = sx.data();
  const int8_t* wp = w.data_ptr<int8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const int64_t o0 = b0 * block, o1 = std::min(out, b1 * block);
    if (long_rows)
      rows_i8(xqp, sxp, R, in, wp, scale_ptr, o0, o1, out, yp);
    else
      rows_i8_one(xqp, sxp, R, in, wp, scale_ptr, o0, o1, out, yp);
  });
  auto shape = x.sizes().vec();
  shape.back() = out;
  return y.view(shape);
}
"""

_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


def reference_product(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's product in PyTorch: ``x [..., in]`` fp32, ``w [out, in]`` int8, ``scale
    [out]`` fp32 -> ``x @ (w * scale).T`` ``[..., out]``."""
    return (x @ w.to(x.dtype).T) * scale


def close(got: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-3) -> bool:
    """Whether the kernel's product is within ``tolerance`` of the largest magnitude of
    ``expected``, the reference's."""
    bound = tolerance * float(expected.abs().max().clamp(min=1e-30))
    return got.shape == expected.shape and float((got - expected).abs().max()) <= bound


def cpu_takes_kernel() -> bool:
    """Whether this CPU has AVX2 and no AVX-512 (``torch.backends.cpu``), and FMA beside them
    (``/proc/cpuinfo`` on Linux)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or \
            torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            flags = next((line for line in info if line.startswith("flags")), "").split()
    except OSError:
        return False
    return {"avx2", "fma"} <= set(flags)


@cache
def _built() -> tuple[Any | None, str]:
    """``(the built kernel module, "")``, or ``(None, why not)``."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"{ENV_SWITCH}=0"
    if not cpu_takes_kernel():
        return None, "not a CPU with AVX2 and FMA but without AVX-512"
    from torch.utils.cpp_extension import load_inline

    # one build per environment: another's headers and paths would make ninja build again
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + torch.__version__ + sys.prefix
                             ).encode())
    name = f"sfi_int8_gemv_{digest.hexdigest()[:12]}"
    folder = cache_root() / "extensions" / name
    # the ninja of sfi's own environment (a dependency) where the environment is not activated
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(folder)
        module = load_inline(name=name, cpp_sources=_SOURCE, functions=["int8_gemv"],
                             extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                             build_directory=str(folder), verbose=False)
    except Exception as exc:  # no compiler, no headers: the reduction runs instead
        return None, f"it did not build ({type(exc).__name__}: {str(exc)[:200]})"
    finally:
        os.environ["PATH"] = path
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=generator)
    w = torch.randint(-127, 128, (9, 40), dtype=torch.int8, generator=generator)
    scale = torch.rand(9, generator=generator)
    if not close(module.int8_gemv(x, w, scale), reference_product(x, w, scale)):
        return None, "it built but its check product disagreed with the reference"
    return module, ""


def clear_stale_lock(folder: Path, stale_after: float = STALE_LOCK_S) -> bool:
    """Remove the build lock in ``folder`` where it is older than ``stale_after`` seconds: what
    a build left that was stopped (Ctrl-C, a killed process) before it let go of the lock,
    which ``torch.utils.cpp_extension`` would otherwise wait for forever. True where one was
    removed."""
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime <= stale_after:
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    notice_once(f"sfi: removed a stale build lock of the int8 kernel ({lock}), left by a build "
                "that was stopped")
    return True


def _extension() -> Any | None:
    """The built kernel module, or None where it does not build or run here."""
    return _built()[0]


def why_not() -> str:
    """Why the kernel does not run here ("" where it does)."""
    return _built()[1]


def available() -> bool:
    """Whether the kernel runs here (built on the first call; see the module)."""
    return _extension() is not None


@torch.library.custom_op("sfi::int8_gemv", mutates_args=())
def int8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., in]`` fp32 times ``w [out, in]`` int8 (contiguous) scaled by ``scale [out]``
    fp32 -> ``[..., out]`` fp32. Meant for a few rows (a decode step's); the kernel where
    :func:`available`, else :func:`reference_product`."""
    module = _extension()
    if module is None:
        return reference_product(x, w, scale)
    return module.int8_gemv(x, w, scale)


@int8_gemv.register_fake
def _int8_gemv_shape(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])
