"""Softmax and log-softmax and their backward ops."""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu import _runtime
from torch_tpu._jax import jnp, lax
from torch_tpu.kernels.nn._common import _opmath
from torch_tpu.kernels.registry import lower


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
