"""Diagonals: diag_embed, diagonal_copy, diagonal_scatter and trace."""

from __future__ import annotations

from typing import Any

import numpy as np

from torch_tpu._jax import jnp, lax
from torch_tpu.kernels.indexing._common import _is_bool, _is_int, _wrap_dim
from torch_tpu.kernels.registry import lower


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
