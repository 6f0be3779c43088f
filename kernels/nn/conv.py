"""Convolution and its backward (the JAX VJP of the forward lowering)."""

from __future__ import annotations

from typing import Any, Sequence

from torch_tpu import _runtime
from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels.nn._common import _expand, _is_float, _masked, _opmath
from torch_tpu.kernels.registry import lower


# ---- convolution ----


_SPATIAL_NAMES = ("depth", "height", "width")


def _check_conv(
    input: Any, weight: Any, bias: Any, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
    transposed: bool, output_padding: Sequence[int], groups: int,
) -> None:
    """CPU's errors for a bad convolution, from static shapes: at::_convolution's argument checks
    (check_shape_forward), then those of the CPU kernels it dispatches to a non-empty input (which see a 1-d
    convolution as a 2-d one of height 1, and so print it)."""
    nd = weight.ndim - 2
    if nd <= 0:
        raise RuntimeError("weight should have at least three dimensions")
    if groups <= 0:
        raise RuntimeError("non-positive groups is not supported")
    params = {"stride": stride, "padding": padding, "dilation": dilation, "output_padding": output_padding}
    for name, v in params.items():
        v = [v] if isinstance(v, int) else list(v)
        if len(v) not in (1, nd):
            raise RuntimeError(f"expected {name} to be a single integer value or a list of {nd} values to match the "
                               f"convolution dimensions, but got {name}={v}")
        params[name] = _expand(v, nd)
    stride, padding, dilation, output_padding = params.values()
    if min(padding) < 0:
        raise RuntimeError("negative padding is not supported")
    if min(output_padding) < 0:
        raise RuntimeError("negative output_padding is not supported")
    if min(stride) <= 0:
        raise RuntimeError("non-positive stride is not supported")
    if min(dilation) < 0:
        raise RuntimeError("dilation should be greater than zero")
    x, w = list(input.shape), list(weight.shape)
    if len(x) != len(w):
        raise RuntimeError(f"Expected {len(w)}-dimensional input for {len(w)}-dimensional weight {w}, but got "
                           f"{len(x)}-dimensional input of size {x} instead")
    if w[0] < groups:
        raise RuntimeError(f"Given groups={groups}, expected weight to be at least {groups} at dimension 0, but got "
                           f"weight of size {w} instead")
    if w[0] % groups:
        raise RuntimeError(f"Given groups={groups}, expected weight to be divisible by {groups} at dimension 0, but "
                           f"got weight of size [{w}] instead")
    channels, out_channels = (w[0], w[1] * groups) if transposed else (w[1] * groups, w[0])
    given = "transposed=1" if transposed else f"groups={groups}"
    if x[1] != channels:
        raise RuntimeError(f"Given {given}, weight of size {w}, expected input{x} to have {channels} channels, but "
                           f"got {x[1]} channels instead")
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != out_channels):
        raise RuntimeError(f"Given {'transposed=1, ' if transposed else ''}weight of size {w}, expected bias to be "
                           f"1-dimensional with {out_channels} elements, but got bias of size {list(bias.shape)} "
                           "instead")
    if not transposed:
        padded = [i + 2 * p for i, p in zip(x[2:], padding)]
        kernel = [d * (k - 1) + 1 for k, d in zip(w[2:], dilation)]
        if any(p < k for p, k in zip(padded, kernel)):
            raise RuntimeError(f"Calculated padded input size per channel: ({' x '.join(map(str, padded))}). Kernel "
                               f"size: ({' x '.join(map(str, kernel))}). Kernel size can't be greater than actual "
                               "input size")
    if x[0] == 0 or x[1] == 0:
        return  # ATen computes an empty batch or channel dim without a kernel

    def view(v: Sequence[int], one: int) -> list[int]:
        return [one, *v] if nd == 1 else list(v)

    def named(what: str, v: Sequence[int], sep: str = " ") -> str:
        return sep.join(f"{what}_{n}: {e}" for n, e in zip(_SPATIAL_NAMES[3 - len(v):], v))

    if 0 in x:
        raise RuntimeError(f"Only zero batch or zero channel inputs are supported, but got input shape: "
                           f"{x[:2] + view(x[2:], 1)}")
    kernel, dilation = view(w[2:], 1), view(dilation, 1)
    if min(kernel) <= 0:  # worded by the kernel CPU picks: dilated, 3-d, or the rest
        got = (f" {kernel}" if not transposed and set(dilation) != {1} else
               f": {' x '.join(map(str, kernel))} (TxHxW)" if not transposed and nd == 3 else
               f" {named('kernel', kernel)}")
        raise RuntimeError(f"kernel size should be greater than zero, but got{got}")
    if min(dilation) <= 0:
        got = named("dilation", dilation, ", ") if transposed else dilation
        raise RuntimeError(f"dilation should be greater than zero, but got {got}")
    if transposed:
        stride, padding, output_padding = view(stride, 1), view(padding, 0), view(output_padding, 0)
        if any(op >= s and op >= d for op, s, d in zip(output_padding, stride, dilation)):
            raise RuntimeError(f"output padding must be smaller than either stride or dilation, but got "
                               f"{named('output_padding', output_padding)} {named('stride', stride)} "
                               f"{named('dilation', dilation)}")
        size = view(x[2:], 1)
        out = [(i - 1) * s - 2 * p + d * (k - 1) + 1 + op
               for i, s, p, d, k, op in zip(size, stride, padding, dilation, kernel, output_padding)]
        if min(out) < 1:
            raise RuntimeError(f"Given input size per channel: ({' x '.join(map(str, size))}). Calculated output "
                               f"size per channel: ({' x '.join(map(str, out))}). Output size is too small")


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
        if _patches_beat_conv(x, w, stride, padding, dilation, groups):
            return _conv_as_patches(x, w, stride, padding, precision)
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


