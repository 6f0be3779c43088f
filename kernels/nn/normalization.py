"""Normalization: batch norm (direct kernels that update the running statistics), layer norm, group norm
and their backward ops."""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import torch

from torch_tpu import _executor, _runtime, _storage
from torch_tpu._jax import jnp
from torch_tpu.kernels.nn._common import _is_low, _masked, _opmath
from torch_tpu.kernels._promote import dtype_name, wrap_arrays, write_outs
from torch_tpu.kernels.math import _rsqrt
from torch_tpu.kernels.registry import direct, lower


# ---- normalization ----


def _channel_shape(x: Any) -> tuple[int, ...]:
    """Shape broadcasting a per-channel (dim 1) vector against x."""
    return (1, -1) + (1,) * (x.ndim - 2)


def _per_channel(x: Any) -> Any:
    """x as (N, C, spatial): batch norm's statistics reduce dims (0, 2) of it. XLA:CPU reduces over the contiguous
    minor dim of this shape much faster than over dims (0, 2, 3, ...) of the original (10x at ResNet's 2x2 maps)."""
    return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))


def _stat_dtype(input: Any, *params: Any) -> Any:
    """ATen's batch-norm parameter dtype: opmath when parameters and input differ in dtype."""
    mixed = any(p is not None and p.dtype != input.dtype for p in params)
    return jnp.float32 if mixed and _is_low(input.dtype) else input.dtype


def _check_mixed(input: Any, *params: Any) -> None:
    """ATen's rule for normalization parameters whose dtype differs from the input's (check_mixed_data_type):
    then every parameter must be float32 and the input bfloat16 or float16, else CPU's error."""
    if not any(p is not None and p.dtype != input.dtype for p in params):
        return
    for p in params:
        if p is not None and p.dtype != jnp.float32:
            raise RuntimeError(
                f"mixed dtype (CPU): expect parameter to have scalar type of Float (input "
                f"{_runtime.torch_dtype(input.dtype)}, parameter {_runtime.torch_dtype(p.dtype)}; cast the module "
                "or the input so that they match)")
    if not _is_low(input.dtype):
        raise RuntimeError(
            f"mixed dtype (CPU): all inputs must share same datatype (input {_runtime.torch_dtype(input.dtype)}, "
            "parameters torch.float32; cast the module or the input so that they match)")


def _batch_norm_math(
    input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, training: bool, momentum: float,
    eps: float,
) -> tuple[Any, Any, Any, Any, Any]:
    """(output, save_mean, save_invstd, new running_mean, new running_var)."""
    _check_mixed(input, weight, bias, running_mean, running_var)
    x = _per_channel(_opmath(input))
    axes = (0, 2)
    cs = _channel_shape(x)
    stat = _stat_dtype(input, weight, bias, running_mean, running_var)
    new_rm, new_rv = running_mean, running_var
    if training:
        n = x.size // x.shape[1] if x.shape[1] else 0
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - mean.reshape(cs)), axis=axes)
        invstd = _rsqrt(var + eps)
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
        invstd = _rsqrt(_opmath(running_var) + eps)
        y = (x - _opmath(running_mean).reshape(cs)) * invstd.reshape(cs)
        save_mean = save_invstd = jnp.zeros((0,), stat)
    if weight is not None:
        y = y * _opmath(weight).reshape(cs)
    if bias is not None:
        y = y + _opmath(bias).reshape(cs)
    return y.reshape(input.shape).astype(input.dtype), save_mean, save_invstd, new_rm, new_rv


