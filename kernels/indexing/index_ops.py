"""The index_* family, a 1-d index along one dim: index_select, index_add, index_copy, index_fill and
index_reduce."""

from __future__ import annotations

from typing import Any

from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jnp
from torch_tpu.kernels.indexing._common import (_divide_count, _dtype_name, _identity, _nonempty, _scatter_apply,
                                                _wrap_dim)
from torch_tpu.kernels.registry import lower


# ---- the index_* family (a 1-d index along one dim) ----

def _check_index_vector(op: str, index: Any) -> None:
    if index.ndim > 1:
        raise IndexError(
            f"{op}(): Index is supposed to be a vector, but got dim: {index.ndim} with type: "
            f"{_dtype_name(index.dtype)} and size: {list(index.shape)}"
        )
    if index.dtype not in (jnp.int64, jnp.int32):
        raise RuntimeError(f"{op}(): Expected dtype int32/int64 for index but got: {_dtype_name(index.dtype)}")


def _along(self: Any, dim: int, index: Any, values: Any, reduce: str) -> Any:
    """`self` with its slices `index` along `dim` combined with `values` (dim-major slices) by `reduce`."""
    x = jnp.moveaxis(_nonempty(self), dim, 0)
    ref = x.at[index.reshape(-1)]
    out = ref.set(values) if reduce == "set" else _scatter_apply(ref, reduce, values)
    return jnp.moveaxis(out, 0, dim).reshape(self.shape)


def _source_slices(source: Any, dim: int, dtype: Any) -> Any:
    return jnp.moveaxis(_nonempty(source), dim, 0).astype(dtype)


@lower("index_select", checks=True)
def index_select(self: Any, dim: int, index: Any) -> Any:
    if index.dtype not in (jnp.int64, jnp.int32):
        raise RuntimeError("index_select(): Expected dtype int32 or int64 for index")
    if index.ndim > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    dim = _wrap_dim(dim, self.ndim)
    report_bad_index("index_select", index, self.shape[dim] if self.ndim else 1, dim)
    if self.ndim == 0:
        return jnp.take(self.reshape(1), index.reshape(()), axis=0)
    if index.size == 0 or self.shape[dim] == 0:
        shape = list(self.shape)
        shape[dim] = index.size
        return jnp.zeros(shape, self.dtype)
    return jnp.take(self, index.reshape(-1), axis=dim, mode="clip")


@lower("index_add", checks=True)
def index_add(self: Any, dim: int, index: Any, source: Any, alpha: Any = 1) -> Any:
    _check_index_vector("index_add_", index)
    if source.dtype != self.dtype:
        raise RuntimeError(
            f"index_add_(): self ({_dtype_name(self.dtype)}) and source ({_dtype_name(source.dtype)}) "
            "must have the same scalar type"
        )
    dim = _wrap_dim(dim, self.ndim)
    report_bad_index("index_add_", index, self.shape[dim] if self.ndim else 1, dim, error=RuntimeError)
    src = (_source_slices(source, dim, source.dtype) * alpha).astype(self.dtype)
    return _along(self, dim, index, src, "sum")


@lower("index_copy", checks=True)
def index_copy(self: Any, dim: int, index: Any, source: Any) -> Any:
    if index.ndim > 1:
        raise IndexError("index_copy_(): Index should have dimension 1 or 0 (got %d)" % index.ndim)
    if index.dtype != jnp.int64:
        raise RuntimeError("index_copy_(): Expected a long tensor for index, but got " + _dtype_name(index.dtype))
    if source.dtype != self.dtype:
        raise RuntimeError(
            f"index_copy_(): self and source expected to have the same dtype, but got (self) "
            f"{_dtype_name(self.dtype)} and (source) {_dtype_name(source.dtype)}"
        )
    dim = _wrap_dim(dim, self.ndim)
    report_bad_index("index_copy_", index, self.shape[dim] if self.ndim else 1, dim)
    return _along(self, dim, index, _source_slices(source, dim, self.dtype), "set")


@lower("index_fill.int_Scalar", "index_fill.int_Tensor", checks=True)
def index_fill(self: Any, dim: int, index: Any, value: Any) -> Any:
    if getattr(value, "ndim", 0) != 0:
        raise RuntimeError(
            f"index_fill_ only supports a 0-dimensional value tensor, but got tensor with {value.ndim} dimension(s)."
        )
    if index.ndim > 1:
        raise RuntimeError("Index has to be a vector/scalar")
    if index.dtype != jnp.int64:
        raise IndexError("index_fill_(): Expected dtype int64 for index.")
    dim = _wrap_dim(dim, self.ndim)
    report_bad_index("index_fill_", index, self.shape[dim] if self.ndim else 1, dim, negative=True)
    return _along(self, dim, index, jnp.asarray(value).astype(self.dtype), "set")


@lower("index_reduce", checks=True)
def index_reduce(self: Any, dim: int, index: Any, source: Any, reduce: str, include_self: bool = True) -> Any:
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise RuntimeError(f"index_reduce(): Expected reduce to be one of prod, mean, amax or amin but got {reduce}.")
    _check_index_vector("index_reduce_", index)
    if source.dtype != self.dtype:
        raise RuntimeError(
            f"index_reduce_(): self ({_dtype_name(self.dtype)}) and source ({_dtype_name(source.dtype)}) "
            "must have the same scalar type"
        )
    dim = _wrap_dim(dim, self.ndim)
    report_bad_index("index_reduce_", index, self.shape[dim] if self.ndim else 1, dim)
    src = _source_slices(source, dim, self.dtype)
    x = self
    if not include_self:
        x = _along(x, dim, index, jnp.asarray(_identity(reduce, self.dtype), self.dtype), "set")
    out = _along(x, dim, index, src, reduce)
    if reduce == "mean":
        n = self.shape[dim] if self.ndim else 1
        count = jnp.full((n,), 1 if include_self else 0, jnp.int64).at[index.reshape(-1)].add(1)
        shape = [1] * max(self.ndim, 1)
        shape[dim] = n
        out = _divide_count(out, jnp.maximum(count, 1).reshape(shape)).reshape(self.shape)
    return out
