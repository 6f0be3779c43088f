"""Fused LayerNorm and RMSNorm: Pallas TPU kernels, forward and backward, sharing one `@lower` entry per ATen op
with the XLA reference paths in kernels/nn/normalization.py.

The ops: `native_layer_norm` / `native_layer_norm_backward` (F.layer_norm, nn.LayerNorm) and `_fused_rms_norm` /
`_fused_rms_norm_backward` (ATen's rms_norm calls `_fused_rms_norm` on every device that has a kernel for it, so
F.rms_norm / nn.RMSNorm on tpu land here, with autograd's formula calling the backward op; channels-last, complex
and mixed-dtype inputs take ATen's composite instead, on CPU and CUDA alike).

Each kernel sees the input as rows (M, N): N = prod(normalized_shape) elements on the lanes, a grid over blocks of
rows. Statistics are float32 inside the kernel whatever the input dtype (float32 or bfloat16); the forward writes
mean/rstd per row, which the backward reads, as ATen's ops do. The backward writes grad_input per row block and
each block's partial sums of grad_weight/grad_bias (G, 1, N), which XLA adds up: no block waits for another.

`fits` is the kernel's shape rule: N a multiple of 128 lanes; M a multiple of a row block (8 rows for float32, 16
for bfloat16, up to 512) whose blocks fit the VMEM budget; float32 or bfloat16 operands. Anything else, and every
platform other than a TPU, runs the reference (kernels/pallas/_select.py). Tests run the kernels in Pallas
interpret mode on CPU against the reference and CPU PyTorch (tests/test_pallas_norms.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels.nn import normalization as ref
from torch_tpu.kernels.nn._common import _masked
from torch_tpu.kernels.pallas import _select
from torch_tpu.kernels.registry import lower

LANES = 128
ROW_BLOCKS = (512, 256, 128, 64, 32, 16, 8)
# Bytes of VMEM one grid step's blocks may take (inputs and outputs double-buffered, float32 temporaries), below
# the default scoped VMEM limit of every TPU generation (16 MiB on v5e).
VMEM_BUDGET = 12 * 2**20


def _dtype_ok(*arrays: Any) -> bool:
    return all(a is None or a.dtype in (jnp.float32, jnp.bfloat16) for a in arrays)


def row_block(rows: int, n: int, itemsize: int, streams: int) -> int | None:
    """The largest row block (a multiple of the dtype's sublane tile) dividing `rows` whose VMEM use fits, or None.
    `streams`: how many (rows, n) arrays of the input's dtype a grid step reads and writes."""
    min_rows = 8 * max(1, 4 // itemsize)
    for br in ROW_BLOCKS:
        step_bytes = br * n * (2 * streams * itemsize + 4 * 4)  # double-buffered blocks + float32 temporaries
        if br >= min_rows and rows % br == 0 and step_bytes <= VMEM_BUDGET:
            return br
    return None


def fits(input: Any, axis: int, *params: Any, streams: int) -> bool:
    """Whether the kernel's constraints hold for `input` normalised over dims axis..: see the module doc."""
    n = math.prod(input.shape[axis:])
    rows = math.prod(input.shape[:axis])
    return (_dtype_ok(input, *params) and n > 0 and n % LANES == 0 and rows > 0
            and row_block(rows, n, input.dtype.itemsize, streams) is not None)


def _call(kernel: Callable[..., None], grid_rows: int, br: int, inputs: Sequence[tuple[Any, str]],
          outputs: Sequence[tuple[tuple[int, ...], Any, str]], interpret: bool) -> list[Any]:
    """One pallas_call over row blocks. Inputs and outputs are (array | shape+dtype, kind), kind: "rows" (M, N),
    "stat" (M, 1) per-row values, "param" (1, N) the same block every step, "partial" (G, 1, N) one row per block."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def spec(kind: str, n: int) -> Any:
        if kind == "rows":
            return pl.BlockSpec((br, n), _int32_blocks(lambda i: (i, 0)))
        if kind == "stat":
            return pl.BlockSpec((br, 1), _int32_blocks(lambda i: (i, 0)))
        if kind == "param":
            return pl.BlockSpec((1, n), _int32_blocks(lambda i: (0, 0)))
        return pl.BlockSpec((1, 1, n), _int32_blocks(lambda i: (i, 0, 0)))

    return pl.pallas_call(
        kernel,
        grid=(grid_rows // br,),
        in_specs=[spec(kind, a.shape[-1]) for a, kind in inputs],
        out_specs=[spec(kind, shape[-1]) for shape, _, kind in outputs],
        out_shape=[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype, _ in outputs],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(*(a for a, _ in inputs))


def _int32_blocks(index_map: Callable[..., tuple]) -> Callable[..., tuple]:
    """`index_map` with every block index an int32: torch_tpu runs JAX with x64 on, where a Python 0 is an int64
    constant beside the int32 grid index, which Mosaic cannot compile ("failed to legalize operation
    'func.return' ... (i32, i64)", seen on a TPU v5e). Interpret mode on CPU accepts either."""
    return lambda *grid: tuple(jnp.asarray(b, jnp.int32) for b in index_map(*grid))


def _f32(ref_: Any) -> Any:
    return ref_[...].astype(jnp.float32)


# ---- LayerNorm ----


def _ln_fwd_kernel(*refs: Any, eps: float, has_w: bool, has_b: bool) -> None:
    it = iter(refs)
    x = _f32(next(it))
    w = _f32(next(it)) if has_w else None
    b = _f32(next(it)) if has_b else None
    y_ref, mean_ref, rstd_ref = it
    mean = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mean
    rstd = lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
    y = xc * rstd
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    y_ref[...] = y.astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def layer_norm_fwd(x: Any, weight: Any, bias: Any, eps: float, *, interpret: bool) -> tuple[Any, Any, Any]:
    """The forward kernel on rows x (M, N), weight/bias (N,) or None: (y (M, N) in x's dtype, mean and rstd (M, 1)
    float32)."""
    m, n = x.shape
    br = row_block(m, n, x.dtype.itemsize, 2)
    params = [(p.reshape(1, n), "param") for p in (weight, bias) if p is not None]
    kernel = functools.partial(_ln_fwd_kernel, eps=float(eps), has_w=weight is not None, has_b=bias is not None)
    y, mean, rstd = _call(kernel, m, br, [(x, "rows"), *params],
                          [((m, n), x.dtype, "rows"), ((m, 1), jnp.float32, "stat"), ((m, 1), jnp.float32, "stat")],
                          interpret)
    return y, mean, rstd


def _ln_bwd_kernel(*refs: Any, has_w: bool, mask: tuple[bool, bool, bool]) -> None:
    it = iter(refs)
    g, x, mean, rstd = _f32(next(it)), _f32(next(it)), _f32(next(it)), _f32(next(it))
    w = _f32(next(it)) if has_w else None
    xhat = (x - mean) * rstd
    if mask[0]:
        wg = g * w if w is not None else g
        dx = rstd * (wg - jnp.mean(wg, axis=-1, keepdims=True)
                     - xhat * jnp.mean(wg * xhat, axis=-1, keepdims=True))
        dx_ref = next(it)
        dx_ref[...] = dx.astype(dx_ref.dtype)
    if mask[1]:
        next(it)[...] = jnp.sum(g * xhat, axis=0, keepdims=True)[None]
    if mask[2]:
        next(it)[...] = jnp.sum(g, axis=0, keepdims=True)[None]


def layer_norm_bwd(g: Any, x: Any, mean: Any, rstd: Any, weight: Any, mask: Sequence[bool], *, interpret: bool
                   ) -> tuple[Any, Any, Any]:
    """The backward kernel on rows: g, x (M, N), mean/rstd (M, 1), weight (N,) or None; the outputs `mask` asks
    for (others None): grad_input (M, N) in x's dtype, grad_weight and grad_bias (N,) float32."""
    m, n = x.shape
    br = row_block(m, n, x.dtype.itemsize, 3)
    blocks = m // br
    mask = tuple(bool(v) for v in mask)
    inputs = [(g, "rows"), (x, "rows"), (mean.reshape(m, 1).astype(jnp.float32), "stat"),
              (rstd.reshape(m, 1).astype(jnp.float32), "stat")]
    if weight is not None:
        inputs.append((weight.reshape(1, n), "param"))
    outputs = [((m, n), x.dtype, "rows"), ((blocks, 1, n), jnp.float32, "partial"),
               ((blocks, 1, n), jnp.float32, "partial")]
    if not any(mask):
        return None, None, None
    kernel = functools.partial(_ln_bwd_kernel, has_w=weight is not None, mask=mask)
    got = iter(_call(kernel, m, br, inputs, [o for o, on in zip(outputs, mask) if on], interpret))
    dx = next(got) if mask[0] else None
    dw = jnp.sum(next(got), axis=(0, 1)) if mask[1] else None
    db = jnp.sum(next(got), axis=(0, 1)) if mask[2] else None
    return dx, dw, db


@lower("native_layer_norm")
def native_layer_norm(input: Any, normalized_shape: Sequence[int], weight: Any, bias: Any, eps: float
                      ) -> tuple[Any, Any, Any]:
    axis = ref.layer_norm_check(input, normalized_shape, weight, bias)
    chosen = _select.path("layer_norm", fits(input, axis, weight, bias, streams=2))
    if chosen == "reference":
        return ref.layer_norm_reference(input, normalized_shape, weight, bias, eps)
    n = math.prod(normalized_shape)
    y, mean, rstd = layer_norm_fwd(input.reshape(-1, n), weight, bias, eps, interpret=_select.interpret(chosen))
    stat_shape = input.shape[:axis] + (1,) * len(normalized_shape)
    stat = ref.layer_norm_stat_dtype(input, weight, bias)
    return y.reshape(input.shape), mean.reshape(stat_shape).astype(stat), rstd.reshape(stat_shape).astype(stat)


@lower("native_layer_norm_backward")
def native_layer_norm_backward(
    grad_out: Any, input: Any, normalized_shape: Sequence[int], mean: Any, rstd: Any, weight: Any, bias: Any,
    output_mask: Sequence[bool],
) -> tuple[Any, Any, Any]:
    axis = ref.norm_axis("layer_norm_backward", input, normalized_shape)
    chosen = _select.path("layer_norm_backward",
                          fits(input, axis, grad_out, weight, bias, streams=3) and grad_out.shape == input.shape)
    if chosen == "reference":
        return ref.layer_norm_backward_reference(grad_out, input, normalized_shape, mean, rstd, weight, bias,
                                                 output_mask)
    n = math.prod(normalized_shape)
    dx, dw, db = layer_norm_bwd(grad_out.reshape(-1, n), input.reshape(-1, n), mean, rstd, weight, output_mask,
                                interpret=_select.interpret(chosen))
    wdtype = ref.layer_norm_param_dtype(input, weight, bias)
    return _masked(output_mask,
                   dx.reshape(input.shape) if dx is not None else None,
                   dw.reshape(normalized_shape).astype(wdtype) if dw is not None else None,
                   db.reshape(normalized_shape).astype(wdtype) if db is not None else None)


# ---- RMSNorm ----


def _rms_fwd_kernel(*refs: Any, eps: float, has_w: bool) -> None:
    it = iter(refs)
    x = _f32(next(it))
    w = _f32(next(it)) if has_w else None
    y_ref, rstd_ref = it
    rstd = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    y = x * rstd
    if w is not None:
        y = y * w
    y_ref[...] = y.astype(y_ref.dtype)
    rstd_ref[...] = rstd


def rms_norm_fwd(x: Any, weight: Any, eps: float, *, interpret: bool) -> tuple[Any, Any]:
    """The forward kernel on rows x (M, N), weight (N,) or None: (y (M, N) in x's dtype, rstd (M, 1) float32)."""
    m, n = x.shape
    br = row_block(m, n, x.dtype.itemsize, 2)
    params = [(weight.reshape(1, n), "param")] if weight is not None else []
    kernel = functools.partial(_rms_fwd_kernel, eps=float(eps), has_w=weight is not None)
    y, rstd = _call(kernel, m, br, [(x, "rows"), *params],
                    [((m, n), x.dtype, "rows"), ((m, 1), jnp.float32, "stat")], interpret)
    return y, rstd


def _rms_bwd_kernel(*refs: Any, n: int, has_w: bool, mask: tuple[bool, bool]) -> None:
    it = iter(refs)
    g, x, rstd = _f32(next(it)), _f32(next(it)), _f32(next(it))
    w = _f32(next(it)) if has_w else None
    xhat = x * rstd
    if mask[0]:
        gxh = g * w if w is not None else g
        dx = (gxh - xhat * (jnp.sum(xhat * gxh, axis=-1, keepdims=True) / n)) * rstd
        dx_ref = next(it)
        dx_ref[...] = dx.astype(dx_ref.dtype)
    if mask[1]:
        next(it)[...] = jnp.sum(g * xhat, axis=0, keepdims=True)[None]


def rms_norm_bwd(g: Any, x: Any, rstd: Any, weight: Any, mask: Sequence[bool], *, interpret: bool
                 ) -> tuple[Any, Any]:
    """The backward kernel on rows: g, x (M, N), rstd (M, 1), weight (N,) or None; the outputs `mask` asks for
    (others None; grad_weight only with a weight): grad_input (M, N) in x's dtype, grad_weight (N,) float32."""
    m, n = x.shape
    br = row_block(m, n, x.dtype.itemsize, 3)
    mask = (bool(mask[0]), bool(mask[1]) and weight is not None)
    if not any(mask):
        return None, None
    inputs = [(g, "rows"), (x, "rows"), (rstd.reshape(m, 1).astype(jnp.float32), "stat")]
    if weight is not None:
        inputs.append((weight.reshape(1, n), "param"))
    outputs = [((m, n), x.dtype, "rows"), ((m // br, 1, n), jnp.float32, "partial")]
    kernel = functools.partial(_rms_bwd_kernel, n=n, has_w=weight is not None, mask=mask)
    got = iter(_call(kernel, m, br, inputs, [o for o, on in zip(outputs, mask) if on], interpret))
    dx = next(got) if mask[0] else None
    dw = jnp.sum(next(got), axis=(0, 1)) if mask[1] else None
    return dx, dw


@lower("_fused_rms_norm")
def _fused_rms_norm(input: Any, normalized_shape: Sequence[int], weight: Any, eps: float | None) -> tuple[Any, Any]:
    axis = ref.rms_norm_check(input, normalized_shape, weight)
    chosen = _select.path("rms_norm", fits(input, axis, weight, streams=2))
    if chosen == "reference":
        return ref.rms_norm_reference(input, normalized_shape, weight, eps)
    n = math.prod(normalized_shape)
    y, rstd = rms_norm_fwd(input.reshape(-1, n), weight, ref.rms_norm_eps(input, eps),
                           interpret=_select.interpret(chosen))
    return y.reshape(input.shape), rstd.reshape(input.shape[:axis] + (1,) * len(normalized_shape))


@lower("_fused_rms_norm_backward")
def _fused_rms_norm_backward(
    grad_out: Any, input: Any, normalized_shape: Sequence[int], rstd: Any, weight: Any, output_mask: Sequence[bool],
) -> tuple[Any, Any]:
    axis = ref.norm_axis("rms_norm_backward", input, normalized_shape)
    chosen = _select.path("rms_norm_backward",
                          fits(input, axis, grad_out, weight, streams=3) and grad_out.shape == input.shape)
    if chosen == "reference":
        return ref.rms_norm_backward_reference(grad_out, input, normalized_shape, rstd, weight, output_mask)
    n = math.prod(normalized_shape)
    dx, dw = rms_norm_bwd(grad_out.reshape(-1, n), input.reshape(-1, n), rstd, weight, output_mask,
                          interpret=_select.interpret(chosen))
    return (dx.reshape(input.shape) if dx is not None else None,
            dw.reshape(normalized_shape).astype(input.dtype) if dw is not None else None)
