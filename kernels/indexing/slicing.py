"""Slicing copies (narrow_copy, select_scatter, slice_scatter, slice_backward, select_backward, unfold_backward) and
joining (cat)."""

from __future__ import annotations

from typing import Any, Sequence

from torch_tpu._jax import jnp, lax
from torch_tpu.kernels.indexing._common import _wrap_dim
from torch_tpu.kernels._promote import result_dtype
from torch_tpu.kernels.registry import lower


# ---- slicing copies ----

@lower("narrow_copy")
def narrow_copy(self: Any, dim: int, start: int, length: int) -> Any:
    if self.ndim == 0:
        raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
    if length < 0:
        raise RuntimeError("narrow(): length must be non-negative.")
    dim = _wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    if not -size <= start <= size:
        raise IndexError(f"start out of range (expected to be in range of [{-size}, {size}], but got {start})")
    start = start % size if start < 0 else start
    if start + length > size:
        raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size ({size}).")
    return lax.slice_in_dim(self, start, start + length, axis=dim)


@lower("select_scatter")
def select_scatter(self: Any, src: Any, dim: int, index: int) -> Any:
    dim = _wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for tensor of size {list(self.shape)} at dimension "
                         f"{dim}")
    expected = self.shape[:dim] + self.shape[dim + 1:]
    if tuple(src.shape) != tuple(expected):
        raise RuntimeError(f"expected src to have a size equal to the slice of self. src size = {list(src.shape)}, "
                           f"slice size = {list(expected)}")
    key = (slice(None),) * dim + (index % size,)
    return self.at[key].set(src.astype(self.dtype))


@lower("slice_scatter")
def slice_scatter(self: Any, src: Any, dim: int = 0, start: int | None = None, end: int | None = None,
                  step: int = 1) -> Any:
    if step <= 0:
        raise RuntimeError("slice step must be positive")
    dim = _wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    lo, hi, _ = slice(start, end, step).indices(size)
    hi = max(hi, lo)
    expected = list(self.shape)
    expected[dim] = len(range(lo, hi, step))
    if list(src.shape) != expected:
        raise RuntimeError(f"expected src to have a size equal to the slice of self. src size = {list(src.shape)}, "
                           f"slice size = {expected}")
    if expected[dim] == 0:
        return self
    key = (slice(None),) * dim + (slice(lo, hi, step),)
    return self.at[key].set(src.astype(self.dtype))


# The gradients of a slice and a select (autograd's SliceBackward0 / SelectBackward0): ATen's composites make zeros of
# the input's shape and copy_ the gradient into a view of them, two programs and a copy into a view, which made a
# Hugging Face Llama step's 8 slice_backward calls (rotate_half) cost 120 us each op by op; one program here.
@lower("slice_backward")
def slice_backward(grad_output: Any, input_sizes: Sequence[int], dim: int, start: int, end: int, step: int) -> Any:
    return slice_scatter(jnp.zeros(tuple(int(s) for s in input_sizes), grad_output.dtype), grad_output, dim, start,
                         end, step)


@lower("select_backward")
def select_backward(grad_output: Any, input_sizes: Sequence[int], dim: int, index: int) -> Any:
    return select_scatter(jnp.zeros(tuple(int(s) for s in input_sizes), grad_output.dtype), grad_output, dim, index)


# ---- joining ----


@lower("unfold_backward")
def unfold_backward(grad_in: Any, input_sizes: Sequence[int], dim: int, size: int, step: int) -> Any:
    """Gradient of Tensor.unfold(dim, size, step): each window's gradient added back at the elements it read
    (overlapping windows sum)."""
    input_sizes = tuple(int(s) for s in input_sizes)
    if len(input_sizes) == 0:  # a 0-dim input unfolds to shape [size] (size <= 1)
        return grad_in.reshape(())
    dim = _wrap_dim(dim, len(input_sizes))
    n = input_sizes[dim]
    windows = (n - size) // step + 1 if n >= size else 0
    expected = input_sizes[:dim] + (windows,) + input_sizes[dim + 1:] + (size,)
    if tuple(grad_in.shape) != expected:
        raise RuntimeError(
            f"unfold_backward: grad_in has shape {list(grad_in.shape)}, expected {list(expected)} for input sizes "
            f"{list(input_sizes)}, dimension {dim}, size {size}, step {step}"
        )
    g = jnp.moveaxis(grad_in, dim, -2)  # [..., windows, size]
    idx = jnp.arange(windows)[:, None] * step + jnp.arange(size)[None, :]
    moved = input_sizes[:dim] + input_sizes[dim + 1:] + (n,)
    out = jnp.zeros(moved, grad_in.dtype).at[..., idx].add(g)
    return jnp.moveaxis(out, -1, dim)


@lower("cat")
def cat(tensors: Sequence[Any], dim: int = 0) -> Any:
    # ATen's cat meta function, in its order: 0-d inputs, dim wrapped by the first non-skipped input, then each
    # non-skipped input's rank and sizes against that one.
    for i, t in enumerate(tensors):
        if t.ndim == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")
    if len(tensors) == 0:
        raise RuntimeError("torch.cat(): expected a non-empty list of Tensors")
    dtype = result_dtype(*tensors)
    # Legacy behaviour kept by PyTorch: 1-D empty tensors are skipped whatever the other shapes.
    kept = [(i, t) for i, t in enumerate(tensors) if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros((0,), dtype)
    first = kept[0][1]
    dim = _wrap_dim(dim, first.ndim)
    for i, t in kept:
        if t.ndim != first.ndim:
            raise RuntimeError(f"Tensors must have same number of dimensions: got {first.ndim} and {t.ndim}")
        for d, (a, b) in enumerate(zip(first.shape, t.shape)):
            if d != dim and a != b:
                raise RuntimeError(f"Sizes of tensors must match except in dimension {dim}. Expected size {a} "
                                   f"but got size {b} for tensor number {i} in the list.")
    return jnp.concatenate([t.astype(dtype) for _, t in kept], axis=dim)
