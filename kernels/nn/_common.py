"""Helpers shared by the torch.nn.functional kernel families (opmath, window sizes, loss reductions)."""

from __future__ import annotations

from typing import Any, Sequence

from torch_tpu._jax import jnp


# ---- helpers ----


def _masked(output_mask: Sequence[bool], *grads: Any) -> tuple[Any, ...]:
    """A backward op's results with those `output_mask` turns off as None (ATen's undefined tensor)."""
    return tuple(g if m else None for g, m in zip(grads, output_mask, strict=True))


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
