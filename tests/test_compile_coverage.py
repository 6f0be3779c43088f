"""Compile coverage seen missing in real models, under torch.compile(backend="tpu"), against CPU PyTorch:
- rotary embeddings through `view_as_complex` / `view_as_real` (Llama, TorchTitan), forward and backward, also in
  eager tpu (DEFER_NEVER and DEFER_AND_FUSE);
- the `flex_attention` higher-order op with a score_mod, a block mask (causal, and a document mask reading a
  captured tensor) and GQA heads, forward and backward, in one graph (fullgraph=True, no eager fallback);
- functional collectives (all_reduce + wait_tensor, all_gather_into_tensor, reduce_scatter_tensor) in a compiled
  step on 2 ranks: the collectives are inside the step's XLA program (its StableHLO has them), the results match
  the eager tpu_dist collectives and gloo on CPU.

This file is also the per-rank worker of the distributed test (`python tests/test_compile_coverage.py <scenario>`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def _scenario_compiled_collectives() -> None:
    import tempfile
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch._dynamo.utils import counters

    local = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("tpu_dist", timeout=timedelta(seconds=60))
    torch.tpu.set_device(local)
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("tpu", local)
    gloo = dist.new_group(backend="gloo")
    group = dist.group.WORLD

    def step(x, w):
        y = torch.tanh(x @ w)
        s = funcol.all_reduce(y, "sum", group)
        g = funcol.all_gather_tensor(y * 2, 0, group)
        r = funcol.reduce_scatter_tensor(g + 1, "sum", 0, group)
        m = funcol.all_reduce(y, "max", group)
        c = funcol.all_reduce_coalesced([y, y.sum(0)], "avg", group)
        b = funcol.broadcast(y + 3, 1, group)
        a = funcol.all_to_all_single(y, None, None, group)
        return s.sum(-1), g, r, m, c[0], c[1], b, a

    torch.manual_seed(rank)
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    dump = tempfile.mkdtemp()
    compiled = torch.compile(step, backend="tpu", fullgraph=True, options={"dump_dir": dump})
    got = compiled(x.to(dev), w.to(dev))
    got = compiled(x.to(dev), w.to(dev))  # the cached program again
    eager = step(x.to(dev), w.to(dev))

    # CPU oracle over gloo
    y = torch.tanh(x @ w)
    s = y.clone()
    dist.all_reduce(s, group=gloo)
    g = torch.empty(n * 4, 6)
    dist.all_gather_into_tensor(g, y * 2, group=gloo)
    r = torch.empty(4, 6)
    dist.reduce_scatter_tensor(r, g + 1, group=gloo)
    m = y.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=gloo)
    c0, c1 = y.clone(), y.sum(0)
    dist.all_reduce(c0, op=dist.ReduceOp.SUM, group=gloo)
    dist.all_reduce(c1, op=dist.ReduceOp.SUM, group=gloo)
    b = y + 3
    dist.broadcast(b, src=1, group=gloo)
    a = torch.empty_like(y)
    dist.all_to_all_single(a, y.contiguous(), group=gloo)
    expected = (s.sum(-1), g, r, m, c0 / n, c1 / n, b, a)
    for a, e, c in zip(got, eager, expected, strict=True):
        torch.testing.assert_close(a.cpu(), c, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.cpu(), e.cpu(), atol=1e-5, rtol=1e-5)
    hlo = "".join(p.read_text() for p in Path(dump).glob("*.stablehlo.mlir"))
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert f"stablehlo.{op}" in hlo, (op, hlo[:2000])
    assert counters["tpu"]["graphs"] == 1 and counters["tpu"]["eager_fallback_graphs"] == 0, dict(counters["tpu"])

    # The c10d API in a compiled step (a DDP-style gradient average): Dynamo rewrites it to the functional ops.
    def average(grad):
        grad = grad * 1.0
        dist.all_reduce(grad)
        return grad / n

    avg = torch.compile(average, backend="tpu", fullgraph=True)(y.to(dev))
    torch.testing.assert_close(avg.cpu(), c0 / n, atol=1e-5, rtol=1e-5)
    assert counters["tpu"]["graphs"] == 2 and counters["tpu"]["eager_fallback_graphs"] == 0, dict(counters["tpu"])
    dist.destroy_process_group()
    print(f"rank {rank}: compiled collectives ok", flush=True)


if __name__ == "__main__":
    globals()[f"_scenario_{sys.argv[1]}"]()
    sys.exit(0)


import contextlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.attention.flex_attention as fa  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402


# ---- rotary embeddings: view_as_complex / view_as_real ----

def _rope(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(-2).type_as(x)


def _freqs(s, d):
    t = torch.arange(s, dtype=torch.float32)
    angles = torch.outer(t, 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)))
    return torch.polar(torch.ones_like(angles), angles)[None, :, None, :]  # complex64 (1, S, 1, D/2)


@pytest.mark.parametrize("mode", ["compile", "DEFER_NEVER", "DEFER_AND_FUSE"])
def test_rotary_view_as_complex_matches_cpu(mode: str) -> None:
    torch.manual_seed(0)
    x, freqs = torch.randn(2, 8, 2, 16), _freqs(8, 16)
    xc = x.clone().requires_grad_()
    ref = _rope(xc, freqs)
    (ref * ref.roll(1, -1)).sum().backward()

    xt = x.to("tpu").requires_grad_()
    fn = torch.compile(_rope, backend="tpu", fullgraph=True) if mode == "compile" else _rope
    ctx = torch.tpu.set_eager_mode(mode) if mode != "compile" else contextlib.nullcontext()
    with ctx:
        out = fn(xt, freqs.to("tpu"))
        (out * out.roll(1, -1)).sum().backward()
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, atol=1e-5, rtol=1e-5)


def test_view_as_real_of_complex_input_compiled() -> None:
    z = torch.randn(3, 4, dtype=torch.complex64)
    fn = torch.compile(lambda t: torch.view_as_real(t * 2j).sum(-1), backend="tpu", fullgraph=True)
    torch.testing.assert_close(fn(z.to("tpu")).cpu(), torch.view_as_real(z * 2j).sum(-1))


# ---- flex_attention ----

def _reference(q, k, v, keep, bias):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + bias
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v


@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])  # (query heads, key/value heads): MHA and GQA
def test_flex_attention_compiled_matches_cpu(heads) -> None:
    torch.manual_seed(0)
    b, n, d = 2, 128, 16
    hq, hkv = heads
    q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    docs = torch.cat([torch.zeros(b, 50, dtype=torch.long), torch.ones(b, n - 50, dtype=torch.long)], 1)
    docs_t = docs.to("tpu")

    def mask_mod(bi, hi, qi, ki):
        return (qi >= ki) & (docs_t[bi, qi] == docs_t[bi, ki])

    def score_mod(score, bi, hi, qi, ki):
        return score + (qi - ki) * 0.01 * (hi + 1)

    block_mask = fa.create_block_mask(mask_mod, b, None, n, n, device="tpu")

    def attend(q, k, v):
        return fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=hq != hkv)

    counters.clear()
    compiled = torch.compile(attend, backend="tpu", fullgraph=True)
    qt, kt, vt = (t.to("tpu").requires_grad_() for t in (q, k, v))
    out = compiled(qt, kt, vt)
    grad = torch.randn(out.shape)
    out.backward(grad.to("tpu"))
    assert counters["tpu"]["graphs"] == 2 and counters["tpu"]["eager_fallback_graphs"] == 0  # forward, backward

    qi = torch.arange(n)
    keep = (qi[:, None] >= qi[None, :]) & (docs[:, None, :, None] == docs[:, None, None, :])
    bias = (qi[:, None] - qi[None, :]) * 0.01 * (torch.arange(hq) + 1)[:, None, None]
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _reference(qc, kc, vc, keep, bias)
    ref.backward(grad)
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=2e-5, rtol=1e-4)
    for t, c in ((qt, qc), (kt, kc), (vt, vc)):
        torch.testing.assert_close(t.grad.cpu(), c.grad, atol=2e-5, rtol=1e-4)


def test_flex_attention_compiled_fully_masked_rows_and_lse() -> None:
    """Rows whose every key is masked give 0 (PyTorch's safe softmax) and a -inf log-sum-exp, without NaN in the
    gradients; return_lse matches CPU's natural-log values elsewhere."""
    torch.manual_seed(1)
    b, h, n, d = 1, 2, 128, 8
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))

    def mask_mod(bi, hi, qi, ki):
        return (qi >= ki) & (qi >= 4)

    block_mask = fa.create_block_mask(mask_mod, b, h, n, n, device="tpu")
    compiled = torch.compile(lambda q, k, v: fa.flex_attention(q, k, v, block_mask=block_mask, return_lse=True),
                             backend="tpu", fullgraph=True)
    qt, kt, vt = (t.to("tpu").requires_grad_() for t in (q, k, v))
    out, lse = compiled(qt, kt, vt)
    (out.sum() + lse[..., 4:].sum()).backward()

    qi = torch.arange(n)
    keep = (qi[:, None] >= qi[None, :]) & (qi[:, None] >= 4)
    s = ((q @ k.transpose(-1, -2)) * d ** -0.5).masked_fill(~keep, float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref = torch.nan_to_num(torch.softmax(s, -1)) @ v
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-4)
    assert torch.isneginf(lse.cpu()[..., :4]).all()
    torch.testing.assert_close(lse.cpu()[..., 4:], ref_lse[..., 4:], atol=2e-5, rtol=1e-4)
    for t in (qt, kt, vt):
        assert torch.isfinite(t.grad.cpu()).all()