@functools.lru_cache(maxsize=256)
def _batch_norm_fn(training: bool, momentum: float, eps: float) -> Any:
    return _executor.jitted(lambda x, w, b, rm, rv: _batch_norm_math(x, w, b, rm, rv, training, momentum, eps),
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
    x, g = _per_channel(_opmath(input)), _per_channel(_opmath(grad_out))
    axes = (0, 2)
    cs = _channel_shape(x)
    if train:
        mean, invstd = _opmath(save_mean), _opmath(save_invstd)
    else:
        mean, invstd = _opmath(running_mean), _rsqrt(_opmath(running_var) + eps)
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
    return _masked(output_mask, grad_input.reshape(input.shape).astype(input.dtype), sum_gx.astype(wdtype),
                   sum_g.astype(wdtype))


@lower("batch_norm_backward")
def batch_norm_backward(
    grad_out: Any, input: Any, weight: Any, running_mean: Any, running_var: Any, save_mean: Any, save_var: Any,
    update: bool, eps: float, output_mask: Sequence[bool], reserve: Any,
) -> tuple[Any, Any, Any]:
    """The backward of _batch_norm_with_update / _batch_norm_no_update (save_var holds the saved invstd)."""
    return native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var,
                                      update, eps, output_mask)


# ---- layer norm and RMS norm: the XLA reference paths of kernels/pallas/norms.py ----
# The ATen lowerings (native_layer_norm, _fused_rms_norm and their backward ops) live in kernels/pallas/norms.py,
# which checks the arguments here, then runs the fused Pallas kernel where it fits on a TPU, else these.


def norm_axis(op: str, input: Any, normalized_shape: Sequence[int]) -> int:
    """The first normalised dim of `input` (ATen's _check_layer_norm_inputs / _check_rms_norm_inputs)."""
    if len(normalized_shape) == 0:
        raise RuntimeError(
            "Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one element, but got "
            f"normalized_shape = [] ({op} of an input of shape {list(input.shape)})")
    axis = input.ndim - len(normalized_shape)
    if axis < 0 or tuple(input.shape[axis:]) != tuple(normalized_shape):
        raise RuntimeError(
            f"Given normalized_shape={list(normalized_shape)}, expected input with shape "
            f"[*, {', '.join(map(str, normalized_shape))}], but got input of size{list(input.shape)}"
        )
    return axis


def _check_norm_param(op: str, name: str, param: Any, normalized_shape: Sequence[int]) -> None:
    if param is not None and tuple(param.shape) != tuple(normalized_shape):
        raise RuntimeError(
            f"Expected {name} to be of same shape as normalized_shape, but got {name} of shape "
            f"{list(param.shape)} and normalized_shape = {list(normalized_shape)} ({op}; give a {name} of shape "
            f"{list(normalized_shape)} or none)")


def layer_norm_check(input: Any, normalized_shape: Sequence[int], weight: Any, bias: Any) -> int:
    """native_layer_norm's argument checks (CPU's errors); returns the first normalised dim."""
    axis = norm_axis("layer_norm", input, normalized_shape)
    _check_norm_param("layer_norm", "weight", weight, normalized_shape)
    _check_norm_param("layer_norm", "bias", bias, normalized_shape)
    _check_mixed(input, weight, bias)
    return axis


def layer_norm_stat_dtype(input: Any, weight: Any, bias: Any) -> Any:
    """The dtype of native_layer_norm's mean/rstd on CPU (param_scalar_type): float32 when the parameters are
    float32 and the input bfloat16/float16 (mixed), else the input's dtype."""
    return _stat_dtype(input, weight, bias)


