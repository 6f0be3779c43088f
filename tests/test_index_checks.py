"""Out-of-range indices raise, in every execution mode, like CPU (at the op) or CUDA (at the next sync).

The checks are computed on the device inside the op's own program (torch_tpu/_checks.py) and raised at the next
synchronization point; under DEFER_NEVER_AND_LAUNCH_BLOCKING at the op. CPU PyTorch is the oracle: for every
case it raises the same exception type for the same input, and in-range (and valid negative) indices give CPU's
values. An error does not poison later correct work.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from torch_tpu import _checks
from torch_tpu._deferred import EagerMode

from conftest import run_python

warnings.filterwarnings("ignore", message="index_reduce.*beta")


def _x(dev: str) -> torch.Tensor:
    return torch.arange(20.0, device=dev).reshape(5, 4)


def _i(dev: str, v: int) -> torch.Tensor:
    return torch.tensor([0, v], device=dev)


# name -> (op(x, index) on any device, index builder (device, value), sizes the valid range, the message must
# show the size like this, CPU allows negative indices)
def _cases() -> dict:
    col = lambda d, v: torch.tensor([[0], [v]], device=d)  # noqa: E731
    return {
        "index_select": (lambda x, i: x.index_select(0, i), _i, "size 5", False),
        "embedding": (lambda x, i: torch.nn.functional.embedding(i, x), _i, "size 5", False),
        "gather": (lambda x, i: x.gather(0, i), col, "size 5", False),
        "scatter_value": (lambda x, i: x.scatter(0, i, 1.5), col, "size 5", False),
        "scatter_src": (lambda x, i: x.scatter(0, i, x * 2), col, "size 5", False),
        "scatter_add": (lambda x, i: x.scatter_add(0, i, x * 2), col, "size 5", False),
        "scatter_reduce": (lambda x, i: x.scatter_reduce(0, i, x * 2, "amax"), col, "size 5", False),
        "index_add": (lambda x, i: x.index_add(0, i, x[:2] * 3), _i, "size 5", False),
        "index_copy": (lambda x, i: x.index_copy(0, i, x[:2] * 3), _i, "size 5", False),
        "index_fill": (lambda x, i: x.index_fill(0, i, -1.0), _i, "size 5", True),
        "index_reduce": (lambda x, i: x.index_reduce(0, i, x[:2] + 1, "prod"), _i, "size 5", False),
        "take": (lambda x, i: x.take(i), _i, "20 elements", True),
        "put": (lambda x, i: x.put(i, torch.tensor([7.0, 8.0], device=x.device)), _i, "20 elements", True),
        "index": (lambda x, i: x[i], _i, "size 5", True),
        "index_dim1": (lambda x, i: x[:, i], _i, "size 4", True),
        "index_put": (lambda x, i: x.index_put((i,), torch.tensor(9.0, device=x.device)), _i, "size 5", True),
        "index_put_acc": (lambda x, i: x.index_put((i,), torch.tensor(9.0, device=x.device), accumulate=True),
                          _i, "size 5", True),
        "nll_loss": (lambda x, i: torch.nn.functional.nll_loss(x[:2].log_softmax(1), i), _i, "out of bounds", False),
    }


CASES = _cases()
# too big, too negative (a flat index for take/put: 20 elements)
BAD = {"take": (28, -24), "put": (28, -24), "index_dim1": (4, -5), "nll_loss": (4, -1)}


def _bad_values(name: str) -> tuple[int, int]:
    return BAD.get(name, (7, -6))


def _cpu_error(name: str, v: int) -> type[Exception]:
    op, index, _, _ = CASES[name]
    with pytest.raises((IndexError, RuntimeError)) as info:
        op(_x("cpu"), index("cpu", v))
    return info.type


def _check_message(e: BaseException, name: str, v: int) -> None:
    msg = str(e)
    assert f"index {v} " in msg or f"Target {v} " in msg, msg
    assert CASES[name][2] in msg, msg


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _clean() -> None:
    with _checks._lock:
        _checks._pending.clear()
    yield
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER
    with _checks._lock:
        _checks._pending.clear()


def _good_values(name: str) -> list[int]:
    n = 20 if name in ("take", "put") else 4 if name in ("index_dim1",) else 2 if name == "nll_loss" else 5
    vals = [n - 1, 1]
    if CASES[name][3]:
        vals.append(-1)
        vals.append(-n)
    return vals


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_raises_at_next_sync(case: str, mode: str) -> None:
    op, index, _, _ = CASES[case]
    torch.tpu.eager_mode = mode
    for v in _bad_values(case):
        cls = _cpu_error(case, v)
        y = op(_x("tpu"), index("tpu", v))  # the op itself returns (its values are unspecified)
        with pytest.raises(cls) as info:
            y.cpu()
        _check_message(info.value, case, v)
        assert "next synchronization point" in str(info.value)
        # the error was reported once; later correct work is right
        good = _good_values(case)[0]
        torch.testing.assert_close(op(_x("tpu"), index("tpu", good)).cpu(), op(_x("cpu"), index("cpu", good)))


def test_raises_at_the_op_when_launch_blocking(case: str) -> None:
    op, index, _, _ = CASES[case]
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    for v in _bad_values(case):
        cls = _cpu_error(case, v)
        with pytest.raises(cls) as info:
            op(_x("tpu"), index("tpu", v))
        _check_message(info.value, case, v)
        assert "at the op" in str(info.value)
    good = _good_values(case)[0]
    torch.testing.assert_close(op(_x("tpu"), index("tpu", good)).cpu(), op(_x("cpu"), index("cpu", good)))


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING", "DEFER_AND_FUSE"])
def test_valid_indices_match_cpu(case: str, mode: str) -> None:
    op, index, _, _ = CASES[case]
    torch.tpu.eager_mode = mode
    for v in _good_values(case):
        torch.testing.assert_close(op(_x("tpu"), index("tpu", v)).cpu(), op(_x("cpu"), index("cpu", v)))
    torch.tpu.synchronize()  # nothing pending raises


def test_compiled(case: str) -> None:
    op, index, _, _ = CASES[case]
    torch._dynamo.reset()
    fn = torch.compile(op, backend="tpu", dynamic=False)
    for v in _good_values(case)[:2]:
        torch.testing.assert_close(fn(_x("tpu"), index("tpu", v)).cpu(), op(_x("cpu"), index("cpu", v)))
    for v in _bad_values(case):
        cls = _cpu_error(case, v)
        y = fn(_x("tpu"), index("tpu", v))
        with pytest.raises(cls) as info:
            y.cpu()
        _check_message(info.value, case, v)
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    with pytest.raises(_cpu_error(case, _bad_values(case)[0])):
        fn(_x("tpu"), index("tpu", _bad_values(case)[0]))
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER
    v = _good_values(case)[0]
    torch.testing.assert_close(fn(_x("tpu"), index("tpu", v)).cpu(), op(_x("cpu"), index("cpu", v)))


def test_item_and_synchronize_are_sync_points() -> None:
    x = _x("tpu")
    y = x.index_select(0, _i("tpu", 9))
    with pytest.raises(IndexError, match="index 9 is out of bounds for dimension 0 with size 5"):
        y.sum().item()
    x.gather(0, torch.tensor([[5]], device="tpu"))
    with pytest.raises(RuntimeError, match=r"gather\(\): index 5 is out of bounds"):
        torch.tpu.synchronize()
    torch.tpu.synchronize()  # reported once


def _long_program() -> torch.Tensor:
    """A (1536, 1536) result of four matmuls: hundreds of milliseconds of XLA:CPU work, dispatched asynchronously."""
    a = torch.randn(1536, 1536, device="tpu") / 40
    h = a
    for _ in range(4):
        h = h @ a
    return h


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_a_read_raises_the_errors_of_the_work_behind_its_value(mode: str) -> None:
    """The read of a value raises the errors of the ops it was computed from, also when it is issued while their
    program still runs (it waits for the value first, then reads the checks)."""
    torch.tpu.eager_mode = mode
    y = _long_program().index_select(0, torch.tensor([0, 1536 + 3], device="tpu"))
    with pytest.raises(IndexError, match="index 1539 is out of bounds for dimension 0 with size 1536"):
        y.cpu()
    z = _long_program().sum(0).index_select(0, torch.tensor([1536 + 5], device="tpu")) * 2
    with pytest.raises(IndexError, match="index 1541 is out of bounds"):
        z.sum().item()
    torch.tpu.synchronize()  # each reported once


def test_a_read_leaves_a_running_check_it_does_not_depend_on_pending() -> None:
    """A check whose program is still running when an unrelated value is read stays pending (the read does not
    wait for it): a later synchronization point raises it. On XLA:CPU the program runs for hundreds of
    milliseconds after the read."""
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER
    ready = torch.arange(3.0, device="tpu")
    ready.cpu()
    torch.tpu.synchronize()
    _long_program().index_select(0, torch.tensor([1536 + 4], device="tpu"))  # its result dropped, its check kept
    try:
        got = ready.cpu()  # (already computed: no program of its own)
    except IndexError:
        assert torch.tpu.get_device_name() != "XLA:CPU (cpu)", "the read waited for a program it does not read"
    else:
        assert torch.equal(got, torch.arange(3.0)) and _checks.pending_count() >= 1
        with pytest.raises(IndexError, match="index 1540 is out of bounds for dimension 0 with size 1536"):
            torch.tpu.synchronize()
    torch.tpu.synchronize()  # reported once


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE", "compile"])
def test_embedding_forward_backward(mode: str) -> None:
    """A training step with an embedding: out-of-range ids raise; in-range ids give CPU's gradients (the backward
    runs on the autograd thread)."""
    def step(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.embedding(ids, w) ** 2).sum()

    fn = step
    if mode == "compile":
        torch._dynamo.reset()
        fn = torch.compile(step, backend="tpu", dynamic=False)
    else:
        torch.tpu.eager_mode = mode
    w_cpu = torch.randn(6, 3, requires_grad=True)
    w = w_cpu.detach().to("tpu").requires_grad_()
    ids = torch.tensor([[0, 5, 2], [5, 1, 1]])
    step(w_cpu, ids).backward()
    loss = fn(w, ids.to("tpu"))
    loss.backward()
    torch.testing.assert_close(loss.cpu(), step(w_cpu, ids).detach())
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad)
    w.grad = None
    loss = fn(w, torch.tensor([[0, 6, 2], [5, 1, 1]], device="tpu"))
    loss.backward()
    with pytest.raises(IndexError, match="index 6 is out of bounds for dimension 0 with size 6"):
        w.grad.cpu()
    w.grad = None
    loss = fn(w, ids.to("tpu"))
    loss.backward()
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad)


def test_pending_flags_are_bounded() -> None:
    """A loop without synchronization does not keep every flag: past the bound the oldest are read."""
    x, i = _x("tpu"), _i("tpu", 3)
    for _ in range(3 * _checks._MAX_PENDING):
        x = x.index_select(0, torch.tensor([0, 1, 2, 3, 4], device="tpu"))
    assert _checks.pending_count() <= _checks._MAX_PENDING
    x.index_select(0, i).cpu()
    # a bad index early in a long loop is still raised (at the latest at the sync)
    x.index_select(0, _i("tpu", 11))
    with pytest.raises(IndexError, match="index 11 is out of bounds"):
        for _ in range(3 * _checks._MAX_PENDING):
            x = x.index_select(0, torch.tensor([0, 1, 2, 3, 4], device="tpu"))
        x.cpu()


def test_unsafe_opt_out() -> None:
    """TORCH_TPU_INDEX_CHECKS=0 (set_enabled(False)), for measuring the checks' cost only: nothing raises."""
    old = _checks.set_enabled(False)
    try:
        for mode in ("DEFER_NEVER", "DEFER_AND_FUSE"):
            torch.tpu.eager_mode = mode
            _x("tpu").index_select(0, _i("tpu", 7)).cpu()
    finally:
        _checks.set_enabled(old)
    torch.tpu.eager_mode = EagerMode.DEFER_AND_FUSE
    with pytest.raises(IndexError):  # the same graph with the checks back on is a different program
        _x("tpu").index_select(0, _i("tpu", 7)).cpu()


