"""Trace-only lowerings: the view, metadata and composite ops that graph executors (torch.compile's FX interpreter)
meet in aten graphs.

Eagerly none of these needs a Python kernel: views (view, permute, expand, slice, select, as_strided...) are C++
metadata kernels over the same storage, and composites (clone, _to_copy, full, embedding...) reach other kernels
(copy_, fill_, index_select). Inside one traced XLA program there are no storages or strides, so each op here
returns the values the view would show. They are registered with `trace_only=True`: in LOWERINGS for every
executor, never installed as PrivateUse1 kernels.

`as_strided` (and `sym_stride`, which needs strides) assumes its input is contiguous in the traced graph; the
compile backend checks the graph's metadata before it relies on that.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from torch_tpu import _runtime
from torch_tpu._executor import next_trace_key
from torch_tpu._checks import report_assert, report_bad_index
from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels.registry import lower

_T = dict(trace_only=True, variants=False)


def _dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _dtype(dtype: torch.dtype | None, like: Any = None, value: Any = None) -> Any:
    """The JAX dtype for an optional torch dtype argument: the given one, else `like`'s, else PyTorch's default for
    a Python `value` (bool -> bool, int -> int64, float -> the default dtype, complex -> its complex)."""
    if dtype is not None:
        return _runtime.jax_dtype(dtype)
    if like is not None:
        return like.dtype
    if isinstance(value, bool):
        return jnp.bool_
    if isinstance(value, int):
        return jnp.int64
    default = torch.get_default_dtype()
    if isinstance(value, complex):
        default = torch.complex128 if default == torch.float64 else torch.complex64
    return _runtime.jax_dtype(default)


# ---- views ----

@lower("view", "_unsafe_view", "reshape", "view_copy", "_reshape_copy", **_T)
def view(self: Any, size: Sequence[int] | None = None, shape: Sequence[int] | None = None) -> Any:
    return jnp.reshape(self, tuple(size if size is not None else shape))


@lower("_reshape_alias", **_T)
def _reshape_alias(self: Any, size: Sequence[int], stride: Sequence[int]) -> Any:
    return jnp.reshape(self, tuple(size))


@lower("view.dtype", **_T)
def view_dtype(self: Any, dtype: torch.dtype) -> Any:
    target = _runtime.jax_dtype(dtype)
    if jnp.dtype(target).itemsize != jnp.dtype(self.dtype).itemsize:
        raise NotImplementedError(
            f"view(dtype) from {self.dtype} to {target} changes the element size: not supported inside a "
            "torch.compile(backend='tpu') graph; do this view outside the compiled function")
    if target == jnp.bool_ or self.dtype == jnp.bool_:
        return (self != 0) if target == jnp.bool_ else self.astype(target)
    return lax.bitcast_convert_type(self, target)


@lower("view_as_real", "view_as_real_copy", **_T)
def view_as_real(self: Any) -> Any:
    """A complex tensor as its (real, imaginary) pairs along a new last dimension (rotary embeddings)."""
    if not jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise RuntimeError(f"view_as_real is only supported for complex tensors, got {self.dtype}")
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@lower("view_as_complex", "view_as_complex_copy", **_T)
def view_as_complex(self: Any) -> Any:
    """(..., 2) pairs of float32/float64 as complex64/complex128 (the inverse of view_as_real)."""
    if self.ndim == 0 or self.shape[-1] != 2:
        raise RuntimeError(f"Tensor must have a last dimension of size 2, got shape {list(self.shape)}")
    if self.dtype not in (jnp.float32, jnp.float64):
        raise RuntimeError(f"view_as_complex is only supported for float and double tensors, got {self.dtype}")
    return lax.complex(self[..., 0], self[..., 1])


@lower("_conj", "_conj_copy", **_T)
def _conj(self: Any) -> Any:
    """The lazy conjugate view in a graph: arrays carry no conjugate bit, so its value is the conjugate (the
    backward of a complex multiply saves one)."""
    return jnp.conj(self) if jnp.issubdtype(self.dtype, jnp.complexfloating) else self


@lower("_neg_view", "_neg_view_copy", **_T)
def _neg_view(self: Any) -> Any:
    return -self


@lower("resolve_conj", "resolve_neg", **_T)
def _resolve_bit(self: Any) -> Any:
    """A graph's values are already resolved (see _conj)."""
    return self


