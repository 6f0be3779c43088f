"""Pooling: max / average / adaptive pooling and their backward ops, max_unpool, im2col / col2im and
channel_shuffle. Window indices depend only on static shapes and are computed with numpy at trace time."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

import torch

from torch_tpu import _storage
from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels.nn._common import _expand, _is_float, _is_low, _lowest, _opmath
from torch_tpu.kernels._promote import write_outs
from torch_tpu.kernels.registry import direct, lower


# ---- pooling ----


_NUMBERS = {2: "two", 3: "three"}


def _pool_arg(op: str, arg: str, v: Sequence[int], nd: int) -> tuple[int, ...]:
    """`v` expanded to nd values, with ATen's check of its length (stride may be empty: the kernel size)."""
    v = tuple(v)
    if len(v) not in ((0, 1, nd) if arg == "stride" else (1, nd)):
        either = "" if op == "avg_pool3d" else "either "
        if arg == "dilation":
            raise RuntimeError(f"{op}: dilation must be {either}a single int, or a tuple of {_NUMBERS[nd]} ints")
        omitted = "omitted, " if arg == "stride" else ""
        raise RuntimeError(f"{op}: {arg} must {either}be {omitted}a single int, or a tuple of {_NUMBERS[nd]} ints")
    return _expand(v, nd) if v else ()


