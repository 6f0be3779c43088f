"""Masks: masked_fill, masked_scatter, nonzero / nonzero_static and masked_select."""

from __future__ import annotations

import functools
from typing import Any

import torch

from torch_tpu import _runtime, _storage
from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jnp
from torch_tpu.kernels.indexing._common import _count_fn, _dtype_name, _nonzero_fn
from torch_tpu.kernels._promote import dtype_name, write_outs
from torch_tpu.kernels.registry import direct, lower


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


@functools.cache
def _scalar_names() -> dict:
    """By dtype, the C++ type names of Scalar::to<T>'s overflow error ("value cannot be converted to type int8_t
    ..."); a function, so that importing the kernels does not import JAX."""
    return {jnp.dtype(k): v for k, v in {
        jnp.uint8: "uint8_t", jnp.int8: "int8_t", jnp.int16: "int16_t", jnp.int32: "int", jnp.int64: "int64_t",
        jnp.float16: "c10::Half", jnp.bfloat16: "c10::BFloat16", jnp.float32: "float", jnp.float64: "double",
        jnp.complex64: "c10::complex<float>", jnp.complex128: "c10::complex<double>",
    }.items()}


def _overflows(v: Any, to: Any) -> Any:
    """c10's overflows<To, From>: whether the real (float64 or int64) array `v` does not fit dtype `to`; None when
    it always fits."""
    if jnp.issubdtype(to, jnp.complexfloating):
        to = jnp.finfo(to).dtype
    if jnp.issubdtype(v.dtype, jnp.integer):
        if jnp.issubdtype(to, jnp.inexact):  # only float16 is narrower than int64
            big = int(jnp.finfo(to).max)
            return (v < -big) | (v > big) if big < 2**63 else None
        if to == jnp.int64:
            return None
        info = jnp.iinfo(to)
        if info.min == 0:  # negative values wrap into an unsigned type, down to -max
            return (v > info.max) | (v < -info.max)
        return (v < info.min) | (v > info.max)
    if jnp.issubdtype(to, jnp.integer):  # no NaN, no infinity
        info = jnp.iinfo(to)
        return jnp.isnan(v) | (v < float(info.min)) | (v > float(info.max))
    if to == jnp.float64:
        return None
    big = float(jnp.finfo(to).max)
    return ~jnp.isinf(v) & ((v < -big) | (v > big))  # infinities convert; NaN compares false


def _report_value_overflow(op: str, value: Any, dtype: Any) -> None:
    """ATen's Scalar::to<T> of the fill value (its checked_convert), on the device: a complex value with an
    imaginary part into a real type, or a value out of the type's range. A bool target converts unchecked."""
    v = jnp.asarray(value)
    if dtype == jnp.bool_ or v.dtype == jnp.bool_ or dtype not in _scalar_names():
        return
    if jnp.issubdtype(dtype, jnp.inexact) and jnp.issubdtype(v.dtype, jnp.inexact) and (
            jnp.issubdtype(dtype, jnp.complexfloating) or not jnp.issubdtype(v.dtype, jnp.complexfloating)):
        # A float into a float type: past the type's range it rounds to +-inf, where CPU raises. Not checked, so
        # that attention code's masked_fill(mask, -1e9) or (mask, finfo.min) runs without a device-side check.
        return
    if jnp.issubdtype(v.dtype, jnp.complexfloating):
        v = v.astype(jnp.complex128)
        parts = [_overflows(v.real, dtype), _overflows(v.imag, dtype)]
        if not jnp.issubdtype(dtype, jnp.complexfloating):
            parts.append(v.imag != 0)
    else:
        parts = [_overflows(v.astype(jnp.int64 if jnp.issubdtype(v.dtype, jnp.integer) else jnp.float64), dtype)]
    parts = [p for p in parts if p is not None]
    if not parts:
        return
    bad = functools.reduce(jnp.logical_or, parts)
    report_bad_index(op, bad.astype(jnp.int64), 1, error=RuntimeError,
                     message=f"value cannot be converted to type {_scalar_names()[dtype]} without overflow")


@lower("masked_fill.Scalar", "masked_fill.Tensor", checks=True)
def masked_fill(self: Any, mask: Any, value: Any) -> Any:
    if getattr(value, "ndim", 0) != 0:
        raise RuntimeError(
            f"masked_fill_ only supports a 0-dimensional value tensor, but got tensor with {value.ndim} dimension(s)."
        )
    _check_mask(mask)
    _report_value_overflow("masked_fill", value, self.dtype)
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

@lower("nonzero", jit=False)
def nonzero(self: Any) -> Any:
    return _nonzero_fn(int(_count_fn()(self)))(self, -1)


@lower("nonzero_static")
def nonzero_static(self: Any, size: int, fill_value: int = -1) -> Any:
    if size < 0:
        raise RuntimeError(f"nonzero_static: 'size' must be an non-negative integer, but got {size}")
    return _nonzero_fn(size)(self, fill_value)


def _check_long_out(op: str, out: torch.Tensor) -> None:
    if out.dtype != torch.int64:
        raise RuntimeError(
            f"{op}: Expected out tensor to have scalar type Long but got scalar type{dtype_name(out.dtype)}"
            f" (out= tensor of dtype {out.dtype} on {out.device}; pass a torch.int64 tensor)")


@direct("nonzero.out")
def nonzero_out(self: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """nonzero's out= form: CPU requires an int64 out tensor (the generated out= form would cast)."""
    _check_long_out("nonzero", out)
    write_outs("nonzero", (out,), (_storage.read(torch.ops.aten.nonzero(self)),))
    return out


@direct("nonzero_static.out")
def nonzero_static_out(self: torch.Tensor, *, size: int, fill_value: int = -1, out: torch.Tensor) -> torch.Tensor:
    _check_long_out("nonzero_static", out)
    write_outs("nonzero_static", (out,), (_storage.read(torch.ops.aten.nonzero_static(self, size=size,
                                                                                      fill_value=fill_value)),))
    return out


# ---- selection by mask ----

@lower("masked_select", jit=False)
def masked_select(self: Any, mask: Any) -> Any:
    if mask.dtype != jnp.bool_:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    return jnp.broadcast_to(self, shape)[jnp.broadcast_to(mask, shape)]
