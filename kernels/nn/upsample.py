"""Upsampling (nearest, nearest-exact, linear, bilinear, trilinear, bicubic) and its backward ops (the JAX VJP
of the forward lowering)."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import torch

from torch_tpu._jax import jax, jnp
from torch_tpu.kernels.nn._common import _opmath
from torch_tpu.kernels.registry import lower


# ---- upsampling ----


def _scale_value(scale: float | None, in_size: int, out_size: int) -> np.float32:
    """ATen's compute_scales_value (float): 1/scale when given and positive, else in/out."""
    if scale is not None and scale > 0:
        return np.float32(1.0 / scale)
    return np.float32(in_size) / np.float32(out_size)


def _nearest_indices(in_size: int, out_size: int, scale: float | None, exact: bool) -> np.ndarray:
    o = np.arange(out_size, dtype=np.float32)
    if exact:
        s = _scale_value(scale, in_size, out_size)
        return np.minimum(np.floor((o + np.float32(0.5)) * s).astype(np.int64), in_size - 1)
    if out_size == in_size:
        return np.arange(out_size)
    if out_size == 2 * in_size:
        return np.arange(out_size) >> 1
    s = _scale_value(scale, in_size, out_size)
    return np.minimum(np.floor(o * s).astype(np.int64), in_size - 1)


def _upsample_nearest(x: Any, output_size: Sequence[int], scales: Sequence[float | None], exact: bool) -> Any:
    nd = len(output_size)
    for j, (o, s) in enumerate(zip(output_size, scales)):
        axis = x.ndim - nd + j
        x = jnp.take(x, jnp.asarray(_nearest_indices(x.shape[axis], o, s, exact)), axis=axis)
    return x


def _check_upsample(x: Any, output_size: Sequence[int]) -> None:
    nd = len(output_size)
    if x.ndim != nd + 2:
        raise RuntimeError(f"Expected {nd + 2}D input tensor, but got {x.ndim}D")
    if any(o <= 0 for o in output_size) or any(n <= 0 for n in x.shape[2:]):
        raise RuntimeError(f"Input and output sizes should be greater than 0, but got input "
                           f"({', '.join(map(str, x.shape[2:]))}) and output ({', '.join(map(str, output_size))})")


def _nearest_ops(nd: int, exact: bool) -> None:
    prefix = "_upsample_nearest_exact" if exact else "upsample_nearest"
    name = f"{prefix}{nd}d"

    def forward(self: Any, output_size: Sequence[int], *scales: float | None) -> Any:
        _check_upsample(self, output_size)
        return _upsample_nearest(self, output_size, scales or (None,) * nd, exact)

    def backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int], *scales: float | None) -> Any:
        f = lambda x: _upsample_nearest(x, output_size, scales or (None,) * nd, exact)  # noqa: E731
        _, vjp = jax.vjp(f, jnp.zeros(tuple(input_size), _opmath(grad_output).dtype))
        return vjp(_opmath(grad_output))[0].astype(grad_output.dtype)

    lower(name)(_by_schema(name, forward))
    lower(f"{name}_backward")(_by_schema(f"{name}_backward", backward))


def _by_schema(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adapts fn(first, output_size, ..., *scales) to the schema's keyword arguments (scales_h, scales_w...)."""
    schema = getattr(torch.ops.aten, name).default._schema
    names = [a.name for a in schema.arguments]
    scale_names = [n for n in names if n.startswith("scales")]
    fixed = [n for n in names if n not in scale_names]

    def kernel(**kwargs: Any) -> Any:
        return fn(*(kwargs[n] for n in fixed), *(kwargs[n] for n in scale_names))

    kernel.__name__ = name
    kernel.__doc__ = f"aten::{name}"
    return kernel


for _nd in (1, 2, 3):
    _nearest_ops(_nd, exact=False)
    _nearest_ops(_nd, exact=True)


def _linear_weights(in_size: int, out_size: int, align_corners: bool, scale: float | None) -> tuple[np.ndarray, ...]:
    """(i0, i1, w0, w1) of linear interpolation, as ATen's area_pixel_compute_source_index (float)."""
    if align_corners:
        s = np.float32((in_size - 1) / (out_size - 1)) if out_size > 1 else np.float32(0)
        src = s * np.arange(out_size, dtype=np.float32)
    else:
        s = _scale_value(scale, in_size, out_size)
        src = np.maximum(s * (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5), 0)
    i0 = src.astype(np.int64)
    lam = np.clip(src - i0, 0, 1).astype(np.float32)
    i1 = i0 + (i0 < in_size - 1)
    return i0, i1, 1 - lam, lam


def _cubic_weights(in_size: int, out_size: int, align_corners: bool, scale: float | None) -> tuple[np.ndarray, ...]:
    """(indices (out, 4), weights (out, 4)) of bicubic interpolation (A = -0.75), borders clamped."""
    o = np.arange(out_size, dtype=np.float32)
    if align_corners:
        s = np.float32((in_size - 1) / (out_size - 1)) if out_size > 1 else np.float32(0)
        src = s * o
    else:
        src = _scale_value(scale, in_size, out_size) * (o + np.float32(0.5)) - np.float32(0.5)
    base = np.floor(src).astype(np.int64)
    t = (src - base).astype(np.float32)
    a = np.float32(-0.75)

    def near(v: np.ndarray) -> np.ndarray:
        return ((a + 2) * v - (a + 3)) * v * v + 1

    def far(v: np.ndarray) -> np.ndarray:
        return ((a * v - 5 * a) * v + 8 * a) * v - 4 * a

    w = np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=1)
    idx = np.clip(base[:, None] + np.arange(-1, 3)[None, :], 0, in_size - 1)
    return idx, w


