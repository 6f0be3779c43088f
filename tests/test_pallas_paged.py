"""torch.tpu.ops.paged_attention (kernels/pallas/paged_attention.py): decode attention over a paged KV cache against
CPU PyTorch attention over the dense cache the pages were cut from (MHA, GQA, MQA; scale, soft cap; lengths 0, partial
and full), forward and backward, in the three execution paths; jax's Pallas kernel (TPU interpret mode) against the
reference and CPU; the device-side checks of lengths and page indices."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torch_tpu._deferred import EagerMode
from torch_tpu._jax import jnp
from torch_tpu.kernels.pallas import _select
from torch_tpu.kernels.pallas import paged_attention as pa


def _cache(batch=3, heads=4, kv_heads=2, head_dim=32, page_size=8, pages_per_seq=4, lengths=(0, 13, 32),
           dtype=torch.float32, page_dtype=None, seed=0):
    """A dense KV cache [batch, kv_heads, tokens, head_dim] and the same cache cut into shuffled pages (spare pages
    with garbage in them, unused page-table entries pointing anywhere in range)."""
    g = torch.Generator().manual_seed(seed)
    page_dtype = page_dtype or dtype
    tokens = pages_per_seq * page_size
    total = batch * pages_per_seq + 3
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    k_dense = torch.randn(batch, kv_heads, tokens, head_dim, generator=g).to(page_dtype)
    v_dense = torch.randn(batch, kv_heads, tokens, head_dim, generator=g).to(page_dtype)
    k_pages = torch.randn(kv_heads, total, page_size, head_dim, generator=g).to(page_dtype) * 100  # garbage
    v_pages = torch.randn(kv_heads, total, page_size, head_dim, generator=g).to(page_dtype) * 100
    page_indices = torch.randperm(total, generator=g)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    for b in range(batch):
        for j in range(pages_per_seq):
            k_pages[:, page_indices[b, j]] = k_dense[b, :, j * page_size:(j + 1) * page_size]
            v_pages[:, page_indices[b, j]] = v_dense[b, :, j * page_size:(j + 1) * page_size]
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    return dict(q=q, k_dense=k_dense, v_dense=v_dense, k_pages=k_pages, v_pages=v_pages, lengths=lengths_t,
                page_indices=page_indices.to(torch.int32))


def _dense_reference(c, scale=None, soft_cap=None):
    """CPU attention of each sequence's query over its first `length` cached tokens (float32), and the gradients of
    sum(out * grad) mapped from the dense cache onto the pages."""
    q = c["q"].float().clone().requires_grad_()
    k = c["k_dense"].float().clone().requires_grad_()
    v = c["v_dense"].float().clone().requires_grad_()
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    s = scale if scale is not None else 1 / math.sqrt(head_dim)
    outs = []
    for b, length in enumerate(c["lengths"].tolist()):
        if length == 0:
            outs.append(q[b] * 0)
            continue
        kb, vb = k[b, :, :length], v[b, :, :length]
        if soft_cap is None:
            outs.append(F.scaled_dot_product_attention(q[b][:, None], kb, vb, scale=s, enable_gqa=True)[:, 0])
        else:
            kk, vv = kb.repeat_interleave(heads // kv_heads, 0), vb.repeat_interleave(heads // kv_heads, 0)
            logits = torch.einsum("hd,htd->ht", q[b], kk) * s
            p = (soft_cap * torch.tanh(logits / soft_cap)).softmax(-1)
            outs.append(torch.einsum("ht,htd->hd", p, vv))
    out = torch.stack(outs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * grad).sum().backward()
    dk_pages, dv_pages = torch.zeros_like(c["k_pages"], dtype=torch.float32), torch.zeros_like(
        c["v_pages"], dtype=torch.float32)
    page_size = c["k_pages"].shape[2]
    for b in range(q.shape[0]):
        for j, page in enumerate(c["page_indices"][b].tolist()):
            dk_pages[:, page] = k.grad[b, :, j * page_size:(j + 1) * page_size]
            dv_pages[:, page] = v.grad[b, :, j * page_size:(j + 1) * page_size]
    return out.detach(), grad, q.grad, dk_pages, dv_pages


def _on_tpu(c, grad, mode="never", **kw):
    q, kp, vp = (c[n].to("tpu").requires_grad_() for n in ("q", "k_pages", "v_pages"))
    lengths, pages = c["lengths"].to("tpu"), c["page_indices"].to("tpu")

    def fn(q, kp, vp, lengths, pages):
        return torch.tpu.ops.paged_attention(q, kp, vp, lengths, pages, **kw)

    if mode == "compile":
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="tpu", fullgraph=True)
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE if mode == "fuse" else torch.tpu.eager_mode):
        out = fn(q, kp, vp, lengths, pages)
        (out * grad.to("tpu", out.dtype)).sum().backward()
    return out.detach().cpu(), q.grad.cpu(), kp.grad.cpu(), vp.grad.cpu()


def _compare(c, mode="never", tol=1e-5, grad_tol=None, **kw):
    want, grad, dq, dk, dv = _dense_reference(c, scale=kw.get("scale"), soft_cap=kw.get("soft_cap"))
    out, gq, gk, gv = _on_tpu(c, grad, mode, **kw)
    assert out.dtype == c["q"].dtype and out.shape == c["q"].shape
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    gt = grad_tol or tol
    torch.testing.assert_close(gq.float(), dq, rtol=gt, atol=gt)
    torch.testing.assert_close(gk.float(), dk, rtol=gt, atol=gt)  # spare pages: zero gradient
    torch.testing.assert_close(gv.float(), dv, rtol=gt, atol=gt)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_matches_dense_attention_forward_backward(kv_heads: int) -> None:
    _compare(_cache(kv_heads=kv_heads), tol=2e-5)


def test_scale_and_soft_cap() -> None:
    _compare(_cache(seed=1, lengths=(5, 32, 9)), scale=0.3, soft_cap=2.0, tol=2e-5)


def test_bfloat16() -> None:
    _compare(_cache(seed=2, dtype=torch.bfloat16), tol=3e-2, grad_tol=6e-2)


@pytest.mark.parametrize("mode", ["fuse", "compile"])
def test_fused_and_compiled(mode: str) -> None:
    _compare(_cache(seed=3, lengths=(17, 1, 30)), mode=mode, tol=2e-5)


def test_pallas_kernel_through_torch(monkeypatch) -> None:
    """TORCH_TPU_PALLAS=interpret: jax's Pallas kernel (TPU interpret mode) on its TPU shapes (head_dim 128, pages of
    16 bfloat16 rows), GQA, a zero-length sequence; matches the dense CPU attention. The backward is the reference's."""
    monkeypatch.setenv("TORCH_TPU_PALLAS", "interpret")
    before = _select.CHOSEN[(pa.KERNEL, "interpret")]
    c = _cache(batch=2, heads=4, kv_heads=2, head_dim=128, page_size=16, pages_per_seq=4, lengths=(0, 45),
               page_dtype=torch.bfloat16, seed=4)
    _compare(c, tol=1e-4, grad_tol=3e-2, pages_per_compute_block=2)  # (bfloat16 page gradients)
    assert _select.CHOSEN[(pa.KERNEL, "interpret")] == before + 1