def _patches_beat_conv(x: Any, w: Any, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                       groups: int) -> bool:
    """XLA:CPU runs a 2-D convolution whose kernel is as large as its (tiny) input about 50x slower than PyTorch:
    its simplifier swaps the operands and the swapped form has no fast path (ResNet-18's last stage, 3x3 kernels
    on 2x2 and 4x4 maps, was 3/4 of the step). As patches times a matrix it runs at PyTorch's speed. TPU's
    convolution unit has no such case, so this is for the CPU platform only."""
    if x.ndim != 4 or groups != 1 or tuple(dilation) != (1, 1) or max(x.shape[2:]) > 4:
        return False
    if any(x.shape[2 + d] + 2 * padding[d] < w.shape[2 + d] for d in range(2)):
        return False  # no output window: lax.conv_general_dilated gives the empty result (or the error)
    return _runtime.platform() == "cpu"


def _conv_as_patches(x: Any, w: Any, stride: Sequence[int], padding: Sequence[int], precision: Any) -> Any:
    """The same convolution as one dot: the k*k strided windows of the padded input, contracted with the kernel."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    ho, wo = (h + 2 * padding[0] - kh) // stride[0] + 1, (wd + 2 * padding[1] - kw) // stride[1] + 1
    xp = jnp.pad(x, ((0, 0), (0, 0), (padding[0], padding[0]), (padding[1], padding[1])))
    windows = jnp.stack([xp[:, :, i:i + stride[0] * (ho - 1) + 1:stride[0], j:j + stride[1] * (wo - 1) + 1:stride[1]]
                         for i in range(kh) for j in range(kw)], axis=2)
    return jnp.einsum("nckhw,ock->nohw", windows, w.reshape(o, c, kh * kw), precision=precision)


@lower("convolution")
def convolution(
    input: Any, weight: Any, bias: Any, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
    transposed: bool, output_padding: Sequence[int], groups: int,
) -> Any:
    _check_conv(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
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
    _check_conv(input, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    def f(x: Any, w: Any) -> Any:
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)

    xf, wf = _opmath(input), _opmath(weight)
    _, vjp = jax.vjp(f, xf, wf)
    g = _opmath(grad_output)
    grad_input, grad_weight = vjp(g.astype(jnp.result_type(xf, wf)))
    grad_bias = jnp.sum(g, axis=(0,) + tuple(range(2, g.ndim)))
    return _masked(output_mask, grad_input.astype(input.dtype), grad_weight.astype(weight.dtype),
                   grad_bias.astype(grad_output.dtype))
