"""scaled_dot_product_attention on tpu: the overrideable fused op (kernels/pallas/flash_attention.py) against CPU
PyTorch, forward and backward; the backend choice; the Pallas kernel in interpret mode against the blocked XLA path;
dropout's statistics and determinism under a seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_tpu._jax import jax, jnp
from torch_tpu.kernels.pallas import _select
from torch_tpu.kernels.pallas import flash_attention as fa

DEV = "tpu"


def _run(q, k, v, mask=None, causal=False, gqa=False, scale=None):
    """(out, dq, dk, dv) of SDPA on CPU and on tpu for the same inputs and output gradient."""
    res = []
    do = None
    for dev in ("cpu", DEV):
        ts = [t.detach().to(dev).requires_grad_() for t in (q, k, v)]
        m = None if mask is None else mask.to(dev)
        o = F.scaled_dot_product_attention(*ts, attn_mask=m, is_causal=causal, enable_gqa=gqa, scale=scale)
        if do is None:
            do = torch.randn(o.shape, dtype=o.dtype)
        o.backward(do.to(dev))
        res.append([o.detach().cpu()] + [t.grad.cpu() for t in ts])
    return res


CASES = [
    # (B, Hq, Hkv, L, S, E, Ev, causal, mask, gqa)
    (2, 4, 4, 5, 7, 8, 8, False, None, False),
    (1, 2, 2, 6, 6, 4, 4, True, None, False),
    (2, 2, 2, 5, 9, 8, 6, False, "bool", False),
    (2, 4, 4, 5, 9, 8, 8, False, "float", False),
    (2, 4, 2, 5, 7, 8, 8, True, None, True),  # GQA
    (1, 4, 1, 3, 600, 8, 8, False, "bool", True),  # MQA; S > KV_BLOCK: several blocks, the last padded
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}/{c[2]}L{c[3]}S{c[4]}{c[7] and 'causal' or ''}"
                                                      f"{c[8] or ''}")
def test_sdpa_fused_matches_cpu(case, dtype):
    B, Hq, Hk, L, S, E, Ev, causal, mask, gqa = case
    torch.manual_seed(0)
    q, k, v = torch.randn(B, Hq, L, E), torch.randn(B, Hk, S, E), torch.randn(B, Hk, S, Ev)
    m = None
    if mask == "bool":
        m = torch.rand(L, S) > 0.3
        m[0] = False  # a fully masked row: PyTorch's math path gives zeros
    elif mask == "float":
        m = torch.randn(1, Hq, L, S)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    m = m.to(dtype) if m is not None and m.dtype != torch.bool else m
    before = fa._select.CHOSEN[(fa.KERNEL, "reference")]
    cpu, tpu = _run(q, k, v, m, causal, gqa)
    assert fa._select.CHOSEN[(fa.KERNEL, "reference")] > before  # the fused op ran (its blocked path)
    tol = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}.get(
        dtype, dict(atol=1e-5, rtol=1e-4))
    for a, b in zip(tpu, cpu):
        torch.testing.assert_close(a, b, **tol)


def test_sdpa_grad_fn_is_the_fused_op_and_mask_grad_goes_to_math():
    q = torch.randn(1, 2, 4, 8, device=DEV, requires_grad=True)
    o = F.scaled_dot_product_attention(q, q, q)
    assert "ScaledDotProductFusedAttentionOverrideable" in type(o.grad_fn).__name__
    assert torch._fused_sdp_choice(q, q, q) == int(SDPBackend.OVERRIDEABLE)
    assert torch._fused_sdp_choice(*(q.double(),) * 3) == int(SDPBackend.MATH)
    m = torch.randn(4, 4, device=DEV, requires_grad=True)
    assert torch._fused_sdp_choice(q, q, q, m) == int(SDPBackend.MATH)
    o = F.scaled_dot_product_attention(q, q, q, attn_mask=m)
    o.sum().backward()
    mc = m.detach().cpu().requires_grad_()
    qc = q.detach().cpu().requires_grad_()
    F.scaled_dot_product_attention(qc, qc, qc, attn_mask=mc).sum().backward()
    torch.testing.assert_close(m.grad.cpu(), mc.grad, atol=1e-5, rtol=1e-4)


def test_tensor_subclasses_go_to_math():
    class Sub(torch.Tensor):  # stands for DTensor: its sharding rules cover the math path's ops, not the fused op
        pass

    q = torch.randn(1, 2, 4, 8, device=DEV)
    assert fa.choose(q, q, q, None, 0.0, False, None, False) == int(SDPBackend.OVERRIDEABLE)
    assert fa.choose(q.as_subclass(Sub), q, q, None, 0.0, False, None, False) == int(SDPBackend.MATH)
    with pytest.raises(RuntimeError, match=r"tensor subclass \(Sub\)"):
        with sdpa_kernel(SDPBackend.OVERRIDEABLE):
            fa.choose(q.as_subclass(Sub), q, q, None, 0.0, False, None, False)


def test_sdpa_kernel_context_is_honoured():
    q = torch.randn(1, 2, 4, 8, device=DEV)
    with sdpa_kernel(SDPBackend.MATH):
        assert torch._fused_sdp_choice(q, q, q) == int(SDPBackend.MATH)
        o = F.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, q, q))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with pytest.raises(RuntimeError, match="no viable backend.*OVERRIDEABLE"):
            F.scaled_dot_product_attention(q, q, q)


def test_sdpa_4k_tokens_matches_cpu():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4096, 16) for _ in range(3))
    cpu, tpu = _run(q, k, v, causal=True)
    for a, b in zip(tpu, cpu):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_sdpa_dropout_statistics_and_determinism():
    L = S = 64
    q = torch.zeros(2, 4, L, 8, device=DEV, requires_grad=True)  # uniform attention: P = 1/S everywhere
    v = torch.ones(2, 4, S, 1, device=DEV, requires_grad=True)
    p = 0.25
    torch.manual_seed(1234)
    o1 = F.scaled_dot_product_attention(q, q, v, dropout_p=p)
    torch.manual_seed(1234)
    o2 = F.scaled_dot_product_attention(q, q, v, dropout_p=p)
    o3 = F.scaled_dot_product_attention(q, q, v, dropout_p=p)
    assert torch.equal(o1.cpu(), o2.cpu()) and not torch.equal(o1.cpu(), o3.cpu())
    # Each output is (kept keys / S) / (1 - p): mean 1, the kept fraction 1 - p.
    kept = (o1.detach().cpu() * (1 - p)).flatten()
    assert abs(kept.mean().item() - (1 - p)) < 0.02
    # Backward regenerates the same mask: dv[s] = sum over rows of the kept, rescaled probabilities.
    o1.sum().backward()
    torch.testing.assert_close(v.grad.cpu().sum(), o1.detach().cpu().sum(), rtol=1e-5, atol=1e-3)


def test_sdpa_fused_mode_and_compile_match_cpu(monkeypatch):
    # The kernel is chosen when a graph is traced; a graph loaded whole from the compile cache is not traced.
    monkeypatch.setenv("TORCH_TPU_CACHE", "0")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    qc = q.clone().requires_grad_()
    ref = f(qc, k, v)
    ref.sum().backward()
    compiled = torch.compile(f, backend="tpu")
    for run, mode in ((f, torch.tpu.EagerMode.DEFER_AND_FUSE), (compiled, None)):
        qt, kt, vt = (t.to(DEV).requires_grad_() for t in (q, k, v))
        if mode is not None:
            with torch.tpu.set_eager_mode(mode):
                o = run(qt, kt, vt)
                o.sum().backward()
        else:
            before = sum(n for (kern, _), n in _select.CHOSEN.items() if kern == fa.KERNEL)
            o = run(qt, kt, vt)
            o.sum().backward()
            # the compiled forward and backward graphs traced the fused op's lowerings
            assert sum(n for (kern, _), n in _select.CHOSEN.items() if kern == fa.KERNEL) >= before + 2
        torch.testing.assert_close(o.detach().cpu(), ref.detach(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(qt.grad.cpu(), qc.grad, atol=1e-5, rtol=1e-4)


# ---- the Pallas kernel (interpret mode) against the blocked XLA path and CPU torch ----

@pytest.mark.parametrize("hk,causal,bias", [(2, True, False), (1, False, True)])
def test_pallas_interpret_matches_blocked_and_cpu(hk, causal, bias):
    key = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(key[0], (1, 2, 128, 32), jnp.float32)
    k = jax.random.normal(key[1], (1, hk, 128, 32), jnp.float32)
    v = jax.random.normal(key[2], (1, hk, 128, 32), jnp.float32)
    b = jax.random.normal(key[3], (1, 1, 128, 128), jnp.float32) if bias else None
    if bias:  # a bool mask as the dispatcher passes it: -inf entries, one row with no key at all
        b = b.at[0, 0, 3].set(-jnp.inf).at[0, 0, 5, ::2].set(-jnp.inf)
    do = jax.random.normal(key[4], (1, 2, 128, 32), jnp.float32)
    sc = 32 ** -0.5
    assert fa._fits(q, k, v, 0.0)
    o_p, lse_p = fa._pallas_forward(q, k, v, b, causal, sc, "interpret")
    o_r, lse_r = fa._blocked_forward(q, k, v, b, causal, sc, 0.0, None)
    assert jnp.allclose(o_p, o_r, atol=1e-5) and jnp.allclose(lse_p, lse_r, atol=1e-5)
    g_p = fa._pallas_backward(do, q, k, v, b, o_p, lse_p, causal, sc, "interpret")
    g_r = fa._blocked_backward(do, q, k, v, b, o_r, lse_r, causal, sc, 0.0, None)
    for x, y in zip(g_p, g_r):
        assert jnp.allclose(x, y, atol=1e-4), float(jnp.abs(x - y).max())
    T = [torch.from_numpy(np.array(a)).requires_grad_() for a in (q, k, v)]
    o = F.scaled_dot_product_attention(*T, attn_mask=None if b is None else torch.from_numpy(np.array(b)),
                                       is_causal=causal, enable_gqa=hk != 2)
    o.backward(torch.from_numpy(np.array(do)))
    torch.testing.assert_close(torch.from_numpy(np.array(o_p)), o.detach(), atol=1e-5, rtol=1e-4)
    for x, t in zip(g_p, T):
        torch.testing.assert_close(torch.from_numpy(np.array(x)), t.grad, atol=1e-4, rtol=1e-4)


def test_fits_rule():
    q = jnp.zeros((1, 2, 128, 32), jnp.float32)
    assert fa._fits(q, q, q, 0.0)
    assert not fa._fits(q, q, q, 0.1)  # dropout: the blocked path
    r = jnp.zeros((1, 2, 100, 32), jnp.float32)
    assert not fa._fits(r, r, r, 0.0)  # not whole blocks
    assert _select.path(fa.KERNEL, False) == "reference"
