"""Indexing, joining and shape ops: advanced indexing (index / index_put), gather and scatter, the index_* family,
masked fills and masked_select, cat, nonzero / unique / bincount (data-dependent shapes, run eagerly), flips, rolls, repeats,
triangles, padding and diagonals.

Data-dependent lowerings (`jit=False`) receive concrete arrays; they do the shape-deciding work eagerly and
hand the rest to small cached `jax.jit` functions so results stay on the inputs' device.

Index values are checked on the device (torch_tpu/_checks.py): every op that indexes with a tensor (index /
index_put integer indices, gather, scatter*, index_select, index_add/copy/fill/reduce, take, put, embedding)
calls `report_bad_index` while it is traced, and an out-of-range index raises the error CPU raises (IndexError or
RuntimeError) at the next synchronization point, as CUDA's device-side asserts do. The computed values of such
an op are unspecified (XLA clamps gathers and drops scattered updates), never returned without the error.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import numpy as np
import torch

from torch_tpu import _runtime
from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels.registry import dtype_name, lower, result_dtype

# ---- helpers ----

def _wrap_dim(dim: int, ndim: int) -> int:
    """PyTorch's dim wrapping (a 0-d tensor accepts dims -1 and 0)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def _dtype_name(dtype: Any) -> str:
    """PyTorch's short dtype name ("Float", "Long") of a JAX dtype, as error messages print it."""
    return dtype_name(_runtime.torch_dtype(dtype))


