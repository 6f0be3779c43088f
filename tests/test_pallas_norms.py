"""kernels/pallas/norms.py: the fused LayerNorm / RMSNorm Pallas kernels in interpret mode against their XLA
reference (kernels/nn/normalization.py) and CPU PyTorch, forward and backward, and which path the ATen ops take."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torch_tpu import _runtime
from torch_tpu._jax import jnp
from torch_tpu.kernels.nn import normalization as ref
from torch_tpu.kernels.pallas import _select, norms

# (shape, normalized_shape): rows x lanes that fit the kernel, one with 2 normalised dims.
FITS = [((2, 16, 256), (256,)), ((16, 2, 128), (2, 128))]
DTYPES = [torch.float32, torch.bfloat16]
# bfloat16: against float32 math on the same (bfloat16) values, so the kernel's float32 statistics are checked and
# the tolerance is a few roundings to bfloat16 of the result.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=4e-2, rtol=1.6e-2)}


def _j(t: torch.Tensor | None):
    """A CPU tensor as a JAX array of the same dtype."""
    if t is None:
        return None
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.numpy())


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(jnp.float32)))


def _close(got, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(_t(got).reshape(want.shape), want.float(), **TOL[dtype])


def _inputs(shape, nshape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(nshape, generator=g) + 0.5).to(dtype)
    b = torch.randn(nshape, generator=g).to(dtype)
    go = torch.randn(shape, generator=g).to(dtype)
    return x, w, b, go


@pytest.mark.parametrize("shape,nshape", FITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_kernel_matches_reference_and_cpu(shape, nshape, dtype) -> None:
    x, w, b, go = _inputs(shape, nshape, dtype)
    n = int(np.prod(nshape))
    axis = len(shape) - len(nshape)
    assert norms.fits(_j(x), axis, _j(w), _j(b), streams=3)
    want_y, want_mean, want_rstd = torch.native_layer_norm(x.float(), nshape, w.float(), b.float(), 1e-5)
    want_dx, want_dw, want_db = torch.ops.aten.native_layer_norm_backward(
        go.float(), x.float(), nshape, want_mean, want_rstd, w.float(), b.float(), [True, True, True])

    y, mean, rstd = norms.layer_norm_fwd(_j(x).reshape(-1, n), _j(w), _j(b), 1e-5, interpret=True)
    assert y.dtype == _j(x).dtype and mean.dtype == rstd.dtype == jnp.float32
    ry, rmean, rrstd = ref.layer_norm_reference(_j(x), nshape, _j(w), _j(b), 1e-5)
    for got, r, want in ((y, ry, want_y), (mean, rmean, want_mean), (rstd, rrstd, want_rstd)):
        _close(got, want, dtype)
        _close(r, want, dtype)

    # the backward from the kernel's float32 statistics; the reference's from its own (in the input's dtype)
    dx, dw, db = norms.layer_norm_bwd(_j(go).reshape(-1, n), _j(x).reshape(-1, n), mean, rstd, _j(w),
                                      [True, True, True], interpret=True)
    rdx, rdw, rdb = ref.layer_norm_backward_reference(_j(go), _j(x), nshape, rmean, rrstd, _j(w), _j(b),
                                                      [True, True, True])
    assert rdx.dtype == rdw.dtype == rdb.dtype == _j(x).dtype
    for got, r, want in ((dx, rdx, want_dx), (dw, rdw, want_dw), (db, rdb, want_db)):
        _close(got, want, dtype)
        _close(r, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_kernel_without_affine_and_with_a_partial_mask(dtype) -> None:
    x, _, _, go = _inputs((32, 128), (128,), dtype, seed=1)
    want_y, mean, rstd = torch.native_layer_norm(x.float(), (128,), None, None, 1e-3)
    want_dx = torch.ops.aten.native_layer_norm_backward(go.float(), x.float(), (128,), mean, rstd, None, None,
                                                        [True, False, False])[0]
    y, kmean, krstd = norms.layer_norm_fwd(_j(x), None, None, 1e-3, interpret=True)
    _close(y, want_y, dtype)
    dx, dw, db = norms.layer_norm_bwd(_j(go), _j(x), kmean, krstd, None, [True, False, False], interpret=True)
    assert dw is None and db is None
    _close(dx, want_dx, dtype)


def _rms_cpu(x, nshape, w, go, eps):
    """CPU's F.rms_norm (ATen's composite) and its autograd gradients, in float64 for the reference values."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_() if w is not None else None
    y = F.rms_norm(x64, nshape, w64, eps)
    y.backward(go.double())
    rstd = torch.rsqrt(x64.detach().pow(2).mean(tuple(range(x.dim() - len(nshape), x.dim())), keepdim=True)
                       + (eps if eps is not None else torch.finfo(torch.float32).eps))
    return y.detach(), rstd, x64.grad, (w64.grad if w is not None else None)


