"""Grouped (ragged) matmul for mixture-of-experts: the lowering of `aten::_grouped_mm` (also `torch.tpu.ops.grouped_matmul`).

`torch._grouped_mm(mat_a, mat_b, offs)` takes the layouts PyTorch's CUDA and fallback kernels take (`offs` int32,
the cumulative group ends along the ragged dimension):
- 2d x 3d: a [M, K], b [G, K, N] -> [M, N]; rows offs[g-1]:offs[g] of a times b[g] (the MoE forward);
- 3d x 2d: a [G, M, K], b [K, N] -> [M, N]; columns offs[g-1]:offs[g] of b times a[g];
- 2d x 2d: a [M, K], b [K, N] -> [G, M, N]; a[:, offs[g-1]:offs[g]] times b[offs[g-1]:offs[g]] (the weight gradient);
- 3d x 3d: a batched matmul, no offs.
Rows (or columns) past offs[-1] are zeros here (PyTorch leaves them uninitialised). Offsets that decrease or run past
the ragged extent raise at the next synchronisation (a device-side assertion, as CUDA asserts), after a clamped,
in-bounds computation.

Two paths, chosen by `_select.path("grouped_matmul", fits)`:
- the megablox Pallas kernels of jax (`jax.experimental.pallas.ops.tpu.megablox`: `gmm` for the ragged-rows layouts,
  `tgmm` for the ragged contraction), where the tiles fit the TPU's (8, 128) layout and the dtype is bfloat16 or
  float32;
- the XLA reference, `jax.lax.ragged_dot` / `ragged_dot_general` (float32 at HIGHEST precision; reduced precision
  accumulates in float32).
Autograd is PyTorch's own formula for `_grouped_mm` (derivatives.yaml), which calls `_grouped_mm` again with the
transposed layouts, so the backward runs these kernels too.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch_tpu import _runtime
from torch_tpu._checks import report_assert
from torch_tpu._jax import jax, jnp
from torch_tpu.kernels.pallas import _select
from torch_tpu.kernels.registry import lower

KERNEL = "grouped_matmul"
_OP = "_grouped_mm"


def _gmm_module() -> Any:
    # (the megablox package re-exports the custom_vjp function `gmm` under the name of its module `gmm`)
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _sublanes(dtype: Any) -> int:
    return 16 if dtype == jnp.bfloat16 else 8


def _lane_tile(n: int) -> int:
    """A tile along a lane dimension: 128, or the whole dimension when it is smaller (Mosaic takes a block equal to
    the array's extent); the kernels mask a ragged last tile."""
    return 128 if n >= 128 else n


def gmm_tiling(m: int, k: int, n: int, dtype: Any) -> tuple[int, int, int] | None:
    """(tm, tk, tn) for `gmm` (lhs [m, k], rows ragged), or None where the kernel does not fit: tm must divide m and
    be a multiple of the sublane count."""
    if dtype not in (jnp.bfloat16, jnp.float32) or min(m, k, n) == 0:
        return None
    sub = _sublanes(dtype)
    tm = next((t for t in (128, 64, 32, 16, 8) if t % sub == 0 and m % t == 0), None)
    return None if tm is None else (tm, _lane_tile(k), _lane_tile(n))


def tgmm_tiling(m: int, k: int, n: int, dtype: Any) -> tuple[int, int, int] | None:
    """(tm, tk, tn) for `tgmm` (lhs [k, m], rhs [m, n], m the ragged contraction): m is a lane dimension of lhs, so tm
    is 128 (dividing m) or m itself when m is at most 128."""
    if dtype not in (jnp.bfloat16, jnp.float32) or min(m, k, n) == 0:
        return None
    if m % 128 == 0:
        tm = 128
    elif m <= 128 and m % _sublanes(dtype) == 0:
        tm = m
    else:
        return None
    sub = _sublanes(dtype)
    tk = k if k < 128 else 128
    if tk % sub and tk != k:
        return None
    return tm, tk, _lane_tile(n)


def _precision(dtype: Any) -> Any:
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def gmm_reference(lhs: Any, rhs: Any, group_sizes: Any, out_dtype: Any) -> Any:
    """The XLA path of `ragged_rows`: `jax.lax.ragged_dot` (rows past the groups are zero)."""
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=_precision(lhs.dtype), preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def gmm_pallas(lhs: Any, rhs: Any, group_sizes: Any, out_dtype: Any, tiling: tuple[int, int, int],
               interpret: bool) -> Any:
    """The Pallas path of `ragged_rows`: megablox `gmm` (float32 accumulation), rows past the groups zeroed."""
    with jax.enable_x64(False):  # (the kernel's index arithmetic is int32; the backend runs with x64 on)
        out = _gmm_module().gmm(lhs, rhs, group_sizes, preferred_element_type=out_dtype, tiling=tiling,
                                interpret=interpret)
    covered = jnp.arange(lhs.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes)  # (gmm leaves those rows unwritten)
    return jnp.where(covered[:, None], out, jnp.zeros((), out.dtype))


def tgmm_reference(lhs: Any, rhs: Any, group_sizes: Any, out_dtype: Any) -> Any:
    """The XLA path of `ragged_contraction`: `jax.lax.ragged_dot_general` with the contraction ragged."""
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [0]), ([], [])),
                                             lhs_ragged_dimensions=[1], rhs_group_dimensions=[])
    out = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims, precision=_precision(lhs.dtype),
                                     preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def tgmm_pallas(lhs: Any, rhs: Any, group_sizes: Any, out_dtype: Any, tiling: tuple[int, int, int],
                interpret: bool) -> Any:
    """The Pallas path of `ragged_contraction`: megablox `tgmm` (an empty group gives zeros)."""
    with jax.enable_x64(False):
        return _gmm_module().tgmm(lhs, rhs, group_sizes, preferred_element_type=out_dtype, tiling=tiling,
                                  interpret=interpret)