def _is_int(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def _is_bool(dtype: Any) -> bool:
    return dtype == jnp.bool_


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _nonempty(x: Any) -> Any:
    """0-d arrays as 1-element 1-d ones (PyTorch's ensure_nonempty_dim for gather/scatter)."""
    return x.reshape(1) if x.ndim == 0 else x


def _device_of(x: Any) -> Any:
    return next(iter(x.devices()))


def _host(x: Any) -> np.ndarray:
    """A concrete array's value on the host (a sync: only for data-dependent shapes and checks)."""
    return np.asarray(jax.device_get(x))


def _lowest(dtype: Any) -> Any:
    if _is_bool(dtype):
        return False
    if _is_int(dtype):
        return jnp.iinfo(dtype).min
    return -jnp.inf


def _highest(dtype: Any) -> Any:
    if _is_bool(dtype):
        return True
    if _is_int(dtype):
        return jnp.iinfo(dtype).max
    return jnp.inf


def _identity(reduce: str, dtype: Any) -> Any:
    return {"sum": 0, "mean": 0, "prod": 1, "amax": _lowest(dtype), "amin": _highest(dtype)}[reduce]


def _scatter_apply(ref: Any, reduce: str, values: Any) -> Any:
    """`ref` (an `x.at[...]` helper) combined with `values` by `reduce` (bool sums/products are or/and)."""
    dtype = values.dtype
    if reduce == "set":
        return ref.set(values)
    if reduce in ("sum", "mean"):
        return ref.max(values) if _is_bool(dtype) else ref.add(values)
    if reduce == "prod":
        return ref.min(values) if _is_bool(dtype) else ref.multiply(values)
    if reduce == "amax":
        return ref.max(values)
    if reduce == "amin":
        return ref.min(values)
    raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")


def _divide_count(x: Any, count: Any) -> Any:
    """The mean step of scatter_reduce / index_reduce: true division for floats, floor division else."""
    if _is_float(x.dtype):
        return (x / count.astype(x.dtype)).astype(x.dtype)
    return jnp.floor_divide(x, count.astype(x.dtype)).astype(x.dtype)


# ---- advanced indexing: index.Tensor, index_put ----

def _is_mask(idx: Any) -> bool:
    return idx.dtype == jnp.bool_ or idx.dtype == jnp.uint8


def _expand_indices(shape: tuple[int, ...], indices: Sequence[Any], op: str) -> tuple[list[Any], tuple[int, ...]]:
    """PyTorch's index preprocessing on concrete arrays: bool/byte masks become their nonzero coordinates
    (a 0-d mask indexes a new unit dim), integer indices are bounds-checked on the device. Returns the per-dim
    index list (None = full slice) and the shape to index (self's, with the unit dims inserted)."""
    used = sum(1 if i is None or not _is_mask(i) else i.ndim for i in indices)
    if used > len(shape):
        raise IndexError(f"too many indices for tensor of dimension {len(shape)}")
    expanded = list(shape)
    out: list[Any] = []
    checks: list[tuple[int, Any, int]] = []  # (position among the non-null indices, index, size)
    dim = 0
    for idx in indices:
        if idx is None:
            out.append(None)
            dim += 1
        elif _is_mask(idx):
            if idx.ndim == 0:
                expanded.insert(dim, 1)
                idx = idx.reshape(1)
            for j in range(idx.ndim):
                if idx.shape[j] != expanded[dim + j]:
                    raise IndexError(
                        f"The shape of the mask {list(idx.shape)} at index {j} does not match the shape of the "
                        f"indexed tensor {expanded} at index {dim + j}"
                    )
            out.extend(_mask_coords(idx))
            dim += idx.ndim
        elif idx.dtype in (jnp.int64, jnp.int32):
            if idx.size:
                checks.append((sum(i is not None for i in out), idx, expanded[dim]))
            out.append(idx)
            dim += 1
        else:
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    arrays = [i for i in out if i is not None]
    try:
        np.broadcast_shapes(*[i.shape for i in arrays])
    except ValueError:
        shapes = ", ".join(str(list(i.shape)) for i in arrays)
        raise IndexError(
            f"shape mismatch: indexing tensors could not be broadcast together with shapes {shapes}"
        ) from None
    for k, idx, size in checks:  # PyTorch numbers the dimension among the indices given
        report_bad_index(op, idx, size, k, negative=True)
    return out, tuple(expanded)


@functools.lru_cache(maxsize=None)
def _count_fn() -> Callable[..., Any]:
    return jax.jit(lambda x: jnp.count_nonzero(x))


def _mask_coords(mask: Any) -> list[Any]:
    """The coordinates of a concrete mask's true elements, one index array per mask dim."""
    coords = _nonzero_fn(int(_count_fn()(mask)))(mask, -1)
    return [coords[:, d] for d in range(mask.ndim)]


@functools.lru_cache(maxsize=None)
def _bounds_fn(n: int) -> Callable[..., Any]:
    def f(*arrs: Any) -> Any:
        return jnp.stack([jnp.stack([a.min(), a.max()]).astype(jnp.int64) for a in arrs])

    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def _index_fn(pattern: tuple[bool, ...]) -> Callable[..., Any]:
    def f(x: Any, *arrs: Any) -> Any:
        it = iter(arrs)
        return x[tuple(next(it) if p else slice(None) for p in pattern)]

    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def _index_put_fn(pattern: tuple[bool, ...], accumulate: bool) -> Callable[..., Any]:
    def f(x: Any, values: Any, *arrs: Any) -> Any:
        it = iter(arrs)
        ref = x.at[tuple(next(it) if p else slice(None) for p in pattern)]
        values = values.astype(x.dtype)
        return _scatter_apply(ref, "sum", values) if accumulate else ref.set(values)

    return jax.jit(f)


@lower("index.Tensor", jit=False, cpu_tensors=True, checks=True)
def index(self: Any, indices: Sequence[Any]) -> Any:
    idx, shape = _expand_indices(tuple(self.shape), indices, "index")
    x = self.reshape(shape) if shape != tuple(self.shape) else self
    pattern = tuple(i is not None for i in idx)
    return _index_fn(pattern)(x, *[i for i in idx if i is not None])


@functools.lru_cache(maxsize=4096)
def _index_shape(pattern: tuple[bool, ...], shape: tuple[int, ...], index_shapes: tuple[tuple[int, ...], ...]) -> tuple:
    """The shape of `x[indices]` (numpy's advanced-indexing rules, which PyTorch shares)."""
    specs = [jax.ShapeDtypeStruct(s, jnp.int64) for s in index_shapes]
    return tuple(jax.eval_shape(_index_fn(pattern), jax.ShapeDtypeStruct(shape, jnp.float32), *specs).shape)


def _index_put(self: Any, indices: Sequence[Any], values: Any, accumulate: bool) -> Any:
    if values.dtype != self.dtype:
        raise RuntimeError(
            "Index put requires the source and destination dtypes match, got "
            f"{_dtype_name(self.dtype)} for the destination and {_dtype_name(values.dtype)} for the source."
        )
    idx, shape = _expand_indices(tuple(self.shape), indices, "index_put_")
    x = self.reshape(shape) if shape != tuple(self.shape) else self
    pattern = tuple(i is not None for i in idx)
    arrays = [i for i in idx if i is not None]
    target = _index_shape(pattern, tuple(x.shape), tuple(tuple(a.shape) for a in arrays))
    try:
        ok = np.broadcast_shapes(tuple(values.shape), target) == target
    except ValueError:
        ok = False
    if not ok:
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                           f"indexing result of shape {list(target)}")
    out = _index_put_fn(pattern, bool(accumulate))(x, values, *arrays)
    return out if x is self else out.reshape(self.shape)


@lower("index_put", jit=False, cpu_tensors=True, checks=True)
def index_put(self: Any, indices: Sequence[Any], values: Any, accumulate: bool = False) -> Any:
    return _index_put(self, indices, values, accumulate)


@lower("_index_put_impl", jit=False, cpu_tensors=True, checks=True)
def _index_put_impl(
    self: Any, indices: Sequence[Any], values: Any, accumulate: bool = False, unsafe: bool = False
) -> Any:
    return _index_put(self, indices, values, accumulate)


def _clamped_indices(shape: tuple[int, ...], indices: Sequence[Any]) -> tuple[Any, ...]:
    """Index key with each index wrapped and clamped into range (the `_unsafe_masked_*` ops' contract)."""
    key = []
    for d, i in enumerate(indices):
        if i is None:
            key.append(slice(None))
        else:
            n = shape[d]
            key.append(jnp.clip(jnp.where(i < 0, i + n, i), 0, max(n - 1, 0)))
    return tuple(key)


@lower("_unsafe_masked_index")
def _unsafe_masked_index(self: Any, mask: Any, indices: Sequence[Any], fill: Any) -> Any:
    taken = self[_clamped_indices(tuple(self.shape), indices)]
    return jnp.where(mask, taken, jnp.asarray(fill).astype(self.dtype))


