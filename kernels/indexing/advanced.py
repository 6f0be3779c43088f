"""Advanced indexing: index.Tensor and index_put (integer and boolean-mask indices), and the masked-index ops
that decompositions emit."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import numpy as np

from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jax, jnp
from torch_tpu.kernels.indexing._common import _count_fn, _dtype_name, _nonzero_fn, _scatter_apply
from torch_tpu.kernels.registry import lower


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


def _mask_coords(mask: Any) -> list[Any]:
    """The coordinates of a concrete mask's true elements, one index array per mask dim."""
    coords = _nonzero_fn(int(_count_fn()(mask)))(mask, -1)
    return [coords[:, d] for d in range(mask.ndim)]


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
