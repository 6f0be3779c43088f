"""Paged attention for decode: one query token per sequence against a KV cache kept in pages, as TPU serving engines
keep it (the layout of `jax.experimental.pallas.ops.tpu.paged_attention`). The op is `torch.tpu.ops.paged_attention`
(`tpu::paged_attention`, defined in torch_tpu/ops.py); these are its lowerings.

- q [batch, heads, head_dim]; k_pages, v_pages [kv_heads, total_pages, page_size, head_dim];
- lengths [batch] int32: how many cached tokens each sequence has; page_indices [batch, pages_per_sequence] int32:
  which pages hold them, in order (entries past a sequence's length are not read);
- heads is a multiple of kv_heads (GQA/MQA): query head h reads kv head h // (heads // kv_heads);
- out [batch, heads, head_dim] = softmax(scale * q k^T over the first `length` tokens) v, with an optional tanh soft
  cap of the logits (`soft_cap * tanh(logits / soft_cap)`); a sequence of length 0 gives zeros.

Two paths, `_select.path("paged_attention", fits)`: the Pallas kernel of jax (its TPU interpret mode on CPU in
tests) where head_dim is a multiple of 128, page_size of 16 and the pages are bfloat16 (the kernel computes with
K and V rounded to bfloat16, so float32 pages take the reference, which keeps them exact); elsewhere the XLA
reference (gather the pages, masked softmax in float32). Lengths past the cache and page indices of used pages
outside k_pages raise at the next synchronisation (device-side checks); the computation itself reads clamped
indices. The backward (`tpu::paged_attention_backward`) is the reference's vjp on every path.
"""

from __future__ import annotations

from typing import Any

from torch_tpu._checks import report_bad_index
from torch_tpu._jax import jax, jnp
from torch_tpu.kernels.pallas import _select
from torch_tpu.kernels.registry import lower

KERNEL = "paged_attention"
OP = "tpu::paged_attention"
BACKWARD = "tpu::paged_attention_backward"
_BLOCK_TOKENS = 512  # tokens per compute block of the kernel (pages_per_compute_block * page_size) by default


def check_shapes(q: Any, k_pages: Any, v_pages: Any, lengths: Any, page_indices: Any) -> None:
    """The layout's static constraints, with the shapes in the message (shared by the fake implementation)."""
    shapes = (f"q {list(q.shape)}, k_pages {list(k_pages.shape)}, v_pages {list(v_pages.shape)}, lengths "
              f"{list(lengths.shape)}, page_indices {list(page_indices.shape)}")

    def bad(why: str) -> RuntimeError:
        return RuntimeError(f"torch.tpu.ops.paged_attention: {why} (got {shapes}); the layout is q [batch, heads, "
                            "head_dim], k_pages/v_pages [kv_heads, total_pages, page_size, head_dim], lengths [batch] "
                            "int32, page_indices [batch, pages_per_sequence] int32")

    if q.ndim != 3 or k_pages.ndim != 4 or lengths.ndim != 1 or page_indices.ndim != 2:
        raise bad("wrong number of dimensions")
    if tuple(k_pages.shape) != tuple(v_pages.shape):
        raise bad("k_pages and v_pages must have the same shape")
    b, h, d = q.shape
    kv = k_pages.shape[0]
    if k_pages.shape[3] != d:
        raise bad("head_dim of q and of the pages differ")
    if kv == 0 or h % kv:
        raise bad("heads must be a multiple of kv_heads")
    if lengths.shape[0] != b or page_indices.shape[0] != b:
        raise bad("lengths and page_indices need one row per batch entry of q")
    for name, x in (("lengths", lengths), ("page_indices", page_indices)):
        if str(x.dtype).removeprefix("torch.") != "int32":
            raise bad(f"{name} must be int32, got {x.dtype}")
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        floating = getattr(x.dtype, "is_floating_point", None)  # (a torch dtype in the fake implementation)
        if not (floating if floating is not None else jnp.issubdtype(x.dtype, jnp.floating)):
            raise bad(f"{name} must be a floating tensor, got {x.dtype}")


def block_pages(pages_per_sequence: int, page_size: int, requested: int | None) -> int:
    """Pages per compute block of the kernel: `requested`, or the largest divisor of pages_per_sequence that keeps a
    block within _BLOCK_TOKENS tokens."""
    if requested is not None:
        if requested <= 0 or pages_per_sequence % requested:
            raise ValueError(f"torch.tpu.ops.paged_attention: pages_per_compute_block={requested} must divide "
                             f"pages_per_sequence={pages_per_sequence}")
        return requested
    best = 1
    for p in range(1, pages_per_sequence + 1):
        if pages_per_sequence % p == 0 and p * page_size <= max(_BLOCK_TOKENS, page_size):
            best = p
    return best