def test_fused_program_from_disk_still_checks(tmp_path) -> None:
    """A fused program loaded from the persistent cache (no tracing) still knows its checks' messages."""
    code = (
        "import torch\n"
        "torch.tpu.eager_mode = 'DEFER_AND_FUSE'\n"
        "x = torch.arange(20.).reshape(5, 4).to('tpu')\n"
        "ok = (x.index_select(0, torch.tensor([1, 4], device='tpu')) * 2).cpu()\n"
        "assert ok.tolist() == [[8., 10., 12., 14.], [32., 34., 36., 38.]], ok\n"
        "try:\n"
        "    (x.index_select(0, torch.tensor([1, 8], device='tpu')) * 2).cpu()\n"
        "except IndexError as e:\n"
        "    print('RAISED', e)\n"
        "print('COMPILES', torch.tpu.metrics().fused_graph_compiles)\n"
    )
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path)}
    for run in range(2):
        r = run_python(code, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "RAISED index_select(): index 8 is out of bounds for dimension 0 with size 5" in r.stdout, r.stdout
        if run == 1:
            assert "COMPILES 0" in r.stdout, r.stdout  # both graphs came from the disk


# Other ops whose values select elements: (op on any device, good inputs, bad inputs, what the message shows)
def _friends() -> dict:
    def masked_scatter(d: str, bad: bool) -> torch.Tensor:
        mask = torch.tensor([True, False, True, True, bad], device=d)
        return torch.zeros(5, device=d).masked_scatter(mask, torch.arange(1.0, 4.0, device=d))

    def multi_margin(d: str, bad: bool) -> torch.Tensor:
        x = torch.linspace(-1, 1, 6, device=d).reshape(2, 3)
        return torch.nn.functional.multi_margin_loss(x, torch.tensor([0, 5 if bad else 2], device=d))

    def max_unpool(d: str, bad: bool) -> torch.Tensor:
        x = torch.arange(1.0, 5.0, device=d).reshape(1, 1, 2, 2)
        idx = torch.tensor([[[[0, 3], [9 if bad else 8, 5]]]], device=d)  # 3x3 output: valid in [0, 9)
        return torch.nn.functional.max_unpool2d(x, idx, 2, output_size=(3, 3))

    return {"masked_scatter": (masked_scatter, "source has 3 elements"), "multi_margin_loss": (multi_margin, "5"),
            "max_unpool2d": (max_unpool, "invalid max index: 9")}


FRIENDS = _friends()


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING", "DEFER_AND_FUSE", "compile"])
@pytest.mark.parametrize("name", list(FRIENDS))
def test_other_value_checks(name: str, mode: str) -> None:
    op, shown = FRIENDS[name]
    with pytest.raises(RuntimeError) as cpu:
        op("cpu", True)
    fn = op
    if mode == "compile":
        torch._dynamo.reset()
        fn = torch.compile(op, backend="tpu", dynamic=False)
    else:
        torch.tpu.eager_mode = mode
    with pytest.raises(cpu.type) as info:
        fn("tpu", True).cpu()
    assert shown in str(info.value), str(info.value)
    if mode == "DEFER_NEVER_AND_LAUNCH_BLOCKING":
        assert "at the op" in str(info.value)
    torch.testing.assert_close(fn("tpu", False).cpu(), op("cpu", False))
