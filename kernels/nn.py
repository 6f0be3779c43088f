"""torch.nn.functional's ATen ops and their backward ops: convolution, pooling, normalization, softmax,
activations, losses, upsampling and dropout.

Conventions: bfloat16/float16 inputs compute in float32 ("opmath", as PyTorch's CPU kernels do) and round once
at the end; float32 matmul-like work (convolution) runs at HIGHEST precision. Window and interpolation indices
depend only on static shapes, so they are computed with numpy at trace time. Backward ops of linear forward ops
(convolution, average pooling, upsampling) are the JAX VJP of the forward lowering. Where ATen would return an
undefined tensor (an output masked off by `output_mask`), these kernels return zeros of the right shape: the
registry has no way to return an undefined tensor, and autograd drops those outputs.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch


from torch_tpu import _C, _deferred, _runtime, _storage
from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels.creation import _key, _philox
from torch_tpu.kernels.registry import DEFAULT, direct, lower, wrap_arrays, write_outs

# ---- helpers ----


def _is_low(dtype: Any) -> bool:
    return dtype in (jnp.bfloat16, jnp.float16)


def _opmath(x: Any) -> Any:
    """x in the dtype PyTorch computes it in: float32 for bfloat16/float16, else unchanged."""
    return x.astype(jnp.float32) if _is_low(x.dtype) else x


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _expand(v: Sequence[int] | int, n: int) -> tuple[int, ...]:
    """ATen's expand_param_if_needed: an int or one-element list stands for n equal values."""
    if isinstance(v, int):
        return (v,) * n
    v = tuple(v)
    return v * n if len(v) == 1 else v


def _reduce(loss: Any, reduction: int) -> Any:
    """Applies at::Reduction (0 none, 1 mean, 2 sum)."""
    if reduction == 0:
        return loss
    if reduction == 1:
        return jnp.mean(loss)
    return jnp.sum(loss)


def _grad_scale(grad_output: Any, reduction: int, numel: int) -> Any:
    """The upstream gradient of each element of an elementwise loss under `reduction`."""
    return grad_output / numel if reduction == 1 else grad_output


def _lowest(dtype: Any) -> Any:
    return -jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min


def _as(value: Any, like: Any) -> Any:
    """A Scalar converted to `like`'s dtype, as ATen's `scalar.to<scalar_t>()`."""
    return jnp.asarray(value).astype(like.dtype)


# ---- convolution ----


def _conv(
    input: Any, weight: Any, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
    transposed: bool, output_padding: Sequence[int], groups: int,
) -> Any:
    """Convolution (or transposed convolution) without bias, in the input's opmath dtype."""
    nd = input.ndim - 2
    stride, padding, dilation = _expand(stride, nd), _expand(padding, nd), _expand(dilation, nd)
    output_padding = _expand(output_padding, nd)
    spatial = "DHW"[3 - nd:] if nd <= 3 else None
    if spatial is None:
        raise RuntimeError(f"torch_tpu: convolution over {nd} spatial dims is not supported")
    dn = lax.conv_dimension_numbers(input.shape, weight.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    x, w = _opmath(input), _opmath(weight)
    precision = lax.Precision.HIGHEST if _is_float(x) else None
    if not transposed:
        return lax.conv_general_dilated(
            x, w, window_strides=stride, padding=[(p, p) for p in padding], rhs_dilation=dilation,
            dimension_numbers=dn, feature_group_count=groups, precision=precision,
        )
    # Transposed: weight is (C_in, C_out / groups, *k). Regroup to (C_out, C_in / groups, *k), flip the
    # kernel and convolve the stride-dilated input with "full" padding, less `padding`, plus output_padding.
    c_in, c_out_g, k = w.shape[0], w.shape[1], w.shape[2:]
    w = w.reshape((groups, c_in // groups, c_out_g) + k).swapaxes(1, 2).reshape((groups * c_out_g, c_in // groups) + k)
    w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
    dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op) for kk, p, d, op in zip(k, padding, dilation, output_padding)]
    return lax.conv_general_dilated(
        x, w, window_strides=(1,) * nd, padding=pads, lhs_dilation=stride, rhs_dilation=dilation,
        dimension_numbers=dn, feature_group_count=groups, precision=precision,
    )


@lower("convolution")
def convolution(
    input: Any, weight: Any, bias: Any, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
    transposed: bool, output_padding: Sequence[int], groups: int,
) -> Any:
    out = _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + _opmath(bias).reshape((1, -1) + (1,) * (out.ndim - 2))
    return out.astype(input.dtype)


@lower("convolution_backward")
def convolution_backward(
    grad_output: Any, input: Any, weight: Any, bias_sizes: Sequence[int] | None, stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
    groups: int, output_mask: Sequence[bool],
) -> tuple[Any, Any, Any]:
    def f(x: Any, w: Any) -> Any:
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)

    xf, wf = _opmath(input), _opmath(weight)
    _, vjp = jax.vjp(f, xf, wf)
    g = _opmath(grad_output)
    grad_input, grad_weight = vjp(g.astype(jnp.result_type(xf, wf)))
    n_bias = tuple(bias_sizes)[0] if bias_sizes else grad_output.shape[1]
    grad_bias = jnp.sum(g, axis=(0,) + tuple(range(2, g.ndim))) if output_mask[2] else jnp.zeros((n_bias,), g.dtype)
    if not output_mask[0]:
        grad_input = jnp.zeros_like(xf)
    if not output_mask[1]:
        grad_weight = jnp.zeros_like(wf)
    return grad_input.astype(input.dtype), grad_weight.astype(weight.dtype), grad_bias.astype(grad_output.dtype)


# ---- pooling ----


