"""True division against CPU PyTorch. XLA's simplifier rewrites a division by a broadcast value into a
multiplication by its reciprocal, an ulp off the quotient in ~9% of float32 elements (`x / 0.7`); on XLA:CPU the
divide kernel keeps the quotient (kernels/elementwise.py, _true_divide), so these match CPU bit for bit there."""

from __future__ import annotations

import pytest
import torch
from torch_tpu import _runtime

MODES = ("DEFER_NEVER", "DEFER_AND_FUSE")
EXACT = _runtime.platform() == "cpu"

CASES = {
    "x / 0.7": lambda t: t / 0.7,
    "x / 0-d tensor": lambda t: t / torch.tensor(0.7, device=t.device),
    "x / keepdim amax": lambda t: t / t.abs().amax(-1, keepdim=True),
    "x / element": lambda t: t / (t[0, 0].abs() + 1),
    "0.7 / x": lambda t: 0.7 / t,
    "x.div_(3.0)": lambda t: t.clone().div_(3.0),
    "div trunc": lambda t: torch.div(t, 0.7, rounding_mode="trunc"),
    "bfloat16 / 0.7": lambda t: t.bfloat16() / 0.7,
    "float16 / 3.0": lambda t: t.half() / 3.0,
    "int64 / 2": lambda t: (t * 10).long() / 2,
    "float64 / 0.7": lambda t: t.double() / 0.7,
    "attention scale": lambda t: (t @ t.transpose(-1, -2)) / 8.0,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_division_by_a_broadcast_value_matches_cpu(case: str, mode: str) -> None:
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0)) * 3
    fn = CASES[case]
    with torch.tpu.set_eager_mode(mode):
        got = fn(x.to("tpu")).cpu()
    want = fn(x)
    assert got.dtype == want.dtype
    if EXACT and case != "attention scale":
        assert torch.equal(got, want), int((got != want).sum())
    else:  # (the matmul's own sums may differ by an ulp)
        torch.testing.assert_close(got, want)


def test_division_compiled_and_its_gradient() -> None:
    x = torch.randn(8, 32)

    def f(t: torch.Tensor) -> torch.Tensor:
        return (t / 0.7 + t / t.abs().sum(-1, keepdim=True)).sum(-1)

    got = torch.compile(f, backend="tpu")(x.to("tpu")).cpu()
    torch.testing.assert_close(got, f(x))
    w = x.clone().requires_grad_()
    f(w).sum().backward()
    t = x.to("tpu").requires_grad_()
    f(t).sum().backward()
    torch.testing.assert_close(t.grad.cpu(), w.grad)
