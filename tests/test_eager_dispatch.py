"""The eager (DEFER_NEVER) dispatch path of cache hits (runtime/TpuDispatch.cpp): a lowering's functional and
in-place forms run repeated calls in C++ and every other call through the Python kernel. Each test calls an op
twice or more, so the second call is a cache hit, and compares with CPU PyTorch; plus the index-checks
declaration of lowerings (kernels/registry.py `checks`)."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import run_python

EagerMode = torch.tpu.EagerMode


@pytest.fixture(autouse=True)
def _restore_mode():
    yield
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER


def _hits(fn, *args, times: int = 3):
    """fn(*args) called `times` times (the first fills the cache); the results."""
    return [fn(*args) for _ in range(times)]


def _kernel(name: str):
    from torch_tpu import _eager

    return _eager.KERNELS[name]


def test_functional_hits_match_cpu_and_use_the_cache() -> None:
    xc, yc = torch.randn(3, 4), torch.randn(3, 4)
    x, y = xc.to("tpu"), yc.to("tpu")
    for r in _hits(torch.add, x, y):
        torch.testing.assert_close(r.cpu(), xc + yc)
        assert r.device.type == "tpu" and r.dtype == torch.float32 and r.shape == (3, 4)
    for r in _hits(lambda a, b: torch.mul(a, b), x, y):
        torch.testing.assert_close(r.cpu(), xc * yc)
    assert (2, 0, None) in _kernel("add.Tensor")._fast  # the entry the C++ kernel's table mirrors
    # New shapes and dtypes through the same entry: jit keys them, results stay right.
    for shape in ((5,), (2, 3, 4), ()):
        ac, bc = torch.randn(shape), torch.randn(shape)
        for r in _hits(torch.add, ac.to("tpu"), bc.to("tpu")):
            torch.testing.assert_close(r.cpu(), ac + bc)
    ic = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    for r in _hits(torch.add, ic.to("tpu"), ic.to("tpu")):
        assert r.dtype == torch.int32
        assert torch.equal(r.cpu(), ic + ic)


def test_results_are_independent_tensors() -> None:
    xc = torch.randn(4)
    x = xc.to("tpu")
    a, b = x + x, x + x
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    a.mul_(0)
    torch.testing.assert_close(b.cpu(), xc + xc)
    torch.testing.assert_close(x.cpu(), xc)


def test_scalar_arguments_are_traced_not_baked_in() -> None:
    xc = torch.randn(4)
    x = xc.to("tpu")
    x + 1.5  # fill the cache (the slow path installs the entry, the next call compiles it)
    x + 1.5
    kernel = _kernel("add.Tensor")
    jitted = kernel._fast[(2, 3 << 2, None)]
    size = jitted._cache_size()
    for v in (2.5, -3.0, 7.25):
        torch.testing.assert_close((x + v).cpu(), xc + v)
        torch.testing.assert_close(torch.add(x, x, alpha=v).cpu(), torch.add(xc, xc, alpha=v))
    assert jitted._cache_size() == size  # new values: no new trace
    for v in (2, 3, -1):  # ints through their own entry
        torch.testing.assert_close((x * v).cpu(), xc * v)
    ic = torch.arange(4)
    for v in (2, 5):  # an int tensor times an int stays int; times a float becomes float
        assert torch.equal((ic.to("tpu") * v).cpu(), ic * v)
        r = ic.to("tpu") * (v + 0.5)
        assert r.dtype == torch.float32
        torch.testing.assert_close(r.cpu(), ic * (v + 0.5))
    b = torch.tensor([True, False, True])
    for v in (True, False):
        assert torch.equal((b.to("tpu") & v).cpu(), b & v)


def test_broadcasting_and_type_promotion() -> None:
    cases = [
        (torch.randn(3, 1), torch.randn(1, 4)),
        (torch.randn(4), torch.randn(2, 3, 4)),
        (torch.arange(6).reshape(2, 3), torch.randn(3)),  # int64 + float32 -> float32
        (torch.randn(2, 2, dtype=torch.float64), torch.randn(2, 2)),
        (torch.tensor([1, 2], dtype=torch.int8), torch.tensor([3, 4], dtype=torch.uint8)),  # -> int16
        (torch.tensor([True, False]), torch.tensor([2, 3])),
    ]
    for ac, bc in cases:
        a, b = ac.to("tpu"), bc.to("tpu")
        for r in _hits(torch.add, a, b):
            expect = ac + bc
            assert r.dtype == expect.dtype and r.shape == expect.shape, (ac.dtype, bc.dtype)
            torch.testing.assert_close(r.cpu(), expect)
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.randn(3, device="tpu") + torch.randn(4, device="tpu")


def test_inplace_hits_swap_the_target() -> None:
    xc, yc = torch.randn(3, 4), torch.randn(3, 4)
    x, y = xc.to("tpu"), yc.to("tpu")
    ptr = x.untyped_storage().data_ptr()
    expect = xc.clone()
    for _ in range(4):
        r = x.add_(y, alpha=0.5)
        expect.add_(yc, alpha=0.5)
        assert r is x
    torch.testing.assert_close(x.cpu(), expect)
    assert x.untyped_storage().data_ptr() == ptr  # the same storage, a new array
    i = torch.arange(4, device="tpu")
    for _ in range(3):
        i.mul_(2)
    assert torch.equal(i.cpu(), torch.arange(4) * 8)
    # A float target with an int operand: promotion to the target's dtype
    f = torch.zeros(4, device="tpu")
    for _ in range(3):
        f.add_(torch.arange(4, device="tpu"))
    torch.testing.assert_close(f.cpu(), torch.arange(4.0) * 3)


def test_inplace_dtype_and_shape_errors_like_cpu() -> None:
    ic, fc = torch.arange(4), torch.randn(4)
    i, f = ic.to("tpu"), fc.to("tpu")
    for _ in range(3):
        i.add_(i)  # the int target's entry exists now
    with pytest.raises(RuntimeError) as cpu_err:
        ic.add_(fc)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="can't be cast to the desired output type Long") as err:
            i.add_(f)
        assert "Float" in str(err.value) and "Float" in str(cpu_err.value)
    assert torch.equal(i.cpu(), torch.arange(4) * 8)  # untouched by the failed calls
    with pytest.raises(RuntimeError, match="can't be cast"):
        i.mul_(2.5)
    x = torch.zeros(3, 1, device="tpu")
    for _ in range(2):
        x.add_(torch.ones(3, 1, device="tpu"))
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        x.add_(torch.ones(3, 4, device="tpu"))
    torch.testing.assert_close(x.cpu(), torch.full((3, 1), 2.0))


def test_out_form() -> None:
    xc, yc = torch.randn(3), torch.randn(3)
    x, y = xc.to("tpu"), yc.to("tpu")
    out = torch.empty(3, device="tpu")
    for _ in range(3):
        r = torch.add(x, y, out=out)
        assert r is out
    torch.testing.assert_close(out.cpu(), xc + yc)
    iout = torch.empty(3, dtype=torch.int64, device="tpu")
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.add(x, y, out=iout)


def test_cpu_scalar_tensors_and_device_mismatch() -> None:
    xc = torch.randn(3)
    x = xc.to("tpu")
    for _ in range(3):
        x + x
    s = torch.tensor(2.5)  # a CPU 0-d tensor mixes with tpu tensors, as on CUDA
    for r in _hits(torch.add, x, s):
        assert r.device.type == "tpu"
        torch.testing.assert_close(r.cpu(), xc + s)
    for r in _hits(torch.mul, s, x):
        torch.testing.assert_close(r.cpu(), s * xc)
    x2 = x.clone()
    for _ in range(2):
        x2.mul_(s)
    torch.testing.assert_close(x2.cpu(), xc * 2.5 * 2.5)
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.randn(3)  # a CPU tensor with dimensions does not
    with pytest.raises(RuntimeError, match="same device"):
        x.add_(torch.randn(3))


def test_two_devices_mismatch_and_hits_on_each() -> None:
    r = run_python(
        """