def _pool_out_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """ATen's pooling_output_shape."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_params(
    name: str, x: Any, nd: int, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], ceil_mode: bool,
) -> tuple[tuple[int, ...], ...]:
    """(kernel, stride, padding, dilation, output size) per spatial dim, with ATen's checks."""
    if x.ndim not in (nd + 1, nd + 2):
        raise RuntimeError(f"{name}: Expected {nd + 1}D or {nd + 2}D input tensor, but got {x.ndim}D")
    k = _expand(kernel_size, nd)
    s = _expand(stride, nd) if len(tuple(stride)) else k
    p, d = _expand(padding, nd), _expand(dilation, nd)
    if any(pp > kk // 2 for pp, kk in zip(p, k)):
        raise RuntimeError(f"pad should be at most half of effective kernel size, but got pad={p[0]}, "
                           f"kernel_size={k[0]} and dilation={d[0]}")
    sizes = x.shape[-nd:]
    out = tuple(_pool_out_size(n, kk, ss, pp, dd, ceil_mode) for n, kk, ss, pp, dd in zip(sizes, k, s, p, d))
    if any(o <= 0 for o in out):
        raise RuntimeError(f"Given input size: {tuple(x.shape)}. Calculated output size: {out}. "
                           "Output size is too small")
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
    """(max, flat index of the first max) of each window; NaN wins, as in PyTorch."""
    vals, valid, flat = _gather_windows(x, windows)
    vals = jnp.where(jnp.asarray(valid), vals, jnp.asarray(_lowest(x.dtype), x.dtype))
    arg = jnp.argmax(vals, axis=-1)[..., None]  # numpy semantics: the first NaN, else the first max
    out = jnp.take_along_axis(vals, arg, axis=-1)[..., 0]
    index = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat), vals.shape), arg, axis=-1)[..., 0]
    return out, index


def _max_pool(name: str, nd: int) -> Callable[..., tuple[Any, Any]]:
    def max_pool(
        self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0,),
        dilation: Sequence[int] = (1,), ceil_mode: bool = False,
    ) -> tuple[Any, Any]:
        k, s, p, d, out = _pool_params(name, self, nd, kernel_size, stride, padding, dilation, ceil_mode)
        sizes = self.shape[-nd:]
        windows = [_strided_windows(*a) for a in zip(sizes, out, k, s, p, d)]
        return _max_over_windows(self, windows)

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
    k, s, p, _, out = _pool_params("avg_pool", x, nd, kernel_size, stride, padding, (1,), ceil_mode)
    if divisor_override is not None and divisor_override == 0:
        raise RuntimeError("divisor must be not zero")
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


@lower("adaptive_max_pool2d", "adaptive_max_pool3d")
def adaptive_max_pool(self: Any, output_size: Sequence[int]) -> tuple[Any, Any]:
    _check_adaptive("adaptive_max_pool", self, output_size)
    nd = len(output_size)
    windows = [_adaptive_windows(n, o) for n, o in zip(self.shape[self.ndim - nd:], output_size)]
    return _max_over_windows(self, windows)


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


# ---- normalization ----


def _channel_shape(x: Any) -> tuple[int, ...]:
    """Shape broadcasting a per-channel (dim 1) vector against x."""
    return (1, -1) + (1,) * (x.ndim - 2)


def _stat_dtype(input: Any, *params: Any) -> Any:
    """ATen's batch-norm parameter dtype: opmath when parameters and input differ in dtype."""
    mixed = any(p is not None and p.dtype != input.dtype for p in params)
    return jnp.float32 if mixed and _is_low(input.dtype) else input.dtype


def _batch_norm_math(
    input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, training: bool, momentum: float,
    eps: float,
) -> tuple[Any, Any, Any, Any, Any]:
    """(output, save_mean, save_invstd, new running_mean, new running_var)."""
    x = _opmath(input)
    axes = (0,) + tuple(range(2, x.ndim))
    cs = _channel_shape(x)
    stat = _stat_dtype(input, weight, bias, running_mean, running_var)
    new_rm, new_rv = running_mean, running_var
    if training:
        n = x.size // x.shape[1] if x.shape[1] else 0
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - mean.reshape(cs)), axis=axes)
        invstd = lax.rsqrt(var + eps)
        y = (x - mean.reshape(cs)) * invstd.reshape(cs)
        if running_mean is not None:
            new_rm = ((1 - momentum) * _opmath(running_mean) + momentum * mean).astype(running_mean.dtype)
        if running_var is not None:
            unbiased = var * (n / (n - 1)) if n > 1 else var * jnp.inf
            new_rv = ((1 - momentum) * _opmath(running_var) + momentum * unbiased).astype(running_var.dtype)
        save_mean, save_invstd = mean.astype(stat), invstd.astype(stat)
    else:
        if running_mean is None or running_var is None:
            raise RuntimeError("running_mean and running_var must be defined in evaluation mode")
        invstd = lax.rsqrt(_opmath(running_var) + eps)
        y = (x - _opmath(running_mean).reshape(cs)) * invstd.reshape(cs)
        save_mean = save_invstd = jnp.zeros((0,), stat)
    if weight is not None:
        y = y * _opmath(weight).reshape(cs)
    if bias is not None:
        y = y + _opmath(bias).reshape(cs)
    return y.astype(input.dtype), save_mean, save_invstd, new_rm, new_rv


@functools.lru_cache(maxsize=256)
def _batch_norm_fn(training: bool, momentum: float, eps: float) -> Any:
    return _deferred.jitted(lambda x, w, b, rm, rv: _batch_norm_math(x, w, b, rm, rv, training, momentum, eps),
                            key=(training, momentum, eps))


def _read(t: torch.Tensor | None, index: int) -> Any:
    if t is None:
        return None
    if t.device.type != "tpu":
        if t.dim() == 0:
            return _runtime.upload(t, index)
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, tpu:{index} and "
            f"{t.device}!"
        )
    return _storage.read(t)


def _batch_norm_arrays(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool, momentum: float,
    eps: float,
) -> tuple[Any, Any, Any]:
    """Batch norm's (output, save_mean, save_invstd) arrays; writes the updated running statistics back into
    their (mutated) buffers."""
    index = input.device.index
    arrays = [_read(t, index) for t in (input, weight, bias, running_mean, running_var)]
    out, mean, invstd, new_rm, new_rv = _batch_norm_fn(bool(training), float(momentum), float(eps))(*arrays)
    if training:
        if running_mean is not None:
            _storage.write(running_mean, new_rm)
        if running_var is not None:
            _storage.write(running_var, new_rv)
    return out, mean, invstd


