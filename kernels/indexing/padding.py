"""Padding: constant_pad_nd and the reflection / replication pads (by gather) with their generated lowerings,
and the pads' backward kernels (the gather's transpose, a scatter-add, by jax.vjp)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels.registry import lower


# ---- padding ----

def _check_pad_length(pad: Sequence[int], ndim: int) -> None:
    if len(pad) % 2:
        raise RuntimeError(f"Length of pad must be even but instead it equals {len(pad)}")
    if len(pad) // 2 > ndim:
        raise RuntimeError(
            "Length of pad should be no more than twice the number of dimensions of the input. "
            f"Pad length is {len(pad)}while the input has {ndim}dimensions."
        )


@lower("constant_pad_nd")
def constant_pad_nd(self: Any, pad: Sequence[int], value: Any = 0) -> Any:
    _check_pad_length(pad, self.ndim)
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        d = self.ndim - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        # PyTorch crops negative pads with narrow() first, which raises before its own size check.
        cropped = self.shape[d] + min(lo, 0)
        if cropped < 0 or cropped + min(hi, 0) < 0:
            raise RuntimeError("narrow(): length must be non-negative.")
        config[d] = (lo, hi, 0)
    fill = jnp.asarray(value).astype(self.dtype)
    if any(s == 0 for s in self.shape):
        shape = [s + c[0] + c[1] for s, c in zip(self.shape, config)]
        return jnp.full(shape, fill, self.dtype)
    return lax.pad(self, fill, config)


def _pad_by_gather(self: Any, padding: Sequence[int], kind: str, nd: int) -> Any:
    """Reflection / replication padding of the last `nd` dims (negative pads crop): one static gather per
    padded dim."""
    batched = self.ndim == nd + 2
    if self.ndim not in (nd + 1, nd + 2) or any(s == 0 for s in self.shape[int(batched):]):
        dims = {1: "2D or 3D", 2: "3D or 4D", 3: "4D or 5D"}[nd]
        raise RuntimeError(
            f"Expected {dims} (batch mode) tensor with possibly 0 batch size and other non-zero dimensions for "
            f"input, but got: {list(self.shape)}"
        )
    if len(padding) != 2 * nd:
        raise RuntimeError(f"padding size is expected to be {2 * nd}, but got: {len(padding)}")
    out_shape = list(self.shape)
    for i in range(nd):
        d = self.ndim - 1 - i
        lo, hi = padding[2 * i], padding[2 * i + 1]
        n = self.shape[d]
        if kind == "reflect" and (lo >= n or hi >= n):
            raise RuntimeError(
                f"Argument #{4 + 2 * i}: Padding size should be less than the corresponding input dimension, but "
                f"got: padding ({lo}, {hi}) at dimension {d} of input {list(self.shape)}"
            )
        out_shape[d] = n + lo + hi
        if nd == 1 and out_shape[d] < 1:
            raise RuntimeError(f"input (W: {n}) is too small. Calculated output W: {out_shape[d]}")
    bad = [m for m in out_shape if m < 0]
    if bad:
        raise RuntimeError(f"Trying to create tensor with negative dimension {bad[0]}: {out_shape}")
    x = self
    for i in range(nd):
        d = self.ndim - 1 - i
        lo, hi = padding[2 * i], padding[2 * i + 1]
        if lo == 0 and hi == 0:
            continue
        n = self.shape[d]
        src = np.arange(n + lo + hi) - lo
        if kind == "reflect":
            src = (n - 1) - np.abs((n - 1) - np.abs(src))
        else:
            src = np.clip(src, 0, n - 1)
        x = jnp.take(x, jnp.asarray(src, jnp.int32), axis=d)
    return x


def _pad_lowering(name: str, kind: str, nd: int) -> None:
    def pad(self: Any, padding: Sequence[int]) -> Any:
        return _pad_by_gather(self, padding, kind, nd)

    pad.__name__ = pad.__qualname__ = name
    pad.__doc__ = f"aten::{name}: {kind} padding of the last {nd} dim(s)."
    lower(name)(pad)


def _pad_backward_lowering(name: str, kind: str, nd: int) -> None:
    def pad_backward(grad_output: Any, self: Any, padding: Sequence[int]) -> Any:
        out, vjp = jax.vjp(lambda x: _pad_by_gather(x, padding, kind, nd), self)
        if tuple(grad_output.shape) != tuple(out.shape):
            raise RuntimeError(
                f"{name}: grad_output has shape {list(grad_output.shape)} but the padded input has shape "
                f"{list(out.shape)} (padding {list(padding)}, input {list(self.shape)})"
            )
        return vjp(grad_output.astype(out.dtype))[0]

    pad_backward.__name__ = pad_backward.__qualname__ = name
    pad_backward.__doc__ = f"aten::{name}: gradient of {kind} padding of the last {nd} dim(s) (overlaps summed)."
    lower(name)(pad_backward)


for _nd in (1, 2, 3):
    _pad_lowering(f"reflection_pad{_nd}d", "reflect", _nd)
    _pad_lowering(f"replication_pad{_nd}d", "edge", _nd)
    _pad_backward_lowering(f"reflection_pad{_nd}d_backward", "reflect", _nd)
    _pad_backward_lowering(f"replication_pad{_nd}d_backward", "edge", _nd)
