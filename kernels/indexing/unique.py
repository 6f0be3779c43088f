"""unique and its variants: data-dependent output shapes, computed on the host."""

from __future__ import annotations

from typing import Any

import numpy as np

from torch_tpu import _runtime
from torch_tpu.kernels.indexing._common import _host, _wrap_dim
from torch_tpu.kernels.registry import lower


# ---- unique (data-dependent, computed on the host) ----

def _put(arr: np.ndarray, like: Any, dtype: Any = None) -> Any:
    """A host array as a device array on `like`'s device (a private copy: the transfer may alias host memory)."""
    return _runtime.put(np.array(arr, dtype if dtype is not None else arr.dtype, order="C", copy=True),
                        _runtime.index_of(like))


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
