"""Helpers shared by the indexing kernel families: dim wrapping, dtype names, scatter reductions, and the small
cached jitted functions (counts, bounds, nonzero coordinates) that data-dependent lowerings call."""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from torch_tpu import _runtime
from torch_tpu._jax import jax, jnp
from torch_tpu.kernels._promote import dtype_name


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
    return np.asarray(x)  # (jax.device_get's Python path adds about 50 us to the transfer)


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


# ---- cached jitted helpers of the data-dependent ops: counts, bounds, nonzero coordinates ----

@functools.lru_cache(maxsize=None)
def _count_fn() -> Callable[..., Any]:
    return jax.jit(lambda x: jnp.count_nonzero(x))


@functools.lru_cache(maxsize=None)
def _bounds_fn(n: int) -> Callable[..., Any]:
    def f(*arrs: Any) -> Any:
        return jnp.stack([jnp.stack([a.min(), a.max()]).astype(jnp.int64) for a in arrs])

    return jax.jit(f)


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