def _pool_out_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """ATen's pooling_output_shape, with its checks."""
    if s == 0:
        raise RuntimeError("stride should not be zero")
    if p < 0:
        raise RuntimeError(f"pad must be non-negative, but got pad: {p}")
    effective = (k - 1) * d + 1
    if p > (abs(effective) // 2) * (1 if effective >= 0 else -1):  # C++ division truncates
        raise RuntimeError(f"pad should be at most half of effective kernel size, but got pad={p}, "
                           f"kernel_size={k} and dilation={d}")
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_params(
    op: str, x: Any, nd: int, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int] | None, ceil_mode: bool, divisor_override: int | None = None,
) -> tuple[tuple[int, ...], ...]:
    """(kernel, stride, padding, dilation, output size) per spatial dim of max_pool{nd}d (`dilation` given) or
    avg_pool{nd}d (None), with ATen's checks in ATen's order (its meta functions, then pooling_output_shape per
    dim, then pool2d_shape_check / pool3d_shape_check of ATen/native/Pool.h)."""
    k = _pool_arg(op, "kernel_size", kernel_size, nd)
    s = _pool_arg(op, "stride", stride, nd) or k
    p = _pool_arg(op, "padding", padding, nd)
    d = _pool_arg(op, "dilation", dilation, nd) if dilation is not None else (1,) * nd
    if (dilation is not None or nd == 3) and x.ndim not in (nd + 1, nd + 2):
        raise RuntimeError(f"non-empty {nd + 1}D or {nd + 2}D (batch mode) tensor expected for input")
    if divisor_override is not None and divisor_override == 0:
        raise RuntimeError("divisor must be not zero")
    if x.ndim < nd + 1:  # avg_pool2d reads input.size(-3)
        raise IndexError("Dimension specified as -3 but tensor has no dimensions" if x.ndim == 0 else
                         f"Dimension out of range (expected to be in range of [{-x.ndim}, {x.ndim - 1}], but got -3)")
    sizes = x.shape[-nd:]
    out = tuple(_pool_out_size(n, kk, ss, pp, dd, ceil_mode) for n, kk, ss, pp, dd in zip(sizes, k, s, p, d))
    dims = ("T", "H", "W")[3 - nd:]

    def got(name: str, v: Sequence[int]) -> str:  # "kH: 3 kW: 0"
        return " ".join(f"{name}{dim}: {vv}" for dim, vv in zip(dims, v))

    if min(k) <= 0:
        raise RuntimeError(f"kernel size should be greater than zero, but got {got('k', k)}")
    if min(s) <= 0:
        raise RuntimeError(f"stride should be greater than zero, but got {got('d', s)}")
    if min(d) <= 0:
        raise RuntimeError(f"dilation should be greater than zero, but got {got('dilation', d)}")
    shape = list(x.shape)
    if nd == 2:
        if not ((x.ndim == 3 and 0 not in shape) or (x.ndim == 4 and 0 not in shape[1:])):
            raise RuntimeError("Expected 3D or 4D (batch mode) tensor with optional 0 dim batch size for input, "
                               f"but got:{shape}")
        if any(pp > kk // 2 for pp, kk in zip(p, k)):
            raise RuntimeError("pad should be smaller than or equal to half of kernel size, but got "
                               f"padW = {p[1]}, padH = {p[0]}, kW = {k[1]}, kH = {k[0]}")
    else:
        fn = "max_pool3d_with_indices_out_cpu_template()" if dilation is not None else "avg_pool3d()"
        for n in shape[x.ndim - 4:]:
            if n == 0:
                raise RuntimeError(f"{fn}: Expected input's non-batch dimensions to have positive length, but input "
                                   f"has a shape of {shape} and non-batch dimension 0 has length zero!")
        if dilation is None and any(n < kk for n, kk in zip(sizes, k)):
            raise RuntimeError(f"input image (T: {sizes[0]} H: {sizes[1]} W: {sizes[2]}) smaller than kernel size "
                               f"(kT: {k[0]} kH: {k[1]} kW: {k[2]})")
        if any(pp > kk // 2 for pp, kk in zip(p, k)):
            raise RuntimeError(f"pad should be smaller than or equal to half of kernel size, but got kT: {k[0]} "
                               f"kW: {k[2]} kH: {k[1]} padT: {p[0]} padW: {p[2]} padH: {p[1]}")
    if min(out) < 1:
        planes = x.shape[-nd - 1]
        raise RuntimeError(f"Given input size: ({'x'.join(map(str, (planes, *sizes)))}). Calculated output size: "
                           f"({'x'.join(map(str, (planes, *out)))}). Output size is too small")
    return k, s, p, d, out


def _strided_windows(size: int, out: int, k: int, s: int, p: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Input index (clamped) and validity of each (output position, kernel offset) of a strided window."""
    idx = np.arange(out)[:, None] * s - p + np.arange(k)[None, :] * d
    return np.clip(idx, 0, size - 1), (idx >= 0) & (idx < size)


def _adaptive_windows(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """Input index (clamped) and validity of each (output position, offset) of adaptive pooling's windows."""
    o = np.arange(out)
    start = (o * size) // out
    end = -((-(o + 1) * size) // out)
    kmax = int(np.max(end - start)) if out else 1
    idx = start[:, None] + np.arange(kmax)[None, :]
    return np.clip(idx, 0, size - 1), idx < end[:, None]


def _gather_windows(x: Any, windows: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[Any, np.ndarray, np.ndarray]:
    """Gathers windows over x's last len(windows) dims.

    Returns (values of shape (..., *out, K), validity (*out, K), flat input index within the plane (*out, K)),
    K running over the window in row-major order, as PyTorch's kernels scan it.
    """
    nd = len(windows)
    sizes = x.shape[x.ndim - nd:]
    index_arrays, valid, flat = [], np.ones((1,) * (2 * nd), bool), np.zeros((1,) * (2 * nd), np.int64)
    plane_stride = [math.prod(sizes[j + 1:]) for j in range(nd)]
    for j, (idx, ok) in enumerate(windows):
        shape = [1] * (2 * nd)
        shape[2 * j], shape[2 * j + 1] = idx.shape
        index_arrays.append(jnp.asarray(idx.reshape(shape)))
        valid = valid & ok.reshape(shape)
        flat = flat + idx.reshape(shape) * plane_stride[j]
    vals = x[(Ellipsis, *index_arrays)]  # (..., O0, K0, O1, K1, ...)
    lead = x.ndim - nd
    outs = tuple(idx.shape[0] for idx, _ in windows)
    ks = math.prod(idx.shape[1] for idx, _ in windows)
    perm = tuple(range(lead)) + tuple(lead + 2 * j for j in range(nd)) + tuple(lead + 2 * j + 1 for j in range(nd))
    vals = vals.transpose(perm).reshape(x.shape[:lead] + outs + (ks,))
    grid_perm = tuple(2 * j for j in range(nd)) + tuple(2 * j + 1 for j in range(nd))
    full = tuple(s for pair in ((idx.shape[0], idx.shape[1]) for idx, _ in windows) for s in pair)
    valid = np.broadcast_to(valid, full).transpose(grid_perm).reshape(outs + (ks,))
    flat = np.broadcast_to(flat, full).transpose(grid_perm).reshape(outs + (ks,))
    return vals, valid, flat


def _max_over_windows(x: Any, windows: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[Any, Any]:
    """(max, flat index) of each window by PyTorch's CPU rule: scanning the window in row-major order, a value
    replaces the running max when it is greater or NaN, so the first max wins, and a NaN window gives its last
    NaN."""
    vals, valid, flat = _gather_windows(x, windows)
    vals = jnp.where(jnp.asarray(valid), vals, jnp.asarray(_lowest(x.dtype), x.dtype))
    arg = jnp.argmax(vals, axis=-1)  # numpy semantics: the first NaN, else the first max
    if jnp.issubdtype(x.dtype, jnp.inexact):
        k = vals.shape[-1]
        last_nan = k - 1 - jnp.argmax(jnp.isnan(vals)[..., ::-1], axis=-1)
        arg = jnp.where(jnp.isnan(jnp.take_along_axis(vals, arg[..., None], axis=-1)[..., 0]), last_nan, arg)
    arg = arg[..., None]
    out = jnp.take_along_axis(vals, arg, axis=-1)[..., 0]
    index = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat), vals.shape), arg, axis=-1)[..., 0]
    return out, index


def _max_pool_strided(x: Any, k: Sequence[int], s: Sequence[int], p: Sequence[int], d: Sequence[int],
                      out: Sequence[int]) -> tuple[Any, Any]:
    """max_pool's (max, flat index) of each strided window, by the rule of `_max_over_windows`, without gathering
    the windows: the max is one reduce_window, and the index one pass of compares between it and the K shifted
    strided slices of the (padded) input, one per kernel offset. (The gather of all K window values, then an
    argmax, was ~10x slower on XLA:CPU: ResNet-18's 3x3/2 pool cost more than its convolutions' share.)"""
    nd = len(k)
    lead = x.ndim - nd
    sizes = x.shape[lead:]
    # Padding after the input so that the last window ends inside (negative: windows never reach the end).
    hi = [(o - 1) * ss + (kk - 1) * dd + 1 - n - pp for n, o, kk, ss, pp, dd in zip(sizes, out, k, s, p, d)]
    low = jnp.asarray(_lowest(x.dtype), x.dtype)
    xp = lax.pad(x, low, [(0, 0, 0)] * lead + [(pp, h, 0) for pp, h in zip(p, hi)])
    ones = (1,) * lead
    mx = lax.reduce_window(xp, low, lax.max, ones + tuple(k), ones + tuple(s), "VALID",
                           window_dilation=ones + tuple(d))
    plane = math.prod(sizes)
    idt = jnp.int32 if plane < 2**31 else jnp.int64
    floating = jnp.issubdtype(x.dtype, jnp.inexact)
    shifted = []
    for off in np.ndindex(*k):  # row-major over the window, as PyTorch scans it
        start = [0] * lead + [o * dd for o, dd in zip(off, d)]
        limit = list(x.shape[:lead]) + [o * dd + (oo - 1) * ss + 1 for o, dd, oo, ss in zip(off, d, out, s)]
        piece = lax.slice(xp, start, limit, ones + tuple(s))
        valid = np.ones(tuple(out), bool)
        flat = np.zeros(tuple(out), np.int64)
        for j in range(nd):
            pos = np.arange(out[j]) * s[j] - p[j] + off[j] * d[j]
            shape = [1] * nd
            shape[j] = -1
            valid = valid & ((pos >= 0) & (pos < sizes[j])).reshape(shape)
            flat = flat + (np.clip(pos, 0, sizes[j] - 1) * math.prod(sizes[j + 1:])).reshape(shape)
        shifted.append((piece, None if valid.all() else jnp.asarray(valid), jnp.asarray(flat.astype(idt))))
    index = jnp.zeros(mx.shape, idt)
    value = mx
    for piece, valid, flat in reversed(shifted):  # the earliest offset holding the max is assigned last
        hit = piece == mx if valid is None else (piece == mx) & valid
        index = jnp.where(hit, flat, index)
        if floating:  # the max's own bits (-0.0 or 0.0 as PyTorch keeps the first)
            value = jnp.where(hit, piece, value)
    if floating:
        nan_index, any_nan = index, jnp.zeros(mx.shape, bool)
        for piece, valid, flat in shifted:  # the latest NaN is assigned last
            nan = jnp.isnan(piece) if valid is None else jnp.isnan(piece) & valid
            nan_index = jnp.where(nan, flat, nan_index)
            any_nan = any_nan | nan
        index = jnp.where(any_nan, nan_index, index)
        value = jnp.where(any_nan, jnp.asarray(jnp.nan, x.dtype), value)
    return value, index.astype(jnp.int64)


def _max_pool(name: str, nd: int) -> Callable[..., tuple[Any, Any]]:
    def max_pool(
        self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0,),
        dilation: Sequence[int] = (1,), ceil_mode: bool = False,
    ) -> tuple[Any, Any]:
        k, s, p, d, out = _pool_params(name, self, nd, kernel_size, stride, padding, dilation, ceil_mode)
        return _max_pool_strided(self, k, s, p, d, out)

    return max_pool


lower("max_pool2d_with_indices")(_max_pool("max_pool2d", 2))
lower("max_pool3d_with_indices")(_max_pool("max_pool3d", 3))


def _max_pool_backward(grad_output: Any, self: Any, indices: Any, nd: int) -> Any:
    """Scatter-adds grad_output to the recorded flat indices of each input plane."""
    lead = self.shape[: self.ndim - nd]
    planes = math.prod(lead)
    g = _opmath(grad_output).reshape(planes, -1)
    idx = indices.reshape(planes, -1)
    grad = jnp.zeros((planes, math.prod(self.shape[self.ndim - nd:])), g.dtype)
    grad = grad.at[jnp.arange(planes)[:, None], idx].add(g)
    return grad.reshape(self.shape).astype(self.dtype)


@lower("max_pool2d_with_indices_backward")
def max_pool2d_with_indices_backward(
    grad_output: Any, self: Any, kernel_size: Any, stride: Any, padding: Any, dilation: Any, ceil_mode: bool,
    indices: Any,
) -> Any:
    return _max_pool_backward(grad_output, self, indices, 2)


@lower("max_pool3d_with_indices_backward")
def max_pool3d_with_indices_backward(
    grad_output: Any, self: Any, kernel_size: Any, stride: Any, padding: Any, dilation: Any, ceil_mode: bool,
    indices: Any,
) -> Any:
    return _max_pool_backward(grad_output, self, indices, 3)


def _avg_pool_forward(
    x: Any, nd: int, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int], ceil_mode: bool,
    count_include_pad: bool, divisor_override: int | None,
) -> Any:
    """Average pooling in x's opmath dtype (integers: truncating division, as PyTorch's CPU kernel)."""
    k, s, p, _, out = _pool_params(f"avg_pool{nd}d", x, nd, kernel_size, stride, padding, None, ceil_mode,
                                   divisor_override)
    sizes = x.shape[-nd:]
    lead = x.ndim - nd
    xo = _opmath(x)
    # Pad (or trim) so that exactly the windows of `out` fit, then sum each window.
    pads = [(0, 0, 0)] * lead + [(pp, (o - 1) * ss + kk - n - pp, 0) for n, o, kk, ss, pp in zip(sizes, out, k, s, p)]
    zero = np.zeros((), xo.dtype)  # a constant init: JAX then knows the window sum (and differentiates it)
    xp = lax.pad(xo, zero, pads)
    sums = lax.reduce_window(xp, zero, lax.add, (1,) * lead + k, (1,) * lead + s, "VALID")
    if divisor_override is not None:
        divisor = np.asarray(divisor_override)
    else:
        divisor = np.ones((1,) * nd, np.int64)
        for j, (n, o, kk, ss, pp) in enumerate(zip(sizes, out, k, s, p)):
            start = np.arange(o) * ss - pp
            end = np.minimum(start + kk, n + pp)
            count = end - start if count_include_pad else np.minimum(end, n) - np.maximum(start, 0)
            shape = [1] * nd
            shape[j] = o
            divisor = divisor * count.reshape(shape)
    if _is_float(xo):
        return sums / jnp.asarray(divisor, xo.dtype)
    return lax.div(sums, jnp.broadcast_to(jnp.asarray(divisor, xo.dtype), sums.shape))


def _avg_pool(nd: int) -> Callable[..., Any]:
    def avg_pool(
        self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0,),
        ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None,
    ) -> Any:
        out = _avg_pool_forward(self, nd, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                divisor_override)
        return out.astype(self.dtype)

    return avg_pool