@lower("_unsafe_masked_index_put_accumulate")
def _unsafe_masked_index_put_accumulate(self: Any, mask: Any, indices: Sequence[Any], values: Any) -> Any:
    values = jnp.where(mask, values, jnp.zeros((), values.dtype)).astype(self.dtype)
    return _scatter_apply(self.at[_clamped_indices(tuple(self.shape), indices)], "sum", values)


# ---- gather / scatter ----

def _check_index_dims(op: str, self: Any, dim: int, index: Any, src: Any | None = None) -> None:
    if max(index.ndim, 1) != max(self.ndim, 1):
        raise RuntimeError("Index tensor must have the same number of dimensions as self tensor"
                           if op != "gather" else
                           "Index tensor must have the same number of dimensions as input tensor")
    if index.size and index.dtype not in (jnp.int64, jnp.int32):
        raise RuntimeError(f"{op}(): Expected dtype int32/int64 for index")
    if src is not None and src.dtype != self.dtype:
        raise RuntimeError(f"{op}(): Expected self.dtype to be equal to src.dtype")


def _scatter_coords(index: Any, dim: int) -> tuple[Any, ...]:
    """Full coordinates of each element of `index` with `index` itself along `dim`."""
    return tuple(index if d == dim else lax.broadcasted_iota(jnp.int64, index.shape, d) for d in range(index.ndim))


def _region(src: Any, shape: tuple[int, ...]) -> Any:
    """The leading `shape` block of `src` (scatter reads only the index's extent of src)."""
    return src[tuple(slice(0, s) for s in shape)]


@lower("gather", checks=True)
def gather(self: Any, dim: int, index: Any, sparse_grad: bool = False) -> Any:
    if index.size == 0:  # PyTorch checks nothing for an empty index
        return jnp.zeros(index.shape, self.dtype)
    _check_index_dims("gather", self, dim, index)
    dim = _wrap_dim(dim, self.ndim)
    x, idx = _nonempty(self), _nonempty(index)
    for d in range(idx.ndim):
        if d != dim and idx.shape[d] > x.shape[d]:
            raise RuntimeError(
                f"Size does not match at dimension {d} expected index {list(index.shape)} to be no larger than "
                f"self {list(self.shape)} apart from dimension {dim}"
            )
    report_bad_index("gather", idx, x.shape[dim], dim, error=RuntimeError)
    coords = _scatter_coords(idx.astype(jnp.int64), dim)
    return x[coords].reshape(index.shape)


def _scatter(op: str, self: Any, dim: int, index: Any, src: Any, reduce: str, include_self: bool = True,
             src_is_tensor: bool = True) -> Any:
    dim = _wrap_dim(dim, self.ndim)
    x, idx = _nonempty(self), _nonempty(index)
    if idx.size == 0:
        return self
    src = jnp.broadcast_to(src, idx.shape) if not src_is_tensor else _nonempty(src)
    for d in range(idx.ndim):
        if (d != dim and idx.shape[d] > x.shape[d]) or idx.shape[d] > src.shape[d]:
            if not src_is_tensor:
                raise RuntimeError(f"Expected index {list(index.shape)} to be no larger than self "
                                   f"{list(self.shape)} apart from dimension {dim}")
            raise RuntimeError(
                f"Expected index {list(index.shape)} to be no larger than self {list(self.shape)} apart from "
                f"dimension {dim} and to be no larger size than src {list(src.shape)}"
            )
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
    _check_index_dims("scatter", self, dim, index, src)
    return _scatter("scatter", self, dim, index, src, "set")


@lower("scatter.value", checks=True)
def scatter_value(self: Any, dim: int, index: Any, value: Any) -> Any:
    _check_index_dims("scatter", self, dim, index)
    return _scatter("scatter", self, dim, index, jnp.asarray(value).astype(self.dtype), "set",
                    src_is_tensor=False)


@lower("scatter.reduce", checks=True)
def scatter_reduce_src(self: Any, dim: int, index: Any, src: Any, reduce: str) -> Any:
    _check_index_dims("scatter", self, dim, index, src)
    return _scatter("scatter", self, dim, index, src, _scatter_reduce_name(reduce))


@lower("scatter.value_reduce", checks=True)
def scatter_value_reduce(self: Any, dim: int, index: Any, value: Any, reduce: str) -> Any:
    _check_index_dims("scatter", self, dim, index)
    return _scatter("scatter", self, dim, index, jnp.asarray(value).astype(self.dtype),
                    _scatter_reduce_name(reduce), src_is_tensor=False)


@lower("scatter_add", checks=True)
def scatter_add(self: Any, dim: int, index: Any, src: Any) -> Any:
    _check_index_dims("scatter_add", self, dim, index, src)
    return _scatter("scatter_add", self, dim, index, src, "sum")


@lower("scatter_reduce.two", checks=True)
def scatter_reduce(self: Any, dim: int, index: Any, src: Any, reduce: str, include_self: bool = True) -> Any:
    _check_index_dims("scatter_reduce", self, dim, index, src)
    if reduce not in ("sum", "prod", "mean", "amax", "amin"):
        raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")
    return _scatter("scatter_reduce", self, dim, index, src, reduce, include_self)


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


