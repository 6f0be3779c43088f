"""torch.special's Bessel/Airy/orthogonal-polynomial functions and torch.linalg's eig, eigvals, lstsq,
ldl_factor(_ex) and ldl_solve against CPU PyTorch, beyond the few OpInfo samples: value grids with the edge
cases of CPU's kernels, every lstsq driver and shape class, Bunch-Kaufman pivots, and gradients."""

from __future__ import annotations

import pytest
import torch

import torch_tpu

# Fused with the extended tests (tools/test_extended): the OpInfo suite runs a spread of ops fused by default.
MODES = ["DEFER_NEVER", pytest.param("DEFER_AND_FUSE", marks=pytest.mark.extended)]

# ---- special functions ----

UNARY = ["bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1",
         "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1",
         "airy_ai"]
POLYNOMIALS = ["chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
               "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u",
               "shifted_chebyshev_polynomial_v", "shifted_chebyshev_polynomial_w", "hermite_polynomial_h",
               "hermite_polynomial_he", "laguerre_polynomial_l", "legendre_polynomial_p"]


def _unary_points(dtype: torch.dtype) -> torch.Tensor:
    pts = [torch.linspace(-40, 40, 4001, dtype=torch.float64), torch.logspace(-6, 3, 400, dtype=torch.float64),
           -torch.logspace(-6, 3, 400, dtype=torch.float64),
           torch.tensor([0.0, 1.0, 2.0, 8.0, 12.0, 50.0, float("inf"), -float("inf"), float("nan")],
                        dtype=torch.float64)]
    return torch.cat(pts).to(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", UNARY)
def test_special_unary_against_cpu(name, dtype, mode) -> None:
    fn = getattr(torch.special, name)
    x = _unary_points(dtype)
    expect = fn(x)
    if name == "airy_ai" and dtype == torch.float32:
        # CPU's float32 Airy takes the phase of its x < -2 expansion in float32 (1e-4 off by x = -1000): the
        # oracle is CPU's float64 result, rounded
        expect = fn(x.double()).float()
    with torch.tpu.set_eager_mode(mode):
        got = fn(x.to("tpu")).cpu()
    assert got.dtype == expect.dtype
    tol = dict(rtol=1.3e-6, atol=1e-5)
    if dtype == torch.float64:
        # Measured against scipy, CPU's float64 J0/J1/Y0/Y1 are off by up to 9e-7 for large x (its phase
        # x - pi/4 is rounded; these reduce x exactly) and its Airy by up to 3e-6 on (-8, -2); elsewhere both
        # agree to ~1e-12.
        big = name.startswith("bessel_") or name == "airy_ai"
        tol = dict(rtol=1e-9, atol=5e-6) if big else dict(rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(got, expect, equal_nan=True, **tol)


def test_special_unary_integral_promotes() -> None:
    for name in UNARY:
        fn = getattr(torch.special, name)
        for x in (torch.arange(-5, 20), torch.tensor([True, False])):
            got = fn(x.to("tpu")).cpu()
            torch.testing.assert_close(got, fn(x), equal_nan=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomials_against_cpu(name, dtype, mode) -> None:
    """Tensor n (integral values, fractions truncated, negative), |x| == 1 / x in {0, 1} edge forms, the
    trigonometric forms for large n, and values outside [-1, 1]. (CPU's result for NaN x is not a NaN for some
    of these — uninitialised — so NaN x is left out; NaN n gives 0, as CPU.)"""
    fn = getattr(torch.special, name)
    xs = torch.cat([torch.linspace(-2.5, 2.5, 101, dtype=torch.float64),
                    torch.tensor([-1.0, 1.0, 0.0, 0.5, -0.5, 9.0, -9.0], dtype=torch.float64)])
    ns = torch.cat([torch.arange(-3, 26, dtype=torch.float64), torch.tensor([2.5, 7.9, -0.5, float("nan")],
                                                                            dtype=torch.float64)])
    x, n = torch.meshgrid(xs, ns, indexing="ij")
    x, n = x.to(dtype), n.to(dtype)
    if dtype == torch.float32:  # the float32 recurrences accumulate rounding differently from CPU's for large n
        n = n.clamp(max=12)
    expect = fn(x, n)
    with torch.tpu.set_eager_mode(mode):
        got = fn(x.to("tpu"), n.to("tpu")).cpu()
        scalar_n = fn(x.to("tpu"), 5).cpu()
        scalar_x = fn(0.25, n.to("tpu")).cpu()
    tol = dict(rtol=2e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got, expect, equal_nan=True, **tol)
    torch.testing.assert_close(scalar_n, fn(x, 5), equal_nan=True, **tol)
    torch.testing.assert_close(scalar_x, fn(0.25, n), equal_nan=True, **tol)


def test_polynomial_non_finite_n_terminates() -> None:
    """CPU casts n to int64 (x86: INT64_MIN for NaN, inf, |n| >= 2^63) and returns 0; a saturating cast to
    INT64_MAX would loop forever."""
    x = torch.tensor([0.5, 2.0, -3.0, 0.5])
    n = torch.tensor([float("inf"), float("inf"), -float("inf"), 1e19])
    for name in POLYNOMIALS:
        fn = getattr(torch.special, name)
        torch.testing.assert_close(fn(x.to("tpu"), n.to("tpu")).cpu(), fn(x, n))


def test_polynomial_int_and_out_forms() -> None:
    x = torch.arange(-4, 5)
    n = torch.arange(0, 9)
    for name in POLYNOMIALS:
        fn = getattr(torch.special, name)
        torch.testing.assert_close(fn(x.to("tpu"), n.to("tpu")).cpu(), fn(x, n))
        out = torch.empty(9, device="tpu")
        fn(x.to("tpu").float(), n.to("tpu").float(), out=out)
        torch.testing.assert_close(out.cpu(), fn(x.float(), n.float()))


# ---- lstsq ----

DRIVERS = ["gels", "gelsy", "gelsd", "gelss"]


def _well_conditioned(*shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*shape, generator=g, dtype=torch.float64)
    u, _, vh = torch.linalg.svd(a, full_matrices=False)
    s = torch.linspace(1, 3, min(shape[-2:]), dtype=torch.float64)
    return (u * s[..., None, :]) @ vh


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("driver", DRIVERS + [None])
@pytest.mark.parametrize("m,n", [(5, 3), (3, 3), (2, 4)])
@pytest.mark.parametrize("batch", [(), (2,)], ids=str)
def test_lstsq_against_cpu(batch, m, n, driver, mode) -> None:
    a = _well_conditioned(*batch, m, n).float()
    b = torch.randn(*batch, m, 2, generator=torch.Generator().manual_seed(1))
    expect = torch.linalg.lstsq(a, b, driver=driver)
    with torch.tpu.set_eager_mode(mode):
        got = torch.linalg.lstsq(a.to("tpu"), b.to("tpu"), driver=driver)
        got = [t.cpu() for t in got]
    for g, e, what in zip(got, expect, ("solution", "residuals", "rank", "singular_values")):
        assert g.shape == e.shape and g.dtype == e.dtype, (what, g.shape, e.shape, g.dtype, e.dtype)
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=what)


def test_lstsq_vector_rhs_broadcast_and_rank_deficient() -> None:
    a = _well_conditioned(1, 6, 3).float()
    b = torch.randn(2, 6, 4)
    for driver in DRIVERS:
        expect = torch.linalg.lstsq(a, b, driver=driver)
        got = torch.linalg.lstsq(a.to("tpu"), b.to("tpu"), driver=driver)
        for g, e in zip(got, expect):
            torch.testing.assert_close(g.cpu(), e, rtol=1e-4, atol=1e-4)
    a2, v = _well_conditioned(2, 6, 3).float(), torch.randn(2, 6)
    for g, e in zip(torch.linalg.lstsq(a2.to("tpu"), v.to("tpu"), driver="gelsd"), torch.linalg.lstsq(a2, v, driver="gelsd")):
        assert g.shape == e.shape
        torch.testing.assert_close(g.cpu(), e, rtol=1e-4, atol=1e-4)
    # rank 2 of 3: the minimum-norm solution, the rank, no residuals (CPU gives them only at full rank)
    d = torch.randn(7, 3, dtype=torch.float64)
    d[:, 2] = d[:, 0] + d[:, 1]
    rhs = torch.randn(7, 2, dtype=torch.float64)
    for driver in ("gelsy", "gelsd", "gelss"):
        expect = torch.linalg.lstsq(d, rhs, driver=driver)
        got = torch.linalg.lstsq(d.to("tpu"), rhs.to("tpu"), driver=driver)
        for g, e in zip(got, expect):
            assert g.shape == e.shape
            torch.testing.assert_close(g.cpu(), e, rtol=1e-8, atol=1e-8)


def test_lstsq_errors_match_cpu() -> None:
    cases = [((torch.randn(3, 3), torch.randn(3, 3)), dict(driver="foo")), ((torch.randn(3), torch.randn(3)), {}),
             ((torch.randn(3, 3), torch.randn(4, 3)), {}),
             ((torch.randn(3, 3), torch.randn(3, 3, dtype=torch.float64)), {})]
    for args, kwargs in cases:
        with pytest.raises(RuntimeError) as cpu:
            torch.linalg.lstsq(*args, **kwargs)
        with pytest.raises(RuntimeError) as tpu:
            torch.linalg.lstsq(*(t.to("tpu") for t in args), **kwargs)
        assert str(cpu.value) == str(tpu.value)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("m,n", [(5, 3), (3, 3), (2, 4)])
def test_lstsq_grad_against_cpu(m, n, driver) -> None:
    a = _well_conditioned(m, n, seed=3)
    b = torch.randn(m, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def grads(device):
        ad = a.to(device).requires_grad_()
        bd = b.to(device).requires_grad_()
        out = torch.linalg.lstsq(ad, bd, driver=driver)
        loss = (out.solution ** 2).sum() + out.solution.sum()
        return [g.cpu() for g in torch.autograd.grad(loss, (ad, bd))]

    for g, e in zip(grads("tpu"), grads("cpu")):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-8)


# ---- eig / eigvals ----


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64], ids=str)
def test_eig_against_cpu(dtype, mode) -> None:
    a = torch.randn(3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).to(dtype)
    w_cpu, v_cpu = torch.linalg.eig(a)
    with torch.tpu.set_eager_mode(mode):
        w, v = torch.linalg.eig(a.to("tpu"))
        vals = torch.linalg.eigvals(a.to("tpu")).cpu()
        w, v = w.cpu(), v.cpu()
    assert w.dtype == w_cpu.dtype and v.dtype == v_cpu.dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype != torch.float64 else dict(rtol=1e-10, atol=1e-10)
    # Both are LAPACK geev: same eigenvalue order and the same normalisation of the vectors.
    torch.testing.assert_close(w, w_cpu, **tol)
    torch.testing.assert_close(vals, w_cpu, **tol)
    # Both normalise each vector to unit norm with its largest component real; the sign (phase) left is the
    # LAPACK build's choice (float32 differs between jaxlib's and torch's for some vectors): compare |v|.
    torch.testing.assert_close(v.abs(), v_cpu.abs(), **tol)
    ac = a.to(w.dtype)
    torch.testing.assert_close(ac @ v, v * w[..., None, :], **tol)