def ragged_rows(lhs: Any, rhs: Any, group_sizes: Any, out_dtype: Any) -> Any:
    """out[rows of group g] = lhs[rows of group g] @ rhs[g]: lhs [m, k], rhs [G, k, n], group_sizes [G] int32 summing to
    at most m -> [m, n]; rows past the groups are zero."""
    m, k = lhs.shape
    tiling = gmm_tiling(m, k, rhs.shape[2], lhs.dtype) if lhs.dtype == rhs.dtype else None
    chosen = _select.path(KERNEL, tiling is not None)
    if chosen == "reference":
        return gmm_reference(lhs, rhs, group_sizes, out_dtype)
    return gmm_pallas(lhs, rhs, group_sizes, out_dtype, tiling, _select.interpret(chosen))


def ragged_contraction(lhs: Any, rhs: Any, group_sizes: Any, out_dtype: Any) -> Any:
    """out[g] = lhs[:, group g] @ rhs[group g, :]: lhs [k, m], rhs [m, n], group_sizes [G] over the contraction m
    -> [G, k, n] (an empty group gives zeros)."""
    k, m = lhs.shape
    tiling = tgmm_tiling(m, k, rhs.shape[1], lhs.dtype) if lhs.dtype == rhs.dtype else None
    chosen = _select.path(KERNEL, tiling is not None)
    if chosen == "reference":
        return tgmm_reference(lhs, rhs, group_sizes, out_dtype)
    return tgmm_pallas(lhs, rhs, group_sizes, out_dtype, tiling, _select.interpret(chosen))


_FLOATS = ("float32", "bfloat16", "float16")  # names, not jnp dtypes: this module loads at `import torch`, JAX lazily


def _dtype_name(dtype: Any) -> str:
    try:
        t = _runtime.torch_dtype(dtype)
    except Exception:
        return str(dtype)
    return {"float64": "Double", "int32": "Int", "int64": "Long", "bool": "Bool", "int8": "Char", "uint8": "Byte",
            "int16": "Short", "complex64": "ComplexFloat", "complex128": "ComplexDouble"}.get(
                str(t).removeprefix("torch."), str(t))


def _validate(a: Any, b: Any, offs: Any, bias: Any, out_dtype: Any) -> None:
    """PyTorch's checks of `_grouped_mm` (its messages), on the static shapes and dtypes."""
    for name, x in (("mat_a", a), ("mat_b", b)):
        if jnp.dtype(x.dtype).name not in _FLOATS:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {_dtype_name(x.dtype)}")
    for name, x in (("mat_a", a), ("mat_b", b)):
        if x.ndim not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected mat_a and mat_b to have the same dtype, but got: {_dtype_name(a.dtype)} != "
                           f"{_dtype_name(b.dtype)} (aten::_grouped_mm, shapes {list(a.shape)} and {list(b.shape)})")
    a2, b2 = a.ndim == 2, b.ndim == 2
    if not a2 and not b2 and a.shape[0] != b.shape[0]:
        raise RuntimeError("batched dimension has to match")
    if not (a2 and b2) and a.shape[-1] != b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if (offs is not None) != (a2 or b2):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        if offs.ndim != 1:
            raise RuntimeError("offs has to be 1D")
        if offs.dtype != jnp.int32:
            raise RuntimeError("Offsets have to be int32")
        if a2 != b2 and offs.shape[0] != (b if a2 else a).shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if out_dtype is not None and _runtime.jax_dtype(out_dtype) != a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")


def _group_sizes(offs: Any, extent: int, what: str) -> Any:
    """Group sizes from cumulative ends `offs`; asserts on the device that they are non-decreasing and within
    [0, extent], and computes with clamped ends so a bad value never reads out of bounds."""
    ok = jnp.all(offs >= 0) & jnp.all(offs <= extent)
    if offs.shape[0] > 1:
        ok = ok & jnp.all(offs[1:] >= offs[:-1])
    report_assert(_OP, ok, f"torch._grouped_mm: offs must be non-decreasing int32 group ends in [0, {extent}] (the "
                           f"{what} of the ragged operand, {offs.shape[0]} groups); got values outside that")
    ends = jax.lax.cummax(jnp.clip(offs, 0, extent))
    return jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype)).astype(jnp.int32)


@lower(_OP, variants=False, checks=True)
def grouped_mm(self: Any, mat2: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
    _validate(self, mat2, offs, bias, out_dtype)
    dtype = self.dtype
    a2, b2 = self.ndim == 2, mat2.ndim == 2
    if not a2 and not b2:
        out = jnp.matmul(self, mat2, precision=_precision(dtype), preferred_element_type=jnp.float32)
        return out.astype(dtype)
    if a2 and not b2:  # rows of a ragged
        return ragged_rows(self, mat2, _group_sizes(offs, self.shape[0], "rows"), dtype)
    if not a2:  # columns of b ragged: out.T[group g] = b.T[group g] @ a[g].T
        sizes = _group_sizes(offs, mat2.shape[1], "columns")
        return ragged_rows(mat2.T, jnp.swapaxes(self, 1, 2), sizes, dtype).T
    # (2d x 2d: PyTorch checks no contraction extents; offs slices both operands, so the shorter one bounds it)
    k = min(self.shape[1], mat2.shape[0])
    sizes = _group_sizes(offs, k, "shared dimension")
    return ragged_contraction(self[:, :k], mat2[:k], sizes, dtype)