def layer_norm_reference(
    input: Any, normalized_shape: Sequence[int], weight: Any, bias: Any, eps: float,
) -> tuple[Any, Any, Any]:
    """native_layer_norm in XLA ops: (output, mean, rstd), statistics in opmath, shaped input.shape[:axis] + 1s."""
    axis = layer_norm_check(input, normalized_shape, weight, bias)
    x = _opmath(input)
    axes = tuple(range(axis, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = _rsqrt(var + eps)
    y = (x - mean) * rstd
    if weight is not None:
        y = y * _opmath(weight)
    if bias is not None:
        y = y + _opmath(bias)
    stat = layer_norm_stat_dtype(input, weight, bias)
    return y.astype(input.dtype), mean.astype(stat), rstd.astype(stat)


def layer_norm_backward_reference(
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
    wdtype = layer_norm_param_dtype(input, weight, bias)
    return _masked(output_mask, grad_input.astype(input.dtype), grad_weight.astype(wdtype), grad_bias.astype(wdtype))


def layer_norm_param_dtype(input: Any, weight: Any, bias: Any) -> Any:
    """The dtype of native_layer_norm_backward's grad_weight/grad_bias: the parameters' dtype."""
    return weight.dtype if weight is not None else (bias.dtype if bias is not None else input.dtype)


def rms_norm_check(input: Any, normalized_shape: Sequence[int], weight: Any) -> int:
    """_fused_rms_norm's argument checks (ATen's _check_rms_norm_inputs); returns the first normalised dim."""
    axis = norm_axis("rms_norm", input, normalized_shape)
    _check_norm_param("rms_norm", "weight", weight, normalized_shape)
    if not jnp.issubdtype(input.dtype, jnp.inexact):
        raise RuntimeError(
            f'"rms_norm" not implemented for \'{dtype_name(_runtime.torch_dtype(input.dtype))}\' (input of shape '
            f"{list(input.shape)}; cast it to a floating or complex dtype)")
    return axis


def rms_norm_eps(input: Any, eps: float | None) -> float:
    """ATen's default eps for rms_norm: the machine epsilon of the opmath dtype."""
    return float(jnp.finfo(_opmath(jnp.zeros((), input.dtype)).dtype).eps) if eps is None else float(eps)


def rms_norm_reference(input: Any, normalized_shape: Sequence[int], weight: Any, eps: float | None) -> tuple[Any, Any]:
    """_fused_rms_norm in XLA ops, as ATen's rms_norm_composite: (output, rstd), rstd in opmath with the normalised
    dims kept as 1s."""
    axis = rms_norm_check(input, normalized_shape, weight)
    x = _opmath(input)
    axes = tuple(range(axis, x.ndim))
    rstd = _rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + rms_norm_eps(input, eps))
    y = x * rstd
    if weight is not None:
        y = y * _opmath(weight)
    return y.astype(input.dtype), rstd


def rms_norm_backward_reference(
    grad_out: Any, input: Any, normalized_shape: Sequence[int], rstd: Any, weight: Any, output_mask: Sequence[bool],
) -> tuple[Any, Any]:
    """_fused_rms_norm_backward (torch._decomp's formula): (grad_input, grad_weight), both in the input's dtype."""
    x, g = _opmath(input), _opmath(grad_out)
    axis = x.ndim - len(normalized_shape)
    axes = tuple(range(axis, x.ndim))
    n = math.prod(x.shape[axis:])
    r = _opmath(rstd).reshape(x.shape[:axis] + (1,) * (x.ndim - axis))
    xhat = x * r
    gxh = g * _opmath(weight) if weight is not None else g
    grad_input = (gxh - xhat / n * jnp.sum(xhat * gxh, axis=axes, keepdims=True)) * r
    grad_weight = jnp.sum(g * xhat, axis=tuple(range(axis))) if weight is not None else None
    return (grad_input.astype(input.dtype) if output_mask[0] else None,
            grad_weight.astype(input.dtype) if output_mask[1] and weight is not None else None)


@lower("native_group_norm")
def native_group_norm(
    input: Any, weight: Any, bias: Any, N: int, C: int, HxW: int, group: int, eps: float,
) -> tuple[Any, Any, Any]:
    if C % group:
        raise RuntimeError(f"Expected number of channels in input to be divisible by num_groups, but got input of "
                           f"shape {list(input.shape)} and num_groups={group}")
    _check_mixed(input, weight, bias)
    x = _opmath(input)
    xr = x.reshape(N, group, (C // group) * HxW)
    mean = jnp.mean(xr, axis=-1)
    var = jnp.mean(jnp.square(xr - mean[..., None]), axis=-1)
    rstd = _rsqrt(var + eps)
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
    return _masked(output_mask, grad_input.reshape(input.shape).astype(input.dtype), grad_weight.astype(wdtype),
                   grad_bias.astype(wdtype))
