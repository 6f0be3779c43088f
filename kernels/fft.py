"""FFTs: the three ATen primitives every torch.fft function decomposes to (real->complex, complex->real,
complex->complex), on XLA's FFT."""

from __future__ import annotations

import math
from typing import Any, Sequence

from torch_tpu._jax import jnp
from torch_tpu.kernels.registry import lower

_NORM_NONE, _NORM_ROOT_N, _NORM_N = 0, 1, 2  # ATen's fft_norm_mode


def _scale(x: Any, n: int, normalization: int) -> Any:
    if normalization == _NORM_ROOT_N:
        return x / jnp.sqrt(jnp.asarray(n, dtype=x.real.dtype))
    if normalization == _NORM_N:
        return x / jnp.asarray(n, dtype=x.real.dtype)
    return x


def _complex_of(x: Any) -> Any:
    return jnp.complex128 if x.dtype == jnp.float64 or x.dtype == jnp.complex128 else jnp.complex64


def _axes(x: Any, dim: Sequence[int]) -> tuple[int, ...]:
    return tuple(d % x.ndim for d in dim)


@lower("_fft_r2c")
def fft_r2c(self: Any, dim: Sequence[int], normalization: int, onesided: bool) -> Any:
    axes = _axes(self, dim)
    x = self.astype(jnp.float64 if self.dtype == jnp.float64 else jnp.float32)
    out = jnp.fft.rfftn(x, axes=axes) if onesided else jnp.fft.fftn(x.astype(_complex_of(x)), axes=axes)
    n = math.prod(self.shape[a] for a in axes)
    return _scale(out, n, normalization).astype(_complex_of(x))


@lower("_fft_c2r")
def fft_c2r(self: Any, dim: Sequence[int], normalization: int, last_dim_size: int) -> Any:
    axes = _axes(self, dim)
    sizes = [self.shape[a] for a in axes]
    sizes[-1] = last_dim_size
    out = jnp.fft.irfftn(self, s=sizes, axes=axes, norm="forward")  # unscaled inverse
    real = jnp.float64 if self.dtype == jnp.complex128 else jnp.float32
    return _scale(out, math.prod(sizes), normalization).astype(real)


@lower("_fft_c2c")
def fft_c2c(self: Any, dim: Sequence[int], normalization: int, forward: bool) -> Any:
    axes = _axes(self, dim)
    if not axes:
        return self
    out = jnp.fft.fftn(self, axes=axes) if forward else jnp.fft.ifftn(self, axes=axes, norm="forward")
    n = math.prod(self.shape[a] for a in axes)
    return _scale(out, n, normalization).astype(self.dtype)
