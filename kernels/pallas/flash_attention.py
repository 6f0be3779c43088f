"""Flash attention for `F.scaled_dot_product_attention` on tpu (PyTorch's `overrideable` SDPA backend).

Routing, the way PyTorch intends for out-of-tree devices: ATen's SDPA composite asks `_fused_sdp_choice_stub`
which backend to run; runtime/TpuAttention.cpp registers its PrivateUse1 entry (and the `_fused_sdp_choice` op),
which calls `choose` here. `choose` answers OVERRIDEABLE where the fused op serves the call and MATH (PyTorch's
own math path, which materialises the L x S scores) where it does not, e.g. a mask that requires grad; it honours
`torch.nn.attention.sdpa_kernel` (OVERRIDEABLE / MATH enabled) and raises when neither can run.

The fused op is `_scaled_dot_product_fused_attention_overrideable` and its backward. The dispatcher has already
turned a bool mask into an additive float one (-inf where False); GQA/MQA arrive as key/value with fewer heads
(query head h reads key/value head h // (Hq // Hkv), as PyTorch's enable_gqa does). Two paths, chosen at trace
time by kernels/pallas/_select.path("flash_attention", fits):
- "tpu" / "interpret": jax.experimental.pallas.ops.tpu.flash_attention (the maintained Pallas TPU kernel), forward
  with its residuals and its backward kernels fed with our saved logsumexp (l = 1, m = logsumexp). It fits when
  there is no dropout, q/k/v are 4-D with equal head dims, and both sequence lengths are multiples of its blocks.
- "reference": a blocked XLA path (`_blocked_forward` / `_blocked_backward`): online softmax over key/value blocks
  in a lax.scan, never materialising L x S; the backward recomputes each block from the saved logsumexp.
Dropout draws a keep mask per key/value block from `key(seed, offset)` folded with the block index, so the
backward regenerates the same mask; (seed, offset) are the op's philox_seed/philox_offset outputs.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from torch_tpu import _C, _executor, _storage
from torch_tpu._jax import jax, jnp, lax
from torch_tpu._rng import draw as _philox, key as _rng_key
from torch_tpu.kernels.pallas import _select
from torch_tpu.kernels.registry import direct, lower

KERNEL = "flash_attention"
# The blocked XLA path's key/value block: scores live as L x KV_BLOCK per step (a 4k-token causal fwd+bwd on XLA:CPU:
# 128 gave 28 MiB of XLA temp and 1.06 s, 256 48 MiB and 1.18 s, 512 88 MiB and 1.64 s).
KV_BLOCK = 128
PALLAS_BLOCK = 128  # the Pallas kernel's q/k block (its MIN_BLOCK_SIZE); longer sequences use up to 512

_MATH = int(torch.nn.attention.SDPBackend.MATH)
_OVERRIDEABLE = int(torch.nn.attention.SDPBackend.OVERRIDEABLE)


# ---- the backend choice (called by runtime/TpuAttention.cpp for every SDPA call on tpu) ----

def _unfused_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    enable_gqa: bool) -> str | None:
    """Why the fused op cannot serve this call (None when it can)."""
    if q.is_nested or k.is_nested or v.is_nested:
        return "nested tensors"
    sub = next((type(t).__name__ for t in (q, k, v, mask) if t is not None and _subclass(t)), None)
    if sub is not None:  # DTensor has sharding rules for the math path's ops, none for the fused op
        return f"a tensor subclass ({sub})"
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        return f"query/key/value of {q.dim()}/{k.dim()}/{v.dim()} dims (the fused op takes 3-D or 4-D ones)"
    if not q.dtype.is_floating_point or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}"
    if q.dtype == torch.float64:
        return "float64 (the fused op keeps its logsumexp in float32, as its schema says)"
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        return "mismatched head dims or key/value lengths"
    if q.dim() == 4 and not (k.shape[0] == v.shape[0] == q.shape[0]):
        return "broadcast batch dims"
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk != hv or (hq != hk and not (enable_gqa and hq % hk == 0)):
        return f"head counts {hq}/{hk}/{hv} without enable_gqa grouping"
    if min(q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]) == 0:
        return "an empty dimension"
    if mask is not None:
        if mask.requires_grad:
            return "an attn_mask that requires grad (the fused backward gives no mask gradient)"
        if mask.dim() > 4:
            return f"a {mask.dim()}-D attn_mask"
        full = (*q.shape[:-1], k.shape[-2])
        try:
            if torch.broadcast_shapes(tuple(mask.shape), full) != torch.Size(full):
                return f"an attn_mask of shape {list(mask.shape)} that does not broadcast to {list(full)}"
        except RuntimeError:
            return f"an attn_mask of shape {list(mask.shape)} that does not broadcast to {list(full)}"
    return None


def _subclass(t: torch.Tensor) -> bool:
    """A tensor subclass such as DTensor (not the fake/functional tensors torch.compile traces with)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return not isinstance(t, (FakeTensor, FunctionalTensor))


def choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
           is_causal: bool, scale: float | None, enable_gqa: bool) -> int:
    """The SDPBackend (as an int) that scaled_dot_product_attention runs on tpu for these arguments."""
    reason = _unfused_reason(q, k, v, mask, enable_gqa)
    fused_on = torch._C._get_overrideable_sdp_enabled()
    math_on = torch._C._get_math_sdp_enabled()
    if reason is None and fused_on:
        return _OVERRIDEABLE
    if math_on:
        return _MATH
    why = (f"the fused tpu kernel cannot take {reason}" if reason is not None
           else "the OVERRIDEABLE backend (tpu's fused kernel) is disabled")
    raise RuntimeError(
        f"scaled_dot_product_attention on tpu (query {list(q.shape)} {q.dtype}): no viable backend: {why}, and "
        "the MATH backend is disabled. Enable SDPBackend.OVERRIDEABLE or SDPBackend.MATH in sdpa_kernel(...)")


_C._set_sdp_choice(choose)


# ---- shapes ----

def _as4(x: Any) -> Any:
    return x if x.ndim == 4 else x[None]


def _bias4(bias: Any) -> Any:
    return bias.reshape((1,) * (4 - bias.ndim) + bias.shape)


def _scale(scale: float | None, e: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(e)


def _acc(dtype: Any) -> Any:
    return jnp.float64 if dtype == jnp.float64 else jnp.float32  # (float64 reaches here only when called directly)


def _fits(q: Any, k: Any, v: Any, dropout_p: float) -> bool:
    if dropout_p > 0 or q.ndim != 4 or q.shape[-1] != v.shape[-1]:
        return False
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        return False
    return q.shape[2] % PALLAS_BLOCK == 0 and k.shape[2] % PALLAS_BLOCK == 0


def _block_of(n: int) -> int:
    return 512 if n % 512 == 0 else 256 if n % 256 == 0 else PALLAS_BLOCK


# ---- the blocked XLA path ----

def _prep(q: Any, k: Any, v: Any, bias: Any, block: int) -> tuple:
    """q as (B, Hkv, G, L, E); k, v as (nblocks, B, Hkv, blk, E) padded to whole blocks; bias as 5-D blocks along S
    (or None / unblocked when it broadcasts over S); the number of valid key columns."""
    b, hq, lq, e = q.shape
    hk, s = k.shape[1], k.shape[2]
    g = hq // hk
    blk = min(block, s)
    nb = -(-s // blk)
    pad = nb * blk - s
    if pad:
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    kb = k.reshape(b, hk, nb, blk, k.shape[-1]).transpose(2, 0, 1, 3, 4)
    vb = v.reshape(b, hk, nb, blk, v.shape[-1]).transpose(2, 0, 1, 3, 4)
    bb = None
    if bias is not None:
        b4 = _bias4(bias)
        h0 = b4.shape[1]
        b5 = b4.reshape(b4.shape[0], hk if h0 != 1 else 1, g if h0 != 1 else 1, b4.shape[2], b4.shape[3])
        if b5.shape[-1] != 1:
            if pad:
                b5 = jnp.pad(b5, ((0, 0),) * 4 + ((0, pad),))
            bb = b5.reshape(*b5.shape[:4], nb, blk).transpose(4, 0, 1, 2, 3, 5)
        else:
            bb = b5  # broadcast over S: the same for every block
    return q.reshape(b, hk, g, lq, e), kb, vb, bb, blk, nb, s


def _scores(qg: Any, kj: Any, j: Any, bj: Any, blk: int, s_valid: int, is_causal: bool, scale: float,
            acc: Any) -> Any:
    """Scaled (masked) scores of block j: (B, Hkv, G, L, blk) in the accumulation dtype."""
    sc = jnp.einsum("bhgle,bhse->bhgls", qg, kj, preferred_element_type=acc) * scale
    if bj is not None:
        sc = sc + bj.astype(acc)
    cols = j * blk + jnp.arange(blk)
    valid = cols < s_valid
    if is_causal:
        rows = jnp.arange(qg.shape[3])
        valid = valid[None, :] & (cols[None, :] <= rows[:, None])
    return jnp.where(valid, sc, -jnp.inf)


def _keep(key: Any, j: Any, shape: tuple, dropout_p: float) -> Any:
    return jax.random.uniform(jax.random.fold_in(key, j), shape, jnp.float32) >= dropout_p


def _bias_block(bb: Any, j: Any) -> Any:
    if bb is None or bb.ndim == 5:
        return bb
    return bb[j]


def _blocked_forward(q: Any, k: Any, v: Any, bias: Any, is_causal: bool, scale: float, dropout_p: float,
                     key: Any, block: int = KV_BLOCK) -> tuple[Any, Any]:
    """(out (B, Hq, L, Ev) in q's dtype, logsumexp (B, Hq, L) float32) by online softmax over key/value blocks."""
    acc = _acc(q.dtype)
    b, hq, lq, _ = q.shape
    qg, kb, vb, bb, blk, nb, s_valid = _prep(q, k, v, bias, block)
    hk, g, ev = qg.shape[1], qg.shape[2], vb.shape[-1]

    def step(carry: tuple, xs: tuple) -> tuple:
        m, l, o = carry
        j, kj, vj = xs
        sc = _scores(qg, kj, j, _bias_block(bb, j), blk, s_valid, is_causal, scale, acc)
        m_new = jnp.maximum(m, sc.max(-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(sc - m_safe[..., None])
        corr = jnp.exp(m - m_safe)
        l = l * corr + p.sum(-1)
        if dropout_p > 0:
            p = jnp.where(_keep(key, j, p.shape, dropout_p), p / (1 - dropout_p), 0.0)
        o = o * corr[..., None] + jnp.einsum("bhgls,bhse->bhgle", p.astype(vj.dtype), vj,
                                             preferred_element_type=acc)
        return (m_new, l, o), None

    init = (jnp.full((b, hk, g, lq), -jnp.inf, acc), jnp.zeros((b, hk, g, lq), acc),
            jnp.zeros((b, hk, g, lq, ev), acc))
    if bb is not None and bb.ndim == 6:
        (m, l, o), _ = lax.scan(lambda c, xs: step(c, xs[:3]), init, (jnp.arange(nb), kb, vb))
    else:
        (m, l, o), _ = lax.scan(step, init, (jnp.arange(nb), kb, vb))
    empty = l == 0  # a row with every key masked: PyTorch's math path gives zeros (its safe softmax)
    out = jnp.where(empty[..., None], 0.0, o / jnp.where(empty, 1.0, l)[..., None])
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
    return out.reshape(b, hq, lq, ev).astype(q.dtype), lse.reshape(b, hq, lq).astype(jnp.float32)


def _blocked_backward(do: Any, q: Any, k: Any, v: Any, bias: Any, out: Any, lse: Any, is_causal: bool,
                      scale: float, dropout_p: float, key: Any, block: int = KV_BLOCK) -> tuple[Any, Any, Any]:
    """(dq, dk, dv): per key/value block, the probabilities recomputed from the saved logsumexp."""
    acc = _acc(q.dtype)
    b, hq, lq, e = q.shape
    qg, kb, vb, bb, blk, nb, s_valid = _prep(q, k, v, bias, block)
    hk, g = qg.shape[1], qg.shape[2]
    dog = do.reshape(b, hk, g, lq, do.shape[-1])
    lse_g = lse.reshape(b, hk, g, lq).astype(acc)
    lse_safe = jnp.where(jnp.isneginf(lse_g), jnp.inf, lse_g)  # fully masked rows: p = 0
    delta = jnp.sum(dog.astype(acc) * out.reshape(dog.shape).astype(acc), -1)

    def step(dq: Any, xs: tuple) -> tuple:
        j, kj, vj = xs
        sc = _scores(qg, kj, j, _bias_block(bb, j), blk, s_valid, is_causal, scale, acc)
        p = jnp.exp(sc - lse_safe[..., None])
        dp = jnp.einsum("bhgle,bhse->bhgls", dog, vj, preferred_element_type=acc)
        if dropout_p > 0:
            keep = _keep(key, j, p.shape, dropout_p)
            pd = jnp.where(keep, p / (1 - dropout_p), 0.0)
            dp = jnp.where(keep, dp / (1 - dropout_p), 0.0)
        else:
            pd = p
        dv = jnp.einsum("bhgls,bhgle->bhse", pd.astype(dog.dtype), dog, preferred_element_type=acc)
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("bhgls,bhse->bhgle", ds.astype(kj.dtype), kj, preferred_element_type=acc)
        dk = jnp.einsum("bhgls,bhgle->bhse", ds.astype(qg.dtype), qg, preferred_element_type=acc)
        return dq, (dk, dv)

    dq, (dk, dv) = lax.scan(step, jnp.zeros(qg.shape, acc), (jnp.arange(nb), kb, vb))
    s = k.shape[2]
    dk = dk.transpose(1, 2, 0, 3, 4).reshape(b, hk, nb * blk, e)[:, :, :s]
    dv = dv.transpose(1, 2, 0, 3, 4).reshape(b, hk, nb * blk, v.shape[-1])[:, :, :s]
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---- the Pallas TPU kernel (jax.experimental.pallas.ops.tpu.flash_attention) ----

def _pallas_context(chosen: str) -> Any:
    from jax.experimental.pallas import tpu as pltpu

    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(jax.enable_x64(False))  # the kernel is written for 32-bit JAX (its scalars would be f64)
    if _select.interpret(chosen):
        stack.enter_context(pltpu.force_tpu_interpret_mode())
    return stack


def _pallas_blocks(lq: int, s: int) -> Any:
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    bq, bk = _block_of(lq), _block_of(s)
    return fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1, block_q_major_dkv=bq,
                         block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq, block_k_major_dq=bk,
                         block_k_dq=bk, block_q_dq=bq)


def _repeat_kv(x: Any, g: int) -> Any:
    return x if g == 1 else jnp.repeat(x, g, axis=1)


_NEG = -1e30  # what -inf in a mask becomes for the kernel (whose online softmax has no -inf guard)


def _full_bias(bias: Any, shape: tuple, scale: float) -> Any:
    """The kernel's `ab`, full-shaped and finite; it computes (q k^T + ab) * sm_scale, SDPA q k^T * scale + bias."""
    if bias is None:
        return None
    ab = jnp.broadcast_to(_bias4(bias), shape).astype(jnp.float32) / scale
    return jnp.where(jnp.isneginf(ab), _NEG, ab)


def _empty_rows(bias: Any, shape: tuple, is_causal: bool) -> Any:
    """(B, H, L): rows whose every key the mask removes (PyTorch's math path gives them zeros)."""
    gone = jnp.isneginf(jnp.broadcast_to(_bias4(bias), shape))
    if is_causal:
        gone = gone | (jnp.arange(shape[3])[None, :] > jnp.arange(shape[2])[:, None])
    return jnp.all(gone, -1)


def _pallas_forward(q: Any, k: Any, v: Any, bias: Any, is_causal: bool, scale: float, chosen: str) -> tuple:
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    g = q.shape[1] // k.shape[1]
    shape = (*q.shape[:3], k.shape[2])
    ab = _full_bias(bias, shape, scale)
    with _pallas_context(chosen):
        o, l, m = fa._flash_attention(q, _repeat_kv(k, g), _repeat_kv(v, g), ab, None, True, is_causal, scale,
                                      _pallas_blocks(q.shape[2], k.shape[2]), False)
    lse = m + jnp.log(l)  # (B, H, L) each
    if bias is not None:
        empty = _empty_rows(bias, shape, is_causal)
        o = jnp.where(empty[..., None], 0, o)
        lse = jnp.where(empty, -jnp.inf, lse)
    return o.astype(q.dtype), lse.astype(jnp.float32)


def _pallas_backward(do: Any, q: Any, k: Any, v: Any, bias: Any, out: Any, lse: Any, is_causal: bool,
                     scale: float, chosen: str) -> tuple:
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    b, hk = k.shape[0], k.shape[1]
    g = q.shape[1] // hk
    ab = _full_bias(bias, (*q.shape[:3], k.shape[2]), scale)
    # the kernel's p = exp(s - m) / l, with l = 1; p = 0 in rows with no key (logsumexp -inf)
    m = jnp.where(jnp.isneginf(lse), -_NEG, lse).astype(jnp.float32)
    l = jnp.ones(lse.shape, jnp.float32)
    residuals = (q, _repeat_kv(k, g), _repeat_kv(v, g), ab, None, out, l, m)
    with _pallas_context(chosen):
        dq, dk, dv, _, _ = fa._flash_attention_bwd(False, is_causal, scale, _pallas_blocks(q.shape[2], k.shape[2]),
                                                   False, residuals, do)
    if g > 1:
        dk = dk.reshape(b, hk, g, *dk.shape[2:]).sum(2)
        dv = dv.reshape(b, hk, g, *dv.shape[2:]).sum(2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---- the two paths behind one entry ----

def attention_forward(q: Any, k: Any, v: Any, bias: Any, dropout_p: float, is_causal: bool, scale: float | None,
                      key: Any) -> tuple[Any, Any]:
    """(out, logsumexp) of 3-D or 4-D q/k/v (logsumexp is (B, H, L); B = 1 for 3-D inputs)."""
    squeeze = q.ndim == 3
    q4, k4, v4 = _as4(q), _as4(k), _as4(v)
    sc = _scale(scale, q.shape[-1])
    chosen = _select.path(KERNEL, _fits(q4, k4, v4, dropout_p) and (bias is None or sc > 0))
    if chosen == "reference":
        out, lse = _blocked_forward(q4, k4, v4, bias, is_causal, sc, dropout_p, key)
    else:
        out, lse = _pallas_forward(q4, k4, v4, bias, is_causal, sc, chosen)
    return (out[0] if squeeze else out), lse


def attention_backward(do: Any, q: Any, k: Any, v: Any, bias: Any, out: Any, lse: Any, dropout_p: float,
                       is_causal: bool, scale: float | None, key: Any) -> tuple[Any, Any, Any]:
    squeeze = q.ndim == 3
    q4, k4, v4, do4, out4 = _as4(q), _as4(k), _as4(v), _as4(do), _as4(out)
    sc = _scale(scale, q.shape[-1])
    chosen = _select.path(KERNEL, _fits(q4, k4, v4, dropout_p) and (bias is None or sc > 0))
    if chosen == "reference":
        grads = _blocked_backward(do4, q4, k4, v4, bias, out4, lse, is_causal, sc, dropout_p, key)
    else:
        grads = _pallas_backward(do4, q4, k4, v4, bias, out4, lse, is_causal, sc, chosen)
    return tuple(x[0] for x in grads) if squeeze else grads  # type: ignore[return-value]


def _u64(x: Any) -> Any:
    return x if x.dtype == jnp.uint64 else lax.bitcast_convert_type(x.astype(jnp.int64), jnp.uint64)


def _i64(x: Any) -> Any:
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.uint64), jnp.int64)


def _key(seed: Any, offset: Any) -> Any:
    """The dropout key of (philox_seed, philox_offset), int64 tensors holding the generator's uint64 pair."""
    return _rng_key(_u64(seed), _u64(offset))


# ---- the ATen ops ----

_FWD = "_scaled_dot_product_fused_attention_overrideable"
_ZERO_U64 = np.uint64(0)
_NO_BIAS = np.zeros((), np.float32)


def _outputs(q: Any, k: Any, out: Any, lse: Any, seed: Any, offset: Any) -> tuple:
    return (out, lse, None, None, q.shape[-2], k.shape[-2], seed, offset, None)


@functools.lru_cache(maxsize=256)
def _forward_fn(dropout_p: float, is_causal: bool, scale: float | None, has_bias: bool) -> Any:
    def run(q: Any, k: Any, v: Any, bias: Any, seed: Any, offset: Any) -> tuple[Any, Any, Any, Any]:
        key = _key(seed, offset) if dropout_p > 0 else None
        out, lse = attention_forward(q, k, v, bias if has_bias else None, dropout_p, is_causal, scale, key)
        return out, lse, _i64(seed), _i64(offset)

    return _executor.jitted(run, key=(_FWD, dropout_p, is_causal, scale, has_bias))


@direct(_FWD, defer=True)
def sdpa_fused_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_bias: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                       return_debug_mask: bool = False, *, scale: float | None = None) -> tuple:
    """Eager forward: draws (seed, offset) from the tpu generator when there is dropout."""
    if return_debug_mask:
        raise NotImplementedError(f"aten::{_FWD} on tpu: return_debug_mask=True (the dropout mask of the fused "
                                  "kernel is never materialised); use the MATH backend to inspect it")
    index = query.device.index
    # Host constants, not jnp values: jnp.uint64(0) / jnp.zeros(()) are eager device transfers (the three took
    # 145 us per attention call), where numpy values are plain program inputs.
    seed, offset = _philox(None, query) if dropout_p > 0 else (_ZERO_U64, _ZERO_U64)
    bias = _storage.read(attn_bias) if attn_bias is not None else _NO_BIAS
    out, lse, seed_t, offset_t = _forward_fn(float(dropout_p), bool(is_causal), scale, attn_bias is not None)(
        _storage.read(query), _storage.read(key), _storage.read(value), bias, seed, offset)
    return (_C._wrap(out, query.dtype, index), _C._wrap(lse, torch.float32, index), None, None,
            query.shape[-2], key.shape[-2], _C._wrap(seed_t, torch.int64, index),
            _C._wrap(offset_t, torch.int64, index), None)


@lower(_FWD, trace_only=True, variants=False)
def sdpa_fused_forward_graph(query: Any, key: Any, value: Any, attn_bias: Any = None, dropout_p: float = 0.0,
                             is_causal: bool = False, return_debug_mask: bool = False,
                             scale: float | None = None) -> tuple:
    """The same op inside torch.compile graphs: the dropout key comes from the program's key stream."""
    if dropout_p > 0:
        seed = _i64(jax.random.bits(_executor.next_trace_key(), (), jnp.uint64))
    else:
        seed = jnp.zeros((), jnp.int64)
    offset = jnp.zeros((), jnp.int64)
    rkey = _key(seed, offset) if dropout_p > 0 else None
    out, lse = attention_forward(query, key, value, attn_bias, dropout_p, is_causal, scale, rkey)
    return _outputs(query, key, out, lse, seed, offset)


@lower("_scaled_dot_product_fused_attention_overrideable_backward", variants=False)
def sdpa_fused_backward(grad_out: Any, query: Any, key: Any, value: Any, attn_bias: Any,
                        grad_input_mask: Any, out: Any, logsumexp: Any, cum_seq_q: Any, cum_seq_k: Any,
                        max_q: int, max_k: int, dropout_p: float, is_causal: bool, philox_seed: Any,
                        philox_offset: Any, scale: float | None = None) -> tuple:
    if len(grad_input_mask) > 3 and grad_input_mask[3]:
        raise NotImplementedError(
            f"aten::_scaled_dot_product_fused_attention_overrideable_backward on tpu: a gradient for attn_bias "
            f"(query {list(query.shape)}): the fused kernel gives none; scaled_dot_product_attention sends a mask "
            "that requires grad to the MATH backend")
    rkey = _key(philox_seed, philox_offset) if dropout_p > 0 else None
    dq, dk, dv = attention_backward(grad_out, query, key, value, attn_bias, out, logsumexp, dropout_p, is_causal,
                                    scale, rkey)
    return dq, dk, dv, None
