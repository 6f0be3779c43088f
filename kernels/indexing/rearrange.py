"""Flips, rolls, repeats and triangles (tril / triu and tril_indices / triu_indices)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from torch_tpu import _runtime
from torch_tpu._jax import jnp
from torch_tpu.kernels.indexing._common import _wrap_dim
from torch_tpu.kernels.registry import lower


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
    if self.size == 0:  # ATen returns a clone before looking at the dims
        return self
    if self.ndim == 0:
        raise IndexError(f"Dimension specified as {dims[0]} but tensor has no dimensions")
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
