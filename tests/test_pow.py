"""pow(tensor, scalar) against CPU PyTorch. CPU computes the exponents 2, 3, -2, 0.5, -0.5 and -1 with exact forms
(x * x, sqrt, 1 / x, ...) and 0 and 1 as fill / copy; tpu picks the same forms on the device (lax.switch on the
traced exponent, kernels/math.py), so those results match CPU bit for bit wherever XLA:CPU's own arithmetic does:
it flushes subnormal results to zero, and its sqrt may differ from a correctly rounded one by an ulp. A new exponent
value must not compile a new program. (On TPU the kernel keeps XLA's power, which fuses with its neighbours: there
the results are checked within tolerance.)"""

from __future__ import annotations

import pytest
import torch
from torch_tpu import _runtime

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
EXACT = {  # exponents whose tpu result is CPU's bit for bit (outside subnormal results)
    torch.float32: (2.0, 3.0, -2.0, -0.5, -1.0, 1.0, 0.0),
    torch.float64: (2.0, 3.0, -2.0, -0.5, -1.0, 1.0, 0.0),
    # bfloat16 3 and -2: CPU rounds x * x to bfloat16 first (one ulp apart at times)
    torch.bfloat16: (2.0, -0.5, -1.0, 1.0, 0.0),
    torch.float16: (2.0, 3.0, -2.0, -0.5, -1.0, 1.0, 0.0),
}
# CPU's float16 pow(x, +-0.5) is C's pow: pow(-0, 0.5) = +0 and pow(-inf, 0.5) = +inf, where sqrt (tpu's form, and
# XLA's power before it) gives -0 and nan: the one known divergence at special values, left out below.
SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -1.0, 2.0, -3.5, 0.25, 1e4, -1e4]
MODES = ("DEFER_NEVER", "DEFER_AND_FUSE")
FORMS = _runtime.platform() == "cpu"  # the exact forms are XLA:CPU's (kernels/math.py, _pow_scalar_exponent)