def _avg_pool_backward(nd: int) -> Callable[..., Any]:
    def avg_pool_backward(
        grad_output: Any, self: Any, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
        ceil_mode: bool, count_include_pad: bool, divisor_override: int | None,
    ) -> Any:
        def f(x: Any) -> Any:
            return _avg_pool_forward(x, nd, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                     divisor_override)

        _, vjp = jax.vjp(f, _opmath(self))
        return vjp(_opmath(grad_output))[0].astype(self.dtype)

    return avg_pool_backward


lower("avg_pool2d")(_avg_pool(2))
lower("avg_pool3d")(_avg_pool(3))
lower("avg_pool2d_backward")(_avg_pool_backward(2))
lower("avg_pool3d_backward")(_avg_pool_backward(3))


def _adaptive_avg(x: Any, output_size: Sequence[int]) -> Any:
    nd = len(output_size)
    sizes = x.shape[x.ndim - nd:]
    windows = [_adaptive_windows(n, o) for n, o in zip(sizes, output_size)]
    if nd == 3 and _is_low(x.dtype):
        # PyTorch's CPU 3-D kernel accumulates in the input dtype, in window order, then divides by kT, kH
        # and kW in turn: reproduce its rounding.
        vals, valid, _ = _gather_windows(x, windows)
        total = jnp.zeros(vals.shape[:-1], x.dtype)
        for k in range(vals.shape[-1]):
            total = total + jnp.where(jnp.asarray(valid[..., k]), vals[..., k], jnp.zeros((), x.dtype))
        for j, (_, ok) in enumerate(windows):
            shape = [1] * nd
            shape[j] = ok.shape[0]
            total = (total / jnp.asarray(ok.sum(axis=1).reshape(shape), jnp.float32)).astype(x.dtype)
        return total
    vals, valid, _ = _gather_windows(_opmath(x), windows)
    count = valid.sum(axis=-1)
    return jnp.sum(jnp.where(jnp.asarray(valid), vals, 0), axis=-1) / jnp.asarray(count, vals.dtype)