import torch
a0, b0 = torch.randn(4, device="tpu:0"), torch.randn(4, device="tpu:0")
for _ in range(3):
    a0 + b0
a1, b1 = a0.to("tpu:1"), b0.to("tpu:1")
for _ in range(3):
    c = a1 + b1
    assert c.device == torch.device("tpu:1"), c.device
    assert torch.allclose(c.cpu(), a0.cpu() + b0.cpu())
for _ in range(2):
    try:
        a1 + b0
    except RuntimeError as e:
        assert "same device" in str(e) and "tpu:1" in str(e) and "tpu:0" in str(e), e
    else:
        raise AssertionError("mixing tpu:0 and tpu:1 did not raise")
    try:
        a0.add_(b1)
    except RuntimeError as e:
        assert "same device" in str(e), e
    else:
        raise AssertionError("in-place mixing tpu:0 and tpu:1 did not raise")
print("ok")
""",
        env={"TORCH_TPU_NUM_DEVICES": "2"},
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr


def test_views_and_non_contiguous_inputs() -> None:
    base_c = torch.randn(4, 6)
    base = base_c.to("tpu")
    for _ in range(2):
        base + base
    views = {
        "transpose": lambda t: t.t(),
        "row": lambda t: t[1],
        "slice": lambda t: t[:, 2:5],
        "strided": lambda t: t[::2, ::3],
        "expand": lambda t: t[:1].expand(3, 6),
    }
    for name, v in views.items():
        for r in _hits(torch.add, v(base), v(base)):
            torch.testing.assert_close(r.cpu(), v(base_c) + v(base_c), msg=name)
        for r in _hits(torch.mul, v(base), 2.0):
            torch.testing.assert_close(r.cpu(), v(base_c) * 2.0, msg=name)
    # In-place through views writes into the base
    t, tc = base.clone(), base_c.clone()
    for _ in range(2):
        t[1].add_(1.0)
        tc[1].add_(1.0)
        t.t()[2].mul_(3.0)
        tc.t()[2].mul_(3.0)
    torch.testing.assert_close(t.cpu(), tc)


def test_autograd_through_hits() -> None:
    xc = torch.randn(3, requires_grad=True)
    x = xc.detach().to("tpu").requires_grad_()
    for _ in range(3):
        x.grad = None
        ((x * x + x) * 2.0).sum().backward()
    xc.grad = None
    ((xc * xc + xc) * 2.0).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), xc.grad)


def test_defer_and_fuse_still_records() -> None:
    xc = torch.randn(4)
    x = xc.to("tpu")
    for _ in range(3):
        x + x  # the DEFER_NEVER entry exists
    torch.tpu.eager_mode = EagerMode.DEFER_AND_FUSE
    m0 = torch.tpu.metrics()
    y = x + x
    z = y * 3.0
    w = x.clone()
    w.add_(x)
    assert torch.tpu.metrics().fused_graph_runs == m0.fused_graph_runs  # nothing ran yet
    torch.testing.assert_close(z.cpu(), (xc + xc) * 3.0)
    torch.testing.assert_close(w.cpu(), xc + xc)
    m1 = torch.tpu.metrics()
    assert m1.fused_graph_runs > m0.fused_graph_runs
    assert m1.fused_ops >= m0.fused_ops + 3, "a hit under DEFER_AND_FUSE must record, not run"


def test_launch_blocking_waits_after_each_op(monkeypatch) -> None:
    from torch_tpu import _executor

    x = torch.randn(8, device="tpu")
    for _ in range(3):
        x + x
    waited = []
    real = _executor.block_arrays
    monkeypatch.setattr(_executor, "block_arrays", lambda out: (waited.append(1), real(out))[1])
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    for _ in range(3):
        y = x + x
    x.add_(y)
    assert len(waited) == 4  # every call took the blocking path, none the C++ hit
    torch.tpu.eager_mode = EagerMode.DEFER_NEVER
    n = len(waited)
    for _ in range(3):
        x + x
    assert len(waited) == n


def test_threads_share_the_cache() -> None:
    xc = torch.randn(16)
    x = xc.to("tpu")
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            local = torch.full((16,), float(seed), device="tpu")
            acc = torch.zeros(16, device="tpu")
            for i in range(200):
                acc.add_(x * local + i)
            expect = sum(xc * float(seed) + i for i in range(200))
            torch.testing.assert_close(acc.cpu(), expect, rtol=1e-4, atol=1e-3)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_recompile_warning_names_the_op_of_a_hit(tmp_path) -> None:
    """A cache hit that compiles new shapes runs in C++ (no Python kernel frame): the warning still names it."""
    script = tmp_path / "storm.py"
    script.write_text(
        """