@pytest.mark.parametrize("shape,nshape", FITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_matches_reference_and_cpu(shape, nshape, dtype) -> None:
    x, w, _, go = _inputs(shape, nshape, dtype, seed=2)
    n = int(np.prod(nshape))
    want_y, want_rstd, want_dx, want_dw = _rms_cpu(x, nshape, w, go, 1e-6)
    # CPU's output in the input's dtype: the kernel must round the same float32 value
    torch.testing.assert_close(F.rms_norm(x, nshape, w, 1e-6).float(), want_y.to(dtype).float(), **TOL[dtype])

    y, rstd = norms.rms_norm_fwd(_j(x).reshape(-1, n), _j(w), 1e-6, interpret=True)
    assert y.dtype == _j(x).dtype and rstd.dtype == jnp.float32
    ry, rrstd = ref.rms_norm_reference(_j(x), nshape, _j(w), 1e-6)
    assert rrstd.dtype == jnp.float32 and rrstd.shape == tuple(want_rstd.shape)
    for got, r, want in ((y, ry, want_y), (rstd, rrstd, want_rstd)):
        _close(got, want, dtype)
        _close(r, want, dtype)

    dx, dw = norms.rms_norm_bwd(_j(go).reshape(-1, n), _j(x).reshape(-1, n), rstd, _j(w), [True, True],
                                interpret=True)
    rdx, rdw = ref.rms_norm_backward_reference(_j(go), _j(x), nshape, rrstd, _j(w), [True, True])
    for got, r, want in ((dx, rdx, want_dx), (dw, rdw, want_dw)):
        _close(got, want, dtype)
        _close(r, want, dtype)


def test_rms_norm_kernel_without_weight() -> None:
    x, _, _, go = _inputs((8, 384), (384,), torch.float32, seed=3)
    want_y, _, want_dx, _ = _rms_cpu(x, (384,), None, go, None)
    y, rstd = norms.rms_norm_fwd(_j(x), None, ref.rms_norm_eps(_j(x), None), interpret=True)
    _close(y, want_y, torch.float32)
    dx, dw = norms.rms_norm_bwd(_j(go), _j(x), rstd, None, [True, True], interpret=True)
    assert dw is None
    _close(dx, want_dx, torch.float32)


@pytest.mark.parametrize("shape,nshape,dtype", [
    ((4, 100), (100,), torch.float32),  # 100 lanes: not a multiple of 128
    ((3, 256), (256,), torch.float32),  # 3 rows: no row block
    ((8, 256), (256,), torch.bfloat16),  # bfloat16 needs 16-row blocks
    ((8, 256), (256,), torch.float64),
    ((16, 0), (0,), torch.float32),  # nothing to normalise
])
def test_shapes_the_kernel_does_not_take(shape, nshape, dtype) -> None:
    x = torch.zeros(shape, dtype=dtype)
    assert not norms.fits(_j(x), len(shape) - len(nshape), streams=2)


def _chosen(kernel: str) -> dict[str, int]:
    return {p: _select.CHOSEN[(kernel, p)] for p in _select.PATHS}


def _diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {p: after[p] - before[p] for p in after if after[p] != before[p]}


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_op_takes_the_interpret_path_where_it_fits(monkeypatch, tpu, dtype) -> None:
    """The ATen op on tpu through its one lowering with TORCH_TPU_PALLAS=interpret (shapes no other test traces:
    the choice is made when a program is traced)."""
    monkeypatch.setenv("TORCH_TPU_PALLAS", "interpret")
    x, w, b, go = _inputs((48, 640), (640,), dtype, seed=4)
    before = [_chosen("layer_norm"), _chosen("layer_norm_backward")]
    xt, wt, bt = (t.to(tpu).requires_grad_() for t in (x, w, b))
    y = F.layer_norm(xt, (640,), wt, bt)
    y.backward(go.to(tpu))
    assert [_diff(b_, _chosen(k)) for b_, k in zip(before, ("layer_norm", "layer_norm_backward"))] == [
        {"interpret": 1}, {"interpret": 1}]
    xc, wc, bc = (t.clone().float().requires_grad_() for t in (x, w, b))
    yc = F.layer_norm(xc, (640,), wc, bc)
    yc.backward(go.float())
    tol = TOL[dtype]
    torch.testing.assert_close(y.cpu().float(), yc.detach(), **tol)
    for got, want in ((xt.grad, xc.grad), (wt.grad, wc.grad), (bt.grad, bc.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu().float(), want, **{**tol, "atol": tol["atol"] * 4})


def test_rms_norm_goes_through_the_fused_op_on_tpu(monkeypatch, tpu) -> None:
    """F.rms_norm on tpu reaches _fused_rms_norm (ATen's rms_norm calls it on devices with a kernel) and its
    backward; with TORCH_TPU_PALLAS=interpret both run the Pallas kernels."""
    monkeypatch.setenv("TORCH_TPU_PALLAS", "interpret")
    x, w, _, go = _inputs((3, 16, 512), (512,), torch.float32, seed=5)
    before = [_chosen("rms_norm"), _chosen("rms_norm_backward")]
    xt, wt = (t.to(tpu).requires_grad_() for t in (x, w))
    y = F.rms_norm(xt, (512,), wt, 1e-5)
    y.backward(go.to(tpu))
    assert [_diff(b_, _chosen(k)) for b_, k in zip(before, ("rms_norm", "rms_norm_backward"))] == [
        {"interpret": 1}, {"interpret": 1}]
    want_y, _, want_dx, want_dw = _rms_cpu(x, (512,), w, go, 1e-5)
    torch.testing.assert_close(y.detach().cpu(), want_y.float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(xt.grad.cpu(), want_dx.float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(wt.grad.cpu(), want_dw.float(), atol=1e-4, rtol=2e-5)


def test_cpu_platform_takes_the_reference_by_default(monkeypatch, tpu) -> None:
    monkeypatch.delenv("TORCH_TPU_PALLAS", raising=False)
    x = torch.randn(24, 896)
    before = [_chosen("layer_norm"), _chosen("rms_norm")]
    y = F.layer_norm(x.to(tpu), (896,))
    r = F.rms_norm(x.to(tpu), (896,))
    want = "tpu" if _runtime.platform() == "tpu" else "reference"
    assert [_diff(before[0], _chosen("layer_norm")), _diff(before[1], _chosen("rms_norm"))] == [{want: 1}] * 2
    torch.testing.assert_close(y.cpu(), F.layer_norm(x, (896,)), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(r.cpu(), F.rms_norm(x, (896,)), atol=2e-5, rtol=2e-5)


def test_a_shape_that_does_not_fit_takes_the_reference_under_interpret(monkeypatch, tpu) -> None:
    monkeypatch.setenv("TORCH_TPU_PALLAS", "interpret")
    x = torch.randn(6, 5, 100)
    before = _chosen("layer_norm")
    y = F.layer_norm(x.to(tpu), (5, 100))
    assert _diff(before, _chosen("layer_norm")) == {"reference": 1}
    torch.testing.assert_close(y.cpu(), F.layer_norm(x, (5, 100)), atol=2e-5, rtol=2e-5)


def test_layer_norm_statistics_dtype_follows_cpu(tpu) -> None:
    """Mean/rstd: the input's dtype, float32 for a bfloat16 input with float32 parameters (CPU's rule)."""
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for w in (torch.randn(8, dtype=torch.bfloat16), torch.randn(8)):
        want = torch.native_layer_norm(x, (8,), w, w, 1e-5)
        got = torch.native_layer_norm(x.to(tpu), (8,), w.to(tpu), w.to(tpu), 1e-5)
        assert [t.dtype for t in got] == [t.dtype for t in want]
        assert [t.shape for t in got] == [t.shape for t in want]


def test_rms_and_layer_norm_errors_follow_cpu(tpu) -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"Expected weight to be of same shape as normalized_shape"):
        torch.native_layer_norm(x.to(tpu), (8,), torch.ones(4, device=tpu), None, 1e-5)
    with pytest.raises(RuntimeError, match=r"Expected weight to be of same shape as normalized_shape"):
        torch.native_layer_norm(x, (8,), torch.ones(4), None, 1e-5)
    with pytest.raises(RuntimeError, match=r"Given normalized_shape=\[4\], expected input with shape \[\*, 4\]"):
        torch._fused_rms_norm(x.to(tpu), [4], None, None)
    with pytest.raises(RuntimeError, match=r"\"rms_norm\" not implemented for 'Long'"):
        torch._fused_rms_norm(torch.ones(2, 8, dtype=torch.long, device=tpu), [8], None, None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_tpu_path_lowers_to_mosaic(dtype, monkeypatch) -> None:
    """The "tpu" path (interpret=False) lowered for a TPU without one (jax.export): Pallas accepts the block specs
    and emits the Mosaic custom call, and every block index is an int32. Mosaic's own compile runs only on a TPU,
    where an int64 block index (a Python 0 under torch_tpu's jax_enable_x64) failed every LayerNorm on a v5e:
    "failed to legalize operation 'func.return' ... (i32, i64)"."""
    import jax
    from jax import export
    from jax.experimental import pallas as pl

    index_maps = []
    block_spec = pl.BlockSpec

    def recording(shape, index_map, *args, **kwargs):
        index_maps.append(index_map)
        return block_spec(shape, index_map, *args, **kwargs)

    monkeypatch.setattr(pl, "BlockSpec", recording)

    x, w = jax.ShapeDtypeStruct((64, 512), dtype), jax.ShapeDtypeStruct((512,), dtype)
    st = jax.ShapeDtypeStruct((64, 1), jnp.float32)
    programs = [
        (lambda x, w: norms.layer_norm_fwd(x, w, w, 1e-5, interpret=False), (x, w)),
        (lambda g, x, m, r, w: norms.layer_norm_bwd(g, x, m, r, w, (True, True, True), interpret=False),
         (x, x, st, st, w)),
        (lambda x, w: norms.rms_norm_fwd(x, w, 1e-6, interpret=False), (x, w)),
        (lambda g, x, r, w: norms.rms_norm_bwd(g, x, r, w, (True, True), interpret=False), (x, x, st, w)),
    ]
    for fn, args in programs:
        assert "tpu_custom_call" in export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert jax.config.jax_enable_x64 and len(index_maps) >= 4 * 3
    for index_map in index_maps:
        blocks = jax.eval_shape(index_map, jax.ShapeDtypeStruct((), jnp.int32))
        assert [b.dtype for b in blocks] == [jnp.int32] * len(blocks), blocks
