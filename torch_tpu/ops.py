"""`torch.tpu.ops`: tpu operators that ATen has no overload for, as torch custom ops (torch.library) under the namespace
`tpu`, and entries over ATen ops that take a handier form.

- `paged_attention(q, k_pages, v_pages, lengths, page_indices, *, scale=None, soft_cap=None,
  pages_per_compute_block=None)` (`torch.ops.tpu.paged_attention`): decode attention, one query token per sequence,
  over a paged KV cache: q [batch, heads, head_dim]; k_pages, v_pages [kv_heads, total_pages, page_size, head_dim]
  (heads a multiple of kv_heads: GQA/MQA); lengths [batch] int32; page_indices [batch, pages_per_sequence] int32.
  Returns [batch, heads, head_dim] = softmax(scale * q k^T over the first `length` tokens) v (scale defaults to
  1/sqrt(head_dim); `soft_cap` caps the logits as soft_cap * tanh(logits / soft_cap); length 0 gives zeros);
  differentiable in q, k_pages and v_pages. Layout and paths: kernels/pallas/paged_attention.py.
- `grouped_matmul(lhs, rhs, group_sizes)` (`torch.ops.tpu.grouped_matmul`): the mixture-of-experts grouped matmul, `torch._grouped_mm(lhs, rhs,
  offs=cumsum(group_sizes))` (its lowering and paths in kernels/pallas/grouped_matmul.py).

A custom op here is defined once with a typed schema, a fake (meta) implementation and autograd, and its lowering is
an entry of the one kernel table (`@lower("tpu::<op>")`), installed like `torch.tpu.jax_op`'s: eager runs it as a
jitted kernel, DEFER_AND_FUSE records it into the pending graph, and `torch.compile(backend="tpu")` lowers the node
inline. They are typed ops rather than `jax_op` functions because their lowerings report device-side checks (bad
lengths or page indices), which jax_op's generic lowerings do not declare, and because a typed schema (named
arguments, no process-local spec string) is what a public op should show in graphs and error messages.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu import _eager
from torch_tpu.kernels.pallas import paged_attention as _paged

__all__ = ["paged_attention", "grouped_matmul"]


def _tpu_only(op: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        devices = sorted({str(a.device) for a in args if isinstance(a, torch.Tensor)})
        raise RuntimeError(f"torch.ops.{op.replace('::', '.')}: runs on tpu tensors only; got tensors on {devices}. "
                           "Move them with .to('tpu') first.")

    return kernel


# ---- paged attention ----
_PAGED_SCHEMA = ("(Tensor q, Tensor k_pages, Tensor v_pages, Tensor lengths, Tensor page_indices, *, float? scale=None, "
                 "float? soft_cap=None, int? pages_per_compute_block=None) -> Tensor")
_PAGED_BACKWARD_SCHEMA = ("(Tensor grad, Tensor q, Tensor k_pages, Tensor v_pages, Tensor lengths, Tensor page_indices, "
                          "*, float? scale=None, float? soft_cap=None) -> (Tensor, Tensor, Tensor)")

_paged_op = torch.library.custom_op(_paged.OP, _tpu_only(_paged.OP), mutates_args=(), schema=_PAGED_SCHEMA)
_paged_backward_op = torch.library.custom_op(_paged.BACKWARD, _tpu_only(_paged.BACKWARD), mutates_args=(),
                                             schema=_PAGED_BACKWARD_SCHEMA)


@_paged_op.register_fake
def _paged_fake(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, lengths: torch.Tensor,
                page_indices: torch.Tensor, *, scale: float | None = None, soft_cap: float | None = None,
                pages_per_compute_block: int | None = None) -> torch.Tensor:
    _paged.check_shapes(q, k_pages, v_pages, lengths, page_indices)
    _paged.block_pages(page_indices.shape[1], k_pages.shape[2], pages_per_compute_block)
    return q.new_empty(q.shape)


@_paged_backward_op.register_fake
def _paged_backward_fake(grad: torch.Tensor, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                         lengths: torch.Tensor, page_indices: torch.Tensor, *, scale: float | None = None,
                         soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k_pages), torch.empty_like(v_pages)


def _paged_setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: Any) -> None:
    ctx.save_for_backward(*inputs)
    ctx.scale, ctx.soft_cap = keyword_only_inputs.get("scale"), keyword_only_inputs.get("soft_cap")


def _paged_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    q, k_pages, v_pages, lengths, page_indices = ctx.saved_tensors
    dq, dk, dv = _paged_backward_op(grad, q, k_pages, v_pages, lengths, page_indices, scale=ctx.scale,
                                    soft_cap=ctx.soft_cap)
    return dq, dk, dv, None, None


_paged_op.register_autograd(_paged_backward, setup_context=_paged_setup)
_eager.install_lowering(_paged.OP)
_eager.install_lowering(_paged.BACKWARD)


# The public entry is the op itself (an OpOverloadPacket), not a Python wrapper: Dynamo skips torch_tpu's files, and
# an op is what it puts in a graph (torch.compile(fullgraph=True) works). Documented in the module doc above and in
# the user guide ("Paged attention and grouped matmul").
paged_attention = torch.ops.tpu.paged_attention


# ---- grouped matmul ----
def _grouped_matmul(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The mixture-of-experts grouped matmul: lhs [m, k] (rows sorted by group), rhs [groups, k, n], group_sizes
    [groups] (integers summing to at most m) -> [m, n], rows of group g times rhs[g]; rows past the groups are zeros.
    It is `torch._grouped_mm(lhs, rhs, offs=cumsum(group_sizes))`, so it is differentiable (PyTorch's formula) and runs
    the megablox Pallas kernel on a TPU where the tiles fit, `jax.lax.ragged_dot` elsewhere."""
    if group_sizes.dim() != 1 or group_sizes.dtype.is_floating_point or group_sizes.dtype.is_complex:
        raise RuntimeError(f"torch.tpu.ops.grouped_matmul: group_sizes must be a 1-D integer tensor, got shape "
                           f"{list(group_sizes.shape)} {group_sizes.dtype} (lhs {list(lhs.shape)}, rhs "
                           f"{list(rhs.shape)})")
    if lhs.dim() != 2 or rhs.dim() != 3:
        raise RuntimeError(f"torch.tpu.ops.grouped_matmul: expects lhs [m, k] and rhs [groups, k, n], got lhs "
                           f"{list(lhs.shape)} and rhs {list(rhs.shape)}; for the other layouts call torch._grouped_mm")
    return torch._grouped_mm(lhs, rhs, torch.cumsum(group_sizes, 0, dtype=torch.int32))


# A CompositeImplicitAutograd op: eager runs the function above (cumsum and _grouped_mm, with _grouped_mm's autograd),
# Dynamo records the op and AOTAutograd decomposes it into the same two ops.
_LIB = torch.library.Library("tpu", "FRAGMENT")
_LIB.define("grouped_matmul(Tensor lhs, Tensor rhs, Tensor group_sizes) -> Tensor")
_LIB.impl("grouped_matmul", _grouped_matmul, "CompositeImplicitAutograd")
grouped_matmul = torch.ops.tpu.grouped_matmul