def _batch_norm(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    index = args[0].device.index
    return wrap_arrays(_batch_norm_arrays(*args), index)


@direct("native_batch_norm", "_native_batch_norm_legit", defer=True)
def native_batch_norm(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool, momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@direct("native_batch_norm.out", "_native_batch_norm_legit.out", defer=True)
def native_batch_norm_out(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool, momentum: float,
    eps: float, *, out: torch.Tensor, save_mean: torch.Tensor, save_invstd: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    arrays = _batch_norm_arrays(input, weight, bias, running_mean, running_var, training, momentum, eps)
    write_outs("native_batch_norm", (out, save_mean, save_invstd), arrays)
    return out, save_mean, save_invstd


@direct("_native_batch_norm_legit.no_stats", defer=True)
def _native_batch_norm_legit_no_stats(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, training: bool, momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _batch_norm(input, weight, bias, None, None, training, momentum, eps)


@direct("_native_batch_norm_legit.no_stats_out", defer=True)
def _native_batch_norm_legit_no_stats_out(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, training: bool, momentum: float,
    eps: float, *, out: torch.Tensor, save_mean: torch.Tensor, save_invstd: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    arrays = _batch_norm_arrays(input, weight, bias, None, None, training, momentum, eps)
    write_outs("native_batch_norm", (out, save_mean, save_invstd), arrays)
    return out, save_mean, save_invstd


@lower("_native_batch_norm_legit_no_training")
def _native_batch_norm_legit_no_training(
    input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, momentum: float, eps: float,
) -> tuple[Any, Any, Any]:
    return _batch_norm_math(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


@direct("_batch_norm_with_update", defer=True)
def _batch_norm_with_update(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, running_mean: torch.Tensor,
    running_var: torch.Tensor, momentum: float, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, mean, invstd = _batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, mean, invstd, torch.empty((0,), dtype=torch.uint8, device=input.device)


@lower("native_batch_norm_backward")
def native_batch_norm_backward(
    grad_out: Any, input: Any, weight: Any, running_mean: Any, running_var: Any, save_mean: Any,
    save_invstd: Any, train: bool, eps: float, output_mask: Sequence[bool],
) -> tuple[Any, Any, Any]:
    x, g = _opmath(input), _opmath(grad_out)
    axes = (0,) + tuple(range(2, x.ndim))
    cs = _channel_shape(x)
    if train:
        mean, invstd = _opmath(save_mean), _opmath(save_invstd)
    else:
        mean, invstd = _opmath(running_mean), lax.rsqrt(_opmath(running_var) + eps)
    w = _opmath(weight) if weight is not None else jnp.ones((x.shape[1],), x.dtype)
    xhat = (x - mean.reshape(cs)) * invstd.reshape(cs)
    sum_g = jnp.sum(g, axis=axes)
    sum_gx = jnp.sum(g * xhat, axis=axes)
    scale = (invstd * w).reshape(cs)
    if train:
        n = x.size // x.shape[1]
        grad_input = (g - (sum_g / n).reshape(cs) - xhat * (sum_gx / n).reshape(cs)) * scale
    else:
        grad_input = g * scale
    wdtype = weight.dtype if weight is not None else input.dtype
    return grad_input.astype(input.dtype), sum_gx.astype(wdtype), sum_g.astype(wdtype)


@lower("batch_norm_backward")
def batch_norm_backward(
    grad_out: Any, input: Any, weight: Any, running_mean: Any, running_var: Any, save_mean: Any, save_var: Any,
    update: bool, eps: float, output_mask: Sequence[bool], reserve: Any,
) -> tuple[Any, Any, Any]:
    """The backward of _batch_norm_with_update / _batch_norm_no_update (save_var holds the saved invstd)."""
    return native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var,
                                      update, eps, output_mask)


@lower("native_layer_norm")
def native_layer_norm(input: Any, normalized_shape: Sequence[int], weight: Any, bias: Any, eps: float) -> tuple[Any, Any, Any]:
    x = _opmath(input)
    axis = x.ndim - len(normalized_shape)
    if tuple(x.shape[axis:]) != tuple(normalized_shape) or axis < 0:
        raise RuntimeError(
            f"Given normalized_shape={list(normalized_shape)}, expected input with shape "
            f"[*, {', '.join(map(str, normalized_shape))}], but got input of size{list(input.shape)}"
        )
    axes = tuple(range(axis, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    y = (x - mean) * rstd
    if weight is not None:
        y = y * _opmath(weight)
    if bias is not None:
        y = y + _opmath(bias)
    return y.astype(input.dtype), mean.astype(input.dtype), rstd.astype(input.dtype)


@lower("native_layer_norm_backward")
def native_layer_norm_backward(
    grad_out: Any, input: Any, normalized_shape: Sequence[int], mean: Any, rstd: Any, weight: Any, bias: Any,
    output_mask: Sequence[bool],
) -> tuple[Any, Any, Any]:
    x, g = _opmath(input), _opmath(grad_out)
    axis = x.ndim - len(normalized_shape)
    axes = tuple(range(axis, x.ndim))
    batch_axes = tuple(range(axis))
    mean, rstd = _opmath(mean), _opmath(rstd)
    xhat = (x - mean) * rstd
    wg = g * _opmath(weight) if weight is not None else g
    grad_input = rstd * (wg - jnp.mean(wg, axis=axes, keepdims=True) - xhat * jnp.mean(wg * xhat, axis=axes, keepdims=True))
    grad_weight = jnp.sum(g * xhat, axis=batch_axes)
    grad_bias = jnp.sum(g, axis=batch_axes)
    wdtype = weight.dtype if weight is not None else (bias.dtype if bias is not None else input.dtype)
    return grad_input.astype(input.dtype), grad_weight.astype(wdtype), grad_bias.astype(wdtype)


@lower("native_group_norm")
def native_group_norm(
    input: Any, weight: Any, bias: Any, N: int, C: int, HxW: int, group: int, eps: float,
) -> tuple[Any, Any, Any]:
    if C % group:
        raise RuntimeError(f"Expected number of channels in input to be divisible by num_groups, but got input of "
                           f"shape {list(input.shape)} and num_groups={group}")
    x = _opmath(input)
    xr = x.reshape(N, group, (C // group) * HxW)
    mean = jnp.mean(xr, axis=-1)
    var = jnp.mean(jnp.square(xr - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    y = ((xr - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    cs = (1, C) + (1,) * (x.ndim - 2)
    if weight is not None:
        y = y * _opmath(weight).reshape(cs)
    if bias is not None:
        y = y + _opmath(bias).reshape(cs)
    return y.astype(input.dtype), mean.astype(input.dtype), rstd.astype(input.dtype)


@lower("native_group_norm_backward")
def native_group_norm_backward(
    grad_out: Any, input: Any, mean: Any, rstd: Any, weight: Any, N: int, C: int, HxW: int, group: int,
    output_mask: Sequence[bool],
) -> tuple[Any, Any, Any]:
    shape = (N, group, C // group, HxW)
    x, g = _opmath(input).reshape(shape), _opmath(grad_out).reshape(shape)
    m, r = _opmath(mean)[:, :, None, None], _opmath(rstd)[:, :, None, None]
    xhat = (x - m) * r
    wg = g * _opmath(weight).reshape(1, group, C // group, 1) if weight is not None else g
    grad_input = r * (wg - jnp.mean(wg, axis=(2, 3), keepdims=True)
                      - xhat * jnp.mean(wg * xhat, axis=(2, 3), keepdims=True))
    grad_weight = jnp.sum(g * xhat, axis=(0, 3)).reshape(C)
    grad_bias = jnp.sum(g, axis=(0, 3)).reshape(C)
    wdtype = weight.dtype if weight is not None else input.dtype
    return (grad_input.reshape(input.shape).astype(input.dtype), grad_weight.astype(wdtype),
            grad_bias.astype(wdtype))


# ---- softmax ----


def _softmax_impl(self: Any, dim: int, half_to_float: bool, log: bool) -> Any:
    out_dtype = jnp.float32 if half_to_float else self.dtype
    x = _opmath(self)
    if x.size == 0:
        return x.astype(out_dtype)
    scalar = x.ndim == 0
    if scalar:
        x = x.reshape(1)
    dim = dim % x.ndim
    m = lax.stop_gradient(jnp.max(x, axis=dim, keepdims=True))
    shifted = x - m
    if log:
        out = shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=dim, keepdims=True))
    else:
        e = jnp.exp(shifted)
        out = e / jnp.sum(e, axis=dim, keepdims=True)
    return (out.reshape(()) if scalar else out).astype(out_dtype)


@lower("_softmax")
def _softmax(self: Any, dim: int, half_to_float: bool) -> Any:
    return _softmax_impl(self, dim, half_to_float, log=False)


@lower("_log_softmax")
def _log_softmax(self: Any, dim: int, half_to_float: bool) -> Any:
    return _softmax_impl(self, dim, half_to_float, log=True)


@lower("_softmax_backward_data")
def _softmax_backward_data(grad_output: Any, output: Any, dim: int, input_dtype: torch.dtype) -> Any:
    g, y = _opmath(grad_output), _opmath(output)
    dim = dim % max(y.ndim, 1)
    s = jnp.sum(g * y, axis=dim, keepdims=True) if y.ndim else g * y
    return (y * (g - s)).astype(_runtime.jax_dtype(input_dtype))


@lower("_log_softmax_backward_data")
def _log_softmax_backward_data(grad_output: Any, output: Any, dim: int, input_dtype: torch.dtype) -> Any:
    g, y = _opmath(grad_output), _opmath(output)
    dim = dim % max(y.ndim, 1)
    s = jnp.sum(g, axis=dim, keepdims=True) if y.ndim else g
    return (g - jnp.exp(y) * s).astype(_runtime.jax_dtype(input_dtype))


# ---- activations ----


def _check_float(name: str, x: Any) -> None:
    if not _is_float(x):
        raise RuntimeError(f"\"{name}\" not implemented for '{_runtime.torch_dtype(x.dtype)}'")


@lower("relu")
def relu(self: Any) -> Any:
    if self.dtype == jnp.bool_:
        raise RuntimeError("\"clamp_min_scalar_cpu\" not implemented for 'Bool'")
    return jnp.maximum(self, jnp.zeros((), self.dtype))


@lower("threshold")
def threshold(self: Any, threshold: Any, value: Any) -> Any:
    return jnp.where(self <= _as(threshold, self), _as(value, self), self)


@lower("threshold_backward")
def threshold_backward(grad_output: Any, self: Any, threshold: Any) -> Any:
    return jnp.where(self <= _as(threshold, self), jnp.zeros((), grad_output.dtype), grad_output)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_KAPPA = 0.044715


@lower("gelu")
def gelu(self: Any, approximate: str = "none") -> Any:
    _check_float("GeluKernelImpl", self)
    x = _opmath(self)
    if approximate == "tanh":
        out = 0.5 * x * (1 + jnp.tanh(_SQRT_2_OVER_PI * (x + _GELU_KAPPA * x * x * x)))
    elif approximate == "none":
        out = 0.5 * x * (1 + lax.erf(x * math.sqrt(0.5)))
    else:
        raise RuntimeError("approximate argument must be either none or tanh.")
    return out.astype(self.dtype)


@lower("gelu_backward")
def gelu_backward(grad_output: Any, self: Any, approximate: str = "none") -> Any:
    x, g = _opmath(self), _opmath(grad_output)
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + _GELU_KAPPA * x * x * x)
        t = jnp.tanh(inner)
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _GELU_KAPPA * x * x)
    else:
        cdf = 0.5 * (1 + lax.erf(x * math.sqrt(0.5)))
        pdf = jnp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        d = cdf + x * pdf
    return (g * d).astype(self.dtype)


@lower("silu")
def silu(self: Any) -> Any:
    _check_float("silu", self)
    x = _opmath(self)
    return (x * jax.nn.sigmoid(x)).astype(self.dtype)


@lower("silu_backward")
def silu_backward(grad_output: Any, self: Any) -> Any:
    x, g = _opmath(self), _opmath(grad_output)
    s = jax.nn.sigmoid(x)
    return (g * s * (1 + x * (1 - s))).astype(self.dtype)


@lower("leaky_relu")
def leaky_relu(self: Any, negative_slope: Any = 0.01) -> Any:
    _check_float("leaky_relu_cpu", self)
    x = _opmath(self)
    return jnp.where(x > 0, x, x * negative_slope).astype(self.dtype)


@lower("leaky_relu_backward")
def leaky_relu_backward(grad_output: Any, self: Any, negative_slope: Any, self_is_result: bool) -> Any:
    g = _opmath(grad_output)
    return jnp.where(self > 0, g, g * negative_slope).astype(grad_output.dtype)


@lower("elu")
def elu(self: Any, alpha: Any = 1, scale: Any = 1, input_scale: Any = 1) -> Any:
    _check_float("elu", self)
    x = _opmath(self)
    return jnp.where(x <= 0, jnp.expm1(x * input_scale) * alpha * scale, x * scale).astype(self.dtype)


@lower("elu_backward")
def elu_backward(
    grad_output: Any, alpha: Any, scale: Any, input_scale: Any, is_result: bool, self_or_result: Any,
) -> Any:
    g, y = _opmath(grad_output), _opmath(self_or_result)
    if is_result:
        neg = g * input_scale * (y + alpha * scale)
    else:
        neg = g * input_scale * alpha * scale * jnp.exp(y * input_scale)
    return jnp.where(y <= 0, neg, g * scale).astype(grad_output.dtype)


@lower("hardtanh")
def hardtanh(self: Any, min_val: Any = -1, max_val: Any = 1) -> Any:
    if self.dtype == jnp.bool_:
        raise RuntimeError("Bool inputs not supported for hardtanh")
    return jnp.minimum(jnp.maximum(self, _as(min_val, self)), _as(max_val, self))


@lower("hardtanh_backward")
def hardtanh_backward(grad_output: Any, self: Any, min_val: Any, max_val: Any) -> Any:
    inside = (self > min_val) & (self < max_val)
    return jnp.where(inside, grad_output, jnp.zeros((), grad_output.dtype))


@lower("hardswish")
def hardswish(self: Any) -> Any:
    x = _opmath(self)
    return (x * jnp.clip(x + 3, 0, 6) / 6).astype(self.dtype)


@lower("hardswish_backward")
def hardswish_backward(grad_output: Any, self: Any) -> Any:
    x, g = _opmath(self), _opmath(grad_output)
    return jnp.where(x < -3, 0, jnp.where(x <= 3, g * (x / 3 + 0.5), g)).astype(grad_output.dtype)


@lower("hardsigmoid")
def hardsigmoid(self: Any) -> Any:
    _check_float("hardsigmoid", self)
    x = _opmath(self)
    return (jnp.clip(x + 3, 0, 6) / 6).astype(self.dtype)


@lower("hardsigmoid_backward")
def hardsigmoid_backward(grad_output: Any, self: Any) -> Any:
    g = _opmath(grad_output)
    return jnp.where((self > -3) & (self < 3), g / 6, 0).astype(grad_output.dtype)


@lower("softplus")
def softplus(self: Any, beta: Any = 1, threshold: Any = 20) -> Any:
    _check_float("softplus", self)
    x = _opmath(self)
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta).astype(self.dtype)


@lower("softplus_backward")
def softplus_backward(grad_output: Any, self: Any, beta: Any, threshold: Any) -> Any:
    x, g = _opmath(self), _opmath(grad_output)
    z = jnp.exp(x * beta)
    return jnp.where(x * beta > threshold, g, g * z / (z + 1)).astype(grad_output.dtype)


@lower("mish")
def mish(self: Any) -> Any:
    _check_float("mish", self)
    x = _opmath(self)
    return (x * jnp.tanh(jnp.log1p(jnp.exp(x)))).astype(self.dtype)


@lower("mish_backward")
def mish_backward(grad_output: Any, self: Any) -> Any:
    x, g = _opmath(self), _opmath(grad_output)
    t = jnp.tanh(jnp.log1p(jnp.exp(x)))
    return (g * (t + x * jax.nn.sigmoid(x) * (1 - t * t))).astype(grad_output.dtype)


@lower("log_sigmoid_forward")
def log_sigmoid_forward(self: Any) -> tuple[Any, Any]:
    _check_float("log_sigmoid_cpu", self)
    x = _opmath(self)
    z = jnp.exp(-jnp.abs(x))
    return (jnp.minimum(x, 0) - jnp.log1p(z)).astype(self.dtype), z.astype(self.dtype)


@lower("log_sigmoid_backward")
def log_sigmoid_backward(grad_output: Any, self: Any, buffer: Any) -> Any:
    x, g = _opmath(self), _opmath(grad_output)
    z = jnp.exp(-jnp.abs(x))  # recomputed: CUDA-style callers pass an empty buffer
    neg = x < 0
    d = jnp.where(neg, 1.0, 0.0) - jnp.where(neg, 1.0, -1.0) * z / (1 + z)
    return (g * d).astype(grad_output.dtype)


@lower("glu")
def glu(self: Any, dim: int = -1) -> Any:
    if self.ndim == 0:
        raise RuntimeError("glu does not support scalars because halving size must be even")
    dim = dim % self.ndim
    if self.shape[dim] % 2:
        raise RuntimeError(f"Halving dimension must be even, but dimension {dim} is size {self.shape[dim]}")
    a, b = jnp.split(_opmath(self), 2, axis=dim)
    return (a * jax.nn.sigmoid(b)).astype(self.dtype)


@lower("glu_backward")
def glu_backward(grad_output: Any, self: Any, dim: int) -> Any:
    dim = dim % self.ndim
    a, b = jnp.split(_opmath(self), 2, axis=dim)
    g = _opmath(grad_output)
    s = jax.nn.sigmoid(b)
    return jnp.concatenate([g * s, g * a * s * (1 - s)], axis=dim).astype(self.dtype)


@lower("_prelu_kernel")
def _prelu_kernel(self: Any, weight: Any) -> Any:
    x, w = _opmath(self), _opmath(weight)
    return jnp.where(x > 0, x, w * x).astype(self.dtype)


@lower("_prelu_kernel_backward")
def _prelu_kernel_backward(grad_output: Any, self: Any, weight: Any) -> tuple[Any, Any]:
    x, w, g = _opmath(self), _opmath(weight), _opmath(grad_output)
    shape = jnp.broadcast_shapes(x.shape, w.shape)
    pos = x > 0
    grad_input = jnp.broadcast_to(jnp.where(pos, g, w * g), shape)
    grad_weight = jnp.broadcast_to(jnp.where(pos, 0, x * g), shape)
    return grad_input.astype(self.dtype), grad_weight.astype(weight.dtype)


@lower("softshrink")
def softshrink(self: Any, lambd: Any = 0.5) -> Any:
    _check_float("softshrink_cpu", self)
    x = _opmath(self)
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, 0)).astype(self.dtype)


@lower("hardshrink")
def hardshrink(self: Any, lambd: Any = 0.5) -> Any:
    _check_float("hardshrink_cpu", self)
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), self.dtype), self)


@lower("softshrink_backward")
def softshrink_backward(grad_output: Any, self: Any, lambd: Any) -> Any:
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), grad_output.dtype), grad_output)


@lower("hardshrink_backward")
def hardshrink_backward(grad_out: Any, self: Any, lambd: Any) -> Any:
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), grad_out.dtype), grad_out)