def _check_adaptive(name: str, x: Any, output_size: Sequence[int]) -> None:
    nd = len(output_size)
    if x.ndim not in (nd + 1, nd + 2) or any(n == 0 for n in x.shape[x.ndim - nd:]):
        raise RuntimeError(f"{name}(): Expected {nd + 1}D or {nd + 2}D tensor, but got {list(x.shape)}")


@lower("_adaptive_avg_pool2d", "_adaptive_avg_pool3d")
def _adaptive_avg_pool(self: Any, output_size: Sequence[int]) -> Any:
    _check_adaptive("adaptive_avg_pool", self, output_size)
    return _adaptive_avg(self, output_size).astype(self.dtype)


def _adaptive_avg_pool_backward(nd: int) -> Callable[..., Any]:
    def adaptive_avg_pool_backward(grad_output: Any, self: Any) -> Any:
        output_size = grad_output.shape[grad_output.ndim - nd:]
        _, vjp = jax.vjp(lambda x: _adaptive_avg(x, output_size), _opmath(self))
        return vjp(_opmath(grad_output))[0].astype(self.dtype)

    return adaptive_avg_pool_backward


lower("_adaptive_avg_pool2d_backward")(_adaptive_avg_pool_backward(2))
lower("_adaptive_avg_pool3d_backward")(_adaptive_avg_pool_backward(3))