def test_eig_grad_against_cpu() -> None:
    a = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))

    def grads(device):
        ad = a.to(device).requires_grad_()
        w, v = torch.linalg.eig(ad)
        # invariant under the eigenvectors' phases, as eig's backward requires
        weights = torch.arange(16, dtype=torch.float64, device=device).reshape(4, 4)
        loss = w.real.sum() + (w.imag ** 2).sum() + ((v * v.conj()).real * weights).sum()
        return torch.autograd.grad(loss, ad)[0].cpu()

    torch.testing.assert_close(grads("tpu"), grads("cpu"), rtol=1e-8, atol=1e-8)


def test_eigvals_out_and_gradient_like_cpu() -> None:
    """linalg.eigvals keeps PyTorch's composite (its gradient goes through linalg_eig, as on CPU) and its out= form
    writes the given tensor: once it returned a new value and left `out` as it was, silently."""
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))
    want = torch.linalg.eigvals(a)
    out = torch.full((4,), 7.0 + 0j, dtype=torch.complex64, device="tpu")
    assert torch.linalg.eigvals(a.tpu(), out=out) is out
    key = lambda v: v.real * 1e3 + v.imag  # noqa: E731  (the values' order is LAPACK's on both; sort to compare)
    torch.testing.assert_close(out.cpu()[torch.argsort(key(out.cpu()))], want[torch.argsort(key(want))],
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.linalg.eigvals(a.tpu(), out=torch.empty(4, device="tpu"))
    grads = []
    for dev in ("cpu", "tpu"):
        x = a.to(dev).requires_grad_()
        v = torch.linalg.eigvals(x)
        assert type(v.grad_fn).__name__ == "LinalgEigBackward0"
        (g,) = torch.autograd.grad((v.real ** 2 + v.imag).sum(), x)
        grads.append(g.cpu())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-4)