# ---- losses ----


def _nll(self: Any, target: Any, weight: Any, ignore_index: int) -> tuple[Any, Any]:
    """Per-element (loss, weight) of the negative log likelihood; class dim 1 (0 for 1-D input)."""
    x = _opmath(self)
    if x.ndim == 1:
        x, target = x[None], target[None]
    valid = target != ignore_index
    t = jnp.where(valid, target, 0)
    picked = jnp.take_along_axis(x, t[:, None], axis=1)[:, 0]
    w = _opmath(weight)[t] if weight is not None else jnp.ones(t.shape, x.dtype)
    w = jnp.where(valid, w, 0).astype(x.dtype)
    return -picked * w, w


def _check_nll(self: Any, target: Any, weight: Any, spatial: bool) -> None:
    if spatial:
        if self.ndim != 4 or target.ndim != 3:
            raise RuntimeError(f"only batches of spatial targets supported (3D tensors) but got targets of "
                               f"dimension: {target.ndim}")
        return
    if self.ndim not in (1, 2):
        raise RuntimeError("input tensor should be 1D or 2D")
    if target.ndim > 1:
        raise RuntimeError("0D or 1D target tensor expected, multi-target not supported")
    if self.ndim == 2 and self.shape[0] != target.shape[0]:
        raise RuntimeError(f"Expected input batch_size ({self.shape[0]}) to match target batch_size "
                           f"({target.shape[0]}).")
    n_classes = self.shape[-1]
    if weight is not None and weight.size != n_classes:
        raise RuntimeError(f"weight tensor should be defined either for all {n_classes} classes or no classes "
                           f"but got weight tensor of shape: {list(weight.shape)}")