@lower("alias", "detach", "lift_fresh_copy", "alias_copy", "detach_copy", **_T)
def alias(self: Any) -> Any:
    return self


@lower("clone", **_T)
def clone(self: Any, memory_format: Any = None) -> Any:
    return self  # device arrays are immutable: a copy is the same value


@lower("permute", "permute_copy", **_T)
def permute(self: Any, dims: Sequence[int]) -> Any:
    return jnp.transpose(self, tuple(_dim(d, self.ndim) for d in dims))


@lower("t", **_T)
def t(self: Any) -> Any:
    return self if self.ndim < 2 else jnp.swapaxes(self, 0, 1)


@lower("transpose.int", **_T)
def transpose(self: Any, dim0: int, dim1: int) -> Any:
    if self.ndim == 0:
        return self
    return jnp.swapaxes(self, _dim(dim0, self.ndim), _dim(dim1, self.ndim))


@lower("unfold", **_T)
def unfold(self: Any, dimension: int, size: int, step: int) -> Any:
    """Tensor.unfold in a graph: the windows gathered along `dimension`, each window's elements as a new last dim."""
    if self.ndim == 0:
        return self.reshape(1)
    d = _dim(dimension, self.ndim)
    windows = (self.shape[d] - size) // step + 1
    idx = jnp.arange(windows)[:, None] * step + jnp.arange(size)[None, :]
    return jnp.moveaxis(jnp.take(self, idx, axis=d), d + 1, -1)


@lower("expand", "expand_copy", **_T)
def expand(self: Any, size: Sequence[int], implicit: bool = False) -> Any:
    lead = len(size) - self.ndim
    shape = tuple(self.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(self, shape)


@lower("squeeze", **_T)
def squeeze(self: Any) -> Any:
    return jnp.reshape(self, tuple(s for s in self.shape if s != 1))


@lower("squeeze.dim", **_T)
def squeeze_dim(self: Any, dim: int) -> Any:
    return squeeze_dims(self, (dim,))


@lower("squeeze.dims", **_T)
def squeeze_dims(self: Any, dim: Sequence[int]) -> Any:
    if self.ndim == 0:
        return self
    dims = {_dim(d, self.ndim) for d in dim}
    return jnp.reshape(self, tuple(s for i, s in enumerate(self.shape) if not (i in dims and s == 1)))


@lower("unsqueeze", "unsqueeze_copy", **_T)
def unsqueeze(self: Any, dim: int) -> Any:
    return jnp.expand_dims(self, _dim(dim, self.ndim + 1))


@lower("select.int", "select_copy.int", **_T)
def select(self: Any, dim: int, index: int) -> Any:
    dim = _dim(dim, self.ndim)
    size = self.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for tensor of size {tuple(self.shape)} at "
                         f"dimension {dim}")
    return lax.index_in_dim(self, index + size if index < 0 else index, dim, keepdims=False)


@lower("slice.Tensor", "slice_copy.Tensor", **_T)
def slice_(self: Any, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1) -> Any:
    dim = _dim(dim, self.ndim)
    lo, hi, st = slice(start, end, step).indices(self.shape[dim])
    if hi <= lo:
        shape = list(self.shape)
        shape[dim] = 0
        return jnp.zeros(tuple(shape), self.dtype)
    return lax.slice_in_dim(self, lo, hi, st, dim)


@lower("narrow", **_T)
def narrow(self: Any, dim: int, start: int, length: int) -> Any:
    dim = _dim(dim, self.ndim)
    start = start + self.shape[dim] if start < 0 else start
    return lax.slice_in_dim(self, start, start + length, 1, dim)


@lower("split_with_sizes", "split_with_sizes_copy", **_T)
def split_with_sizes(self: Any, split_sizes: Sequence[int], dim: int = 0) -> list[Any]:
    dim = _dim(dim, self.ndim)
    out, start = [], 0
    for s in split_sizes:
        out.append(lax.slice_in_dim(self, start, start + s, 1, dim))
        start += s
    return out


