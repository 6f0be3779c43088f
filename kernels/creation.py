"""Creation and filling: fill_, zero_, arange, and the random fills (normal_, uniform_) driven by the tpu
generator's (seed, offset) state."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from torch_tpu import _C, _runtime, _storage
from torch_tpu._jax import jax, jnp
from torch_tpu.kernels.registry import direct


def _on(index: int) -> Any:
    return jax.sharding.SingleDeviceSharding(_runtime.device(index))


@functools.lru_cache(maxsize=1024)
def _full(shape: tuple[int, ...], dtype: Any, index: int) -> Any:
    return jax.jit(lambda value: jnp.full(shape, value, dtype), out_shardings=_on(index))


def _fill_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise RuntimeError(
                f"fill_ only supports 0-dimension value tensor but got tensor with {value.dim()} dimensions."
            )
        return value.item()
    return value


@direct("fill_.Scalar", "fill_.Tensor")
def fill_(self: torch.Tensor, value: Any) -> torch.Tensor:
    dtype = _runtime.jax_dtype(self.dtype)
    _storage.write(self, _full(tuple(self.shape), dtype, self.device.index)(_fill_value(value)))
    return self


@direct("zero_")
def zero_(self: torch.Tensor) -> torch.Tensor:
    return fill_(self, 0)


@functools.lru_cache(maxsize=1024)
def _arange(n: int, dtype: Any, index: int, integral: bool) -> Any:
    def arange(start: Any, step: Any) -> Any:
        if integral:
            return (start + step * jnp.arange(n, dtype=jnp.int64)).astype(dtype)
        return (start + step * jnp.arange(n, dtype=jnp.float64)).astype(dtype)

    return jax.jit(arange, out_shardings=_on(index))


@direct("arange.start_out")
def arange_start_out(start: Any, end: Any, step: Any = 1, *, out: torch.Tensor) -> torch.Tensor:
    start, end, step = (v.item() if isinstance(v, torch.Tensor) else v for v in (start, end, step))
    if step == 0:
        raise RuntimeError("step must be nonzero")
    if not all(math.isfinite(float(v)) for v in (start, end)):
        raise RuntimeError(f"unsupported range: {start} -> {end}")
    if (step > 0 and start > end) or (step < 0 and start < end):
        raise RuntimeError("upper bound and larger bound inconsistent with step sign")
    integral = not out.dtype.is_floating_point and not out.dtype.is_complex
    if integral and all(isinstance(v, int) for v in (start, end, step)):
        n = (end - start + step - (1 if step > 0 else -1)) // step
    else:
        n = math.ceil((float(end) - float(start)) / float(step))
    n = max(int(n), 0)
    if tuple(out.shape) != (n,):
        out.resize_((n,))
    dtype = _runtime.jax_dtype(out.dtype)
    _storage.write(out, _arange(n, dtype, out.device.index, integral)(start, step))
    return out


# ---- random ----

def generator_for(generator: torch.Generator | None, t: torch.Tensor) -> torch.Generator:
    if generator is None:
        from torch_tpu import device_module

        return device_module.default_generators[t.device.index]
    if generator.device.type != "tpu":
        raise RuntimeError(
            f"Expected a 'tpu' device type for generator but found '{generator.device.type}'"
        )
    return generator


def _key(seed: Any, offset: Any) -> Any:
    key = jax.random.key(seed)
    key = jax.random.fold_in(key, (offset & 0xFFFFFFFF).astype(jnp.uint32))
    return jax.random.fold_in(key, (offset >> 32).astype(jnp.uint32))


def _sample_dtype(dtype: Any) -> Any:
    return dtype if dtype in (jnp.float32, jnp.float64) else jnp.float32


@functools.lru_cache(maxsize=1024)
def _normal(shape: tuple[int, ...], dtype: Any, index: int) -> Any:
    def normal(seed: Any, offset: Any, mean: Any, std: Any) -> Any:
        z = jax.random.normal(_key(seed, offset), shape, _sample_dtype(dtype))
        return (z * std + mean).astype(dtype)

    return jax.jit(normal, out_shardings=_on(index))


@functools.lru_cache(maxsize=1024)
def _uniform(shape: tuple[int, ...], dtype: Any, index: int) -> Any:
    def uniform(seed: Any, offset: Any, low: Any, high: Any) -> Any:
        u = jax.random.uniform(_key(seed, offset), shape, _sample_dtype(dtype))
        return (u * (high - low) + low).astype(dtype)

    return jax.jit(uniform, out_shardings=_on(index))


def _philox(generator: torch.Generator | None, t: torch.Tensor) -> tuple[Any, Any]:
    seed, offset = _C._philox_step(generator_for(generator, t), 1)
    return jnp.uint64(seed), jnp.uint64(offset)


def _check_float(op: str, t: torch.Tensor) -> None:
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise RuntimeError(f"{op} expects floating point dtypes, got {t.dtype}")


@direct("normal_")
def normal_(self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: Any = None) -> torch.Tensor:
    _check_float("normal_", self)
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    seed, offset = _philox(generator, self)
    fn = _normal(tuple(self.shape), _runtime.jax_dtype(self.dtype), self.device.index)
    _storage.write(self, fn(seed, offset, float(mean), float(std)))
    return self


@direct("uniform_")
def uniform_(self: torch.Tensor, from_: float = 0.0, to: float = 1.0, *, generator: Any = None) -> torch.Tensor:
    _check_float("uniform_", self)
    if from_ > to:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={from_} > to={to}")
    seed, offset = _philox(generator, self)
    fn = _uniform(tuple(self.shape), _runtime.jax_dtype(self.dtype), self.device.index)
    _storage.write(self, fn(seed, offset, float(from_), float(to)))
    return self
