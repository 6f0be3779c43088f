"""The `flex_attention` higher-order operator (torch.nn.attention.flex_attention) in compiled graphs: its math path
in JAX, with the same numerics as PyTorch's own dense implementation (`torch._higher_order_ops.flex_attention.
math_attention`), which is what eager tpu runs.

The HOP carries its `score_mod` and `mask_mod` as FX subgraphs of scalar functions (score, b, h, q_idx, kv_idx).
The executor hands them here as JAX callables (their nodes lowered through the same registry), and they are
vectorised over the (batch, head, query, key) grid with `jax.vmap` (`_checks.vmap`: an index check inside, e.g.
of a document-id buffer read at `q_idx`, stays a device-side check), as PyTorch's `_vmap_for_bhqkv` does with
`torch.vmap`. The backward HOP is the VJP of the same forward (the score_mod's own gradient included), so a
score_mod needs no hand-written joint graph. Scores are computed in float32 (float64 for float64 inputs) at HIGHEST
precision; the log-sum-exp is returned in base 2, as the HOP's contract says (the public API converts it back).
The full (B, H, M, N) score matrix is materialised, as in PyTorch's math path: block sparsity is not used.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from torch_tpu import _checks
from torch_tpu._jax import jax, jnp, lax
from torch_tpu.kernels.registry import higher_order

_LN2 = math.log(2.0)


def _vmap_bhqkv(fn: Callable[..., Any], n_buffers: int, with_score: bool) -> Callable[..., Any]:
    """fn(score?, b, h, q, kv, *buffers) of scalars -> the same over the (B, H, M, N) grid (buffers not mapped)."""
    lead = (0,) if with_score else ()
    rest = (None,) * n_buffers
    levels = ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None))
    return _checks.vmap(fn, *(lead + dims + rest for dims in levels))  # index checks of buffer reads kept


def _working_dtype(dtype: Any) -> Any:
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _broadcast_kv(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """GQA (query heads a multiple of key heads) and a key/value batch of 1, as PyTorch's math path allows."""
    bq, hq = q.shape[0], q.shape[1]
    bkv, hkv = k.shape[0], k.shape[1]
    if not (bq == bkv or bkv == 1):
        raise RuntimeError(f"flex_attention: Bq and Bkv must broadcast. Got Bq={bq} and Bkv={bkv}")
    if hq % hkv:
        raise ValueError(f"flex_attention: the query's {hq} heads are not a multiple of the key's {hkv} heads")
    g = hq // hkv
    k = jnp.broadcast_to(jnp.repeat(k, g, axis=1), (bq, hq) + k.shape[2:])
    v = jnp.broadcast_to(jnp.repeat(v, g, axis=1), (bq, hq) + v.shape[2:])
    return k, v


def _post_mod_scores(q: Any, k: Any, score_mod: Callable[..., Any], mask_mod: Callable[..., Any], scale: float,
                     score_buffers: Sequence[Any], mask_buffers: Sequence[Any]) -> Any:
    wp = _working_dtype(q.dtype)
    scores = jnp.matmul(q.astype(wp), jnp.swapaxes(k.astype(wp), -1, -2), precision=lax.Precision.HIGHEST)
    scores = (scores * scale).astype(wp)
    b, h, m, n = (jnp.arange(s, dtype=jnp.int32) for s in scores.shape)
    modded = _vmap_bhqkv(score_mod, len(score_buffers), True)(scores, b, h, m, n, *score_buffers)
    keep = _vmap_bhqkv(mask_mod, len(mask_buffers), False)(b, h, m, n, *mask_buffers)
    keep = jnp.broadcast_to(keep, scores.shape)
    return jnp.where(keep, jnp.asarray(modded).astype(wp), -jnp.inf)