def _nll_forward(self: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> tuple[Any, Any]:
    report_bad_index("nll_loss", jnp.where(target != ignore_index, target, 0), self.shape[1 if self.ndim > 1 else 0],
                     message="{op}(): Target {value} is out of bounds.")
    loss, w = _nll(self, target, weight, ignore_index)
    if reduction == 0:
        return loss.reshape(target.shape).astype(self.dtype), jnp.zeros((), self.dtype)
    total = jnp.sum(w)
    out = jnp.sum(loss) if reduction == 2 else jnp.sum(loss) / total
    return out.astype(self.dtype), total.astype(self.dtype)


@lower("nll_loss_forward", checks=True)
def nll_loss_forward(self: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> tuple[Any, Any]:
    _check_nll(self, target, weight, spatial=False)
    return _nll_forward(self, target, weight, reduction, ignore_index)


@lower("nll_loss2d_forward", checks=True)
def nll_loss2d_forward(self: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> tuple[Any, Any]:
    _check_nll(self, target, weight, spatial=True)
    return _nll_forward(self, target, weight, reduction, ignore_index)


def _nll_backward(
    grad_output: Any, self: Any, target: Any, weight: Any, reduction: int, ignore_index: int, total_weight: Any,
) -> Any:
    x = self if self.ndim > 1 else self[None]
    tgt = target if self.ndim > 1 else target[None]
    _, w = _nll(x, tgt, weight, ignore_index)
    g = _opmath(grad_output)
    if reduction == 0:
        g = g.reshape(w.shape)
    elif reduction == 1:
        g = g / _opmath(total_weight)
    per = -w * g  # (N, *spatial)
    t = jnp.where(tgt != ignore_index, tgt, 0)
    classes = jnp.arange(x.shape[1]).reshape((1, -1) + (1,) * (x.ndim - 2))
    grad = jnp.where(t[:, None] == classes, per[:, None], 0)
    return grad.reshape(self.shape).astype(self.dtype)


@lower("nll_loss_backward", "nll_loss2d_backward")
def nll_loss_backward(
    grad_output: Any, self: Any, target: Any, weight: Any, reduction: int, ignore_index: int, total_weight: Any,
) -> Any:
    return _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)


@lower("mse_loss", promote=DEFAULT, promote_args=("self", "target"))
def mse_loss(self: Any, target: Any, reduction: int = 1) -> Any:
    return _reduce(jnp.square(_opmath(self) - _opmath(target)), reduction).astype(self.dtype)


@lower("mse_loss_backward")
def mse_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int) -> Any:
    g = _grad_scale(_opmath(grad_output), reduction, self.size)
    return (2 * (_opmath(self) - _opmath(target)) * g).astype(self.dtype)


@lower("smooth_l1_loss", promote=DEFAULT, promote_args=("self", "target"))
def smooth_l1_loss(self: Any, target: Any, reduction: int = 1, beta: float = 1.0) -> Any:
    if beta < 0:
        raise RuntimeError("smooth_l1_loss does not support negative values for beta.")
    d = jnp.abs(_opmath(self) - _opmath(target))
    loss = d if beta == 0 else jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)
    return _reduce(loss, reduction).astype(self.dtype)