def test_flex_attention_compiled_bias_buffer_gets_its_gradient() -> None:
    """A learnable bias read by the score_mod (a relative-position table, as in T5) gets its gradient."""
    torch.manual_seed(2)
    b, h, n, d = 1, 2, 128, 8
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    table = torch.randn(h, 2 * n - 1)

    def attend(q, k, v, bias):
        def score_mod(score, bi, hi, qi, ki):
            return score + bias[hi, qi - ki + n - 1]
        return fa.flex_attention(q, k, v, score_mod=score_mod)

    compiled = torch.compile(attend, backend="tpu", fullgraph=True)
    qt, kt, vt, bt = (t.to("tpu").requires_grad_() for t in (q, k, v, table))
    out = compiled(qt, kt, vt, bt)
    out.sum().backward()

    qc, kc, vc, bc = (t.clone().requires_grad_() for t in (q, k, v, table))
    qi = torch.arange(n)
    rel = bc[:, (qi[:, None] - qi[None, :] + n - 1)]
    ref = _reference(qc, kc, vc, torch.ones(n, n, dtype=torch.bool), rel)
    ref.sum().backward()
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=2e-5, rtol=1e-4)
    for t, c in ((qt, qc), (kt, kc), (vt, vc), (bt, bc)):
        torch.testing.assert_close(t.grad.cpu(), c.grad, atol=2e-5, rtol=1e-4)