# ---- masks ----

# C++ type names, as PyTorch prints a mask's dtype in masked_fill's error.
_CPP_NAMES = {
    torch.uint8: "unsigned char", torch.int8: "signed char", torch.int16: "short int", torch.int32: "int",
    torch.int64: "long int", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16", torch.float32: "float",
    torch.float64: "double",
}


def _check_mask(mask: Any) -> None:
    if mask.dtype != jnp.bool_:
        dtype = _runtime.torch_dtype(mask.dtype)
        raise RuntimeError(
            f"masked_fill_ only supports boolean masks, but got mask with dtype {_CPP_NAMES.get(dtype, dtype)}"
        )


@lower("masked_fill.Scalar", "masked_fill.Tensor")
def masked_fill(self: Any, mask: Any, value: Any) -> Any:
    _check_mask(mask)
    if getattr(value, "ndim", 0) != 0:
        raise RuntimeError(
            f"masked_fill_ only supports a 0-dimensional value tensor, but got tensor with {value.ndim} dimension(s)."
        )
    return jnp.where(mask, jnp.asarray(value).astype(self.dtype), self)


@lower("masked_scatter", checks=True)
def masked_scatter(self: Any, mask: Any, source: Any) -> Any:
    if mask.dtype != jnp.bool_:
        raise RuntimeError(
            f"masked_scatter_ only supports boolean masks, but got mask with dtype {_dtype_name(mask.dtype)}"
        )
    if source.dtype != self.dtype:
        raise RuntimeError(
            f"masked_scatter: expected self and source to have same dtypes but got{_dtype_name(self.dtype)} and "
            f"{_dtype_name(source.dtype)}"
        )
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    x = jnp.broadcast_to(self, shape)
    m = jnp.broadcast_to(mask, shape).reshape(-1)
    src = source.reshape(-1)
    need = jnp.cumsum(m.astype(jnp.int64)) - 1  # the source element each masked position takes
    report_bad_index("masked_scatter_", jnp.where(m, need, 0), src.size, error=RuntimeError,
                     message="{op}(): Number of elements of source < number of ones in mask (source has {size} "
                     "elements; element {value} was needed)")
    if src.size == 0:
        return x
    pos = jnp.clip(need, 0, src.size - 1)
    return jnp.where(m, src[pos], x.reshape(-1)).reshape(shape)


# ---- nonzero ----

@functools.lru_cache(maxsize=None)
def _nonzero_fn(size: int) -> Callable[..., Any]:
    def f(x: Any, fill: Any) -> Any:
        flat = (x != 0).reshape(-1)
        if x.ndim == 0:
            return jnp.zeros((size, 0), jnp.int64)
        if x.size == 0:
            return jnp.full((size, x.ndim), fill, jnp.int64)
        (pos,) = jnp.nonzero(flat, size=size, fill_value=-1)
        coords = jnp.stack(jnp.unravel_index(jnp.maximum(pos, 0), x.shape), axis=1).astype(jnp.int64)
        return jnp.where((pos >= 0)[:, None], coords, jnp.asarray(fill, jnp.int64))

    return jax.jit(f)


@lower("nonzero", jit=False)
def nonzero(self: Any) -> Any:
    return _nonzero_fn(int(_count_fn()(self)))(self, -1)


@lower("nonzero_static")
def nonzero_static(self: Any, size: int, fill_value: int = -1) -> Any:
    if size < 0:
        raise RuntimeError(f"nonzero_static: 'size' must be an non-negative integer, but got {size}")
    return _nonzero_fn(size)(self, fill_value)


# ---- flat take / put ----

_FLAT_OUT_OF_RANGE = "{op}(): out of range: tried to access index {value} on a tensor of {size} elements."


def _flat_index(index: Any, n: int) -> Any:
    index = index.astype(jnp.int64)
    return jnp.where(index < 0, index + n, index)


@lower("take", checks=True)
def take(self: Any, index: Any) -> Any:
    if index.dtype != jnp.int64:
        raise RuntimeError(f"take(): Expected a long tensor for index, but got {_dtype_name(index.dtype)}")
    flat = self.reshape(-1)
    report_bad_index("take", index, flat.size, negative=True, message=_FLAT_OUT_OF_RANGE)
    if flat.size == 0:
        return jnp.zeros(index.shape, self.dtype)
    return jnp.take(flat, _flat_index(index, flat.size), mode="clip")


@lower("put", checks=True)
def put(self: Any, index: Any, source: Any, accumulate: bool = False) -> Any:
    if index.dtype != jnp.int64:
        raise RuntimeError(f"put_(): Expected a long tensor for index, but got {_dtype_name(index.dtype)}")
    if source.dtype != self.dtype:
        raise RuntimeError(
            f"put_(): self and source expected to have the same dtype, but got self.dtype = "
            f"{_dtype_name(self.dtype)} and source.dtype = {_dtype_name(source.dtype)}"
        )
    if source.size != index.size:
        raise IndexError(
            "put_(): Expected source and index to have the same number of elements, but got source.numel() = "
            f"{source.size}, index.numel() = {index.size}"
        )
    flat = self.reshape(-1)
    if index.size == 0:
        return self
    report_bad_index("put_", index, flat.size, negative=True, message=_FLAT_OUT_OF_RANGE)
    ref = flat.at[_flat_index(index.reshape(-1), flat.size)]
    vals = source.reshape(-1)
    return (_scatter_apply(ref, "sum", vals) if accumulate else ref.set(vals)).reshape(self.shape)


