"""Counting: bincount, repeat_interleave.Tensor (data-dependent sizes) and isin."""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch_tpu._jax import jax, jnp
from torch_tpu.kernels.indexing._common import _bounds_fn, _dtype_name, _host, _is_int
from torch_tpu.kernels.registry import lower


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