def _values(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, generator=g, dtype=torch.float64) * 3
    return torch.cat([x, torch.tensor(SPECIAL, dtype=torch.float64)]).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal values with equal signs (so -0 != 0), or both NaN."""
    a, b = a.double(), b.double()
    return ((a == b) & (a.signbit() == b.signbit())) | (a.isnan() & b.isnan())


def _normal(t: torch.Tensor) -> torch.Tensor:
    """Where a result is not subnormal (XLA:CPU flushes those to zero)."""
    tiny = torch.finfo(t.dtype).tiny
    return ~((t != 0) & (t.abs() < tiny))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_special_exponents_match_cpu(dtype: torch.dtype, mode: str) -> None:
    x = _values(dtype)
    t = x.to("tpu")
    with torch.tpu.set_eager_mode(mode):
        got = {e: t.pow(e) for e in (2.0, 3.0, -2.0, 0.5, -0.5, -1.0, 1.0, 0.0, 2.5, 4, -3)}
        got = {e: v.cpu() for e, v in got.items()}
    for e, value in got.items():
        want = x.pow(e)
        assert value.dtype == want.dtype, e
        # special values (NaN, +-inf, +-0) take CPU's semantics in every form: pow(nan, 0) = 1, sqrt(-0) = -0, ...
        known = torch.ones(len(x), dtype=torch.bool)
        if dtype == torch.float16 and e in (0.5, -0.5):
            known = ~((x == 0) & x.signbit() | (x == -float("inf")))
        value, want, x_ = value[known], want[known], x[known]
        special = torch.arange(len(x_)) >= len(x_) - int(known[-len(SPECIAL):].sum())
        torch.testing.assert_close(value[special], want[special], equal_nan=True, rtol=1e-2, atol=0,
                                   msg=lambda m, e=e: f"exponent {e}: {m}")
        if FORMS and e in EXACT[dtype]:
            keep = _normal(want)
            bad = ~_same_bits(value, want) & keep
            assert not bool(bad.any()), (e, x_[bad][:5].tolist(), value[bad][:5].tolist(), want[bad][:5].tolist())
        else:
            torch.testing.assert_close(value, want, equal_nan=True, msg=lambda m, e=e: f"exponent {e}: {m}")


@pytest.mark.skipif(not FORMS, reason="the exact forms run on XLA:CPU only")
def test_signed_zero_and_infinity_semantics() -> None:
    # the forms CPU uses give these, where a general pow would not: sqrt(-0) = -0, sqrt(-inf) = nan, 1/sqrt(-0) = -inf
    x = torch.tensor([-0.0, 0.0, -float("inf"), float("inf"), float("nan")])
    for e in (0.5, -0.5, -1.0, -2.0, 0.0, 1.0):
        got = x.to("tpu").pow(e).cpu()
        assert bool(_same_bits(got, x.pow(e)).all()), (e, got.tolist(), x.pow(e).tolist())


def test_new_exponent_values_do_not_compile() -> None:
    x = torch.randn(7, 5, device="tpu")
    x.pow(2.0).cpu()  # compiles the program once
    before = torch.tpu.metrics().compiles
    for e in (3.0, 0.5, 2.5, -1.0, 7.0, 0.0):
        torch.testing.assert_close(x.pow(e).cpu(), x.cpu().pow(e), equal_nan=True)
    assert torch.tpu.metrics().compiles == before


@pytest.mark.parametrize("mode", MODES)
def test_in_place_out_and_operator_forms(mode: str) -> None:
    c = torch.randn(4, 6, dtype=torch.float32)
    with torch.tpu.set_eager_mode(mode):
        t = c.to("tpu")
        t.pow_(2)
        out = torch.empty(4, 6, device="tpu")
        torch.pow(c.to("tpu"), 3, out=out)
        sq = torch.square(c.to("tpu"))
        star = c.to("tpu") ** -1
        results = [r.cpu() for r in (t, out, sq, star)]
    for got, want in zip(results, (c.pow(2), c.pow(3), torch.square(c), c ** -1)):
        assert bool(_same_bits(got, want).all()) if FORMS else torch.allclose(got, want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5, -0.5, 1.0, 2.5])
def test_gradients_match_cpu(exponent: float, mode: str) -> None:
    # pow's backward is grad * e * x.pow(e - 1): it reaches the forms too (x.pow(1.0) for a square)
    c = torch.rand(5, 8, dtype=torch.float32) + 0.5
    cx = c.clone().requires_grad_()
    cx.pow(exponent).sum().backward()
    with torch.tpu.set_eager_mode(mode):
        tx = c.to("tpu").requires_grad_()
        tx.pow(exponent).sum().backward()
        grad = tx.grad.cpu()
    torch.testing.assert_close(grad, cx.grad)


def test_compiled_constant_exponent() -> None:
    def rms(h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

    h = torch.randn(4, 16, 32)
    got = torch.compile(rms, backend="tpu")(h.to("tpu")).cpu()
    torch.testing.assert_close(got, rms(h))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_rsqrt_and_division_by_sqrt_match_cpu(dtype: torch.dtype, mode: str) -> None:
    # CPU computes rsqrt as 1 / sqrt(x). XLA's rsqrt (which its simplifier also makes of `a / sqrt(b)` inside one
    # program, as in a fused hand-written layer norm) differs from that in about a third of float32 elements on
    # XLA:CPU; tpu keeps CPU's form there (kernels/math.py, _sqrt and _rsqrt), bit for bit for rsqrt
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(4000, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-20, 20, (4000,), generator=g))
    x = torch.cat([x, torch.tensor(SPECIAL, dtype=torch.float64)]).to(dtype)
    y = torch.randn(len(x), generator=g, dtype=torch.float64).to(dtype)
    with torch.tpu.set_eager_mode(mode):
        t, u = x.to("tpu"), y.to("tpu")
        got = [r.cpu() for r in (torch.rsqrt(t), u / torch.sqrt(t), u / t.sqrt().float(), t.pow(-0.5))]
    wants = (torch.rsqrt(x), y / torch.sqrt(x), y / x.sqrt().float(), x.pow(-0.5))
    for k, (value, want) in enumerate(zip(got, wants)):
        assert value.dtype == want.dtype
        normal = _normal(want) & _normal(x if x.dtype == want.dtype else x.float())
        if dtype == torch.float16 and k == 3:  # C's pow at -0 and -inf (see SPECIAL above)
            normal &= ~((x == 0) & x.signbit() | (x == -float("inf")))
        if FORMS and k in (0, 3):  # (XLA:CPU's sqrt itself may be an ulp off, so a division by it is too)
            bad = ~_same_bits(value, want) & normal
            assert not bool(bad.any()), (k, x[bad][:5].tolist(), value[bad][:5].tolist(), want[bad][:5].tolist())
        else:
            torch.testing.assert_close(value[normal], want[normal], equal_nan=True)


@pytest.mark.parametrize("mode", MODES)
def test_hand_written_layer_norm_matches_cpu(mode: str) -> None:
    # timm's ConvNeXt-style LayerNorm: (x - u) / torch.sqrt(s + eps), fused into one program in DEFER_AND_FUSE
    def ln(x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return (x - u) / torch.sqrt(s + 1e-6)

    x = torch.randn(4, 8, 64)
    with torch.tpu.set_eager_mode(mode):
        got = ln(x.to("tpu")).cpu()
    torch.testing.assert_close(got, ln(x), rtol=1e-6, atol=1e-6)