import warnings, torch
w = torch.randn(8, device="tpu")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for n in range(1, 14):
        x = torch.ones(n, 8, device="tpu")
        x + w  # the slow path once, then C++ hits compiling each new shape
        (x + w).cpu()
msgs = [str(m.message) for m in caught if issubclass(m.category, torch.tpu.RecompilationWarning)]
assert any("aten::add.Tensor" in m and "storm.py" in m for m in msgs), msgs
print("ok")
""")
    r = run_python(f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_index_ops_declare_their_checks_and_undeclared_reports_fail_loudly() -> None:
    from torch_tpu import _checks, _eager
    from torch_tpu.kernels import registry

    # Every eager lowering whose trace reports a check declares it (the index ops keep raising: test_index_checks)
    for name in ("index_select", "gather", "embedding", "take", "nll_loss_forward", "scatter.src"):
        assert registry.LOWERINGS[name].checks, name
    assert not registry.LOWERINGS["add.Tensor"].checks
    with pytest.raises(IndexError, match="out of range|out of bounds"):
        torch.index_select(torch.randn(3, device="tpu"), 0, torch.tensor([5], device="tpu")).cpu()

    # A lowering that reports without the declaration: its eager trace fails, naming the op and the way out.
    from torch_tpu._jax import jnp

    def undeclared(self, index):
        _checks.report_bad_index("my_gather", index, self.shape[0])
        return jnp.take(self, index)

    lowering = registry.Lowering("undeclared.test", undeclared, None, (), True, False)
    jitted = _eager._jit(lowering, lambda a, i: lowering.fn(a, i))
    arr, idx = jnp.arange(3.0), jnp.array([1])
    with pytest.raises(RuntimeError, match=r"aten::undeclared.test.*my_gather.*checks=True"):
        jitted(arr, idx)
    old = _checks.set_enabled(False)
    try:
        with pytest.raises(RuntimeError, match="checks=True"):  # even with the checks turned off
            _eager._jit(lowering, lambda a, i: lowering.fn(a, i))(arr, idx)
    finally:
        _checks.set_enabled(old)
    declared = dataclasses_replace(lowering, checks=True)
    before = _checks.pending_count()
    out = _eager._jit(declared, lambda a, i: declared.fn(a, i))(arr, jnp.array([7]))
    assert out.shape == (1,) and _checks.pending_count() == before + 1
    with pytest.raises(IndexError, match="my_gather"):
        _checks.raise_pending()


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_result_shapes_and_dtypes_when_an_entry_alternates() -> None:
    """A hit reads its result's shape and dtype through the aval it last decoded (runtime/TpuDispatch.cpp
    result_meta): calls that alternate between shapes and dtypes through one entry get each their own."""
    cases = [
        (torch.randn(2, 2), torch.randn(2, 2)),
        (torch.randn(3, 1), torch.randn(1, 4)),  # broadcast: a result shape neither input has
        (torch.randn(5), torch.randn(5)),
        (torch.arange(6, dtype=torch.int32), torch.arange(6, dtype=torch.int32)),
        (torch.randn(2, 2, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)),
        (torch.randn(()), torch.randn(())),
    ]
    dev = [(a.to("tpu"), b.to("tpu")) for a, b in cases]
    cpu = [(a.clone(), b) for a, b in cases]  # CPU mirrors, updated in place alongside
    for _ in range(3):
        for (ac, bc), (a, b) in zip(cpu, dev):
            r = a * b
            expect = ac * bc
            assert r.shape == expect.shape and r.dtype == expect.dtype and r.is_contiguous()
            torch.testing.assert_close(r.cpu(), expect)
            if ac.shape == expect.shape:
                assert a.add_(b) is a
                ac.add_(bc)
            torch.testing.assert_close(a.cpu(), ac)


def test_data_pointers_stay_unique_when_threads_make_and_free_results() -> None:
    """Small storages' address spans are cached per thread (runtime/TpuAllocator.cpp SpanCache): results made
    on one thread and freed on another never share a data pointer with a live storage, and keep their values."""
    x = torch.arange(8.0, device="tpu")
    made: list[list[torch.Tensor]] = [[] for _ in range(3)]

    def work(i: int) -> None:
        for k in range(40):
            made[i].append(x + float(i * 100 + k))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    live = [t for ts in made for t in ts[::2]]
    for ts in made:
        del ts[1::2]  # freed on this thread: their spans go to this thread's cache
    live += [x * float(k) for k in range(60)]  # new results take spans from it
    ptrs = [t.untyped_storage().data_ptr() for t in live]
    assert len(set(ptrs)) == len(ptrs)
    for i in range(3):
        for j, t in enumerate(made[i]):
            torch.testing.assert_close(t.cpu(), torch.arange(8.0) + float(i * 100 + 2 * j))
    for k, t in enumerate(live[-60:]):
        torch.testing.assert_close(t.cpu(), torch.arange(8.0) * float(k))


def test_which_calls_the_cpp_path_serves(monkeypatch) -> None:
    """Repeated calls of a training step's common ops (unary and binary elementwise, mm/addmm on whole arrays,
    their in-place forms, Python scalars) never enter the Python kernel; views enter it and take its wider fast
    path; unusual inputs (CPU 0-d tensors, out=, kwargs the schema keeps as keywords) always bind the schema,
    and every result matches CPU."""
    from torch_tpu import _eager

    slow: list[str] = []  # Python kernel entries: its fast paths (_fast_args, _fast_args_ex) or a binding (op name)
    bind, fast_args = _eager.OpKernel.bind, _eager._fast_args

    def counting_bind(self, args, kwargs):
        slow.append(self.name)
        return bind(self, args, kwargs)

    def counting_fast_args(args):
        slow.append("_fast_args")
        return fast_args(args)

    fast_args_ex = _eager._fast_args_ex

    def counting_fast_args_ex(args, static_mask):
        slow.append("_fast_args_ex")
        return fast_args_ex(args, static_mask)

    def count(on: bool) -> None:
        monkeypatch.setattr(_eager.OpKernel, "bind", counting_bind if on else bind)
        monkeypatch.setattr(_eager, "_fast_args", counting_fast_args if on else fast_args)
        monkeypatch.setattr(_eager, "_fast_args_ex", counting_fast_args_ex if on else fast_args_ex)

    ac, bc, wc = torch.randn(4, 3), torch.randn(4, 3), torch.randn(3, 5)
    a, b, w = ac.to("tpu"), bc.to("tpu"), wc.to("tpu")
    biasc = torch.randn(5)
    bias = biasc.to("tpu")
    served = {
        "add": (lambda x, y: x + y, (a, b), (ac, bc)),
        "sub alpha": (lambda x, y: torch.sub(x, y, alpha=2), (a, b), (ac, bc)),
        "mul scalar": (lambda x: x * 1.5, (a,), (ac,)),
        "div": (lambda x, y: x / y, (a, b), (ac, bc)),
        "neg": (lambda x: -x, (a,), (ac,)),
        "exp": (torch.exp, (a,), (ac,)),
        "relu": (torch.relu, (a,), (ac,)),
        "mm": (torch.mm, (a, w), (ac, wc)),
        "addmm": (torch.addmm, (bias, a, w), (biasc, ac, wc)),
        "add_": (lambda x, y: x.clone().add_(y), (a, b), (ac, bc)),
        "mul_ scalar": (lambda x: x.clone().mul_(0.5), (a,), (ac,)),
    }
    for name, (fn, dev, cpu) in served.items():
        for _ in range(2):  # the first call installs the entry
            fn(*dev)
        count(True)
        slow.clear()
        for _ in range(3):
            r = fn(*dev)
        count(False)
        assert slow == [], (name, slow)
        torch.testing.assert_close(r.cpu(), fn(*cpu), msg=name)
    two = torch.tensor(2.0)
    out = torch.empty(4, 3, device="tpu")
    # Views (a transpose, a slice) enter the Python kernel and take its wider fast path (_fast_args_ex), which
    # reads them inside the op's program without binding the schema.
    views = {
        "transposed operands": (lambda: torch.mm(w.t(), a.t()), lambda: torch.mm(wc.t(), ac.t())),
        "slices": (lambda: a[1:] + b[1:], lambda: ac[1:] + bc[1:]),
    }
    unusual = {
        "CPU 0-d tensor": (lambda: a * two, lambda: ac * two),
        "out=": (lambda: torch.add(a, b, out=out), lambda: ac + bc),
    }
    for name, (fn, cpu_fn) in {**views, **unusual}.items():
        for _ in range(2):
            fn()
        count(True)
        slow.clear()
        r = fn()
        count(False)
        if name in views:
            assert slow == ["_fast_args", "_fast_args_ex"], (name, slow)
        else:
            assert set(slow) - {"_fast_args", "_fast_args_ex"}, (name, slow)  # bound: the kernel with its checks
        torch.testing.assert_close(r.cpu(), cpu_fn(), msg=name)


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE])
def test_wider_fast_path_serves_static_args_views_and_tuples(monkeypatch, mode) -> None:
    """Calls with static arguments (int lists, flags), None optional tensors, tensor lists, several results, or
    views (a transposed weight, a reshaped or permuted activation, slices, a broadcast) take the Python kernel's
    wider fast path (_C._fast_args_ex) on a repeat: no schema binding, in DEFER_NEVER and DEFER_AND_FUSE, every value
    as CPU."""
    from torch_tpu import _eager

    xc, wc, bc = torch.randn(4, 6, 5), torch.randn(7, 5), torch.randn(5)
    x, w, b = xc.to("tpu"), wc.to("tpu"), bc.to("tpu")
    calls = {
        "mm, transposed weight": lambda x, w, b: torch.mm(x.view(24, 5), w.t()),
        "sum of a permuted view": lambda x, w, b: torch.sum(x.permute(2, 0, 1), dim=[1, 2], keepdim=True),
        "layer norm, three results": lambda x, w, b: torch.native_layer_norm(x, [5], b, b, 1e-5),
        "layer norm, None weight": lambda x, w, b: torch.native_layer_norm(x, [5], None, None, 1e-3),
        "softmax of a transposed view": lambda x, w, b: torch.softmax(x.transpose(1, 2), dim=-1),
        "slices of one storage": lambda x, w, b: x[1:, :, :3] * x[:-1, :, 2:],
        "strided slice and a broadcast": lambda x, w, b: x[::2, 1::2] + b[:1].expand(5),
        "mm of a row block, transposed": lambda x, w, b: torch.mm(w[2:5], x[0].t()),
        "cat of a tensor and views": lambda x, w, b: torch.cat([x[0], w[1:7], x[3, :, :].t().reshape(6, 5)]),
        "stack": lambda x, w, b: torch.stack((b, b * 2), dim=1),
    }
    binds: list[str] = []
    bind = _eager.OpKernel.bind

    def counting_bind(self, args, kwargs):
        binds.append(self.name)
        return bind(self, args, kwargs)

    with torch.tpu.set_eager_mode(mode):
        for name, fn in calls.items():
            want = fn(xc, wc, bc)
            for attempt in range(3):
                if attempt == 2:
                    binds.clear()
                    monkeypatch.setattr(_eager.OpKernel, "bind", counting_bind)
                got = fn(x, w, b)
                monkeypatch.setattr(_eager.OpKernel, "bind", bind)
                if attempt == 2:
                    assert binds == [], (name, binds)
                pairs = zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,))
                for g, c in pairs:
                    assert g.shape == c.shape and g.dtype == c.dtype, name
                    torch.testing.assert_close(g.cpu(), c, msg=name)


def test_wider_fast_path_entries_are_bounded(monkeypatch) -> None:
    """A loop over many view geometries (`x[i]` for each i) installs at most _FAST_EX_ENTRIES entries per kernel;
    later geometries take the slow path, with the same values."""
    from torch_tpu import _eager

    monkeypatch.setattr(_eager, "_FAST_EX_ENTRIES", 3)
    xc = torch.randn(8, 5)
    x = xc.to("tpu")
    kernel = _kernel("atan2")
    for _ in range(2):
        for i in range(8):
            torch.testing.assert_close(torch.atan2(x[i], x[7 - i]).cpu(), torch.atan2(xc[i], xc[7 - i]))
    assert 0 < len(kernel._fast_ex) <= 3
    with torch.tpu.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        for i in range(8):
            torch.testing.assert_close(torch.atan2(x[i], x[i]).cpu(), torch.atan2(xc[i], xc[i]))
    assert 0 < len(kernel._fast_rec) <= 3


def test_wider_fast_path_keys() -> None:
    """_C._fast_args_ex keys a call by its static values (1 and True apart), None positions, each view's geometry
    (sizes, strides, storage offset) and a tensor list's elements; a reinterpreting view, a lazy bit, a CPU tensor or an unhashable
    static value declines (the call binds the schema)."""
    from torch_tpu import _C

    a = torch.randn(4, 6, device="tpu")
    x3 = torch.randn(2, 3, 4, device="tpu")
    as_int, as_bool = _C._fast_args_ex((a, 1), 0b10), _C._fast_args_ex((a, True), 0b10)
    assert as_int[3] != as_bool[3] and as_int[2][1] is None
    dev, mask, dyn, key = _C._fast_args_ex((a, [0, 1], None), 0b10)
    assert key == ((1, (0, 1)), (2, None)) and dyn[1] is None and dyn[2] is None
    assert _C._fast_args_ex((a,), 0)[3] == ()  # a tensor that is its storage's array: no entry
    views = {
        "t": (a.t(), ((6, 4), (1, 6), 0)),
        "view": (a.view(24), ((24,), (1,), 0)),
        "permute": (x3.permute(2, 0, 1), ((4, 2, 3), (1, 12, 4), 0)),  # (x3's storage; the rest are a's)
        "slice": (a[1:], ((3, 6), (6, 1), 6)),
        "strided": (a[::2, 1::3], ((2, 2), (12, 3), 1)),
        "expand": (a[:1].expand(3, 6), ((3, 6), (0, 1), 0)),
    }
    for name, (v, geometry) in views.items():
        got = _C._fast_args_ex((v,), 0)
        assert got[3] == ((0, *geometry),), name
        assert got[2][0] is _C._storage_array(x3 if name == "permute" else a)[0], name  # the storage's array
    # A tensor list: its arrays as a tuple, each element's None, () or view geometry in the key.
    dev, mask, dyn, key = _C._fast_args_ex(([a, None, a[1:]], 0), 0b10)
    assert key == ((0, "list", ((), None, ((3, 6), (6, 1), 6))), (1, 0, 2))
    assert dyn[0][0] is dyn[0][2] is _C._storage_array(a)[0] and dyn[0][1] is None
    assert _C._fast_args_ex(([a, torch.randn(2)], 0), 0b10) is None  # a CPU tensor in the list
    complex_a = torch.randn(3, dtype=torch.complex64, device="tpu")
    for declined in (a.view(torch.int32)[1:], complex_a.conj(), torch.randn(3)):
        assert _C._fast_args_ex((declined,), 0) is None
    assert _C._fast_args_ex((a, [[0]]), 0b10) is None  # an unhashable static value


def test_an_op_compiles_once_for_its_first_two_calls(tmp_path) -> None:
    """The first call shaped for the fast path runs through the entry it installs: its program is compiled (or,
    on a warm start, loaded from the persistent cache) once, not once for the slow path's general callable and
    again for the entry on the second call. Functional and in-place forms and the wider fast path's relaid operand,
    cold and warm, values as CPU."""
    code = """
import torch
xc, yc = torch.randn(7, 13), torch.randn(7, 13)
x, y = xc.to("tpu"), yc.to("tpu")
def programs():
    m = torch.tpu.metrics()
    return m.compiles + m.persistent_cache_hits
base = programs()
outs = [torch.atan2(x, y) for _ in range(3)]
after_functional = programs() - base
z = x.clone()
base = programs()
for _ in range(3):
    z.mul_(y)
after_inplace = programs() - base
wc = torch.randn(5, 13)
w = wc.to("tpu")
base = programs()
outs_t = [torch.mm(x, w.t()) for _ in range(3)]  # the wider fast path (_fast_args_ex): a transposed operand
after_relaid = programs() - base
for o in outs_t:
    torch.testing.assert_close(o.cpu(), xc @ wc.t())
for o in outs:
    torch.testing.assert_close(o.cpu(), torch.atan2(xc, yc))
torch.testing.assert_close(z.cpu(), xc * yc ** 3)
print("PROGRAMS", after_functional, after_inplace, after_relaid)
"""
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path / "cache")}
    for start in ("cold", "warm"):
        r = run_python(code, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("PROGRAMS")][-1]
        assert line.split()[1:] == ["1", "1", "1"], (start, line)