def _interpolate(x: Any, output_size: Sequence[int], align_corners: bool, scales: Sequence[float | None],
                 cubic: bool = False) -> Any:
    """Separable (multi)linear or bicubic interpolation over the last len(output_size) dims, in opmath."""
    nd = len(output_size)
    x = _opmath(x)
    for j, (o, s) in enumerate(zip(output_size, scales)):
        axis = x.ndim - nd + j
        n = x.shape[axis]
        bshape = [1] * x.ndim
        bshape[axis] = o
        if cubic:
            idx, w = _cubic_weights(n, o, align_corners, s)
            acc = 0
            for k in range(4):
                wk = jnp.asarray(w[:, k].reshape(bshape), x.dtype)
                acc = acc + jnp.take(x, jnp.asarray(idx[:, k]), axis=axis) * wk
            x = acc
        else:
            i0, i1, w0, w1 = _linear_weights(n, o, align_corners, s)
            x0 = jnp.take(x, jnp.asarray(i0), axis=axis)
            x1 = jnp.take(x, jnp.asarray(i1), axis=axis)
            x = x0 * jnp.asarray(w0.reshape(bshape), x.dtype) + x1 * jnp.asarray(w1.reshape(bshape), x.dtype)
    return x


def _interp_ops(name: str, nd: int, cubic: bool) -> None:
    def forward(self: Any, output_size: Sequence[int], align_corners: bool, *scales: float | None) -> Any:
        _check_upsample(self, output_size)
        return _interpolate(self, output_size, align_corners, scales or (None,) * nd, cubic).astype(self.dtype)

    def backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int], align_corners: bool,
                 *scales: float | None) -> Any:
        f = lambda x: _interpolate(x, output_size, align_corners, scales or (None,) * nd, cubic)  # noqa: E731
        _, vjp = jax.vjp(f, jnp.zeros(tuple(input_size), _opmath(grad_output).dtype))
        return vjp(_opmath(grad_output))[0].astype(grad_output.dtype)

    lower(name)(_by_schema(name, forward))
    lower(f"{name}_backward")(_by_schema(f"{name}_backward", backward))


_interp_ops("upsample_linear1d", 1, cubic=False)
_interp_ops("upsample_bilinear2d", 2, cubic=False)
_interp_ops("upsample_trilinear3d", 3, cubic=False)
_interp_ops("upsample_bicubic2d", 2, cubic=True)


# ---- antialiased bilinear (F.interpolate(..., antialias=True)) ----


def _aa_weights(in_size: int, out_size: int, align_corners: bool, scale: float | None) -> np.ndarray:
    """The (out, in) matrix of ATen's antialiased linear interpolation: a triangle filter stretched by the scale
    when downsampling, each row normalized to sum 1 (UpSampleKernel.cpp, _compute_weights_aa)."""
    if align_corners:
        s = (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    else:
        s = float(_scale_value(scale, in_size, out_size))
    support = s if s >= 1.0 else 1.0  # interp_size / 2 = 1, times the scale when downsampling
    invscale = 1.0 / s if s >= 1.0 else 1.0
    max_size = int(math.ceil(support)) * 2 + 1
    m = np.zeros((out_size, in_size), np.float64)
    for i in range(out_size):
        center = s * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        n = min(max(min(int(center + support + 0.5), in_size) - lo, 0), max_size)
        j = np.arange(n)
        w = np.maximum(1 - np.abs((j + lo - center + 0.5) * invscale), 0)
        total = w.sum()
        if total != 0:
            w = w / total
        m[i, lo:lo + n] = w
    return m


def _upsample_aa(x: Any, output_size: Sequence[int], align_corners: bool, scales: Sequence[float | None]) -> Any:
    v = _opmath(x)
    (oh, ow), (sh, sw) = output_size, scales
    wh = jnp.asarray(_aa_weights(x.shape[-2], oh, align_corners, sh), v.dtype)
    ww = jnp.asarray(_aa_weights(x.shape[-1], ow, align_corners, sw), v.dtype)
    hi = jax.lax.Precision.HIGHEST
    v = jnp.einsum("...hw,ow->...ho", v, ww, precision=hi)
    return jnp.einsum("...hw,oh->...ow", v, wh, precision=hi)


def _upsample_aa_forward(self: Any, output_size: Sequence[int], align_corners: bool, *scales: float | None) -> Any:
    _check_upsample(self, output_size)
    return _upsample_aa(self, output_size, align_corners, scales or (None, None)).astype(self.dtype)


def _upsample_aa_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                          align_corners: bool, *scales: float | None) -> Any:
    f = lambda x: _upsample_aa(x, output_size, align_corners, scales or (None, None))  # noqa: E731
    _, vjp = jax.vjp(f, jnp.zeros(tuple(input_size), _opmath(grad_output).dtype))
    return vjp(_opmath(grad_output))[0].astype(grad_output.dtype)


lower("_upsample_bilinear2d_aa")(_by_schema("_upsample_bilinear2d_aa", _upsample_aa_forward))
lower("_upsample_bilinear2d_aa_backward")(_by_schema("_upsample_bilinear2d_aa_backward", _upsample_aa_backward))
