"""The embedding's backward (the forward has no eager kernel: ATen's composite calls index_select; graph
executors use its trace-only lowering in kernels/views.py), and embedding_bag with its backward ops."""

from __future__ import annotations

from typing import Any

from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jax, jnp
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


@lower("embedding_renorm", checks=True)
def embedding_renorm(self: Any, indices: Any, max_norm: float, norm_type: float) -> Any:
    """max_norm of F.embedding / F.embedding_bag (installed in place as embedding_renorm_): each row named in
    `indices` whose norm_type-norm exceeds max_norm is scaled to max_norm / (norm + 1e-7), as ATen does."""
    if self.ndim != 2:
        raise RuntimeError(f"embedding_renorm_: expected a 2-D weight, got {self.ndim}-D")
    idx = indices.reshape(-1)
    report_bad_index("embedding_renorm_", idx, self.shape[0])
    w = _opmath(self)
    a = jnp.abs(w)
    if norm_type == float("inf"):
        norms = jnp.max(a, axis=1)
    elif norm_type == 0:
        norms = jnp.sum((a != 0).astype(w.dtype), axis=1)
    else:
        norms = jnp.sum(a ** norm_type, axis=1) ** (1.0 / norm_type)
    named = jnp.zeros((self.shape[0],), bool).at[idx].set(True, mode="drop")
    scale = jnp.where(named & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return (w * scale[:, None].astype(w.dtype)).astype(self.dtype)


# ---- embedding_bag ----
# Bags are given by `offsets` (the start of each bag in the flat `indices`). A bag's members are found on the
# device with searchsorted, so offsets never reach the host; the output has one row per bag (a static shape).

_SUM, _MEAN, _MAX = 0, 1, 2


def _check_bag(name: str, weight: Any, indices: Any, offsets: Any, mode: int, per_sample_weights: Any) -> None:
    if indices.ndim != 1:
        raise RuntimeError(f"{name}: input has to be a 1D or 2D Tensor, but got Tensor of dimension {indices.ndim}")
    if offsets.ndim != 1:
        raise RuntimeError(f"{name}: offsets has to be a 1D Tensor, but got Tensor of dimension {offsets.ndim}")
    if weight.ndim != 2:
        raise RuntimeError(f"{name}: weight has to be a 2D Tensor, but got Tensor of dimension {weight.ndim}")
    if indices.dtype != offsets.dtype:
        raise RuntimeError(f"{name}: Expected tensor for argument #1 'indices' to have the same type as tensor for "
                           f"argument #1 'offsets'; but type {indices.dtype} does not equal {offsets.dtype}")
    if per_sample_weights is not None:
        if mode != _SUM:
            raise NotImplementedError("embedding_bag: per_sample_weights was not None. per_sample_weights is only "
                                      f"supported for mode='sum' (got mode={mode}). Please open a feature request "
                                      "on GitHub.")
        if per_sample_weights.shape != indices.shape:
            raise RuntimeError(f"{name}: expected per_sample_weights.sizes() == indices.sizes(), got "
                               f"{list(per_sample_weights.shape)} and {list(indices.shape)}")


def _offset2bag(indices: Any, offsets: Any, include_last_offset: bool) -> tuple[Any, int]:
    """(the bag of each index position, the number of bags): bag b holds positions offsets[b] .. offsets[b+1]-1."""
    n_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    starts = offsets[:n_bags]
    pos = jnp.arange(indices.shape[0], dtype=offsets.dtype)
    bag = jnp.searchsorted(starts, pos, side="right").astype(indices.dtype) - 1
    return bag, n_bags


@lower("_embedding_bag", "_embedding_bag_forward_only", checks=True)
def embedding_bag(
    weight: Any, indices: Any, offsets: Any, scale_grad_by_freq: bool = False, mode: int = 0, sparse: bool = False,
    per_sample_weights: Any = None, include_last_offset: bool = False, padding_idx: int = -1,
) -> tuple[Any, Any, Any, Any]:
    """(output (bags, dim), offset2bag, bag_size, max_indices) as ATen's CPU kernel gives them: bag_size counts
    the indices that are not padding_idx (zeros in sum mode), max_indices is (bags, dim) in max mode (0 for empty
    bags) and repeats bag_size in mean mode (zeros in sum mode)."""
    _check_bag("embedding_bag", weight, indices, offsets, mode, per_sample_weights)
    num, dim = weight.shape
    report_bad_index("embedding_bag", indices, num, error=RuntimeError,
                     message="{op}: Expected idx >= 0 && idx < num_embeddings but found idx to be {value}")
    bag, n_bags = _offset2bag(indices, offsets, include_last_offset)
    # Positions past the last bag (include_last_offset with a short last offset) belong to no bag.
    live = (indices != padding_idx) & (bag >= 0) & (bag < n_bags)
    seg = jnp.where(live, bag, n_bags)  # dead positions go to an extra segment that is dropped
    rows = _opmath(weight)[jnp.clip(indices, 0, num - 1)]
    itype = indices.dtype
    counts = jax.ops.segment_sum(live.astype(itype), seg, n_bags + 1)[:n_bags]
    if mode == _MAX:
        best = jax.ops.segment_max(jnp.where(live[:, None], rows, -jnp.inf), seg, n_bags + 1)[:n_bags]
        # The first position holding the maximum, as the CPU kernel scans the bag.
        at_best = live[:, None] & (rows == best[jnp.clip(seg, 0, max(n_bags - 1, 0))])
        positions = jnp.arange(indices.shape[0])[:, None]
        first = jax.ops.segment_min(jnp.where(at_best, positions, indices.shape[0]), seg, n_bags + 1)[:n_bags]
        empty = (counts == 0)[:, None]
        out = jnp.where(empty, 0, best)
        max_indices = jnp.where(empty, 0, indices[jnp.clip(first, 0, max(indices.shape[0] - 1, 0))]).astype(itype)
        if indices.shape[0] == 0:
            max_indices = jnp.zeros((n_bags, dim), itype)
        return out.astype(weight.dtype), bag, counts, max_indices
    if per_sample_weights is not None:
        rows = rows * _opmath(per_sample_weights)[:, None].astype(rows.dtype)
    out = jax.ops.segment_sum(jnp.where(live[:, None], rows, 0), seg, n_bags + 1)[:n_bags]
    if mode == _MEAN:
        out = out / jnp.maximum(counts, 1)[:, None].astype(out.dtype)
        return out.astype(weight.dtype), bag, counts, counts
    zeros = jnp.zeros((n_bags,), itype)
    return out.astype(weight.dtype), bag, zeros, zeros


@lower("_embedding_bag_dense_backward")
def embedding_bag_dense_backward(
    grad: Any, indices: Any, offset2bag: Any, bag_size: Any, maximum_indices: Any, num_weights: int,
    scale_grad_by_freq: bool, mode: int, per_sample_weights: Any = None, padding_idx: int = -1,
) -> Any:
    g = _opmath(grad)
    n_bags, dim = g.shape
    if mode == _MAX:
        live = (bag_size > 0)[:, None] & jnp.ones((1, dim), bool)
        cols = jnp.broadcast_to(jnp.arange(dim), (n_bags, dim))
        rows = jnp.where(live, maximum_indices, num_weights)  # dropped
        out = jnp.zeros((num_weights, dim), g.dtype).at[rows, cols].add(g, mode="drop")
        return out.astype(grad.dtype)
    bag = jnp.clip(offset2bag, 0, max(n_bags - 1, 0))
    live = (indices != padding_idx) & (offset2bag >= 0) & (offset2bag < n_bags)
    per = g[bag]
    if mode == _MEAN:
        per = per / jnp.maximum(bag_size[bag], 1)[:, None].astype(per.dtype)
    if per_sample_weights is not None:
        per = per * _opmath(per_sample_weights)[:, None].astype(per.dtype)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), per.dtype).at[indices].add(1, mode="drop")
        per = per / jnp.maximum(counts[jnp.clip(indices, 0, num_weights - 1)], 1)[:, None]
    target = jnp.where(live, indices, num_weights)
    out = jnp.zeros((num_weights, dim), per.dtype).at[target].add(per, mode="drop")
    return out.astype(grad.dtype)