def test_pallas_path_matches_reference_with_soft_cap() -> None:
    c = _cache(batch=2, heads=8, kv_heads=1, head_dim=128, page_size=16, pages_per_seq=2, lengths=(32, 7),
               page_dtype=torch.bfloat16, seed=5)
    args = [jnp.asarray(c[n].float().numpy(), dtype=jnp.bfloat16 if n != "q" else jnp.float32)
            for n in ("q", "k_pages", "v_pages")]
    args += [jnp.asarray(c["lengths"].numpy()), jnp.asarray(c["page_indices"].numpy())]
    assert pa.fits(args[0], args[1])
    got = pa.pallas_path(*args, 0.125, 5.0, 1, interpret=True)
    ref = pa.reference(*args, 0.125, 5.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)
    want = _dense_reference(c, scale=0.125, soft_cap=5.0)[0]
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-4, atol=1e-4)


def test_fits_rule() -> None:
    q = jnp.zeros((2, 8, 128), jnp.float32)
    assert pa.fits(q, jnp.zeros((2, 4, 16, 128), jnp.bfloat16))
    assert not pa.fits(q, jnp.zeros((2, 4, 16, 128), jnp.float32))  # the kernel rounds K/V to bfloat16
    assert not pa.fits(q[..., :64], jnp.zeros((2, 4, 16, 64), jnp.bfloat16))
    assert not pa.fits(q, jnp.zeros((2, 4, 8, 128), jnp.bfloat16))
    assert pa.block_pages(8, 16, None) == 8 and pa.block_pages(64, 16, None) == 32 and pa.block_pages(6, 128, None) == 3


def test_bad_lengths_and_page_indices_raise_at_the_next_sync() -> None:
    c = _cache(seed=6)
    args = {n: c[n].to("tpu") for n in ("q", "k_pages", "v_pages", "lengths", "page_indices")}
    lengths = torch.tensor([0, 33, 4], dtype=torch.int32, device="tpu")  # 33 > 4 pages x 8
    out = torch.tpu.ops.paged_attention(args["q"], args["k_pages"], args["v_pages"], lengths, args["page_indices"])
    with pytest.raises(RuntimeError, match=r"sequence length of 33 is outside \[0, 32\]"):
        out.cpu()
    pages = c["page_indices"].clone()
    pages[1, 0] = 99  # used (length 13)
    pages[0, 3] = -5  # unused (length 0): not read, no error for it
    out = torch.tpu.ops.paged_attention(args["q"], args["k_pages"], args["v_pages"], args["lengths"],
                                        pages.to("tpu"))
    with pytest.raises(RuntimeError, match="page index 99 .* out of range for k_pages/v_pages with 15 pages"):
        out.cpu()
    pages[1, 0] = c["page_indices"][1, 0]
    out = torch.tpu.ops.paged_attention(args["q"], args["k_pages"], args["v_pages"], args["lengths"],
                                        pages.to("tpu"))
    torch.testing.assert_close(out.cpu(), _dense_reference(c)[0], rtol=2e-5, atol=2e-5)


def test_shape_and_device_errors() -> None:
    c = _cache(seed=7)
    args = [c[n] for n in ("q", "k_pages", "v_pages", "lengths", "page_indices")]
    tpu = [a.to("tpu") for a in args]
    with pytest.raises(RuntimeError, match="heads must be a multiple of kv_heads"):
        torch.tpu.ops.paged_attention(tpu[0][:, :3], *tpu[1:])
    with pytest.raises(RuntimeError, match="page_indices must be int32"):
        torch.tpu.ops.paged_attention(*tpu[:4], tpu[4].long())
    with pytest.raises(ValueError, match="pages_per_compute_block=3 must divide pages_per_sequence=4"):
        torch.tpu.ops.paged_attention(*tpu, pages_per_compute_block=3)
    with pytest.raises(RuntimeError, match="runs on tpu tensors only"):
        torch.tpu.ops.paged_attention(*args)