@lower("split.Tensor", "split_copy.Tensor", **_T)
def split(self: Any, split_size: int, dim: int = 0) -> list[Any]:
    n = self.shape[_dim(dim, self.ndim)]
    sizes = [min(split_size, n - i) for i in range(0, n, split_size)] if split_size else [n]
    return split_with_sizes(self, sizes or [0], dim)


@lower("unbind.int", "unbind_copy.int", **_T)
def unbind(self: Any, dim: int = 0) -> list[Any]:
    dim = _dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, dim, keepdims=False) for i in range(self.shape[dim])]


@lower("diagonal", **_T)
def diagonal(self: Any, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Any:
    return jnp.diagonal(self, offset, _dim(dim1, self.ndim), _dim(dim2, self.ndim))


@lower("as_strided", "as_strided_copy", **_T)
def as_strided(self: Any, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None) -> Any:
    """The view of a contiguous input's flat storage (the compile backend checks the input is contiguous)."""
    flat = jnp.reshape(self, (-1,))
    size = tuple(size)
    if math.prod(size) == 0:
        return jnp.zeros(size, self.dtype)
    idx = jnp.full(size, storage_offset or 0, dtype=jnp.int64)
    for d, st in enumerate(stride):
        if size[d] > 1 and st != 0:
            idx = idx + lax.broadcasted_iota(jnp.int64, size, d) * st
    return flat[idx]


# ---- metadata queries (symbolic sizes) ----

@lower("sym_size.int", **_T)
def sym_size(self: Any, dim: int) -> int:
    return int(self.shape[_dim(dim, self.ndim)])


@lower("sym_numel", **_T)
def sym_numel(self: Any) -> int:
    return int(math.prod(self.shape))


@lower("_assert_scalar", **_T)
def _assert_scalar(self: Any, assert_msg: str) -> None:
    """A graph's runtime assertion on a symbolic value: a value known when the graph is traced (a shape) is
    checked then, as CPU checks it; a traced one is a device-side assertion (kernels/asserts.py)."""
    if isinstance(self, (bool, int)):
        if not self:
            raise RuntimeError(assert_msg)
        return None
    report_assert("_assert_scalar", jnp.asarray(self), assert_msg)
    return None


# ---- copies, casts and creation (composites eagerly) ----

@lower("_to_copy", **_T)
def _to_copy(self: Any, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
             pin_memory: Any = None, non_blocking: bool = False, memory_format: Any = None) -> Any:
    if device is not None and torch.device(device).type != "tpu":
        raise NotImplementedError(
            f"a copy to {device} inside a torch.compile(backend='tpu') graph: move the .to()/.cpu() call out of "
            "the compiled function")
    return self if dtype is None else self.astype(_runtime.jax_dtype(dtype))


@lower("copy", **_T)
def copy(self: Any, src: Any, non_blocking: bool = False) -> Any:
    return jnp.broadcast_to(jnp.asarray(src).astype(self.dtype), self.shape)


@lower("full", **_T)
def full(size: Sequence[int], fill_value: Any, dtype: torch.dtype | None = None, layout: Any = None,
         device: Any = None, pin_memory: Any = None) -> Any:
    return jnp.full(tuple(size), fill_value, _dtype(dtype, value=fill_value))


@lower("full_like", **_T)
def full_like(self: Any, fill_value: Any, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
              pin_memory: Any = None, memory_format: Any = None) -> Any:
    return jnp.full(self.shape, fill_value, _dtype(dtype, like=self))


@lower("zeros_like", "empty_like", **_T)
def zeros_like(self: Any, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
               pin_memory: Any = None, memory_format: Any = None) -> Any:
    return jnp.zeros(self.shape, _dtype(dtype, like=self))


@lower("ones_like", **_T)
def ones_like(self: Any, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
              pin_memory: Any = None, memory_format: Any = None) -> Any:
    return jnp.ones(self.shape, _dtype(dtype, like=self))


@lower("zeros", "empty.memory_format", **_T)
def zeros(size: Sequence[int], dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
          pin_memory: Any = None, memory_format: Any = None) -> Any:
    return jnp.zeros(tuple(size), _dtype(dtype, value=0.0))


@lower("ones", **_T)
def ones(size: Sequence[int], dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
         pin_memory: Any = None) -> Any:
    return jnp.ones(tuple(size), _dtype(dtype, value=0.0))


@lower("empty_strided", **_T)
def empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype | None = None, layout: Any = None,
                  device: Any = None, pin_memory: Any = None) -> Any:
    return jnp.zeros(tuple(size), _dtype(dtype, value=0.0))