@lower("smooth_l1_loss_backward")
def smooth_l1_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int, beta: float) -> Any:
    x = _opmath(self) - _opmath(target)
    g = _grad_scale(_opmath(grad_output), reduction, self.size)
    d = jnp.sign(x) if beta == 0 else jnp.where(x < -beta, -1.0, jnp.where(x > beta, 1.0, x / beta))
    return (d * g).astype(self.dtype)


@lower("huber_loss", promote=DEFAULT, promote_args=("self", "target"))
def huber_loss(self: Any, target: Any, reduction: int = 1, delta: float = 1.0) -> Any:
    if delta <= 0:
        raise RuntimeError("huber_loss does not support non-positive values for delta.")
    d = jnp.abs(_opmath(self) - _opmath(target))
    loss = jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))
    return _reduce(loss, reduction).astype(self.dtype)


@lower("huber_loss_backward")
def huber_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int, delta: float) -> Any:
    x = _opmath(self) - _opmath(target)
    g = _grad_scale(_opmath(grad_output), reduction, self.size)
    return (jnp.clip(x, -delta, delta) * g).astype(self.dtype)


@lower("binary_cross_entropy")
def binary_cross_entropy(self: Any, target: Any, weight: Any = None, reduction: int = 1) -> Any:
    x, y = _opmath(self), _opmath(target)
    loss = (y - 1) * jnp.maximum(jnp.log1p(-x), -100) - y * jnp.maximum(jnp.log(x), -100)
    if weight is not None:
        loss = loss * _opmath(weight)
    return _reduce(loss, reduction).astype(self.dtype)


