"""torch._grouped_mm and torch.tpu.ops.grouped_matmul on tpu (kernels/pallas/grouped_matmul.py): every layout PyTorch
routes, float32 and bfloat16, forward and backward against CPU PyTorch's own _grouped_mm, in the three execution
paths; the megablox Pallas path (interpret mode) against the XLA reference and against CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_tpu._deferred import EagerMode
from torch_tpu._jax import jax, jnp
from torch_tpu.kernels.pallas import _select
from torch_tpu.kernels.pallas import grouped_matmul as gm

G = 3
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


def _case(layout: str, dtype: torch.dtype, m: int = 24, k: int = 16, n: int = 32, seed: int = 0):
    """(a, b, offs, the part of the output CPU defines): rows/columns past offs[-1] are left uninitialised by CPU
    PyTorch's kernel (zeros on tpu)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    end = m - 4
    offs = torch.tensor([5, 5, end], dtype=torch.int32)  # an empty group, and a tail past the groups
    if layout == "2d3d":
        return r(m, k), r(G, k, n), offs, (slice(0, end),)
    if layout == "3d2d":
        return r(G, n, k), r(k, m), offs, (slice(None), slice(0, end))
    if layout == "2d2d":
        return r(n, m), r(m, k), offs, (slice(None),)
    return r(G, n, k), r(G, k, m), None, (slice(None),)


def _fwd_bwd(a, b, offs, grad, mode="never"):
    """out = _grouped_mm(a, b, offs), then the backward of sum(out * grad), in one of the execution paths (compiled:
    the forward with fullgraph=True, its backward graph run by autograd)."""
    a = a.detach().requires_grad_()
    b = b.detach().requires_grad_()

    def fn(a, b, offs):
        return torch._grouped_mm(a, b, offs)

    if mode == "compile":
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="tpu", fullgraph=True)
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE if mode == "fuse" else torch.tpu.eager_mode):
        out = fn(a, b, offs)
        (out * grad).sum().backward()
    return out.detach(), a.grad, b.grad


def _check(layout, dtype, mode="never", **shape):
    a, b, offs, part = _case(layout, dtype, **shape)
    want = torch._grouped_mm(a, b, offs)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want_out, want_da, want_db = _fwd_bwd(a, b, offs, grad)
    dev = [x.to("tpu") if x is not None else None for x in (a, b, offs, grad)]
    out, da, db = _fwd_bwd(*dev, mode=mode)
    assert out.dtype == dtype and out.shape == want_out.shape
    torch.testing.assert_close(out.cpu()[part], want_out[part], **TOL[dtype])
    if layout == "2d3d":  # rows past the groups: zeros, and no gradient flows to them
        assert torch.count_nonzero(out.cpu()[part[0].stop:]) == 0
        assert torch.count_nonzero(da.cpu()[part[0].stop:]) == 0
        torch.testing.assert_close(da.cpu()[part], want_da[part], **TOL[dtype])
        torch.testing.assert_close(db.cpu(), want_db, **TOL[dtype])
    elif layout == "3d2d":
        torch.testing.assert_close(da.cpu(), want_da, **TOL[dtype])
        torch.testing.assert_close(db.cpu()[part], want_db[part], **TOL[dtype])
    elif layout == "2d2d":  # the shared dimension past the groups gets no gradient (CPU leaves it uninitialised)
        end = offs[-1].item()
        torch.testing.assert_close(da.cpu()[:, :end], want_da[:, :end], **TOL[dtype])
        torch.testing.assert_close(db.cpu()[:end], want_db[:end], **TOL[dtype])
        assert torch.count_nonzero(da.cpu()[:, end:]) == 0 and torch.count_nonzero(db.cpu()[end:]) == 0
    else:
        torch.testing.assert_close(da.cpu(), want_da, **TOL[dtype])
        torch.testing.assert_close(db.cpu(), want_db, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["2d3d", "3d2d", "2d2d", "3d3d"])
def test_layouts_forward_backward_match_cpu(layout: str, dtype: torch.dtype) -> None:
    _check(layout, dtype)


# (under torch.compile PyTorch's meta function of _grouped_mm takes bfloat16 only, as it does for CUDA)
@pytest.mark.parametrize("mode,dtype", [("fuse", torch.float32), ("compile", torch.bfloat16)])
def test_fused_and_compiled_match_cpu(mode: str, dtype: torch.dtype) -> None:
    _check("2d3d", dtype, mode=mode, m=32)


def test_grouped_matmul_entry_matches_a_per_group_loop() -> None:
    g = torch.Generator().manual_seed(3)
    lhs, rhs = torch.randn(20, 8, generator=g), torch.randn(4, 8, 16, generator=g)
    sizes = torch.tensor([3, 0, 9, 6])
    out = torch.tpu.ops.grouped_matmul(lhs.to("tpu"), rhs.to("tpu"), sizes.to("tpu")).cpu()
    ends = np.cumsum(sizes.numpy())
    for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends)):
        torch.testing.assert_close(out[s:t], lhs[s:t] @ rhs[e], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[ends[-1]:]) == 0
    torch._dynamo.reset()  # a torch op, so compiled graphs hold it (fullgraph); bfloat16: PyTorch's meta rule
    fn = torch.compile(lambda l, r, s: torch.tpu.ops.grouped_matmul(l, r, s), backend="tpu", fullgraph=True)
    got = fn(lhs.bfloat16().to("tpu"), rhs.bfloat16().to("tpu"), sizes.to("tpu")).cpu()
    torch.testing.assert_close(got.float()[:ends[-1]], out[:ends[-1]], rtol=2e-2, atol=1e-1)
    with pytest.raises(RuntimeError, match="group_sizes must be a 1-D integer tensor"):
        torch.tpu.ops.grouped_matmul(lhs.to("tpu"), rhs.to("tpu"), sizes.float().to("tpu"))