@direct("adaptive_avg_pool3d_backward.grad_input")
def adaptive_avg_pool3d_backward_out(grad_output: torch.Tensor, self: torch.Tensor, *,
                                     grad_input: torch.Tensor) -> torch.Tensor:
    """The legacy out= form (autograd calls _adaptive_avg_pool3d_backward): the same gradient, written out."""
    result = torch.ops.aten._adaptive_avg_pool3d_backward(grad_output, self)
    write_outs("adaptive_avg_pool3d_backward", [grad_input], [_storage.read(result)])
    return grad_input


def _adaptive_max_pool(nd: int) -> Callable[..., tuple[Any, Any]]:
    def adaptive_max_pool(self: Any, output_size: Sequence[int]) -> tuple[Any, Any]:
        """ATen's adaptive_max_pool{nd}d meta checks, in its order, then the max of each window."""
        op = f"adaptive_max_pool{nd}d()"
        shape = list(self.shape)
        if self.ndim not in (nd + 1, nd + 2):
            raise RuntimeError(f"{op}: Expected {nd + 1}D or {nd + 2}D tensor, but got: {shape}")
        for i in range(1, self.ndim):
            if shape[i] == 0:
                raise RuntimeError(f"{op}: Expected input to have non-zero size for non-batch dimensions, but input "
                                   f"has sizes {shape} with dimension {i} being empty")
        if len(output_size) != nd:
            raise RuntimeError(f"{op}: internal error: output_size.size() must be {nd}")
        out_shape = shape[:self.ndim - nd] + list(output_size)
        for o in output_size:
            if o < 0:
                raise RuntimeError(f"Trying to create tensor with negative dimension {o}: {out_shape}")
        windows = [_adaptive_windows(n, o) for n, o in zip(self.shape[self.ndim - nd:], output_size)]
        return _max_over_windows(self, windows)

    return adaptive_max_pool


