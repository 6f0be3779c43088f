"""The embedding's backward. The forward has no eager kernel (ATen's composite calls index_select); graph
executors use its trace-only lowering in kernels/views.py."""

from __future__ import annotations

from typing import Any

from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jnp
from torch_tpu.kernels.nn._common import _opmath
from torch_tpu.kernels.registry import lower


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
