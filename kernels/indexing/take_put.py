"""Flat take / put: indices into the flattened tensor."""

from __future__ import annotations

from typing import Any

from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jnp
from torch_tpu.kernels.indexing._common import _dtype_name, _scatter_apply
from torch_tpu.kernels.registry import lower


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
