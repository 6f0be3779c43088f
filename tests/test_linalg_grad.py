"""Gradients of the determinant family (det, slogdet, logdet) on tpu against CPU, through PyTorch's own backward
formulas, which solve with the LU factors and pivots our forward kernels return."""

from __future__ import annotations

import pytest
import torch


def _grads(f, A: torch.Tensor, dev: str, upstream: list[torch.Tensor]) -> list[torch.Tensor]:
    a = A.to(dev).requires_grad_()
    outs = f(a)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, g.to(dev)) for o, g in zip(outs, upstream) if o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], a, [g for _, g in pairs])
    return [g.cpu() for g in grads]


FNS = {
    "det": torch.linalg.det,
    "torch.det": torch.det,
    "slogdet": torch.linalg.slogdet,
    "torch.slogdet": torch.slogdet,
    "logdet": torch.logdet,
}


def _input(shape: tuple[int, ...], layout: str, dtype: torch.dtype, positive: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + len(layout))
    n = shape[-1]
    A = torch.randn(*shape, generator=g, dtype=dtype)
    if positive:  # logdet needs det > 0
        A = A @ A.mT + n * torch.eye(n, dtype=dtype)
    if layout == "transposed":  # a non-contiguous input (the same values)
        A = A.mT.contiguous().mT
    elif layout == "strided":
        A = torch.repeat_interleave(A, 2, dim=-1)[..., ::2]
    return A


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (1, 1)])
@pytest.mark.parametrize("name", list(FNS))
def test_det_family_backward_matches_cpu(name: str, shape: tuple[int, ...], layout: str) -> None:
    f = FNS[name]
    A = _input(shape, layout, torch.float32, positive=name == "logdet")
    assert layout == "contiguous" or not A.is_contiguous() or shape == (1, 1)
    outs = f(A)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(7)
    upstream = [torch.randn(o.shape, generator=g) for o in outs]
    want = _grads(f, A, "cpu", upstream)
    got = _grads(f, A, "tpu", upstream)
    for w, h in zip(want, got):
        torch.testing.assert_close(h, w, rtol=1e-4, atol=1e-4)
    # The formula's own check: d det(A) = det(A) A^-T (a nonsymmetric A tells the transpose apart).
    if name == "det" and shape == (3, 3):
        torch.testing.assert_close(got[0], upstream[0] * torch.linalg.det(A) * torch.linalg.inv(A).mT,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_det_backward_dtypes(dtype: torch.dtype) -> None:
    A = _input((3, 3), "contiguous", dtype, positive=False)
    for f in (torch.linalg.det, lambda a: torch.linalg.slogdet(a)[1]):
        want = _grads(f, A, "cpu", [torch.ones((), dtype=f(A).dtype)])
        got = _grads(f, A, "tpu", [torch.ones((), dtype=f(A).dtype)])
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)


def test_lu_solve_adjoint_matches_cpu() -> None:
    """The solve det's backward uses: linalg.lu_solve with adjoint=True, left and right."""
    A = _input((4, 4), "contiguous", torch.float32, positive=False)
    B = torch.randn(4, 2, generator=torch.Generator().manual_seed(3))
    LU, piv = torch.linalg.lu_factor(A)
    dLU, dpiv = torch.linalg.lu_factor(A.to("tpu"))
    for adjoint in (False, True):
        want = torch.linalg.lu_solve(LU, piv, B, adjoint=adjoint)
        got = torch.linalg.lu_solve(dLU, dpiv, B.to("tpu"), adjoint=adjoint).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        want = torch.linalg.lu_solve(LU, piv, B.mT, left=False, adjoint=adjoint)
        got = torch.linalg.lu_solve(dLU, dpiv, B.mT.to("tpu"), left=False, adjoint=adjoint).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_det_family_under_compile(layout: str) -> None:
    """torch.compile(backend='tpu') decomposes the ops with the same contract, deciding on the fake input's layout."""
    A = _input((3, 3), layout, torch.float32, positive=True)
    f = lambda a: torch.linalg.det(a) + torch.linalg.slogdet(a)[1] * 2 + torch.logdet(a)  # noqa: E731
    cf = torch.compile(f, backend="tpu")
    a = A.to("tpu").requires_grad_()
    out = cf(a)
    (g,) = torch.autograd.grad(out, a)
    ac = A.clone().requires_grad_()
    want = f(ac)
    (wg,) = torch.autograd.grad(want, ac)
    torch.testing.assert_close(out.detach().cpu(), want.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(g.cpu(), wg, rtol=1e-4, atol=1e-4)