# ---- flips, rolls, repeats, triangles ----

@lower("flip")
def flip(self: Any, dims: Sequence[int]) -> Any:
    wrapped = [_wrap_dim(d, self.ndim) for d in dims]
    seen: set[int] = set()
    for d in wrapped:
        if d in seen:
            raise RuntimeError(f"dim {d} appears multiple times in the list of dims")
        seen.add(d)
    if self.ndim == 0 or not wrapped:
        return self
    return jnp.flip(self, axis=tuple(wrapped))


@lower("roll")
def roll(self: Any, shifts: Sequence[int], dims: Sequence[int] = ()) -> Any:
    if not shifts:
        raise RuntimeError("`shifts` required")
    if not dims:
        if len(shifts) != 1:
            raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims:0")
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    if len(shifts) != len(dims):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims:{len(dims)}")
    if self.ndim == 0:
        return self
    return jnp.roll(self, tuple(shifts), axis=tuple(_wrap_dim(d, self.ndim) for d in dims))


@lower("repeat")
def repeat(self: Any, repeats: Sequence[int]) -> Any:
    if len(repeats) < self.ndim:
        raise RuntimeError(
            "Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor"
        )
    lead = len(repeats) - self.ndim
    shape = (1,) * lead + tuple(self.shape)
    out_shape = [s * r for s, r in zip(shape, repeats)]
    if any(r < 0 for r in repeats):
        bad = next(s for s in out_shape if s < 0)
        raise RuntimeError(f"Trying to create tensor with negative dimension {bad}: {out_shape}")
    return jnp.tile(self.reshape(shape), tuple(repeats))


@lower("tril")
def tril(self: Any, diagonal: int = 0) -> Any:
    if self.ndim < 2:
        raise RuntimeError("tril: input tensor must have at least 2 dimensions")
    return jnp.tril(self, diagonal)


@lower("triu")
def triu(self: Any, diagonal: int = 0) -> Any:
    if self.ndim < 2:
        raise RuntimeError("triu: input tensor must have at least 2 dimensions")
    return jnp.triu(self, diagonal)


_SCALAR_TYPES = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64,
    None, torch.complex64, torch.complex128, torch.bool, None, None, None, torch.bfloat16,
)


def _as_torch_dtype(dtype: Any, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, int):
        return _SCALAR_TYPES[dtype] or default
    return dtype


def _tri_indices(lower_: bool, row: int, col: int, offset: int, dtype: Any) -> Any:
    if row < 0 or col < 0:
        raise RuntimeError(f"row must be non-negative, got{row}" if row < 0 else f"col must be non-negative, got{col}")
    fn = np.tril_indices if lower_ else np.triu_indices
    rows, cols = fn(row, offset, col)
    out = np.stack([rows, cols]).astype(np.int64).reshape(2, -1)
    return jnp.asarray(out).astype(_runtime.jax_dtype(_as_torch_dtype(dtype, torch.int64)))


@lower("tril_indices")
def tril_indices(row: int, col: int, offset: int = 0, dtype: Any = None, layout: Any = None,
                 device: Any = None, pin_memory: Any = None) -> Any:
    return _tri_indices(True, row, col, offset, dtype)


@lower("triu_indices")
def triu_indices(row: int, col: int, offset: int = 0, dtype: Any = None, layout: Any = None,
                 device: Any = None, pin_memory: Any = None) -> Any:
    return _tri_indices(False, row, col, offset, dtype)


# ---- padding ----

def _check_pad_length(pad: Sequence[int], ndim: int) -> None:
    if len(pad) % 2:
        raise RuntimeError(f"Length of pad must be even but instead it equals {len(pad)}")
    if len(pad) // 2 > ndim:
        raise RuntimeError(
            "Length of pad should be no more than twice the number of dimensions of the input. "
            f"Pad length is {len(pad)}while the input has {ndim}dimensions."
        )


@lower("constant_pad_nd")
def constant_pad_nd(self: Any, pad: Sequence[int], value: Any = 0) -> Any:
    _check_pad_length(pad, self.ndim)
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        d = self.ndim - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        # PyTorch crops negative pads with narrow() first, which raises before its own size check.
        cropped = self.shape[d] + min(lo, 0)
        if cropped < 0 or cropped + min(hi, 0) < 0:
            raise RuntimeError("narrow(): length must be non-negative.")
        config[d] = (lo, hi, 0)
    fill = jnp.asarray(value).astype(self.dtype)
    if any(s == 0 for s in self.shape):
        shape = [s + c[0] + c[1] for s, c in zip(self.shape, config)]
        return jnp.full(shape, fill, self.dtype)
    return lax.pad(self, fill, config)