@lower("_embedding_bag_per_sample_weights_backward")
def embedding_bag_per_sample_weights_backward(
    grad: Any, weight: Any, indices: Any, offsets: Any, offset2bag: Any, mode: int, padding_idx: int = -1,
) -> Any:
    if mode != _SUM:
        raise RuntimeError("embedding_bag_backward: per_sample_weights only supported for mode='sum'")
    n_bags = grad.shape[0]
    bag = jnp.clip(offset2bag, 0, max(n_bags - 1, 0))
    rows = _opmath(weight)[jnp.clip(indices, 0, weight.shape[0] - 1)]
    dots = jnp.sum(_opmath(grad)[bag] * rows, axis=1)
    live = (indices != padding_idx) & (offset2bag >= 0) & (offset2bag < n_bags)
    return jnp.where(live, dots, 0).astype(grad.dtype)


@lower("_embedding_bag_backward")
def embedding_bag_backward(
    grad: Any, indices: Any, offsets: Any, offset2bag: Any, bag_size: Any, maximum_indices: Any, num_weights: int,
    scale_grad_by_freq: bool, mode: int, sparse: bool, per_sample_weights: Any = None, padding_idx: int = -1,
) -> Any:
    if sparse:
        raise NotImplementedError("torch_tpu: embedding_bag(sparse=True) needs sparse tensors, which tpu does not "
                                  "support; use sparse=False (a dense gradient) on tpu")
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                        scale_grad_by_freq, mode, per_sample_weights, padding_idx)
