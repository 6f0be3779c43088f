"""Indexing and joining: masked_select (data-dependent shape, run eagerly) and cat."""

from __future__ import annotations

from typing import Any, Sequence

from torch_tpu._jax import jnp
from torch_tpu.kernels.registry import lower, result_dtype


@lower("masked_select", jit=False)
def masked_select(self: Any, mask: Any) -> Any:
    if mask.dtype != jnp.bool_:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    return jnp.broadcast_to(self, shape)[jnp.broadcast_to(mask, shape)]


@lower("cat")
def cat(tensors: Sequence[Any], dim: int = 0) -> Any:
    if len(tensors) == 0:
        raise RuntimeError("torch.cat(): expected a non-empty list of Tensors")
    dtype = result_dtype(*tensors)
    # Legacy behaviour kept by PyTorch: 1-D empty tensors are skipped whatever the other shapes.
    parts = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not parts:
        return jnp.zeros((0,), dtype)
    nd = parts[0].ndim
    if nd == 0:
        raise RuntimeError("zero-dimensional tensor (at position 0) cannot be concatenated")
    return jnp.concatenate([t.astype(dtype) for t in parts], axis=dim % nd)
