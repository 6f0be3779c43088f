"""`torch._assert_async` works like CUDA's device-side assert: the condition is read on the device and a false
one raises at the next synchronization point (under DEFER_NEVER_AND_LAUNCH_BLOCKING at the op), as the
RuntimeError CPU raises at the op, with CPU's text or the given message. One mechanism with the index checks
(torch_tpu/_checks.py); an error is raised once and does not poison later work."""

from __future__ import annotations

import pytest
import torch

from torch_tpu import _checks

MODES = ["DEFER_NEVER", "DEFER_AND_FUSE"]


def _cpu_error(fn) -> str:
    with pytest.raises(RuntimeError) as e:
        fn("cpu")
    return str(e.value)


CASES = {
    "bool": lambda d: torch._assert_async(torch.tensor(False, device=d)),
    "float": lambda d: torch._assert_async(torch.zeros((), device=d)),
    "int_1elem": lambda d: torch._assert_async(torch.tensor([0], device=d)),
    "msg": lambda d: torch._assert_async(torch.arange(3, device=d).sum() > 5, "sum must be above 5"),
    "empty_msg": lambda d: torch._assert_async(torch.tensor(0, device=d), ""),
    "computed_view": lambda d: torch._assert_async((torch.arange(6.0, device=d).reshape(2, 3) * 2)[1, 1] == 1, "x"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_false_assert_raises_at_the_next_sync_like_cpu(case: str, mode: str) -> None:
    fn = CASES[case]
    expected = _cpu_error(fn)
    with torch.tpu.set_eager_mode(mode):
        y = torch.ones(2, device="tpu") * 3
        fn("tpu")  # queued: nothing is read here
        assert _checks.pending_count() >= 1
        with pytest.raises(RuntimeError) as e:
            torch.tpu.synchronize()
    assert str(e.value).startswith(expected), (str(e.value), expected)
    assert "next synchronization point" in str(e.value)
    # raised once; later work is correct
    torch.tpu.synchronize()
    assert torch.equal(y.cpu(), torch.full((2,), 3.0))


@pytest.mark.parametrize("mode", MODES)
def test_true_asserts_pass_and_a_read_raises(mode: str) -> None:
    with torch.tpu.set_eager_mode(mode):
        x = torch.arange(4.0, device="tpu")
        for cond in (x.sum() > 1, torch.tensor(True, device="tpu"), torch.tensor([2], device="tpu"), x[1:2],
                     torch.tensor(-0.5, device="tpu", dtype=torch.bfloat16)):
            torch._assert_async(cond)
            torch._assert_async(cond, "never")
        assert x.sum().item() == 6.0  # a read is a synchronization point: nothing raised
        torch._assert_async(x[0], "x[0] is zero")
        with pytest.raises(RuntimeError, match="^x\\[0\\] is zero"):
            x.cpu()  # .cpu() of another value raises too, as on CUDA


def test_assert_on_a_dead_fused_graph_still_fires() -> None:
    """Under DEFER_AND_FUSE an op no tensor refers to is not run; an assertion's condition is still computed
    (the held flag keeps its graph's output alive), inside the same graph as the ops before it."""
    from torch_tpu import _metrics

    with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
        x = torch.randn(8, device="tpu")
        torch.tpu.synchronize()
        before = _metrics.metrics()
        y = (x * 0).abs()
        torch._assert_async(y.sum() > 0, "all zero")
        del y
        after = _metrics.metrics()
        assert after.fused_graph_runs == before.fused_graph_runs, "an assertion must not flush the graph"
        with pytest.raises(RuntimeError, match="^all zero"):
            torch.tpu.synchronize()
        assert _metrics.metrics().fused_graph_runs == before.fused_graph_runs + 1


def test_launch_blocking_raises_at_the_op() -> None:
    expected = _cpu_error(CASES["msg"])
    with torch.tpu.set_eager_mode("DEFER_NEVER_AND_LAUNCH_BLOCKING"):
        with pytest.raises(RuntimeError) as e:
            CASES["msg"]("tpu")
        assert str(e.value).startswith(expected) and "at the op" in str(e.value)
        torch._assert_async(torch.tensor(1, device="tpu"), "fine")
    assert _checks.pending_count() == 0


@pytest.mark.parametrize("n", [0, 2])
def test_not_one_element_raises_at_the_call_like_cpu(n: int) -> None:
    expected = _cpu_error(lambda d: torch._assert_async(torch.ones(n, device=d)))
    with pytest.raises(RuntimeError) as e:
        torch._assert_async(torch.ones(n, device="tpu"))
    assert str(e.value) == expected


def test_compiled_assert_raises_at_the_next_sync() -> None:
    def f(x):
        y = x * 2
        torch._assert_async(y.sum() > 0, "sum must be positive")
        return y + 1

    cf = torch.compile(f, backend="tpu", fullgraph=True)
    good = torch.ones(3, device="tpu")
    assert torch.equal(cf(good).cpu(), f(good.cpu()))
    bad = -torch.ones(3, device="tpu")
    out = cf(bad)
    with pytest.raises(RuntimeError, match="^sum must be positive"):
        out.cpu()
    assert torch.equal(cf(good).cpu(), f(good.cpu()))  # raised once, the same program keeps working
    with pytest.raises(RuntimeError, match="sum must be positive"):
        f(bad.cpu())  # CPU's error for the same input, at the op


def test_graph_assertions_through_the_trace_lowerings() -> None:
    """What torch.compile graphs carry: `_assert_scalar` on a value known at trace time (a shape) raises then,
    with the graph's message; on a traced value, and `_functional_assert_async.msg`, it is a device flag of the
    program (raised when the program's flags are registered)."""
    import jax
    import jax.numpy as jnp

    from torch_tpu import _trace

    with _checks.collecting() as found:
        assert _trace.trace_call("_assert_scalar", (True, "fine"), {}) is None
        with pytest.raises(RuntimeError, match="^Runtime assertion failed for u0 > 2$"):
            _trace.trace_call("_assert_scalar", (False, "Runtime assertion failed for u0 > 2"), {})
    assert not found

    def program(v):
        with _checks.collecting() as found:
            _trace.trace_call("_assert_scalar", (v > 0, "v must be positive"), {})
            token = _trace.trace_call("_functional_assert_async.msg", (v < 10, "v below 10", jnp.zeros(())), {})
        return token, dict(found)

    prog = jax.jit(program)
    for v, error in ((3, None), (-1, "v must be positive"), (12, "v below 10")):
        _, flags = prog(jnp.asarray(v))
        assert len(flags) == 2
        _checks.register(flags)
        if error is None:
            torch.tpu.synchronize()
        else:
            with pytest.raises(RuntimeError, match=f"^{error}"):
                torch.tpu.synchronize()