def fits(q: Any, k_pages: Any) -> bool:
    """Where the Pallas kernel applies (Mosaic's tiles, and bfloat16 pages: the kernel rounds K/V to bfloat16)."""
    page_size, head_dim = k_pages.shape[2], k_pages.shape[3]
    return (k_pages.dtype == jnp.bfloat16 and q.dtype in (jnp.bfloat16, jnp.float32) and head_dim % 128 == 0
            and page_size % 16 == 0 and q.shape[0] > 0)


def _report(lengths: Any, page_indices: Any, total_pages: int, page_size: int) -> None:
    capacity = page_indices.shape[1] * page_size
    report_bad_index(OP, lengths, capacity + 1, error=RuntimeError,
                     message=f"torch.tpu.ops.paged_attention: a sequence length of {{value}} is outside [0, {capacity}] "
                             f"(pages_per_sequence {page_indices.shape[1]} x page_size {page_size})")
    used = (jnp.arange(page_indices.shape[1], dtype=jnp.int32) * page_size)[None, :] < lengths[:, None]
    report_bad_index(OP, jnp.where(used, page_indices, 0), total_pages, error=RuntimeError,
                     message=f"torch.tpu.ops.paged_attention: page index {{value}} (of a page in use) is out of range "
                             f"for k_pages/v_pages with {total_pages} pages")


def reference(q: Any, k_pages: Any, v_pages: Any, lengths: Any, page_indices: Any, scale: float,
              soft_cap: float | None) -> Any:
    """The XLA path: gather each sequence's pages, masked softmax in float32 (differentiable: the backward)."""
    b, h, d = q.shape
    kv, total, page_size, _ = k_pages.shape
    tokens = page_indices.shape[1] * page_size
    idx = jnp.clip(page_indices, 0, total - 1)
    k = k_pages[:, idx].reshape(kv, b, tokens, d).astype(jnp.float32)
    v = v_pages[:, idx].reshape(kv, b, tokens, d).astype(jnp.float32)
    qg = q.reshape(b, kv, h // kv, d).astype(jnp.float32) * scale
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bkgd,kbtd->bkgt", qg, k, precision=hi)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = jnp.arange(tokens, dtype=jnp.int32)[None, None, None, :] < lengths[:, None, None, None]
    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jnp.where(mask, jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True))), 0.0)
    denom = p.sum(-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)  # (a sequence of length 0 attends to nothing: zeros)
    out = jnp.einsum("bkgt,kbtd->bkgd", p, v, precision=hi)
    return out.reshape(b, h, d).astype(q.dtype)


def pallas_path(q: Any, k_pages: Any, v_pages: Any, lengths: Any, page_indices: Any, scale: float,
            soft_cap: float | None, pages_per_block: int, interpret: bool) -> Any:
    import contextlib

    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as pallas_paged_attention

    total = k_pages.shape[1]
    capacity = page_indices.shape[1] * k_pages.shape[2]
    mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    # (the kernel's index arithmetic is int32; the backend runs with x64 on)
    with jax.enable_x64(False), mode:
        out = pallas_paged_attention(
            (q.astype(jnp.float32) * scale), k_pages, v_pages, jnp.clip(lengths, 0, capacity),
            jnp.clip(page_indices, 0, total - 1), attn_logits_soft_cap=soft_cap, pages_per_compute_block=pages_per_block)
    return out.astype(q.dtype)


def _scale(q: Any, scale: float | None) -> float:
    return float(scale) if scale is not None else 1.0 / float(q.shape[-1]) ** 0.5


@lower(OP, variants=False, checks=True)
def paged_attention(q: Any, k_pages: Any, v_pages: Any, lengths: Any, page_indices: Any, scale: float | None = None,
                    soft_cap: float | None = None, pages_per_compute_block: int | None = None) -> Any:
    check_shapes(q, k_pages, v_pages, lengths, page_indices)
    kv, total, page_size, _ = k_pages.shape
    ppcb = block_pages(page_indices.shape[1], page_size, pages_per_compute_block)
    _report(lengths, page_indices, total, page_size)
    s = _scale(q, scale)
    chosen = _select.path(KERNEL, fits(q, k_pages) and v_pages.dtype == k_pages.dtype)
    if chosen == "reference":
        return reference(q, k_pages, v_pages, lengths, page_indices, s, soft_cap)
    return pallas_path(q, k_pages, v_pages, lengths, page_indices, s, soft_cap, ppcb, _select.interpret(chosen))


@lower(BACKWARD, variants=False)
def paged_attention_backward(grad: Any, q: Any, k_pages: Any, v_pages: Any, lengths: Any, page_indices: Any,
                             scale: float | None = None, soft_cap: float | None = None) -> tuple[Any, Any, Any]:
    s = _scale(q, scale)
    _, pull = jax.vjp(lambda q, k, v: reference(q, k, v, lengths, page_indices, s, soft_cap), q, k_pages, v_pages)
    return pull(grad.astype(q.dtype))