lower("adaptive_max_pool2d")(_adaptive_max_pool(2))
lower("adaptive_max_pool3d")(_adaptive_max_pool(3))


@lower("adaptive_max_pool2d_backward")
def adaptive_max_pool2d_backward(grad_output: Any, self: Any, indices: Any) -> Any:
    return _max_pool_backward(grad_output, self, indices, 2)


@lower("adaptive_max_pool3d_backward")
def adaptive_max_pool3d_backward(grad_output: Any, self: Any, indices: Any) -> Any:
    return _max_pool_backward(grad_output, self, indices, 3)


def _max_unpool(self: Any, indices: Any, output_size: Sequence[int]) -> Any:
    """Scatters each plane's values to their flat indices in a zero plane of `output_size`."""
    nd = len(output_size)
    if indices.shape != self.shape:
        raise RuntimeError(f"Expected shape of indices to be same as that of the input tensor "
                           f"({list(self.shape)}) but got indices tensor with shape: {list(indices.shape)}")
    lead = self.shape[: self.ndim - nd]
    planes = math.prod(lead)
    out = jnp.zeros((planes, math.prod(output_size)), self.dtype)
    sizes = "x".join(str(s) for s in output_size)
    report_bad_index(f"max_unpool{nd}d", indices, math.prod(output_size), error=RuntimeError,
                     message="{op}(): Found an invalid max index: {value} (output volumes are of size " + sizes + ")")
    out = out.at[jnp.arange(planes)[:, None], indices.reshape(planes, -1)].set(self.reshape(planes, -1))
    return out.reshape(tuple(lead) + tuple(output_size))