@lower("new_zeros", "new_empty", **_T)
def new_zeros(self: Any, size: Sequence[int], dtype: torch.dtype | None = None, layout: Any = None,
              device: Any = None, pin_memory: Any = None) -> Any:
    return jnp.zeros(tuple(size), _dtype(dtype, like=self))


@lower("new_ones", **_T)
def new_ones(self: Any, size: Sequence[int], dtype: torch.dtype | None = None, layout: Any = None,
             device: Any = None, pin_memory: Any = None) -> Any:
    return jnp.ones(tuple(size), _dtype(dtype, like=self))


@lower("new_full", **_T)
def new_full(self: Any, size: Sequence[int], fill_value: Any, dtype: torch.dtype | None = None, layout: Any = None,
             device: Any = None, pin_memory: Any = None) -> Any:
    return jnp.full(tuple(size), fill_value, _dtype(dtype, like=self))


@lower("scalar_tensor", **_T)
def scalar_tensor(s: Any, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
                  pin_memory: Any = None) -> Any:
    return jnp.asarray(s, _dtype(dtype, value=0.0))


@lower("arange", "arange.start", "arange.start_step", **_T)
def arange(end: Any = None, start: Any = 0, step: Any = 1, dtype: torch.dtype | None = None, layout: Any = None,
           device: Any = None, pin_memory: Any = None) -> Any:
    # arange(end) names its bound `end`; the start forms name theirs start, end, step.
    if any(not isinstance(v, (int, float, bool)) for v in (start, end, step)):
        raise NotImplementedError("arange with traced bounds inside a torch.compile(backend='tpu') graph")
    n = max(0, math.ceil((end - start) / step))
    if dtype is None:
        dtype = torch.int64 if all(isinstance(v, int) for v in (start, end, step)) else torch.get_default_dtype()
    jd = _runtime.jax_dtype(dtype)
    wide = jnp.int64 if jnp.issubdtype(jd, jnp.integer) else jnp.float64
    return (start + step * jnp.arange(n, dtype=wide)).astype(jd)


@lower("embedding", **_T, checks=True)
def embedding(weight: Any, indices: Any, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> Any:
    report_bad_index("embedding", indices, weight.shape[0])
    return jnp.take(weight, indices, axis=0)


# ---- random values inside traced programs (eagerly: the random fills in creation.py) ----
# The executor supplies a fresh key per program call from the tpu generator (_executor.trace_random).

def _float(dtype: torch.dtype | None, like: Any = None) -> Any:
    jd = _dtype(dtype, like=like, value=0.0)
    return jd, (jd if jd in (jnp.float32, jnp.float64) else jnp.float32)


@lower("rand_like", **_T)
def rand_like(self: Any, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
              pin_memory: Any = None, memory_format: Any = None) -> Any:
    jd, sd = _float(dtype, self)
    return jax.random.uniform(next_trace_key(), self.shape, sd).astype(jd)


@lower("randn_like", **_T)
def randn_like(self: Any, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
               pin_memory: Any = None, memory_format: Any = None) -> Any:
    jd, sd = _float(dtype, self)
    return jax.random.normal(next_trace_key(), self.shape, sd).astype(jd)


@lower("rand", **_T)
def rand(size: Sequence[int], dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
         pin_memory: Any = None) -> Any:
    jd, sd = _float(dtype)
    return jax.random.uniform(next_trace_key(), tuple(size), sd).astype(jd)


@lower("randn", **_T)
def randn(size: Sequence[int], dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
          pin_memory: Any = None) -> Any:
    jd, sd = _float(dtype)
    return jax.random.normal(next_trace_key(), tuple(size), sd).astype(jd)

