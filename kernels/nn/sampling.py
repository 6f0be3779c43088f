"""Grid sampling (F.grid_sample: grid_sampler_2d / grid_sampler_3d) and its backward ops (the JAX VJP of the
forward lowering). Coordinates are unnormalized and padded as ATen's GridSampler.h does; each tap is a gather
per batch element, so the VJP scatters into the input and differentiates the weights for the grid."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from torch_tpu._jax import jax, jnp
from torch_tpu.kernels.registry import lower

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _unnormalize(c: Any, size: int, align_corners: bool, vectorized: bool) -> Any:
    """Grid coordinate in [-1, 1] -> pixel coordinate. `vectorized`: the operation order of ATen's vectorized 2-d
    kernel, else of its scalar 3-d kernel; both compute in the input's dtype, so bfloat16 rounds as on CPU."""
    if vectorized:
        return (c + 1) * ((size - 1) / 2) if align_corners else (c + 1) * (size / 2) - 0.5
    return (c + 1) / 2 * (size - 1) if align_corners else ((c + 1) * size - 1) / 2


def _reflect(c: Any, twice_low: int, twice_high: int, vectorized: bool) -> Any:
    if twice_low == twice_high:
        return jnp.zeros_like(c)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    if vectorized:  # ATen's vectorized form: fold |c - low| into [0, 2 span), then mirror the upper half
        a = jnp.abs(c - low)
        extra = a - jnp.trunc(a / (2 * span)) * (2 * span)
        return jnp.minimum(extra, 2 * span - extra) + low
    c = jnp.abs(c - low)
    extra = jnp.fmod(c, span)
    flips = jnp.floor(c / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _pad_coordinates(c: Any, size: int, padding_mode: int, align_corners: bool, vectorized: bool) -> Any:
    """ATen's compute_coordinates: clip (border) or reflect then clip (reflection); zeros leaves c as it is."""
    if padding_mode == _BORDER:
        return jnp.clip(c, 0, size - 1)
    if padding_mode == _REFLECTION:
        if align_corners:
            c = _reflect(c, 0, 2 * (size - 1), vectorized)
        else:
            c = _reflect(c, -1, 2 * size - 1, vectorized)
        return jnp.clip(c, 0, size - 1)
    return c


def _gather(x: Any, idx: Sequence[Any]) -> Any:
    """x (N, C, *sizes) read at integer positions idx[j] (N, *out) per spatial dim; out of bounds reads 0."""
    n, c = x.shape[:2]
    sizes = x.shape[2:]
    valid = jnp.ones(idx[0].shape, bool)
    flat = jnp.zeros(idx[0].shape, jnp.int32)
    stride = 1
    for j in reversed(range(len(sizes))):
        i = idx[j].astype(jnp.int32)
        valid = valid & (i >= 0) & (i < sizes[j])
        flat = flat + jnp.clip(i, 0, sizes[j] - 1) * stride
        stride *= sizes[j]
    out_shape = idx[0].shape[1:]
    vals = jax.vmap(lambda xb, ib: xb[:, ib])(x.reshape(n, c, -1), flat.reshape(n, -1))
    vals = vals.reshape((n, c) + out_shape)
    return jnp.where(valid[:, None], vals, 0)


def _cubic(t: Any) -> list[Any]:
    """The four cubic convolution weights (A = -0.75) of taps at offsets -1, 0, 1, 2 from floor."""
    a = -0.75

    def near(v: Any) -> Any:
        return ((a + 2) * v - (a + 3)) * v * v + 1

    def far(v: Any) -> Any:
        return ((a * v - 5 * a) * v + 8 * a) * v - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _grid_sample(input: Any, grid: Any, interpolation_mode: int, padding_mode: int, align_corners: bool) -> Any:
    """In the input's dtype with ATen's operation order (the 2-d vectorized kernel, the 3-d scalar one), so that
    bfloat16 rounds as CPU's kernels do."""
    x = input
    g = grid.astype(x.dtype)
    nd = x.ndim - 2
    vec = nd == 2
    sizes = x.shape[2:]
    # grid[..., 0] indexes the last spatial dim (W), grid[..., 1] the one before (H), ...
    coords = [_unnormalize(g[..., nd - 1 - j], sizes[j], align_corners, vec) for j in range(nd)]
    if interpolation_mode == _BICUBIC:
        # (2-d only) four rows interpolated along W, then those four along H, as ATen's vectorized kernel.
        base = [jnp.floor(c) for c in coords]
        wy, wx = (_cubic(c - b) for c, b in zip(coords, base))
        cols = [jnp.trunc(_pad_coordinates(base[1] - 1 + k, sizes[1], padding_mode, align_corners, vec))
                for k in range(4)]
        out = 0
        for i in range(4):
            row = jnp.trunc(_pad_coordinates(base[0] - 1 + i, sizes[0], padding_mode, align_corners, vec))
            along = 0
            for k in range(4):
                along = along + wx[k][:, None] * _gather(x, [row, cols[k]])
            out = out + wy[i][:, None] * along
        return out
    coords = [_pad_coordinates(c, s, padding_mode, align_corners, vec) for c, s in zip(coords, sizes)]
    if interpolation_mode == _NEAREST:
        return _gather(x, [jnp.round(c) for c in coords])
    base = [jnp.floor(c) for c in coords]
    if vec:  # distances to the lower / upper neighbour: f and 1 - f; weights multiply H's then W's
        lo = [c - b for c, b in zip(coords, base)]
        parts = [(1 - f, f) for f in lo]
        order = list(range(nd))
    else:  # (floor + 1 - c) and (c - floor); weights multiply W's, H's, then D's
        parts = [((b + 1) - c, c - b) for c, b in zip(coords, base)]
        order = list(reversed(range(nd)))
    out = 0
    for corner in itertools.product((0, 1), repeat=nd):
        w = None
        for j in order:
            p = parts[j][corner[j]]
            w = p if w is None else w * p
        out = out + _gather(x, [b + bit for b, bit in zip(base, corner)]) * w[:, None]
    return out


def _check_grid_sampler(name: str, input: Any, grid: Any, interpolation_mode: int, padding_mode: int) -> None:
    nd = 2 if name.endswith("2d") else 3
    if input.ndim != nd + 2 or grid.ndim != nd + 2:
        raise RuntimeError(f"grid_sampler(): expected {nd + 2}D input and grid with same number of dimensions, but "
                           f"got input with sizes {list(input.shape)} and grid with sizes {list(grid.shape)}")
    if input.shape[0] != grid.shape[0]:
        raise RuntimeError(f"grid_sampler(): expected grid and input to have same batch size, but got input with "
                           f"sizes {list(input.shape)} and grid with sizes {list(grid.shape)}")
    if grid.shape[-1] != nd:
        raise RuntimeError(f"grid_sampler(): expected grid to have size {nd} in last dimension, but got grid with "
                           f"sizes {list(grid.shape)}")
    if any(s == 0 for s in input.shape[2:]):
        raise RuntimeError(f"grid_sampler(): expected input to have non-empty spatial dimensions, but input has "
                           f"sizes {list(input.shape)} with dimension {input.shape.index(0)} being empty")
    if interpolation_mode == _BICUBIC and nd != 2:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    if interpolation_mode not in (_BILINEAR, _NEAREST, _BICUBIC) or padding_mode not in (_ZEROS, _BORDER,
                                                                                          _REFLECTION):
        raise RuntimeError(f"{name}: unknown interpolation mode {interpolation_mode} or padding mode {padding_mode}")


@lower("grid_sampler_2d", "grid_sampler_3d")
def grid_sampler(input: Any, grid: Any, interpolation_mode: int, padding_mode: int, align_corners: bool) -> Any:
    """F.grid_sample: input (N, C, *in) sampled at grid (N, *out, nd) in [-1, 1] coordinates."""
    _check_grid_sampler("grid_sampler_3d" if input.ndim == 5 else "grid_sampler_2d", input, grid,
                        interpolation_mode, padding_mode)
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


@lower("grid_sampler_2d_backward", "grid_sampler_3d_backward")
def grid_sampler_backward(
    grad_output: Any, input: Any, grid: Any, interpolation_mode: int, padding_mode: int, align_corners: bool,
    output_mask: Sequence[bool],
) -> tuple[Any, Any]:
    """(grad_input, grad_grid) by the VJP of the forward; grad_input undefined (None) when masked off, as ATen
    leaves it (ATen always computes grad_grid)."""
    f = lambda x, g: _grid_sample(x, g, interpolation_mode, padding_mode, align_corners)  # noqa: E731
    _, vjp = jax.vjp(f, input, grid.astype(input.dtype))
    gx, gg = vjp(grad_output.astype(input.dtype))
    return gx.astype(input.dtype) if output_mask[0] else None, gg.astype(grid.dtype)
