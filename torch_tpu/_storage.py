"""The Python half of the storage model: reading a tensor's value from its storage's device array, and
writing a value back through a view.

A storage owns one immutable device array in its producer's shape and dtype. A tensor is that storage plus
sizes, strides, offset and dtype. Reading: the whole array as is (fast path, in C++), a contiguous window
as a slice, a permutation or broadcast as transpose/broadcast, anything else as a gather. Writing: the whole
storage is replaced; otherwise the value is update-sliced or scattered into the base array, which is then
swapped in. Views that reinterpret the dtype bitcast through bytes. Every geometry is one cached jit.

A tensor's lazy conjugate and negative bits (`z.conj()`, `torch._neg_view`) are resolved here, at the one place
values cross between tensors and arrays: `read` returns the value the tensor stands for (the conjugate/negation
of its storage's elements), and `write` stores the conjugate/negation of the value, so no lowering ever sees a
bit (PyTorch's Conjugate/Negative fallbacks already resolve them for most ops; the ones it lets through, e.g.
dot, mm, addmm, bmm, copy_, reach the kernels with the bit set). The C++ whole-array fast paths decline such
tensors (runtime/TpuPython.cpp, TpuDispatch.cpp), so they come here.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from torch_tpu import _C, _executor, _runtime
from torch_tpu._jax import jax, jnp, lax

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # sizes, strides, storage offset


def _is_contiguous(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


# ---- bytes <-> typed arrays (dtype-reinterpreting views) ----

def _to_bytes(x: Any) -> Any:
    """Flat uint8 view of an array's bytes (little-endian, like torch's CPU storage)."""
    x = x.reshape(-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        part = jnp.float32 if x.dtype == jnp.complex64 else jnp.float64
        x = jnp.stack([jnp.real(x).astype(part), jnp.imag(x).astype(part)], axis=-1).reshape(-1)
    if x.dtype.itemsize == 1:
        return lax.bitcast_convert_type(x, jnp.uint8)
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b: Any, dtype: Any) -> Any:
    """Flat array of `dtype` from flat uint8 bytes (length a multiple of the item size)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return b != 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = jnp.float32 if dtype == jnp.complex64 else jnp.float64
        pairs = _from_bytes(b, part).reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(b, dtype)
    return lax.bitcast_convert_type(b.reshape(-1, dtype.itemsize), dtype)


def _flat_as(base: Any, dtype: Any) -> Any:
    if base.dtype == dtype:
        return base.reshape(-1)
    return _from_bytes(_to_bytes(base), dtype)