@lower("max_unpool2d", checks=True)
def max_unpool2d(self: Any, indices: Any, output_size: Sequence[int]) -> Any:
    return _max_unpool(self, indices, output_size)


@lower("max_unpool3d", checks=True)
def max_unpool3d(self: Any, indices: Any, output_size: Sequence[int], stride: Sequence[int],
                 padding: Sequence[int]) -> Any:
    return _max_unpool(self, indices, output_size)


def _im2col(x: Any, kernel_size: Sequence[int], dilation: Sequence[int], padding: Sequence[int],
            stride: Sequence[int]) -> Any:
    """(N, C, H, W) or (C, H, W) -> (N, C * kh * kw, L) columns of sliding blocks (zero padding)."""
    k, d, p, s = _expand(kernel_size, 2), _expand(dilation, 2), _expand(padding, 2), _expand(stride, 2)
    sizes = x.shape[-2:]
    out = tuple((n + 2 * pp - dd * (kk - 1) - 1) // ss + 1 for n, kk, dd, pp, ss in zip(sizes, k, d, p, s))
    if any(o < 1 for o in out):
        raise RuntimeError(f"Given input with spatial size {tuple(sizes)}, kernel_size={k}, dilation={d}, "
                           f"padding={p}, calculated shape of the array of sliding blocks as {out}, but its "
                           "components must be at least one.")
    windows = [_strided_windows(*a) for a in zip(sizes, out, k, s, p, d)]
    vals, valid, _ = _gather_windows(x, windows)  # (..., C, oh, ow, K)
    vals = jnp.where(jnp.asarray(valid), vals, jnp.zeros((), x.dtype))
    lead = x.shape[:-3]
    vals = jnp.moveaxis(vals, -1, -3)  # (..., C, K, oh, ow)
    return vals.reshape(tuple(lead) + (x.shape[-3] * k[0] * k[1], out[0] * out[1]))


@lower("im2col")
def im2col(self: Any, kernel_size: Sequence[int], dilation: Sequence[int], padding: Sequence[int],
           stride: Sequence[int]) -> Any:
    return _im2col(self, kernel_size, dilation, padding, stride)


@lower("col2im")
def col2im(self: Any, output_size: Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int],
           padding: Sequence[int], stride: Sequence[int]) -> Any:
    """Sums columns of sliding blocks back into an image: the adjoint of im2col."""
    k = _expand(kernel_size, 2)
    channels = self.shape[-2] // (k[0] * k[1])
    shape = tuple(self.shape[:-2]) + (channels,) + tuple(output_size)
    x = _opmath(self)
    _, vjp = jax.vjp(lambda img: _im2col(img, kernel_size, dilation, padding, stride), jnp.zeros(shape, x.dtype))
    return vjp(x)[0].astype(self.dtype)


