"""Dropout (a direct kernel: the mask comes from the device's Philox generator) and its backward."""

from __future__ import annotations

import functools
from typing import Any

import torch

from torch_tpu import _C, _executor, _storage
from torch_tpu._jax import jax, jnp
from torch_tpu._rng import draw as _philox, key as _key
from torch_tpu.kernels.nn._common import _is_float, _opmath
from torch_tpu.kernels.registry import direct, lower


# ---- dropout ----


@functools.lru_cache(maxsize=256)
def _dropout_fn(p: float) -> Any:
    def run(x: Any, seed: Any, offset: Any) -> tuple[Any, Any]:
        keep = jax.random.uniform(_key(seed, offset), x.shape, jnp.float32) < (1 - p)
        scale = 0.0 if p == 1 else 1.0 / (1 - p)
        return (_opmath(x) * keep * scale).astype(x.dtype), keep

    return _executor.jitted(run, key=p)


@functools.lru_cache(maxsize=16)
def _dropout_eval_fn() -> Any:
    return _executor.jitted(lambda x: (x, jnp.ones(x.shape, jnp.bool_)), key="eval")


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