def _pad_by_gather(self: Any, padding: Sequence[int], kind: str, nd: int) -> Any:
    """Reflection / replication padding of the last `nd` dims (negative pads crop): one static gather per
    padded dim."""
    batched = self.ndim == nd + 2
    if self.ndim not in (nd + 1, nd + 2) or any(s == 0 for s in self.shape[int(batched):]):
        dims = {1: "2D or 3D", 2: "3D or 4D", 3: "4D or 5D"}[nd]
        raise RuntimeError(
            f"Expected {dims} (batch mode) tensor with possibly 0 batch size and other non-zero dimensions for "
            f"input, but got: {list(self.shape)}"
        )
    if len(padding) != 2 * nd:
        raise RuntimeError(f"padding size is expected to be {2 * nd}, but got: {len(padding)}")
    out_shape = list(self.shape)
    for i in range(nd):
        d = self.ndim - 1 - i
        lo, hi = padding[2 * i], padding[2 * i + 1]
        n = self.shape[d]
        if kind == "reflect" and (lo >= n or hi >= n):
            raise RuntimeError(
                f"Argument #{4 + 2 * i}: Padding size should be less than the corresponding input dimension, but "
                f"got: padding ({lo}, {hi}) at dimension {d} of input {list(self.shape)}"
            )
        out_shape[d] = n + lo + hi
        if nd == 1 and out_shape[d] < 1:
            raise RuntimeError(f"input (W: {n}) is too small. Calculated output W: {out_shape[d]}")
    bad = [m for m in out_shape if m < 0]
    if bad:
        raise RuntimeError(f"Trying to create tensor with negative dimension {bad[0]}: {out_shape}")
    x = self
    for i in range(nd):
        d = self.ndim - 1 - i
        lo, hi = padding[2 * i], padding[2 * i + 1]
        if lo == 0 and hi == 0:
            continue
        n = self.shape[d]
        src = np.arange(n + lo + hi) - lo
        if kind == "reflect":
            src = (n - 1) - np.abs((n - 1) - np.abs(src))
        else:
            src = np.clip(src, 0, n - 1)
        x = jnp.take(x, jnp.asarray(src, jnp.int32), axis=d)
    return x


def _pad_lowering(name: str, kind: str, nd: int) -> None:
    def pad(self: Any, padding: Sequence[int]) -> Any:
        return _pad_by_gather(self, padding, kind, nd)

    pad.__name__ = pad.__qualname__ = name
    pad.__doc__ = f"aten::{name}: {kind} padding of the last {nd} dim(s)."
    lower(name)(pad)


for _nd in (1, 2, 3):
    _pad_lowering(f"reflection_pad{_nd}d", "reflect", _nd)
    _pad_lowering(f"replication_pad{_nd}d", "edge", _nd)


# ---- diagonals ----

def _check_diag_dims(d1: int, d2: int, dim1: int, dim2: int) -> None:
    if d1 == d2:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")


@lower("diag_embed")
def diag_embed(self: Any, offset: int = 0, dim1: int = -2, dim2: int = -1) -> Any:
    nd = self.ndim + 1
    d1, d2 = _wrap_dim(dim1, nd), _wrap_dim(dim2, nd)
    _check_diag_dims(d1, d2, dim1, dim2)
    m = self.shape[-1] if self.ndim else 1
    x = self.reshape(-1) if self.ndim == 0 else self
    n = m + abs(offset)
    rows = lax.broadcasted_iota(jnp.int64, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int64, (n, n), 1)
    on = cols - rows == offset
    k = rows if offset >= 0 else cols
    if m == 0:
        out = jnp.zeros(x.shape[:-1] + (n, n), self.dtype)
    else:
        taken = jnp.take(x, jnp.clip(k, 0, m - 1).reshape(-1), axis=-1).reshape(x.shape[:-1] + (n, n))
        out = jnp.where(on, taken, jnp.zeros((), self.dtype))
    return jnp.moveaxis(out, (-2, -1), (d1, d2))


def _diag_coords(shape: tuple[int, ...], offset: int, d1: int, d2: int) -> tuple[Any, Any, int]:
    if offset >= 0:
        length = max(min(shape[d1], shape[d2] - offset), 0)
    else:
        length = max(min(shape[d1] + offset, shape[d2]), 0)
    i = np.arange(length)
    return i + max(-offset, 0), i + max(offset, 0), length