def _attention(q: Any, k: Any, v: Any, score_mod: Callable[..., Any], mask_mod: Callable[..., Any], scale: float,
               score_buffers: Sequence[Any], mask_buffers: Sequence[Any]) -> tuple[Any, Any, Any]:
    """(out, logsumexp / ln 2, max score / ln 2); fully masked rows give out 0, lse and max -inf (PyTorch's
    `_safe_softmax`). Written with finite intermediates so that its VJP has no NaN on masked entries."""
    k, v = _broadcast_kv(q, k, v)
    s = _post_mod_scores(q, k, score_mod, mask_mod, scale, score_buffers, mask_buffers)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    masked = row_max == -jnp.inf
    shift = lax.stop_gradient(jnp.where(masked, 0.0, row_max).astype(s.dtype))
    e = jnp.exp(s - shift)  # exactly 0 where masked
    total = jnp.sum(e, axis=-1, keepdims=True)
    safe_total = jnp.where(masked, 1.0, total).astype(s.dtype)
    p = e / safe_total
    lse = jnp.where(masked, -jnp.inf, jnp.log(safe_total) + shift)[..., 0]
    out = jnp.matmul(p.astype(q.dtype), v.astype(q.dtype), precision=lax.Precision.HIGHEST)
    return out, lse / _LN2, lax.stop_gradient(row_max[..., 0]) / _LN2


def _block_mask_parts(block_mask: Sequence[Any]) -> tuple[Callable[..., Any], Sequence[Any]]:
    """The HOP's block-mask tuple: (kv_num_blocks, kv_indices, ..., Q_BLOCK, KV_BLOCK, mask_mod): only the
    mask_mod is used (the math path evaluates it at every position)."""
    return block_mask[-1], block_mask[:-1]


@higher_order("flex_attention")
def flex_attention(query: Any, key: Any, value: Any, score_mod: Callable[..., Any], block_mask: Sequence[Any],
                   scale: float, kernel_options: dict[str, Any], score_mod_other_buffers: Sequence[Any] = (),
                   mask_mod_other_buffers: Sequence[Any] = ()) -> tuple[Any, Any, Any]:
    mask_mod, _ = _block_mask_parts(block_mask)
    return _attention(query, key, value, score_mod, mask_mod, scale, tuple(score_mod_other_buffers),
                      tuple(mask_mod_other_buffers))


@higher_order("flex_attention_backward", unused=("joint_graph",))
def flex_attention_backward(query: Any, key: Any, value: Any, out: Any, logsumexp: Any, grad_out: Any,
                            grad_logsumexp: Any, fw_graph: Callable[..., Any], joint_graph: Any,
                            block_mask: Sequence[Any], scale: float, kernel_options: dict[str, Any],
                            score_mod_other_buffers: Sequence[Any] = (), mask_mod_other_buffers: Sequence[Any] = ()
                            ) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """Gradients of query, key, value and of the score_mod's floating-point buffers (the HOP returns None for
    buffers that do not require grad; the executor drops those): the VJP of `flex_attention`'s forward, recomputed
    from the inputs (as PyTorch's math backward recomputes the scores). `joint_graph` is not needed."""
    mask_mod, _ = _block_mask_parts(block_mask)
    bufs = tuple(score_mod_other_buffers)
    float_pos = [i for i, b in enumerate(bufs) if hasattr(b, "dtype") and jnp.issubdtype(b.dtype, jnp.floating)]

    def forward(q: Any, k: Any, v: Any, fb: tuple) -> tuple[Any, Any]:
        full = list(bufs)
        for i, b in zip(float_pos, fb):
            full[i] = b
        o, lse, _ = _attention(q, k, v, fw_graph, mask_mod, scale, tuple(full), tuple(mask_mod_other_buffers))
        return o, lse

    (o, lse), vjp = jax.vjp(forward, query, key, value, tuple(bufs[i] for i in float_pos))
    g_out = jnp.zeros_like(o) if grad_out is None else grad_out.astype(o.dtype)
    g_lse = jnp.zeros_like(lse) if grad_logsumexp is None else grad_logsumexp.astype(lse.dtype)
    gq, gk, gv, gb = vjp((g_out, g_lse))
    grads: list[Any] = [None] * len(bufs)
    for i, g in zip(float_pos, gb):
        grads[i] = g
    return gq, gk, gv, tuple(grads)
