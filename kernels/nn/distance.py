"""Pairwise distances: cdist (_cdist_forward / _cdist_backward) and pdist (_pdist_forward / _pdist_backward).
Distances are computed from the differences directly (ATen's matmul form for large p=2 inputs is its composite
_euclidean_dist, which runs on other kernels); the backward ops use ATen's formulas, which give 0 where a
distance is 0 (the derivative of the norm is undefined there)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from torch_tpu._jax import jnp
from torch_tpu.kernels.nn._common import _is_float, _opmath
from torch_tpu.kernels.registry import lower


def _dist(diff: Any, p: float) -> Any:
    """The p-norm over the last dim of differences."""
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=-1)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    if math.isinf(p):
        return jnp.max(a, axis=-1, initial=0)
    return jnp.sum(a ** p, axis=-1) ** (1.0 / p)


def _dist_grad(diff: Any, dist: Any, grad: Any, p: float) -> Any:
    """d dist / d x1 times grad for each pair (..., P, R, M), as ATen's Dist<>::backward."""
    d, g = dist[..., None], grad[..., None]
    zero = jnp.zeros_like(diff)
    if p == 0:
        return zero
    if p == 1:
        return jnp.sign(diff) * g
    if p == 2:
        return jnp.where(d == 0, zero, g * diff / jnp.where(d == 0, 1, d))
    if math.isinf(p):
        return jnp.sign(diff) * (jnp.abs(diff) == d) * g
    safe_d = jnp.where(d == 0, 1, d)
    if p < 1:
        r = jnp.where(diff == 0, 0, jnp.sign(diff) * jnp.abs(diff) ** (p - 1) * g / safe_d ** (p - 1))
        return jnp.where(d == 0, zero, r)
    return jnp.where(d == 0, zero, diff * jnp.abs(diff) ** (p - 2) * g / safe_d ** (p - 1))


def _check_cdist(x1: Any, x2: Any, p: float) -> None:
    if x1.ndim < 2 or x2.ndim < 2:
        raise RuntimeError(f"cdist only supports at least 2D tensors, X{1 if x1.ndim < 2 else 2} got: "
                           f"{min(x1.ndim, x2.ndim)}D")
    if x1.shape[-1] != x2.shape[-1]:
        raise RuntimeError(f"X1 and X2 must have the same number of columns. X1: {x1.shape[-1]} X2: "
                           f"{x2.shape[-1]}")
    if not (_is_float(x1) and _is_float(x2)):
        raise RuntimeError(f"cdist only supports floating-point dtypes, X1 got: {x1.dtype}")
    if p < 0:
        raise RuntimeError("cdist only supports non-negative p values")


def _pairs(x1: Any, x2: Any) -> Any:
    """x1[..., i, :] - x2[..., j, :] for every pair, batch dims broadcast: (..., P, R, M)."""
    return _opmath(x1)[..., :, None, :] - _opmath(x2)[..., None, :, :]


@lower("_cdist_forward")
def cdist_forward(x1: Any, x2: Any, p: float, compute_mode: int | None = None) -> Any:
    _check_cdist(x1, x2, p)
    return _dist(_pairs(x1, x2), p).astype(x1.dtype)


def _sum_to(x: Any, shape: tuple[int, ...]) -> Any:
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and x.shape[lead + i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True).reshape(shape) if axes else x


@lower("_cdist_backward")
def cdist_backward(grad: Any, x1: Any, x2: Any, p: float, cdist: Any) -> Any:
    """The gradient for x1 (ATen computes x2's as _cdist_backward of the transposes)."""
    diff = _pairs(x1, x2)
    per = _dist_grad(diff, _opmath(cdist), _opmath(grad), p)
    return _sum_to(jnp.sum(per, axis=-2), x1.shape).astype(x1.dtype)


def _check_pdist(self: Any, p: float) -> None:
    if self.ndim != 2:
        raise RuntimeError(f"pdist only supports 2D tensors, got: {self.ndim}D")
    if not _is_float(self):
        raise RuntimeError("pdist only supports floating-point dtypes")
    if p < 0:
        raise RuntimeError("pdist only supports non-negative p values")


@lower("_pdist_forward")
def pdist_forward(self: Any, p: float = 2) -> Any:
    """Distances of the rows i < j, in row-major order of the pairs: (N (N - 1) / 2,)."""
    _check_pdist(self, p)
    i, j = np.triu_indices(self.shape[0], k=1)
    x = _opmath(self)
    return _dist(x[i] - x[j], p).astype(self.dtype)


@lower("_pdist_backward")
def pdist_backward(grad: Any, self: Any, p: float, pdist: Any) -> Any:
    x = _opmath(self)
    i, j = np.triu_indices(self.shape[0], k=1)
    per = _dist_grad(x[i] - x[j], _opmath(pdist), _opmath(grad), p)  # d/d x[i]; x[j] gets its negative
    out = jnp.zeros(x.shape, per.dtype).at[i].add(per).at[j].add(-per)
    return out.astype(self.dtype)