def test_a_lowering_cannot_name_a_mutating_overload() -> None:
    """@lower names functional overloads (their in-place and out= forms are generated); installed as a functional
    kernel, a mutating overload would return a new value and leave its written argument unchanged."""
    from torch_tpu import _eager

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_eager, "_LIB", None)
        mp.setattr(_eager, "LOWERINGS", {"linalg_eigvals.out": _eager.LOWERINGS["_linalg_eigvals"]})
        with pytest.raises(RuntimeError, match=r"linalg_eigvals\.out.*writes its arguments"):
            _eager.install()


def test_eig_names_the_way_out_on_tpu(monkeypatch) -> None:
    """XLA's TPU backend has no general eigensolver: the kernel says so and how to get the result."""
    monkeypatch.setattr(torch_tpu._runtime, "platform", lambda: "tpu")
    a = torch.randn(7, 7, device="tpu")  # a shape no other test uses: the kernel is traced here
    with pytest.raises(NotImplementedError, match=r"linalg\.eig.*not available on TPU.*\.cpu\(\).*eigh"):
        torch.linalg.eig(a)


# ---- LDL ----


def _ldl_inputs():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(4, 6, 6, dtype=torch.float64, generator=g)
    yield "random symmetric", a + a.mT
    yield "zero diagonal (2x2 pivots)", torch.tensor([[0.0, 1, 2], [1, 0, 3], [2, 3, 0]], dtype=torch.float64)
    d = torch.randn(5, 5, dtype=torch.float64, generator=g)
    d = d + d.mT
    d.diagonal().mul_(1e-3)
    yield "small diagonal", d
    yield "singular", torch.zeros(3, 3, dtype=torch.float64)
    z = torch.zeros(5, 5, dtype=torch.float64)
    z[:3, :3] = a[0, :3, :3]
    yield "zero trailing block (info 4)", z


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_ldl_factor_matches_lapack(dtype, mode) -> None:
    for what, a in _ldl_inputs():
        a = a.to(dtype)
        ld_cpu, piv_cpu, info_cpu = torch.linalg.ldl_factor_ex(a)
        with torch.tpu.set_eager_mode(mode):
            ld, piv, info = (t.cpu() for t in torch.linalg.ldl_factor_ex(a.to("tpu")))
        assert torch.equal(piv, piv_cpu), (what, piv, piv_cpu)
        assert torch.equal(info, info_cpu), what
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ld, ld_cpu, **tol, msg=what)


