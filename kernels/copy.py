"""Copies between devices and host, and reading scalars back: kernels written against torch tensors."""

from __future__ import annotations

import functools
from typing import Any

import torch

from torch_tpu import _C, _executor, _runtime, _storage
from torch_tpu._jax import jax, jnp
from torch_tpu._profiler import program_name
from torch_tpu.kernels.registry import direct


def _as_dtype(v: Any, dtype: Any) -> Any:
    """`v` converted to `dtype` as copy_ converts."""
    if jnp.issubdtype(v.dtype, jnp.complexfloating) and not jnp.issubdtype(dtype, jnp.complexfloating):
        v = jnp.real(v)  # torch discards the imaginary part (with a warning on CPU)
    return v.astype(dtype)


@functools.lru_cache(maxsize=1024)
def _convert(shape: tuple[int, ...], dtype: Any) -> Any:
    """Cast to `dtype` and broadcast to `shape`, as copy_ does."""

    def convert(v: Any) -> Any:
        return jnp.broadcast_to(_as_dtype(v, dtype), shape)

    return _executor.jitted(convert, key=(shape, dtype))


def _value_for(dst: torch.Tensor, src: torch.Tensor) -> Any:
    index = dst.device.index
    if src.device.type == "tpu":
        val = _storage.read(src)  # its value: lazy conjugate/negative bits applied (and dst's by write)
        if src.device.index != index:
            val = jax.device_put(_executor.concrete(val, "transfer"), _runtime.device(index))
    else:
        if src.numel() and _executor.capturing():  # (an empty copy carries no value to keep)
            raise RuntimeError(
                f"torch_tpu: copy_ from {src.device} to {dst.device} (shape {list(src.shape)}, {src.dtype}) while a "
                "tpu graph is being captured: the graph would keep this host value in every replay. Copy host "
                "data into a static tpu tensor before replay() instead (CUDA graphs reject this copy too)."
            )
        val = _runtime.upload(src, index)
    dtype = _runtime.jax_dtype(dst.dtype)
    shape = tuple(dst.shape)
    if tuple(val.shape) == shape:
        if val.dtype == dtype:
            return val
        return _convert(shape, dtype)(val)  # (a cast, as x.to(torch.bfloat16): no broadcast to check)
    try:
        torch.broadcast_shapes(tuple(src.shape), shape)  # (PyTorch's Python reference: about 30 us)
    except RuntimeError:
        raise RuntimeError(
            f"The size of tensor a ({list(shape)}) must match the size of tensor b ({list(src.shape)}) "
            f"(copy_ from {src.device} to {dst.device})"
        ) from None
    return _convert(shape, dtype)(val)


def _cast(self: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """aten::_to_copy of a contiguous tpu tensor to another dtype on its own device (runtime/TpuCast.cpp calls it
    for that form; every other form runs ATen's composite: empty_like, then copy_ above). The same value as that
    composite: `self` read with its lazy conjugate/negative bits applied, converted as copy_ converts, in a new
    contiguous tensor. Deferrable: under DEFER_AND_FUSE the conversion is recorded."""
    val = _storage.read(self)
    return _C._wrap(_convert(tuple(self.shape), _runtime.jax_dtype(dtype))(val), dtype, self.device.index)


def _cast_program(dtype: torch.dtype) -> Any:
    """The jitted conversion of an array to `dtype` (any shape), which runtime/TpuCast.cpp calls itself under
    DEFER_NEVER for a tensor viewing its whole computed array: `_cast`'s value for that case, without its Python
    frames. Its executables are kept in the compile cache like an eager op's (a warm start loads them)."""
    from torch_tpu import compile_cache

    try:
        want = _runtime.jax_dtype(dtype)
    except Exception:  # noqa: BLE001  (a dtype tpu does not hold: `_cast` gives its error)
        return None

    def cast(v: Any) -> Any:
        return _as_dtype(v, want)

    cast.__name__ = program_name("_to_copy")  # the XLA program's name, as an eager op's
    return compile_cache.persistent_jit(cast, repr(("eager-cast", str(dtype))))


def _to_host(self: torch.Tensor, reason: str = "to_cpu") -> torch.Tensor:
    """A CPU tensor of its own with the values of tpu tensor `self` (its dtype and shape). aten::_to_copy of a
    contiguous tpu tensor to the CPU with its dtype is this call (runtime/TpuCast.cpp): the download itself is the
    result, not copied once more into an empty CPU tensor as ATen's composite would; copy_ to the host casts and
    broadcasts from it. A synchronization point."""
    out = _runtime.download(_storage.read_for_host(self, reason))
    if out.dtype != self.dtype or out.shape != self.shape:  # (not expected: then exactly what copy_ gives)
        return torch.empty(self.shape, dtype=self.dtype).copy_(out)
    return out


# (as the deferrable direct kernels are installed: under DEFER_NEVER_AND_LAUNCH_BLOCKING the cast is waited for;
# the C++ kernel reads a computed whole array to the host itself, through `host_array`, and calls `_to_host` else)
CASTS = (_executor.blocking_after(_cast), _to_host, _runtime.host_array, _cast_program)
_C._set_casts(*CASTS)


@direct("copy_", defer=True)
def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if self.device.type == "tpu":
        _storage.write(self, _value_for(self, src))
    elif src.device.type == "tpu":
        # To the host (or another backend): fetch, then let that device's copy_ cast and broadcast.
        self.copy_(_to_host(src))
    else:
        raise RuntimeError(f"torch_tpu: copy_ from {src.device} to {self.device} reached the tpu backend")
    return self


@direct("_copy_from", defer=True)
def _copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return copy_(dst, self, non_blocking)


@direct("_copy_from_and_resize", defer=True)
def _copy_from_and_resize(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    dst.resize_(self.shape)
    return copy_(dst, self)


def _item_host(self: torch.Tensor) -> torch.Tensor:
    """The one-element CPU tensor aten::_local_scalar_dense (.item(), runtime/TpuCast.cpp) takes its number from,
    where the kernel does not read the array itself (a placeholder, a view, a lazy bit). As copy_ to the host: under
    DEFER_AND_FUSE the graph holding the storage's value runs, not every graph of the thread, then a view is read
    eagerly (_storage.read_for_host), and no boundary flush is paid by sync-heavy code."""
    return _to_host(self, "item")


_C._set_item(_item_host)


@direct("record_stream", defer=True)
def record_stream(self: torch.Tensor, s: Any) -> None:
    """Nothing to do: PJRT frees a device array only once the programs using it are done, whatever stream issued
    them (docs/user_guide.md, "Streams and events"); CUDA needs it because its allocator reuses memory per
    stream."""
    return None