@lower("diagonal_copy")
def diagonal_copy(self: Any, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Any:
    d1, d2 = _wrap_dim(dim1, self.ndim), _wrap_dim(dim2, self.ndim)
    _check_diag_dims(d1, d2, dim1, dim2)
    rows, cols, length = _diag_coords(tuple(self.shape), offset, d1, d2)
    x = jnp.moveaxis(self, (d1, d2), (-2, -1))
    if length == 0:
        return jnp.zeros(x.shape[:-2] + (0,), self.dtype)
    return x[..., rows, cols]


@lower("diagonal_scatter")
def diagonal_scatter(self: Any, src: Any, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Any:
    d1, d2 = _wrap_dim(dim1, self.ndim), _wrap_dim(dim2, self.ndim)
    _check_diag_dims(d1, d2, dim1, dim2)
    rows, cols, length = _diag_coords(tuple(self.shape), offset, d1, d2)
    x = jnp.moveaxis(self, (d1, d2), (-2, -1))
    expected = x.shape[:-2] + (length,)
    if tuple(src.shape) != expected:
        raise RuntimeError(f"expected src to have a size equal to the diagonal of the input. Got {list(src.shape)} "
                           f"for a diagonal of shape {list(expected)}")
    if length == 0:
        return self
    return jnp.moveaxis(x.at[..., rows, cols].set(src.astype(self.dtype)), (-2, -1), (d1, d2))


@lower("trace")
def trace(self: Any) -> Any:
    if self.ndim != 2:
        raise RuntimeError(f"trace: expected a matrix, but got tensor with dim {self.ndim}")
    dtype = jnp.int64 if (_is_int(self.dtype) or _is_bool(self.dtype)) else self.dtype
    return jnp.trace(self.astype(dtype)).astype(dtype)


# ---- slicing copies ----

@lower("narrow_copy")
def narrow_copy(self: Any, dim: int, start: int, length: int) -> Any:
    if self.ndim == 0:
        raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
    if length < 0:
        raise RuntimeError("narrow(): length must be non-negative.")
    dim = _wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    if not -size <= start <= size:
        raise IndexError(f"start out of range (expected to be in range of [{-size}, {size}], but got {start})")
    start = start % size if start < 0 else start
    if start + length > size:
        raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size ({size}).")
    return lax.slice_in_dim(self, start, start + length, axis=dim)


@lower("select_scatter")
def select_scatter(self: Any, src: Any, dim: int, index: int) -> Any:
    dim = _wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for tensor of size {list(self.shape)} at dimension "
                         f"{dim}")
    expected = self.shape[:dim] + self.shape[dim + 1:]
    if tuple(src.shape) != tuple(expected):
        raise RuntimeError(f"expected src to have a size equal to the slice of self. src size = {list(src.shape)}, "
                           f"slice size = {list(expected)}")
    key = (slice(None),) * dim + (index % size,)
    return self.at[key].set(src.astype(self.dtype))


@lower("slice_scatter")
def slice_scatter(self: Any, src: Any, dim: int = 0, start: int | None = None, end: int | None = None,
                  step: int = 1) -> Any:
    if step <= 0:
        raise RuntimeError("slice step must be positive")
    dim = _wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    lo, hi, _ = slice(start, end, step).indices(size)
    hi = max(hi, lo)
    expected = list(self.shape)
    expected[dim] = len(range(lo, hi, step))
    if list(src.shape) != expected:
        raise RuntimeError(f"expected src to have a size equal to the slice of self. src size = {list(src.shape)}, "
                           f"slice size = {expected}")
    if expected[dim] == 0:
        return self
    key = (slice(None),) * dim + (slice(lo, hi, step),)
    return self.at[key].set(src.astype(self.dtype))


# ---- unique (data-dependent, computed on the host) ----

def _put(arr: np.ndarray, like: Any, dtype: Any = None) -> Any:
    """A host array as a device array on `like`'s device."""
    return jax.device_put(jnp.asarray(arr, dtype if dtype is not None else arr.dtype), _device_of(like))


def _sortable(flat: np.ndarray) -> np.ndarray:
    """Values numpy can sort and compare (bfloat16 exactly widened to float32)."""
    return flat.astype(np.float32) if str(flat.dtype) == "bfloat16" else flat


def _groups(starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group id of each element and the group sizes, from a boolean 'starts a group' vector."""
    gid = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    counts = np.diff(np.append(first, len(starts)))
    return gid, counts


def _empty_i64(like: Any) -> Any:
    return _put(np.zeros((0,), np.int64), like)


@lower("_unique2", jit=False)
def _unique2(self: Any, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False) -> Any:
    flat = _host(self).reshape(-1)
    order = np.argsort(_sortable(flat), kind="stable")
    s = flat[order]
    key = _sortable(s)
    starts = np.ones(len(s), bool)
    starts[1:] = key[1:] != key[:-1]
    gid, counts = _groups(starts)
    values = s[starts]
    inverse = np.empty(len(flat), np.int64)
    inverse[order] = gid
    return (
        _put(values, self, self.dtype),
        _put(inverse.reshape(self.shape), self) if return_inverse else _empty_i64(self),
        _put(counts.astype(np.int64), self) if return_counts else _empty_i64(self),
    )


@lower("_unique", jit=False)
def _unique(self: Any, sorted: bool = True, return_inverse: bool = False) -> Any:
    values, inverse, _ = _unique2(self, sorted, return_inverse, False)
    return values, inverse


def _consecutive_flat(self: Any, return_inverse: bool, return_counts: bool) -> Any:
    flat = _host(self).reshape(-1)
    key = _sortable(flat)
    starts = np.ones(len(flat), bool)
    starts[1:] = key[1:] != key[:-1]
    gid, counts = _groups(starts)
    return (
        _put(flat[starts], self, self.dtype),
        _put(gid.astype(np.int64).reshape(self.shape), self) if return_inverse else _empty_i64(self),
        _put(counts.astype(np.int64), self) if return_counts else _empty_i64(self),
    )


def _unique_rows(self: Any, dim: int, consecutive: bool) -> Any:
    dim = _wrap_dim(dim, self.ndim)
    x = np.moveaxis(_host(self), dim, 0)
    n = x.shape[0]
    rows = _sortable(x.reshape(n, int(np.prod(x.shape[1:]))))
    if consecutive or rows.shape[1] == 0:
        order = np.arange(n)
    else:
        order = np.lexsort(rows.T[::-1]) if n else np.arange(0)
    s = rows[order]
    starts = np.ones(n, bool)
    if n:
        starts[1:] = np.any(s[1:] != s[:-1], axis=1)
    gid, counts = _groups(starts)
    inverse = np.empty(n, np.int64)
    inverse[order] = gid
    values = np.moveaxis(x[order][starts], 0, dim)
    return _put(values, self, self.dtype), _put(inverse, self), _put(counts.astype(np.int64), self)


@lower("unique_dim", jit=False)
def unique_dim(self: Any, dim: int, sorted: bool = True, return_inverse: bool = False,
               return_counts: bool = False) -> Any:
    return _unique_rows(self, dim, consecutive=False)


@lower("unique_dim_consecutive", jit=False)
def unique_dim_consecutive(self: Any, dim: int, return_inverse: bool = False, return_counts: bool = False) -> Any:
    return _unique_rows(self, dim, consecutive=True)


@lower("unique_consecutive", jit=False)
def unique_consecutive(self: Any, return_inverse: bool = False, return_counts: bool = False,
                       dim: int | None = None) -> Any:
    if dim is None:
        return _consecutive_flat(self, return_inverse, return_counts)
    return _unique_rows(self, dim, consecutive=True)


# ---- counting ----

@functools.lru_cache(maxsize=None)
def _bincount_fn(n: int, out_dtype: Any) -> Callable[..., Any]:
    def f(x: Any, w: Any) -> Any:
        vals = jnp.ones(x.shape, out_dtype) if w is None else w.astype(out_dtype)
        return jnp.zeros((n,), out_dtype).at[x].add(vals, mode="drop")

    return jax.jit(f)


@lower("bincount", jit=False)
def bincount(self: Any, weights: Any = None, minlength: int = 0) -> Any:
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if not _is_int(self.dtype):
        raise NotImplementedError(f'"bincount_cpu" not implemented for \'{_dtype_name(self.dtype)}\'')
    if self.ndim != 1:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if weights is not None and (weights.ndim != 1 or weights.shape[0] != self.shape[0]):
        raise RuntimeError("weights should be 1-d and have the same length as input")
    if self.size:
        lo, hi = (int(v) for v in _host(_bounds_fn(1)(self))[0])
        if lo < 0:
            raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
        n = max(hi + 1, minlength)
    else:
        n = minlength
    if weights is None:
        dtype = jnp.int64
    else:
        dtype = jnp.float32 if weights.dtype == jnp.float32 else jnp.float64
    return _bincount_fn(n, dtype)(self, weights)


@functools.lru_cache(maxsize=None)
def _repeat_interleave_fn(total: int) -> Callable[..., Any]:
    def f(repeats: Any) -> Any:
        return jnp.repeat(jnp.arange(repeats.shape[0], dtype=repeats.dtype), repeats, total_repeat_length=total)

    return jax.jit(f)


@lower("repeat_interleave.Tensor", jit=False)
def repeat_interleave(repeats: Any, output_size: int | None = None) -> Any:
    if repeats.ndim > 1:
        raise RuntimeError("repeat_interleave only accept 1D vector as repeat")
    if repeats.dtype not in (jnp.int64, jnp.int32):
        raise RuntimeError("repeats has to be Long or Int tensor")
    repeats = repeats.reshape(-1)
    if repeats.size and int(repeats.min()) < 0:
        raise RuntimeError("repeats can not be negative")
    total = int(repeats.sum()) if output_size is None else output_size
    return _repeat_interleave_fn(total)(repeats)


@lower("isin.Tensor_Tensor", "isin.Tensor_Scalar", "isin.Scalar_Tensor", promote=None)
def isin(elements: Any, test_elements: Any, assume_unique: bool = False, invert: bool = False) -> Any:
    """Membership of each element in test_elements (compared in their promoted dtype), as a bool tensor."""
    e = jnp.asarray(elements)
    t = jnp.asarray(test_elements).reshape(-1)
    common = jnp.promote_types(e.dtype, t.dtype)
    found = (e.astype(common)[..., None] == t.astype(common)).any(axis=-1) if t.size else jnp.zeros(e.shape, bool)
    return jnp.logical_not(found) if invert else found


# ---- selection by mask and joining ----


@lower("masked_select", jit=False)
def masked_select(self: Any, mask: Any) -> Any:
    if mask.dtype != jnp.bool_:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    return jnp.broadcast_to(self, shape)[jnp.broadcast_to(mask, shape)]


@lower("cat")
def cat(tensors: Sequence[Any], dim: int = 0) -> Any:
    if len(tensors) == 0:
        raise RuntimeError("torch.cat(): expected a non-empty list of Tensors")
    dtype = result_dtype(*tensors)
    # Legacy behaviour kept by PyTorch: 1-D empty tensors are skipped whatever the other shapes.
    parts = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not parts:
        return jnp.zeros((0,), dtype)
    nd = parts[0].ndim
    if nd == 0:
        raise RuntimeError("zero-dimensional tensor (at position 0) cannot be concatenated")
    return jnp.concatenate([t.astype(dtype) for t in parts], axis=dim % nd)