@lower("binary_cross_entropy_backward")
def binary_cross_entropy_backward(
    grad_output: Any, self: Any, target: Any, weight: Any = None, reduction: int = 1,
) -> Any:
    x, y = _opmath(self), _opmath(target)
    g = _grad_scale(_opmath(grad_output), reduction, self.size)
    grad = g * (x - y) / jnp.maximum((1 - x) * x, 1e-12)
    if weight is not None:
        grad = grad * _opmath(weight)
    return grad.astype(self.dtype)


@lower("binary_cross_entropy_with_logits")
def binary_cross_entropy_with_logits(
    self: Any, target: Any, weight: Any = None, pos_weight: Any = None, reduction: int = 1,
) -> Any:
    x, y = _opmath(self), _opmath(target)
    log_sigmoid = jnp.minimum(x, 0) - jnp.log1p(jnp.exp(-jnp.abs(x)))
    if pos_weight is not None:
        loss = (1 - y) * x - ((_opmath(pos_weight) - 1) * y + 1) * log_sigmoid
    else:
        loss = (1 - y) * x - log_sigmoid
    if weight is not None:
        loss = loss * _opmath(weight)
    return _reduce(loss, reduction).astype(self.dtype)


def _multi_margin_terms(self: Any, target: Any, p: Any, margin: Any, weight: Any) -> tuple[Any, Any, Any, Any]:
    """(x, hinge margins z = margin - x[y] + x[j] masked to j != y and z > 0, sample weights, one-hot of y)."""
    x = _opmath(self)
    if x.ndim <= 1:
        x, target = x.reshape(1, -1), target.reshape(1)
    onehot = target[:, None] == jnp.arange(x.shape[1])[None, :]
    picked = jnp.take_along_axis(x, target[:, None], axis=1)
    z = margin - picked + x
    z = jnp.where(onehot | (z <= 0), 0, z)
    w = _opmath(weight)[target][:, None] if weight is not None else jnp.ones((x.shape[0], 1), x.dtype)
    return x, z, w, onehot


@lower("multi_margin_loss", checks=True)
def multi_margin_loss(self: Any, target: Any, p: Any = 1, margin: Any = 1, weight: Any = None,
                      reduction: int = 1) -> Any:
    report_bad_index("multi_margin_loss", target, self.shape[-1] if self.ndim else 1, error=RuntimeError,
                     message="{op}(): target out of range: target {value} with {size} classes")
    x, z, w, _ = _multi_margin_terms(self, target, p, margin, weight)
    per = jnp.sum(jnp.where(p == 1, z, z * z) * w, axis=1) / x.shape[1]
    if reduction == 0 and self.ndim <= 1:
        per = per.reshape(())
    return _reduce(per, reduction).astype(self.dtype)


@lower("multi_margin_loss_backward")
def multi_margin_loss_backward(grad_output: Any, self: Any, target: Any, p: Any, margin: Any, weight: Any = None,
                               reduction: int = 1) -> Any:
    x, z, w, onehot = _multi_margin_terms(self, target, p, margin, weight)
    g = _opmath(grad_output)
    g = g.reshape(-1, 1) if reduction == 0 else (g / x.shape[0] if reduction == 1 else g)
    d = jnp.where(z > 0, jnp.where(p == 1, 1.0, 2 * z), 0) * w / x.shape[1]
    grad = d - onehot * jnp.sum(d, axis=1, keepdims=True)
    return (grad * g).reshape(self.shape).astype(self.dtype)


