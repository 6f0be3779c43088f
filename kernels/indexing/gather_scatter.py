"""gather, scatter (src / value / reduce), scatter_add and scatter_reduce."""

from __future__ import annotations

from typing import Any

from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jnp, lax
from torch_tpu.kernels.indexing._common import _divide_count, _identity, _nonempty, _scatter_apply, _wrap_dim
from torch_tpu.kernels.registry import lower


# ---- gather / scatter ----

def _check_index_dtype(op: str, self: Any, index: Any, src: Any | None = None) -> None:
    """ATen's scatter_gather_dtype_check."""
    if index.size and index.dtype not in (jnp.int64, jnp.int32):
        raise RuntimeError(f"{op}(): Expected dtype int32/int64 for index")
    if src is not None and src.dtype != self.dtype:
        raise RuntimeError(f"{op}(): Expected self.dtype to be equal to src.dtype")


def _size(x: Any, d: int) -> int:
    """ATen's ensure_nonempty_size: a 0-d tensor has size 1; a missing dim raises its IndexError."""
    return 1 if x.ndim == 0 else x.shape[_wrap_dim(d, x.ndim)]


def _gather_check(self: Any, dim: int, index: Any) -> int:
    """ATen's gather meta checks, in its order; returns the wrapped dim."""
    dim = _wrap_dim(dim, self.ndim)
    _check_index_dtype("gather", self, index)
    if index.size == 0:
        return dim
    if max(index.ndim, 1) != max(self.ndim, 1):
        raise RuntimeError("Index tensor must have the same number of dimensions as input tensor")
    for d in range(max(self.ndim, 1)):
        if d != dim and _size(index, d) > _size(self, d):
            raise RuntimeError(
                f"Size does not match at dimension {d} expected index {list(index.shape)} to be no larger than "
                f"self {list(self.shape)} apart from dimension {dim}"
            )
    return dim


def _scatter_check(op: str, self: Any, dim: int, index: Any, src: Any | None = None) -> int:
    """ATen's scatter meta checks (scatter_gather_dtype_check, scatter_shape_check), in its order; `src` is None
    for the value overloads. Returns the wrapped dim."""
    dim = _wrap_dim(dim, self.ndim)
    _check_index_dtype(op, self, index, src)
    if index.size == 0:
        return dim
    if max(index.ndim, 1) != max(self.ndim, 1):
        raise RuntimeError("Index tensor must have the same number of dimensions as self tensor")
    dims = range(max(self.ndim, 1))
    wrong = any(d != dim and _size(index, d) > _size(self, d) for d in dims)
    if not wrong and src is not None:
        wrong = any(_size(index, d) > _size(src, d) for d in dims)
    if src is None:
        if wrong:
            raise RuntimeError(f"Expected index {list(index.shape)} to be no larger than self "
                               f"{list(self.shape)} apart from dimension {dim}")
        return dim
    if max(src.ndim, 1) != max(index.ndim, 1):
        raise RuntimeError("Index tensor must have the same number of dimensions as src tensor")
    if wrong:
        raise RuntimeError(
            f"Expected index {list(index.shape)} to be no larger than self {list(self.shape)} apart from "
            f"dimension {dim} and to be no larger size than src {list(src.shape)}"
        )
    return dim


def _scatter_coords(index: Any, dim: int) -> tuple[Any, ...]:
    """Full coordinates of each element of `index` with `index` itself along `dim`."""
    return tuple(index if d == dim else lax.broadcasted_iota(jnp.int64, index.shape, d) for d in range(index.ndim))


def _region(src: Any, shape: tuple[int, ...]) -> Any:
    """The leading `shape` block of `src` (scatter reads only the index's extent of src)."""
    return src[tuple(slice(0, s) for s in shape)]


@lower("gather", checks=True)
def gather(self: Any, dim: int, index: Any, sparse_grad: bool = False) -> Any:
    dim = _gather_check(self, dim, index)
    if index.size == 0:
        return jnp.zeros(index.shape, self.dtype)
    x, idx = _nonempty(self), _nonempty(index)
    report_bad_index("gather", idx, x.shape[dim], dim, error=RuntimeError)
    coords = _scatter_coords(idx.astype(jnp.int64), dim)
    return x[coords].reshape(index.shape)


def _scatter(op: str, self: Any, dim: int, index: Any, src: Any, reduce: str, include_self: bool = True,
             src_is_tensor: bool = True) -> Any:
    """`self` with `src` (a tensor, or a value broadcast to the index) scattered by `reduce` along `dim`, which the
    caller has checked and wrapped with _scatter_check."""
    x, idx = _nonempty(self), _nonempty(index)
    if idx.size == 0:
        return self
    src = jnp.broadcast_to(src, idx.shape) if not src_is_tensor else _nonempty(src)
    report_bad_index(op, idx, x.shape[dim], dim, error=RuntimeError)
    values = _region(src, tuple(idx.shape)).astype(x.dtype)
    coords = _scatter_coords(idx, dim)
    if reduce == "set":
        return x.at[coords].set(values).reshape(self.shape)
    if not include_self:
        x = x.at[coords].set(jnp.asarray(_identity(reduce, x.dtype), x.dtype))
    out = _scatter_apply(x.at[coords], reduce, values)
    if reduce == "mean":
        count = jnp.full(x.shape, 1 if include_self else 0, jnp.int64).at[coords].add(1)
        out = _divide_count(out, jnp.maximum(count, 1))
    return out.reshape(self.shape)


_SCATTER_REDUCE = {"add": "sum", "multiply": "prod"}


def _scatter_reduce_name(reduce: str) -> str:
    if reduce not in _SCATTER_REDUCE:
        raise RuntimeError("reduce argument must be either add or multiply.")
    return _SCATTER_REDUCE[reduce]


@lower("scatter.src", checks=True)
def scatter_src(self: Any, dim: int, index: Any, src: Any) -> Any:
    dim = _scatter_check("scatter", self, dim, index, src)
    return _scatter("scatter", self, dim, index, src, "set")


@lower("scatter.value", checks=True)
def scatter_value(self: Any, dim: int, index: Any, value: Any) -> Any:
    dim = _scatter_check("scatter", self, dim, index)
    return _scatter("scatter", self, dim, index, jnp.asarray(value).astype(self.dtype), "set",
                    src_is_tensor=False)


@lower("scatter.reduce", checks=True)
def scatter_reduce_src(self: Any, dim: int, index: Any, src: Any, reduce: str) -> Any:
    dim = _scatter_check("scatter", self, dim, index, src)
    return _scatter("scatter", self, dim, index, src, _scatter_reduce_name(reduce))


@lower("scatter.value_reduce", checks=True)
def scatter_value_reduce(self: Any, dim: int, index: Any, value: Any, reduce: str) -> Any:
    dim = _scatter_check("scatter", self, dim, index)
    return _scatter("scatter", self, dim, index, jnp.asarray(value).astype(self.dtype),
                    _scatter_reduce_name(reduce), src_is_tensor=False)


@lower("scatter_add", checks=True)
def scatter_add(self: Any, dim: int, index: Any, src: Any) -> Any:
    dim = _scatter_check("scatter_add", self, dim, index, src)
    return _scatter("scatter_add", self, dim, index, src, "sum")


@lower("scatter_reduce.two", checks=True)
def scatter_reduce(self: Any, dim: int, index: Any, src: Any, reduce: str, include_self: bool = True) -> Any:
    dim = _scatter_check("scatter_reduce", self, dim, index, src)
    if reduce not in ("sum", "prod", "mean", "amax", "amin"):
        raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")
    return _scatter("scatter_reduce", self, dim, index, src, reduce, include_self)