def test_errors_follow_pytorch() -> None:
    a, b = torch.randn(8, 8, device="tpu"), torch.randn(2, 8, 8, device="tpu")
    with pytest.raises(RuntimeError, match="Offsets have to be int32"):
        torch._grouped_mm(a, b, torch.tensor([4, 8], device="tpu"))
    with pytest.raises(RuntimeError, match="Have to provide offsets"):
        torch._grouped_mm(a, b)
    with pytest.raises(RuntimeError, match="Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Int"):
        torch._grouped_mm(a.int(), b.int(), torch.tensor([4, 8], dtype=torch.int32, device="tpu"))
    with pytest.raises(RuntimeError, match="Grouped gemm output dtype must match"):
        torch._grouped_mm(a, b, torch.tensor([4, 8], dtype=torch.int32, device="tpu"), out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="matrix batch sizes have to match"):
        torch._grouped_mm(a, b, torch.tensor([4], dtype=torch.int32, device="tpu"))


def test_bad_offsets_raise_at_the_next_sync() -> None:
    a, b = torch.randn(8, 8, device="tpu"), torch.randn(2, 8, 8, device="tpu")
    out = torch._grouped_mm(a, b, torch.tensor([6, 3], dtype=torch.int32, device="tpu"))  # decreasing
    with pytest.raises(RuntimeError, match=r"offs must be non-decreasing int32 group ends in \[0, 8\]"):
        out.cpu()
    out = torch._grouped_mm(a, b, torch.tensor([4, 9], dtype=torch.int32, device="tpu"))  # past the rows
    with pytest.raises(RuntimeError, match="offs must be non-decreasing"):
        torch.tpu.synchronize()
    del out


# ---- the Pallas path (megablox, interpret mode) against the reference ----

def test_pallas_gmm_matches_reference_bf16() -> None:
    m, k, n = 32, 16, 128
    tiling = gm.gmm_tiling(m, k, n, jnp.bfloat16)
    assert tiling == (32, 16, 128)
    ks = jax.random.split(jax.random.key(0), 2)
    lhs = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    rhs = jax.random.normal(ks[1], (G, k, n), jnp.float32).astype(jnp.bfloat16)
    sizes = jnp.array([7, 0, 17], jnp.int32)
    got = np.asarray(gm.gmm_pallas(lhs, rhs, sizes, jnp.bfloat16, tiling, interpret=True).astype(jnp.float32))
    ref = np.asarray(gm.gmm_reference(lhs, rhs, sizes, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=5e-2)
    assert not got[24:].any()  # rows past the groups: zeros on both paths
    cpu = torch._grouped_mm(torch.from_numpy(np.array(lhs.astype(jnp.float32))).bfloat16(),
                            torch.from_numpy(np.array(rhs.astype(jnp.float32))).bfloat16(),
                            torch.tensor([7, 7, 24], dtype=torch.int32))
    np.testing.assert_allclose(got[:24], cpu[:24].float().numpy(), rtol=2e-2, atol=5e-2)


def test_pallas_path_forward_backward_through_torch(monkeypatch) -> None:
    """TORCH_TPU_PALLAS=interpret: _grouped_mm and its backward (PyTorch's formula: gmm with the transposed rhs, tgmm
    for the weight gradient) run the megablox kernels and match CPU. (Shapes no other test uses: the per-op programs
    are cached by shape, and the path is chosen when a program is traced.)"""
    monkeypatch.setenv("TORCH_TPU_PALLAS", "interpret")
    before = _select.CHOSEN[(gm.KERNEL, "interpret")]
    _check("2d3d", torch.float32, m=40, k=8, n=16)
    assert _select.CHOSEN[(gm.KERNEL, "interpret")] >= before + 3  # forward, grad of a (gmm), grad of b (tgmm)


def test_tiling_rule() -> None:
    assert gm.gmm_tiling(256, 512, 1024, jnp.bfloat16) == (128, 128, 128)
    assert gm.gmm_tiling(24, 16, 32, jnp.bfloat16) is None  # 24 rows: no tile of 16 sublanes divides them
    assert gm.gmm_tiling(24, 16, 32, jnp.float32) == (8, 16, 32)
    assert gm.gmm_tiling(32, 16, 32, jnp.float16) is None  # megablox takes bfloat16 and float32 only
    assert gm.tgmm_tiling(384, 64, 256, jnp.float32) == (128, 64, 128)
    assert gm.tgmm_tiling(200, 64, 256, jnp.float32) is None  # the ragged contraction is a lane dimension