@lower("embedding_dense_backward", checks=True)
def embedding_dense_backward(
    grad_output: Any, indices: Any, num_weights: int, padding_idx: int, scale_grad_by_freq: bool,
) -> Any:
    dim = grad_output.shape[-1]
    idx = indices.reshape(-1)
    report_bad_index("embedding_backward", idx, num_weights)
    g = _opmath(grad_output).reshape(-1, dim)
    g = jnp.where((idx == padding_idx)[:, None], 0, g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
        g = g / counts[idx][:, None]
    return jnp.zeros((num_weights, dim), g.dtype).at[idx].add(g).astype(grad_output.dtype)


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


# ---- dropout ----


@functools.lru_cache(maxsize=256)
def _dropout_fn(p: float) -> Any:
    def run(x: Any, seed: Any, offset: Any) -> tuple[Any, Any]:
        keep = jax.random.uniform(_key(seed, offset), x.shape, jnp.float32) < (1 - p)
        scale = 0.0 if p == 1 else 1.0 / (1 - p)
        return (_opmath(x) * keep * scale).astype(x.dtype), keep

    return _deferred.jitted(run, key=p)


@functools.lru_cache(maxsize=16)
def _dropout_eval_fn() -> Any:
    return _deferred.jitted(lambda x: (x, jnp.ones(x.shape, jnp.bool_)), key="eval")


@direct("native_dropout", defer=True)
def native_dropout(input: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout with a Bernoulli(1 - p) keep mask drawn from the tpu generator."""
    if p < 0 or p > 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    index = input.device.index
    x = _storage.read(input)
    if train is False or input.numel() == 0:
        out, mask = _dropout_eval_fn()(x)
    else:
        seed, offset = _philox(None, input)
        out, mask = _dropout_fn(float(p))(x, seed, offset)
    return _C._wrap(out, input.dtype, index), _C._wrap(mask, torch.bool, index)


@lower("native_dropout_backward")
def native_dropout_backward(grad_output: Any, mask: Any, scale: float) -> Any:
    dtype = grad_output.dtype if _is_float(grad_output) else jnp.float32  # a float scale promotes integers
    return (_opmath(grad_output.astype(dtype)) * mask * scale).astype(dtype)


# ---- fused recurrent cells (what nn.LSTM / nn.GRU call on an accelerator) ----


def _gate_sum(input_gates: Any, hidden_gates: Any, input_bias: Any, hidden_bias: Any) -> Any:
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    return gates


@lower("_thnn_fused_lstm_cell")
def thnn_fused_lstm_cell(input_gates: Any, hidden_gates: Any, cx: Any, input_bias: Any = None,
                         hidden_bias: Any = None) -> tuple[Any, Any, Any]:
    """One LSTM step: gates (input, forget, cell, output) -> (hy, cy, workspace of activated gates)."""
    gates = _gate_sum(input_gates, hidden_gates, input_bias, hidden_bias)
    i, f, g, o = jnp.split(gates, 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    hy = o * jnp.tanh(cy)
    return hy, cy, jnp.concatenate([i, f, g, o], axis=1)


@lower("_thnn_fused_lstm_cell_backward_impl")
def thnn_fused_lstm_cell_backward_impl(grad_hy: Any, grad_cy: Any, cx: Any, cy: Any, workspace: Any,
                                       has_bias: bool) -> tuple[Any, Any, Any]:
    """Gradients of one fused LSTM step w.r.t. the summed gates, cx and the bias."""
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    tanh_cy = jnp.tanh(cy)
    ghy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    gcy = jnp.zeros_like(cy) if grad_cy is None else grad_cy
    gcx = ghy * o * (1 - tanh_cy * tanh_cy) + gcy
    grad_gates = jnp.concatenate([
        gcx * g * i * (1 - i),          # input gate
        gcx * cx * f * (1 - f),         # forget gate
        gcx * i * (1 - g * g),          # cell gate
        ghy * tanh_cy * o * (1 - o),    # output gate
    ], axis=1)
    grad_bias = grad_gates.sum(axis=0) if has_bias else jnp.zeros((grad_gates.shape[1],), grad_gates.dtype)
    return grad_gates, gcx * f, grad_bias


@lower("_thnn_fused_gru_cell")
def thnn_fused_gru_cell(input_gates: Any, hidden_gates: Any, hx: Any, input_bias: Any = None,
                        hidden_bias: Any = None) -> tuple[Any, Any]:
    """One GRU step (reset, update, new gates) -> (hy, workspace)."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, ii, inn = jnp.split(input_gates, 3, axis=1)
    hr, hi, hn = jnp.split(hidden_gates, 3, axis=1)
    r = jax.nn.sigmoid(ir + hr)
    z = jax.nn.sigmoid(ii + hi)
    n = jnp.tanh(inn + r * hn)
    hy = n + z * (hx - n)
    return hy, jnp.concatenate([r, z, n, hx, hn], axis=1)


@lower("_thnn_fused_gru_cell_backward")
def thnn_fused_gru_cell_backward(grad_hy: Any, workspace: Any, has_bias: bool) -> tuple[Any, Any, Any, Any, Any]:
    """Gradients of one fused GRU step: (input gates, hidden gates, hx, input bias, hidden bias)."""
    r, z, n, hx, hn = jnp.split(workspace, 5, axis=1)
    gn = grad_hy * (1 - z) * (1 - n * n)
    gz = grad_hy * (hx - n) * z * (1 - z)
    gr = gn * hn * r * (1 - r)
    grad_input = jnp.concatenate([gr, gz, gn], axis=1)
    grad_hidden = jnp.concatenate([gr, gz, gn * r], axis=1)
    grad_hx = grad_hy * z
    if has_bias:
        return grad_input, grad_hidden, grad_hx, grad_input.sum(axis=0), grad_hidden.sum(axis=0)
    zeros = jnp.zeros((grad_input.shape[1],), grad_input.dtype)
    return grad_input, grad_hidden, grad_hx, zeros, zeros