@pytest.mark.parametrize("mode", MODES)
def test_ldl_solve_against_cpu(mode) -> None:
    for what, a in _ldl_inputs():
        if what in ("singular", "zero trailing block (info 4)"):
            continue
        ld, piv = torch.linalg.ldl_factor(a)
        b = torch.randn(*a.shape[:-1], 3, dtype=a.dtype)
        expect = torch.linalg.ldl_solve(ld, piv, b)
        with torch.tpu.set_eager_mode(mode):
            tld, tpiv = torch.linalg.ldl_factor(a.to("tpu"))
            got = torch.linalg.ldl_solve(tld, tpiv, b.to("tpu")).cpu()
        torch.testing.assert_close(got, expect, rtol=1e-9, atol=1e-9, msg=what)
        torch.testing.assert_close(a @ got, b, rtol=1e-8, atol=1e-8, msg=what)


def test_ldl_factor_check_errors() -> None:
    with pytest.raises(RuntimeError, match="ldl_factor"):
        torch.linalg.ldl_factor(torch.zeros(3, 3, device="tpu"))


def test_ldl_errors_match_cpu() -> None:
    a = torch.randn(3, 3)
    ld, piv = torch.linalg.ldl_factor(a + a.mT)
    cases = [lambda d: torch.linalg.ldl_factor_ex(torch.randn(3, 4).to(d)),
             lambda d: torch.linalg.ldl_factor_ex(torch.randn(3, 3).int().to(d)),
             lambda d: torch.linalg.ldl_solve(ld.to(d), piv.to(d), torch.randn(4, 2).to(d)),
             lambda d: torch.linalg.ldl_solve(ld.to(d), piv.to(d), torch.randn(3, 2, dtype=torch.float64).to(d)),
             lambda d: torch.linalg.ldl_solve(ld.to(d), piv.to(d), torch.randn(3).to(d))]
    for case in cases:
        with pytest.raises((RuntimeError, IndexError)) as cpu:
            case("cpu")
        with pytest.raises(type(cpu.value)) as tpu:
            case("tpu")
        assert str(tpu.value) == str(cpu.value)
    # int64 pivots are accepted, as on CPU
    b = torch.randn(3, 2)
    torch.testing.assert_close(torch.linalg.ldl_solve(ld.to("tpu"), piv.long().to("tpu"), b.to("tpu")).cpu(),
                               torch.linalg.ldl_solve(ld, piv.long(), b))


@pytest.mark.parametrize("mode", MODES)
def test_eig_rejects_non_finite_input(mode) -> None:
    """CPU's eig raises for inf/NaN input (its eigvals crashes in MKL): tpu raises CPU's error at the next
    synchronization point, from a flag computed on the device."""
    a = torch.randn(4, 4)
    a[1, 2] = float("nan")
    with pytest.raises(RuntimeError) as cpu:
        torch.linalg.eig(a)
    for fn, name in ((lambda x: torch.linalg.eig(x)[0], "linalg.eig"), (torch.linalg.eigvals, "linalg.eigvals")):
        with torch.tpu.set_eager_mode(mode):
            with pytest.raises(RuntimeError, match=f"torch.{name}: input tensor should not contain infs or NaNs"):
                fn(a.to("tpu")).cpu()
    assert str(cpu.value) == "torch.linalg.eig: input tensor should not contain infs or NaNs."
    finite = torch.randn(4, 4)
    torch.testing.assert_close(torch.linalg.eigvals(finite.to("tpu")).cpu(), torch.linalg.eigvals(finite),
                               rtol=1e-4, atol=1e-4)