def _gather_index(sizes: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Any:
    idx = jnp.full(sizes, offset, dtype=jnp.int64)
    for dim, stride in enumerate(strides):
        if sizes[dim] > 1 and stride != 0:
            idx = idx + lax.broadcasted_iota(jnp.int64, sizes, dim) * stride
    return idx


@functools.lru_cache(maxsize=4096)
def _block_plan(sizes: tuple[int, ...], strides: tuple[int, ...], offset: int) -> tuple | None:
    """A view that is a strided slice of a dense block of its storage, as slices instead of an element gather: what
    slicing a (possibly transposed) tensor makes, e.g. `q[..., :16]` of `q = x.view(b, s, h, d).transpose(1, 2)`
    (rotary embeddings), `labels[:, 1:]`, `x[:, ::2]`. Its dims (size-1 dims left out), ordered by falling stride
    s_0 > s_1 > ... > s_{k-1}, must nest (each stride divides the one before). Then the view is, within the block of
    `rows * s_0` elements from `start`, reshaped to (rows, s_0/s_1, ..., s_{k-2}/s_{k-1}, s_{k-1}), the slice from
    `lo` to `hi` (the offset's digits in that mixed radix; the last dim is the element picked within a stride), as
    long as no dim wraps past its extent. Returns (start, block shape, lo, hi, the view's dims in that order), or
    None (overlapping or irregular views, stride 0: the caller gathers)."""
    dims = [d for d in range(len(sizes)) if sizes[d] != 1]
    if not dims or any(strides[d] <= 0 for d in dims):
        return None
    order = sorted(dims, key=lambda d: -strides[d])
    s = [strides[d] for d in order]
    z = [sizes[d] for d in order]
    shape = [z[0]]
    for i in range(1, len(s)):
        if s[i - 1] % s[i]:
            return None
        shape.append(s[i - 1] // s[i])
    shape.append(s[-1])
    row, rest = divmod(offset, s[0])
    lo = [0]
    for i in range(1, len(s)):
        digit, rest = divmod(rest, s[i])
        if digit + z[i] > shape[i]:
            return None
        lo.append(digit)
    lo.append(rest)
    hi = [a + b for a, b in zip(lo, z)] + [rest + 1]
    return row * s[0], tuple(shape), tuple(lo), tuple(hi), tuple(order)


def _block(flat: Any, start: int, shape: tuple[int, ...]) -> Any:
    """`math.prod(shape)` elements of `flat` from `start`, reshaped to `shape` (zeros past the end: a last row that
    the view does not reach into may be cut short in its storage)."""
    end = start + math.prod(shape)
    part = lax.slice(flat, (start,), (min(end, flat.shape[0]),))
    if end > flat.shape[0]:
        part = jnp.pad(part, (0, end - flat.shape[0]))
    return part.reshape(shape)


def _read_flat(flat: Any, sizes: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Any:
    numel = math.prod(sizes)
    if numel == 0:
        return jnp.zeros(sizes, flat.dtype)
    if _is_contiguous(sizes, strides):
        return lax.slice(flat, (offset,), (offset + numel,)).reshape(sizes)
    # Broadcast (stride 0) dims: read the reduced view, then broadcast.
    keep = [d for d in range(len(sizes)) if not (strides[d] == 0 and sizes[d] > 1)]
    if len(keep) < len(sizes):
        sub = _read_flat(flat, tuple(sizes[d] for d in keep), tuple(strides[d] for d in keep), offset)
        return lax.broadcast_in_dim(sub, sizes, tuple(keep))
    # A permutation of a contiguous block: slice + reshape + transpose.
    order = sorted(range(len(sizes)), key=lambda d: -strides[d])
    psizes = tuple(sizes[d] for d in order)
    pstrides = tuple(strides[d] for d in order)
    if _is_contiguous(psizes, pstrides):
        block = lax.slice(flat, (offset,), (offset + numel,)).reshape(psizes)
        return jnp.transpose(block, tuple(order.index(d) for d in range(len(sizes))))
    plan = _block_plan(sizes, strides, offset)
    if plan is not None:
        start, shape, lo, hi, order = plan
        part = lax.slice(_block(flat, start, shape), lo, hi).reshape(tuple(sizes[d] for d in order))
        dims = sorted(order)  # the view's dims of size > 1, in the view's order
        return jnp.transpose(part, tuple(order.index(d) for d in dims)).reshape(sizes)
    return flat[_gather_index(sizes, strides, offset)]


def view_of(base: Any, sizes: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Any:
    """The view (sizes, strides, storage offset) of a storage array `base` of the view's dtype, as traceable JAX:
    what `read` computes, for a function that reads the view inside its own program (the eager fast path)."""
    return _read_flat(base.reshape(-1), sizes, strides, offset)


def _apply_bits(x: Any, conj: bool, neg: bool) -> Any:
    """The value a tensor with these lazy bits stands for, from its storage's elements (its own inverse)."""
    if conj and jnp.iscomplexobj(x):
        x = jnp.conj(x)
    if neg:
        x = -x
    return x


@functools.lru_cache(maxsize=4096)
def _reader(base_shape: tuple[int, ...], base_dtype: Any, dtype: Any, geom: Geometry, conj: bool = False,
            neg: bool = False) -> Any:
    sizes, strides, offset = geom

    def read(base: Any) -> Any:
        return _apply_bits(_read_flat(_flat_as(base, dtype), sizes, strides, offset), conj, neg)

    return _executor.jitted(read, key=(base_shape, base_dtype, dtype, geom, conj, neg))


@functools.lru_cache(maxsize=4096)
def _writer(base_shape: tuple[int, ...], base_dtype: Any, dtype: Any, geom: Geometry, conj: bool = False,
            neg: bool = False) -> Any:
    sizes, strides, offset = geom

    def write(base: Any, value: Any) -> Any:
        flat = _flat_as(base, dtype)
        value = _apply_bits(value.astype(dtype).reshape(sizes), conj, neg)
        if math.prod(sizes) == 0:
            return base
        if _is_contiguous(sizes, strides):
            flat = lax.dynamic_update_slice(flat, value.reshape(-1), (offset,))
        elif (plan := _block_plan(sizes, strides, offset)) is not None:  # into the block it slices: no scatter
            start, shape, lo, hi, order = plan
            dims = sorted(order)
            part = jnp.transpose(value.reshape(tuple(sizes[d] for d in dims)), tuple(dims.index(d) for d in order))
            block = lax.dynamic_update_slice(_block(flat, start, shape), part.reshape(part.shape + (1,)), lo)
            block = block.reshape(-1)[: flat.shape[0] - start]
            flat = block if start == 0 and block.shape[0] == flat.shape[0] else lax.dynamic_update_slice(
                flat, block, (start,))
        else:
            flat = flat.at[_gather_index(sizes, strides, offset)].set(value)
        if dtype != base_dtype:
            flat = _from_bytes(_to_bytes(flat), base_dtype)
        return flat.reshape(base_shape)

    return _executor.jitted(write, key=(base_shape, base_dtype, dtype, geom, conj, neg))


@functools.lru_cache(maxsize=4096)
def _caster(shape: tuple[int, ...], dtype: Any, conj: bool = False, neg: bool = False) -> Any:
    """Cast to `dtype` and reshape to `shape` (a value written over a whole storage), with a target's lazy bits."""
    return _executor.jitted(lambda v: _apply_bits(v.astype(dtype).reshape(shape), conj, neg),
                            key=(shape, dtype, conj, neg))


def _geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _zeros_base(nbytes: int, dtype: Any, index: int) -> Any:
    item = jnp.dtype(dtype).itemsize
    if nbytes % item == 0:
        shape, zdtype = (nbytes // item,), dtype
    else:
        shape, zdtype = (nbytes,), jnp.uint8
    return jax.device_put(jnp.zeros(shape, zdtype), _runtime.device(index))


def read(t: torch.Tensor) -> Any:
    """The value of tpu tensor `t` as a device array of its shape and dtype (its conjugate/negative bits
    applied)."""
    arr = _C._array(t)  # (None for a tensor with a lazy bit)
    if arr is not None:
        return arr
    base, nbytes, index = _C._storage_array(t)
    dtype = _runtime.jax_dtype(t.dtype)
    if base is None:  # never written: reads as zeros
        return jax.device_put(jnp.zeros(tuple(t.shape), dtype), _runtime.device(index))
    conj, neg = t.is_conj(), t.is_neg()
    value = _reader(base.shape, base.dtype, dtype, _geometry(t), conj, neg)(base)
    # A contiguous tensor over its whole storage in another shape than the storage's array, and the only tensor of
    # that storage (a Linear's bias gradient is `sum(0, keepdim=True).view(n)`: an (n,) tensor over a (1, n) array
    # whose tensor is gone): the storage keeps the array in this tensor's shape from now on, as a write of the whole
    # tensor would, so that its next reads take the whole-array path (an optimizer step reads each gradient three
    # times; each read was a reshape). The bytes are the same. While another tensor views the storage (`x` and
    # `x.view(-1)` both read in a loop), the array stays as it is: reads of both would each reshape it back.
    if (not conj and not neg and base.dtype == dtype and t.numel() > 0 and _covers_whole(t, nbytes)
            and not _executor.capturing() and _sole_tensor(t)):
        _C._set_array(t, value, t.dtype)
    return value


def read_for_host(t: torch.Tensor, reason: str) -> Any:
    """The value of tpu tensor `t` as a computed device array, for a read on the host (a synchronization point:
    `.cpu()`, `.item()`; `reason` names it). Under DEFER_AND_FUSE a view (or a lazy bit) is not recorded: its
    storage's array is computed (the graph holding it runs, or the direct one-op segment that made it ends, as a
    read of the whole would), then the view is read now. Recording the read, only to run it at once, cost a flush
    around the same program (`x[1, 2].item()` took 1.8-2.3x DEFER_NEVER's time) and made sync-heavy code that reads
    views record every op (`(x + y)[0].cpu()`: a graph of two ops each time, never a one-op segment)."""
    arr = _C._array(t)
    if arr is None and _executor.recording() and not _executor.capturing():  # (a capture records the read)
        base = _C._storage_array(t)[0]
        if base is not None:
            _executor.concrete(base, reason)
            with _executor.eagerly():
                return read(t)
    return _executor.concrete(arr if arr is not None else read(t), reason)


def _covers_whole(t: torch.Tensor, nbytes: int) -> bool:
    """`t` is its storage's every byte, in order: offset 0, contiguous, numel * element size == the storage's
    `nbytes` (a write of it replaces the storage's array; a read of it may keep its own shape as the array's)."""
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == nbytes


def _sole_tensor(t: torch.Tensor) -> bool:
    """No other tensor (nor a view's `_base`) holds `t`'s storage: its C++ references are `t`'s own and the one of
    its Python storage object, which `untyped_storage()` makes here or finds alive (others holding that same object,
    as a captured graph holds its static storages, add none)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2


def write(t: torch.Tensor, value: Any) -> None:
    """Writes `value` (t's shape; cast to t's dtype) into tpu tensor `t`, through its storage (a conjugate or
    negative view stores the conjugate/negation, so that `t` then reads as `value`)."""
    dtype = _runtime.jax_dtype(t.dtype)
    base, nbytes, index = _C._storage_array(t)
    conj, neg = t.is_conj(), t.is_neg()
    if _covers_whole(t, nbytes):
        if value.dtype != dtype or tuple(value.shape) != tuple(t.shape) or conj or neg:
            value = _caster(tuple(t.shape), dtype, conj, neg)(value)
        _C._set_array(t, value, t.dtype)
        return
    if base is None:
        base = _zeros_base(nbytes, dtype, index)
    new = _writer(base.shape, base.dtype, dtype, _geometry(t), conj, neg)(base, value)
    _C._set_array(t, new, _runtime.torch_dtype(new.dtype))


def resize_array(base: Any, dtype: torch.dtype, old_nbytes: int, new_nbytes: int, index: int) -> tuple:
    """Callback of the C++ storage resize: the first min(old, new) bytes are kept, new bytes are zero."""
    base = _executor.concrete(base)  # a value DEFER_AND_FUSE has not computed yet
    jd = _runtime.jax_dtype(dtype)
    item = jnp.dtype(jd).itemsize
    if old_nbytes % item == 0 and new_nbytes % item == 0:
        flat = base.reshape(-1)
    else:
        flat, jd, item = _to_bytes(base), jnp.uint8, 1
        dtype = torch.uint8
    n_old, n_new = old_nbytes // item, new_nbytes // item
    if n_new <= n_old:
        new = flat[:n_new]
    else:
        new = jnp.concatenate([flat, jnp.zeros((n_new - n_old,), jd)])
    new = jax.device_put(new, _runtime.device(index))
    return new, dtype, tuple(new.shape)
