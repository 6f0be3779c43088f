"""Activations and their backward ops."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from torch_tpu import _executor, _runtime, _storage
from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jax, jnp, lax
from torch_tpu._rng import draw as _philox, key as _rng_key
from torch_tpu.kernels._promote import dtype_name, wrap_arrays
from torch_tpu.kernels.nn._common import _as, _is_float, _opmath
from torch_tpu.kernels.registry import direct, lower


# ---- activations ----


def _check_float(name: str, x: Any) -> None:
    """ATen's dispatch over the floating dtypes of its kernel `name`."""
    if not _is_float(x):
        raise NotImplementedError(f"\"{name}\" not implemented for '{dtype_name(_runtime.torch_dtype(x.dtype))}'")


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
    _check_float("silu_cpu", self)
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
    _check_float("elu_cpu", self)
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
    _check_float("hardsigmoid_cpu", self)
    x = _opmath(self)
    return (jnp.clip(x + 3, 0, 6) / 6).astype(self.dtype)


@lower("hardsigmoid_backward")
def hardsigmoid_backward(grad_output: Any, self: Any) -> Any:
    g = _opmath(grad_output)
    return jnp.where((self > -3) & (self < 3), g / 6, 0).astype(grad_output.dtype)


@lower("softplus")
def softplus(self: Any, beta: Any = 1, threshold: Any = 20) -> Any:
    _check_float("softplus_cpu", self)
    x = _opmath(self)
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta).astype(self.dtype)


@lower("softplus_backward")
def softplus_backward(grad_output: Any, self: Any, beta: Any, threshold: Any) -> Any:
    x, g = _opmath(self), _opmath(grad_output)
    z = jnp.exp(x * beta)
    return jnp.where(x * beta > threshold, g, g * z / (z + 1)).astype(grad_output.dtype)


@lower("mish")
def mish(self: Any) -> Any:
    _check_float("mish_cpu", self)
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


@lower("glu_jvp")
def glu_jvp(glu: Any, x: Any, dx: Any, dim: int) -> Any:
    """Forward-mode derivative of glu (a * sigmoid(b)): da * sigmoid(b) + glu * (1 - sigmoid(b)) * db."""
    dim = dim % x.ndim
    _, b = jnp.split(_opmath(x), 2, axis=dim)
    da, db = jnp.split(_opmath(dx), 2, axis=dim)
    s = jax.nn.sigmoid(b)
    return (da * s + _opmath(glu) * (1 - s) * db).astype(glu.dtype)


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


@lower("softshrink", checks=True)
def softshrink(self: Any, lambd: Any = 0.5) -> Any:
    _check_float("softshrink_check", self)
    # lambd is traced (its value is not known while tracing): its range is checked on the device, raised at the
    # next synchronization point.
    top = float(jnp.finfo(self.dtype).max)
    out_of_range = ~((lambd >= 0) & (jnp.asarray(lambd, jnp.float64) <= top))
    report_bad_index("softshrink", out_of_range.astype(jnp.int32), 1, error=RuntimeError,
                     message=f"lambda must be in range [0, {top:.6g}] for input dtype "
                             f"{dtype_name(_runtime.torch_dtype(self.dtype))}, but found a value outside it")
    x = _opmath(self)
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, x * 0)).astype(self.dtype)  # NaN stays


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


# ---- rrelu ----
# Training draws each negative element's slope from U(lower, upper) with the tpu generator (Philox, like
# dropout) and writes it to `noise` (1 for the others), as ATen's kernel does; eval is leaky_relu with the mean
# slope and leaves noise alone.


@functools.lru_cache(maxsize=64)
def _rrelu_train_fn() -> Any:
    def run(x: Any, lower: Any, upper: Any, seed: Any, offset: Any) -> tuple[Any, Any]:
        v = _opmath(x)
        r = jax.random.uniform(_rng_key(seed, offset), x.shape, jnp.float32)
        r = (lower + (upper - lower) * r).astype(v.dtype)
        neg = v <= 0
        return jnp.where(neg, v * r, v).astype(x.dtype), jnp.where(neg, r, 1).astype(x.dtype)

    return _executor.jitted(run, key="rrelu_train")


@functools.lru_cache(maxsize=16)
def _rrelu_eval_fn() -> Any:
    def run(x: Any, lower: Any, upper: Any) -> Any:
        v = _opmath(x)
        return jnp.where(v > 0, v, v * ((lower + upper) / 2)).astype(x.dtype)

    return _executor.jitted(run, key="rrelu_eval")


def _rrelu(self: torch.Tensor, noise: torch.Tensor, lower: Any, upper: Any, training: bool,
           generator: Any) -> torch.Tensor:
    if not self.is_floating_point():
        raise RuntimeError(f"\"rrelu_with_noise_cpu\" not implemented for '{self.dtype}'")
    lo, hi = float(lower), float(upper)
    if hi < lo:
        raise RuntimeError(f"Lower bound should be less than or equal to the upper bound, got lower={lo} and "
                           f"upper={hi}")
    x = _storage.read(self)
    if training:
        if noise.shape != self.shape:
            raise RuntimeError(f"rrelu_with_noise: noise of shape {list(noise.shape)} does not match the input's "
                               f"shape {list(self.shape)}")
        seed, offset = _philox(generator, self)
        out, r = _rrelu_train_fn()(x, np.float32(lo), np.float32(hi), seed, offset)  # host scalars: no transfer each
        _storage.write(noise, r)
    else:
        out = _rrelu_eval_fn()(x, np.float32(lo), np.float32(hi))
    return out


@direct("rrelu_with_noise", defer=True)
def rrelu_with_noise(self: torch.Tensor, noise: torch.Tensor, lower: Any = 0.125, upper: Any = 1 / 3,
                     training: bool = False, generator: Any = None) -> torch.Tensor:
    return wrap_arrays(_rrelu(self, noise, lower, upper, training, generator), self.device.index)


@direct("rrelu_with_noise_", defer=True)
def rrelu_with_noise_(self: torch.Tensor, noise: torch.Tensor, lower: Any = 0.125, upper: Any = 1 / 3,
                      training: bool = False, generator: Any = None) -> torch.Tensor:
    _storage.write(self, _rrelu(self, noise, lower, upper, training, generator))
    return self


@lower("rrelu_with_noise_backward")
def rrelu_with_noise_backward(grad_output: Any, self: Any, noise: Any, lower: Any, upper: Any, training: bool,
                              self_is_result: bool) -> Any:
    g = _opmath(grad_output)
    leaky = jnp.where(_opmath(self) > 0, g, g * ((lower + upper) / 2))
    if not training:
        return leaky.astype(grad_output.dtype)
    return jnp.where(upper - lower > 1e-6, g * _opmath(noise), leaky).astype(grad_output.dtype)
