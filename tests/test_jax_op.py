"""torch.tpu.jax_op: a JAX or Pallas function as a torch custom op, in DEFER_NEVER, DEFER_AND_FUSE and
torch.compile(backend="tpu") graphs; CPU PyTorch is the oracle (forward and gradients)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl
from torch._dynamo.utils import counters

from conftest import run_python
from torch_tpu._deferred import EagerMode

MODES = ["never", "fuse", "compile"]


def _run(mode: str, fn, *args):
    """fn(*args) in one of the three execution paths."""
    if mode == "never":
        return fn(*args)
    if mode == "fuse":
        with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
            out = fn(*args)
        return out
    torch._dynamo.reset()
    return torch.compile(fn, backend="tpu", fullgraph=True)(*args)


def _train(mode: str, fwd, *args):
    """loss, out = fwd(*args), then loss.backward(), in one of the three execution paths (compiled: the forward
    with fullgraph=True, its backward graph run by autograd)."""
    if mode == "compile":
        torch._dynamo.reset()
        fwd = torch.compile(fwd, backend="tpu", fullgraph=True)
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE if mode == "fuse" else torch.tpu.eager_mode):
        loss, out = fwd(*args)
        loss.backward()
    return out.detach()


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


gelu = torch.tpu.jax_op(_gelu, name="test_gelu")


@pytest.mark.parametrize("mode", MODES)
def test_forward_and_vjp_backward_match_torch(mode: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    w = torch.randn(8, 3)

    def step(x, w):
        y = gelu(x @ w) * 2.0
        return y.square().sum(), y

    xt = x.to("tpu").requires_grad_()
    wt = w.to("tpu").requires_grad_()
    got = _train(mode, step, xt, wt)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = step_ref = torch.nn.functional.gelu(xc @ wc, approximate="tanh") * 2.0
    step_ref.square().sum().backward()
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-5, atol=1e-5)
    # (XLA fuses and reorders the backward's sums: float32 rounding differs from CPU's at 1e-5)
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(wt.grad.cpu(), wc.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["never", "fuse"])
def test_complex_gradients_follow_torch_convention(mode: str) -> None:
    torch.manual_seed(0)
    z, w = torch.randn(5, dtype=torch.complex64), torch.randn(5, dtype=torch.complex64)
    op = torch.tpu.jax_op(lambda z, w: jnp.sin(z) * w, name=f"test_complex_sin_{mode}")

    def step(z, w):
        out = op(z, w)
        return (out * out.conj()).real.sum() + out.imag.sum(), out

    zt, wt = z.to("tpu").requires_grad_(), w.to("tpu").requires_grad_()
    _train(mode, step, zt, wt)
    zc, wc = z.clone().requires_grad_(), w.clone().requires_grad_()
    out = torch.sin(zc) * wc
    ((out * out.conj()).real.sum() + out.imag.sum()).backward()
    torch.testing.assert_close(zt.grad.cpu(), zc.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wt.grad.cpu(), wc.grad, rtol=1e-5, atol=1e-5)


def test_fused_mode_records_the_op_without_a_flush() -> None:
    x = torch.randn(16, device="tpu")
    torch.tpu.synchronize()
    torch.tpu.reset_metrics()
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        y = gelu(x * 3) + 1
        assert torch.tpu.metrics().flushes == {}, "a jax_op must be recorded into the pending graph"
        got = y.cpu()
        m = torch.tpu.metrics()
        assert m.flushes == {"to_cpu": 1} and m.fused_ops == 3, (m.flushes, m.fused_ops)
    ref = torch.nn.functional.gelu(x.cpu() * 3, approximate="tanh") + 1
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # the backward (the tpu_jax::<name>_vjp op) is recorded too: the forward runs as the backward pass starts, the
    # backward as it ends (then .cpu() finds nothing pending)
    xg = x.clone().requires_grad_()
    torch.tpu.synchronize()
    torch.tpu.reset_metrics()
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        gelu(xg * 3).sum().backward()
        m = torch.tpu.metrics()
        assert m.flushes == {"backward_start": 1, "backward_end": 1} and m.fused_graph_runs == 2, \
            (m.flushes, m.fused_graph_runs)
        grad = xg.grad.cpu()
        assert torch.tpu.metrics().flushes == {"backward_start": 1, "backward_end": 1}
    xc = x.cpu().requires_grad_()
    torch.nn.functional.gelu(xc * 3, approximate="tanh").sum().backward()
    torch.testing.assert_close(grad, xc.grad, rtol=1e-5, atol=1e-5)


def _stats(inputs, scale, *, axis, squash):
    a, (b, c) = inputs["a"], inputs["pair"]
    s = (a * scale + b).sum(axis=axis)
    out = {"sum": jnp.tanh(s) if squash else s, "max": (jnp.max(c, axis=axis), c.astype(jnp.float32) * 2)}
    return out


stats = torch.tpu.jax_op(static_argnames=("axis", "squash"))(_stats)


def _stats_ref(inputs, scale, *, axis, squash):
    a, (b, c) = inputs["a"], inputs["pair"]
    s = (a * scale + b).sum(dim=axis)
    return {"sum": torch.tanh(s) if squash else s, "max": (c.amax(dim=axis), c.float() * 2)}


@pytest.mark.parametrize("mode", MODES)
def test_pytrees_statics_and_integer_inputs(mode: str) -> None:
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    c = torch.randint(-50, 50, (3, 5), dtype=torch.int32)
    for scale, axis, squash in ((2.0, 0, True), (0.5, 1, False), (2.0, 1, True)):  # each static value is its own
        def f(a, b, c):
            return stats({"a": a, "pair": (b, c)}, scale, axis=axis, squash=squash)

        got = _run(mode, f, a.to("tpu"), b.to("tpu"), c.to("tpu"))
        want = _stats_ref({"a": a, "pair": (b, c)}, scale, axis=axis, squash=squash)
        assert set(got) == {"sum", "max"} and isinstance(got["max"], tuple)
        torch.testing.assert_close(got["sum"].cpu(), want["sum"], rtol=1e-5, atol=1e-5)
        assert got["max"][0].dtype == torch.int32 and torch.equal(got["max"][0].cpu(), want["max"][0])
        torch.testing.assert_close(got["max"][1].cpu(), want["max"][1])


def _hard_round(x, y):
    return jnp.round(x) * y


def _straight_through(ct, x, y):
    # jax.vjp of round is zero: the custom rule passes the cotangent straight through for x, and scales y's
    return ct * y, 3.0 * ct


hard_round = torch.tpu.jax_op(_hard_round, backward=_straight_through)


@pytest.mark.parametrize("mode", MODES)
def test_user_backward_replaces_the_vjp(mode: str) -> None:
    x = torch.randn(6) * 4
    y = torch.randn(6)

    def step(x, y):
        out = hard_round(x, y)
        return (out * torch.arange(6, device=out.device, dtype=out.dtype)).sum(), out

    xt, yt = x.to("tpu").requires_grad_(), y.to("tpu").requires_grad_()
    got = _train(mode, step, xt, yt)
    ct = torch.arange(6, dtype=torch.float32)
    torch.testing.assert_close(got.cpu(), torch.round(x) * y)
    torch.testing.assert_close(xt.grad.cpu(), ct * y)
    torch.testing.assert_close(yt.grad.cpu(), 3.0 * ct)


def _pallas_scaled_add(x, y, *, alpha):
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] * alpha + y_ref[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, y)


def _pallas_scaled_add_bwd(ct, x, y, *, alpha):
    return ct * alpha, ct


pallas_scaled_add = torch.tpu.jax_op(_pallas_scaled_add, static_argnames="alpha", backward=_pallas_scaled_add_bwd)


@pytest.mark.parametrize("mode", MODES)
def test_pallas_interpret_kernel_trains(mode: str) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    lin_t = torch.nn.Linear(8, 8).to("tpu")
    lin_t.load_state_dict(lin.state_dict())
    x, skip = torch.randn(4, 8), torch.randn(4, 8)

    def step(model, x, skip, add):
        out = add(model(x), skip)
        return out.square().mean(), out

    got = _train(mode, lambda m, a, b: step(m, a, b, lambda u, v: pallas_scaled_add(u, v, alpha=0.5)),
                 lin_t, x.to("tpu"), skip.to("tpu"))
    want = _train("never", step, lin, x, skip, lambda u, v: u * 0.5 + v)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin_t.weight.grad.cpu(), lin.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin_t.bias.grad.cpu(), lin.bias.grad, rtol=1e-5, atol=1e-5)


def test_compile_lowers_the_op_inline_in_one_program() -> None:
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(4, 8)
    fresh = torch.tpu.jax_op(_gelu, name="test_gelu_compiled")  # first called while Dynamo traces

    def f(x):
        return fresh(x.sin()).cos() * 2

    cf = torch.compile(f, backend="tpu", fullgraph=True)
    got = cf(x.to("tpu"))
    assert counters["tpu"]["xla_programs"] == 1, dict(counters["tpu"])
    assert counters["tpu"].get("eager_fallback_graphs", 0) == 0
    torch.testing.assert_close(got.cpu(), torch.nn.functional.gelu(x.sin(), approximate="tanh").cos() * 2,
                               rtol=1e-5, atol=1e-5)
    before = (dict(counters["tpu"]), counters["stats"]["unique_graphs"])
    x2 = torch.randn(4, 8)
    got2 = cf(x2.to("tpu"))  # same shapes: no new Dynamo graph, no new program (the spec's guards hold)
    assert (dict(counters["tpu"]), counters["stats"]["unique_graphs"]) == before
    torch.testing.assert_close(got2.cpu(), torch.nn.functional.gelu(x2.sin(), approximate="tanh").cos() * 2,
                               rtol=1e-5, atol=1e-5)


def test_decorator_form_and_op_registration() -> None:
    @torch.tpu.jax_op(name="test_softplus_twice")
    def softplus_twice(x):
        return jax.nn.softplus(x) * 2

    x = torch.randn(5)
    got = softplus_twice(x.to("tpu"))
    torch.testing.assert_close(got.cpu(), torch.nn.functional.softplus(x) * 2, rtol=1e-6, atol=1e-6)
    assert hasattr(torch.ops.tpu_jax, "test_softplus_twice")
    with pytest.raises(ValueError, match="exists already"):
        torch.tpu.jax_op(lambda x: x, name="test_softplus_twice")


def test_errors_name_the_function_and_shapes() -> None:
    with pytest.raises(RuntimeError, match=r"_gelu: tensor argument 0 \(shape \[2, 3\], torch.float32\) is on cpu"):
        gelu(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match=r"_gelu: tensor argument 0 has dtype torch.complex32"):
        gelu(torch.zeros(2, dtype=torch.complex32))

    bad = torch.tpu.jax_op(lambda x, y: x @ y, name="test_bad_matmul")
    with pytest.raises(TypeError, match=r"<lambda> failed on inputs \(\[2, 3\] float32, \[4, 5\] float32\)"):
        bad(torch.randn(2, 3, device="tpu"), torch.randn(4, 5, device="tpu"))
    with pytest.raises(RuntimeError, match="<lambda>: a call needs at least one tpu tensor"):
        torch.tpu.jax_op(lambda: jnp.ones(3), name="test_no_inputs")()
    with pytest.raises(TypeError, match="must be hashable"):
        stats({"a": torch.randn(3, device="tpu"), "pair": (torch.randn(3, device="tpu"),) * 2}, 1.0,
              axis=[0], squash=True)


def test_eager_calls_compile_once_per_shape_and_static() -> None:
    op = torch.tpu.jax_op(lambda x, *, k: jnp.cumsum(x, axis=0) * k, name="test_cumsum_k", static_argnames="k")
    a, b = torch.randn(6, 3, device="tpu"), torch.randn(6, 3, device="tpu")
    op(a, k=2).cpu()  # warm: this shape and static value compiled
    torch.tpu.reset_metrics()
    got = op(b, k=2).cpu()  # same shape and static: the cached executable
    m = torch.tpu.metrics()
    assert m.compiles == 0 and m.persistent_cache_hits == 0, m
    torch.testing.assert_close(got, torch.cumsum(b.cpu(), 0) * 2, rtol=1e-6, atol=1e-6)
    got3 = op(b, k=3).cpu()  # a new static value is a new program, with its own value (never a stale one)
    torch.testing.assert_close(got3, torch.cumsum(b.cpu(), 0) * 3, rtol=1e-6, atol=1e-6)
    m = torch.tpu.metrics()  # (compiled, or loaded from the on-disk cache of an earlier run)
    assert m.compiles + m.persistent_cache_hits >= 1, m


def test_second_device_and_mixed_devices() -> None:
    code = (
        "import torch, jax\n"
        "op = torch.tpu.jax_op(lambda x, y: x * y + 1, name='mul1')\n"
        "a, b = torch.randn(3), torch.randn(3)\n"
        "out = op(a.to('tpu:1'), b.to('tpu:1'))\n"
        "assert out.device == torch.device('tpu:1'), out.device\n"
        "torch.testing.assert_close(out.cpu(), a * b + 1)\n"
        "try:\n"
        "    op(a.to('tpu:0'), b.to('tpu:1'))\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    r = run_python(code, env={"TORCH_TPU_NUM_DEVICES": "2"}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERR torch.tpu.jax_op <lambda>: tensor argument 1 is on tpu:1 and argument 0 on tpu:0" in r.stdout, r.stdout


def test_opcheck_schema_fake_and_aot_dispatch() -> None:
    """PyTorch's own custom-op checks: the fake implementation (jax.eval_shape) matches the real outputs, the schema
    holds, and AOT dispatch (static and dynamic shapes) works. (opcheck's autograd-registration check is not
    implemented by PyTorch for devices other than CPU/CUDA/XPU; autograd is checked against CPU above.)"""
    f = torch.tpu.jax_op(lambda x, y: {"p": jnp.sin(x) * y, "s": x.sum()}, name="test_opcheck_sinmul")
    x = torch.randn(3, 4, device="tpu", requires_grad=True)
    y = torch.randn(3, 4, device="tpu", requires_grad=True)
    f(x, y)
    op = f.jax_op
    (key,) = op._keys.values()
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op._fwd, ([x, y], key), test_utils=checks)
    cts = [torch.randn(3, 4, device="tpu"), torch.randn((), device="tpu")]
    torch.library.opcheck(op._vjp, ([x.detach(), y.detach()], cts, key), test_utils=checks[:2])
