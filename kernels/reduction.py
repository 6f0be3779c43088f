"""Reductions with PyTorch's dtype rules (integer and bool sums accumulate in int64)."""

from __future__ import annotations

from typing import Any, Sequence

from torch_tpu import _runtime
from torch_tpu._jax import jnp
from torch_tpu.kernels.registry import lower


def _axes(self: Any, dim: Sequence[int] | None) -> tuple[int, ...] | None:
    if dim is None or len(dim) == 0:
        return None
    nd = max(self.ndim, 1)
    return tuple(sorted({d % nd for d in dim})) if self.ndim else None


def _sum_dtype(self: Any, dtype: Any) -> Any:
    if dtype is not None:
        return _runtime.jax_dtype(dtype)
    if self.dtype == jnp.bool_ or jnp.issubdtype(self.dtype, jnp.integer):
        return jnp.int64
    return self.dtype


@lower("sum", "sum.dim_IntList")
def sum_(self: Any, dim: Sequence[int] | None = None, keepdim: bool = False, dtype: Any = None) -> Any:
    out = _sum_dtype(self, dtype)
    return jnp.sum(self.astype(out), axis=_axes(self, dim), keepdims=keepdim)


@lower("mean", "mean.dim")
def mean(self: Any, dim: Sequence[int] | None = None, keepdim: bool = False, dtype: Any = None) -> Any:
    out = _runtime.jax_dtype(dtype) if dtype is not None else self.dtype
    if not (jnp.issubdtype(out, jnp.inexact)):
        raise RuntimeError(
            "mean(): could not infer output dtype. Input dtype must be either a floating point or complex "
            f"dtype. Got: {_runtime.torch_dtype(out)}"
        )
    return jnp.mean(self.astype(out), axis=_axes(self, dim), keepdims=keepdim).astype(out)


def _check_nonempty(op: str, self: Any) -> None:
    if self.size == 0:
        raise RuntimeError(
            f"{op}(): Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )


@lower("min", variants=False)
def min_(self: Any) -> Any:
    _check_nonempty("min", self)
    return jnp.min(self)


@lower("max", variants=False)
def max_(self: Any) -> Any:
    _check_nonempty("max", self)
    return jnp.max(self)