@lower("channel_shuffle")
def channel_shuffle(self: Any, groups: int) -> Any:
    if groups <= 0:
        raise RuntimeError(f"Number of groups to divide channels in must be positive. Value of groups:{groups}")
    n, c = self.shape[0], self.shape[1]
    if c % groups:
        raise RuntimeError(f"Number of channels must be divisible by groups. Got {c} channels and {groups} groups.")
    rest = self.shape[2:]
    return self.reshape((n, groups, c // groups) + rest).swapaxes(1, 2).reshape(self.shape)


# ---- fractional max pooling ----
# The windows' starts come from random_samples (one sample in [0, 1) per plane and dim, drawn by the caller:
# F.fractional_max_pool*d draws them with the device generator), computed as ATen's generate_intervals does, in
# the input's dtype; the windows are then gathered per plane.


def _fractional_starts(sample: Any, in_size: int, out_size: int, pool: int) -> Any:
    """Window starts (planes, out_size) of ATen's generate_intervals, in the samples' dtype."""
    dt = sample.dtype
    starts = [jnp.full(sample.shape, in_size - pool, jnp.int64)] if out_size > 0 else []
    if out_size > 1:
        alpha = jnp.asarray(in_size - pool, dt) / jnp.asarray(out_size - 1, dt)
        i = jnp.arange(out_size - 1).astype(dt)
        seq = ((i[None, :] + sample[:, None]) * alpha).astype(jnp.int64) - (sample * alpha).astype(jnp.int64)[:, None]
        return jnp.concatenate([seq, starts[0][:, None]], axis=1)
    return starts[0][:, None] if starts else jnp.zeros(sample.shape + (0,), jnp.int64)


def _fractional_max_pool(name: str, nd: int) -> Callable[..., tuple[Any, Any]]:
    def forward(self: Any, kernel_size: Sequence[int], output_size: Sequence[int],
                random_samples: Any) -> tuple[Any, Any]:
        if self.ndim not in (nd + 1, nd + 2):
            raise RuntimeError(f"{name}(): Expected {nd + 1}D or {nd + 2}D tensor, but got: {list(self.shape)}")
        k, out = _expand(kernel_size, nd), _expand(output_size, nd)
        sizes = self.shape[-nd:]
        dims = ("time", "height", "width")[3 - nd:]
        for j in range(nd):
            if out[j] + k[j] - 1 > sizes[j]:
                raise RuntimeError(f"{name}(): pool {dims[j]} {k[j]} too large relative to input {dims[j]} "
                                   f"{sizes[j]}")
        lead = self.shape[: self.ndim - nd]
        planes = math.prod(lead)
        if random_samples.ndim != 3 or random_samples.shape[-1] != nd or \
                random_samples.shape[0] * random_samples.shape[1] < planes:
            raise RuntimeError(f"{name}(): expected random_samples of shape (N, C, {nd}) matching the input "
                               f"{list(self.shape)}, but got {list(random_samples.shape)}")
        samples = random_samples.astype(self.dtype).reshape(-1, nd)[:planes]
        # Samples are ordered (W, H) in 2-d and (T, H, W) in 3-d, as in ATen's kernels.
        order = (1, 0) if nd == 2 else (0, 1, 2)
        flat = jnp.zeros((planes,) + (1,) * (2 * nd), jnp.int64)
        stride = 1
        for j in reversed(range(nd)):
            starts = _fractional_starts(samples[:, order[j]], sizes[j], out[j], k[j])  # (P, out_j)
            idx = starts[:, :, None] + jnp.arange(k[j])[None, None, :]
            shape = [planes] + [1] * (2 * nd)
            shape[1 + j], shape[1 + nd + j] = out[j], k[j]
            flat = flat + idx.reshape(shape) * stride
            stride *= sizes[j]
        flat = jnp.broadcast_to(flat, (planes,) + tuple(out) + tuple(k))
        flat = flat.reshape(planes, math.prod(out), math.prod(k))
        x = self.reshape(planes, math.prod(sizes))
        vals = jnp.take_along_axis(x, flat.reshape(planes, flat.shape[1] * flat.shape[2]), axis=1).reshape(flat.shape)
        arg = jnp.argmax(vals, axis=-1)[..., None]  # the first max; a NaN wins
        value = jnp.take_along_axis(vals, arg, axis=-1)[..., 0]
        index = jnp.take_along_axis(flat, arg, axis=-1)[..., 0]
        shape = tuple(lead) + tuple(out)
        return value.reshape(shape), index.reshape(shape)

    return forward


lower("fractional_max_pool2d")(_fractional_max_pool("fractional_max_pool2d", 2))
lower("fractional_max_pool3d")(_fractional_max_pool("fractional_max_pool3d", 3))


def _fractional_max_pool_backward(nd: int) -> Callable[..., Any]:
    def backward(grad_output: Any, self: Any, kernel_size: Any, output_size: Any, indices: Any) -> Any:
        if self.size == 0:
            return jnp.zeros(self.shape, self.dtype)
        return _max_pool_backward(grad_output, self, indices, nd)

    return backward


lower("fractional_max_pool2d_backward")(_fractional_max_pool_backward(2))
lower("fractional_max_pool3d_backward")(_fractional_max_pool_backward(3))