def test_flex_attention_compiled_mask_mod_index_is_checked() -> None:
    """An out-of-range read of a captured tensor inside the mask_mod is an IndexError at the next sync, as in eager
    code (a device-side check), never a silently clamped value."""
    b, h, n, d = 1, 1, 128, 8
    short = torch.zeros(n - 1, dtype=torch.long, device="tpu")  # one entry too few for q_idx = n - 1

    def mask_mod(bi, hi, qi, ki):
        return short[qi] >= 0

    block_mask = fa.create_block_mask(lambda bi, hi, qi, ki: qi >= 0, b, h, n, n, device="tpu")
    block_mask.mask_mod = mask_mod
    q = torch.randn(b, h, n, d, device="tpu")
    compiled = torch.compile(lambda q: fa.flex_attention(q, q, q, block_mask=block_mask), backend="tpu",
                             fullgraph=True)
    with pytest.raises(IndexError, match="out of bounds"):
        compiled(q).cpu()


def test_higher_order_op_without_lowering_is_named() -> None:
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: x + 1, lambda x: x - 1, (x,))

    with pytest.raises(Exception, match=r"torch\.ops\.higher_order\.cond \(node"):
        torch.compile(f, backend="tpu", fullgraph=True)(torch.randn(3, device="tpu"))


# ---- functional collectives in a compiled step, 2 ranks ----

def test_compiled_collectives_are_in_the_program(tmp_path: Path) -> None:
    from test_distributed import _expect_ok, _launch

    results = _launch(2, "compiled_collectives", 240, tmp_path, script=HERE)
    _expect_ok(results, "compiled collectives ok")
