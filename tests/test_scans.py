"""cumsum against CPU PyTorch. CPU sums a float32 scan sequentially in double (its acc_type) and rounds each prefix
once; on XLA:CPU tpu sums in float64 too (a parallel prefix, kernels/reduction.py), so float32 and complex64
prefixes equal CPU's bit for bit, where float32 sums differed in about half the elements of a long row."""

from __future__ import annotations

import pytest
import torch
from torch_tpu import _runtime

MODES = ("DEFER_NEVER", "DEFER_AND_FUSE")
EXACT = _runtime.platform() == "cpu"  # the double accumulation is XLA:CPU's (a TPU emulates float64)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.float64, torch.bfloat16, torch.float16,
                                   torch.int32, torch.int64, torch.uint8, torch.bool], ids=str)
def test_cumsum_matches_cpu(dtype: torch.dtype, mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    for shape, dim in (((5, 37), -1), ((5, 37), 0), ((3, 4, 50), 1), ((32000,), 0), ((1,), 0), ((3, 0, 2), 1)):
        x = torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 1
        x = (x > 0) if dtype == torch.bool else (x * 50).to(dtype) if not (dtype.is_floating_point or
                                                                            dtype.is_complex) else x.to(dtype)
        with torch.tpu.set_eager_mode(mode):
            got = torch.cumsum(x.to("tpu"), dim).cpu()
        want = torch.cumsum(x, dim)
        assert got.dtype == want.dtype
        if EXACT and dtype in (torch.float32, torch.complex64) or not (dtype.is_floating_point or dtype.is_complex):
            assert torch.equal(got, want), (shape, dim, int((got != want).sum()))
        else:
            torch.testing.assert_close(got, want, rtol=1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-7,
                                       atol=1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-9)


def test_cumsum_dtype_argument_gradient_and_compile() -> None:
    x = torch.rand(4, 300, dtype=torch.float32)
    got = torch.cumsum(x.to("tpu"), 1, dtype=torch.float64).cpu()
    assert torch.equal(got, torch.cumsum(x, 1, dtype=torch.float64)) or not EXACT
    # top-p sampling's cumulative probabilities, compiled
    def top_p_mask(logits: torch.Tensor) -> torch.Tensor:
        probs, _ = logits.softmax(-1).sort(-1, descending=True)
        return probs.cumsum(-1) <= 0.9

    logits = torch.randn(2, 1000)
    assert torch.equal(torch.compile(top_p_mask, backend="tpu")(logits.to("tpu")).cpu(), top_p_mask(logits)) or \
        not EXACT
    w = x.clone().requires_grad_()
    (torch.cumsum(w, 1) * torch.arange(300.0)).sum().backward()
    t = x.to("tpu").requires_grad_()
    (torch.cumsum(t, 1) * torch.arange(300.0, device="tpu")).sum().backward()
    torch.testing.assert_close(t.grad.cpu(), w.grad)
