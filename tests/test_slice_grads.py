"""slice_backward and select_backward (the gradients of slicing and indexing by an integer) against CPU PyTorch: the
ops called directly with the arguments autograd passes (negative and out-of-range bounds, steps, every dim), and
gradients through slices and selects in a computation, in DEFER_NEVER and DEFER_AND_FUSE."""

from __future__ import annotations

import pytest
import torch

MODES = ("DEFER_NEVER", "DEFER_AND_FUSE")
# (the sweep below compiles a program per shape on purpose)
pytestmark = pytest.mark.filterwarnings("ignore:.*compiled again in")
BIG = 9223372036854775807  # what x[a:] passes as its end


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_ops_match_cpu(dtype: torch.dtype, mode: str) -> None:
    sizes = [4, 6, 10]
    cases = []
    for dim in (0, 1, 2, -1):
        n = sizes[dim]
        for start, end, step in ((0, n, 1), (1, n - 1, 1), (2, BIG, 1), (-3, n, 1), (0, n, 3), (1, 100, 2), (3, 3, 1)):
            length = len(range(*slice(start, end, step).indices(n)))
            shape = list(sizes)
            shape[dim] = length
            cases.append(("slice", shape, (dim, start, end, step)))
        for index in (0, n - 1, -1, -n):
            shape = list(sizes)
            del shape[dim]
            cases.append(("select", shape, (dim, index)))
    for k, (kind, shape, args) in enumerate(cases):
        g = torch.Generator().manual_seed(k)
        grad = (torch.randn(shape, generator=g) * 10).to(dtype)
        op = torch.ops.aten.slice_backward if kind == "slice" else torch.ops.aten.select_backward
        want = op(grad, sizes, *args)
        with torch.tpu.set_eager_mode(mode):
            got = op(grad.to("tpu"), sizes, *args).cpu()
        assert got.dtype == want.dtype and torch.equal(got, want), (kind, args)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_through_slices_and_selects(mode: str) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # Llama's rotate_half
        return (rotated * x).sum() + x[1].square().sum() + x[:, ::2, 1:-1].exp().sum() + x[-1, -1, -1]

    c = torch.randn(3, 5, 8, dtype=torch.float32)
    cx = c.clone().requires_grad_()
    f(cx).backward()
    with torch.tpu.set_eager_mode(mode):
        tx = c.to("tpu").requires_grad_()
        f(tx).backward()
        grad = tx.grad.cpu()
    torch.testing.assert_close(grad, cx.grad)
