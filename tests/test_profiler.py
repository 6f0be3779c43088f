"""Profiling: torch.profiler with the PrivateUse1 (tpu) activity records the tpu ops and record_function ranges
(key_averages, an exported Chrome trace parsed back); torch.tpu.profiler writes a JAX device trace in which every
XLA program is named after its aten op, fused graph or compiled graph (parsed back from the .xplane.pb); the
program names are the lowered HLO modules' names. CPU PyTorch is the oracle for the op names and the values."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from conftest import run_python
from torch_tpu import _eager, _storage


def _model_step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with record_function("tpu_test_range"):
        return (x @ w).relu().sum(0)


def _profiled(device: str) -> tuple[profile, torch.Tensor]:
    x = torch.arange(24.0).reshape(4, 6).div(7).to(device)
    w = torch.arange(18.0).reshape(6, 3).sub(9).div(5).to(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.PrivateUse1] if device != "cpu" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        out = _model_step(x, w).cpu()
    return prof, out


def test_privateuse1_activity_is_supported() -> None:
    assert ProfilerActivity.PrivateUse1 in torch.profiler.supported_activities()


def test_ops_and_ranges_recorded_like_cpu(tmp_path) -> None:
    prof, out = _profiled("tpu")
    cpu_prof, cpu_out = _profiled("cpu")
    torch.testing.assert_close(out, cpu_out)
    keys = {e.key for e in prof.key_averages()}
    cpu_keys = {e.key for e in cpu_prof.key_averages()}
    wanted = {"tpu_test_range", "aten::mm", "aten::relu", "aten::sum"}
    assert wanted <= cpu_keys  # the oracle records them...
    assert wanted <= keys, sorted(keys)  # ...and so does the tpu run
    mm = next(e for e in prof.events() if e.name == "aten::mm")
    assert mm.input_shapes == [[4, 6], [6, 3]]
    rng = next(e for e in prof.events() if e.name == "tpu_test_range")
    assert rng.time_range.start <= mm.time_range.start and mm.time_range.end <= rng.time_range.end

    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    by_name = {e.get("name"): e for e in events if e.get("ph") == "X"}
    assert by_name["tpu_test_range"]["cat"] == "user_annotation"
    assert by_name["aten::mm"]["cat"] == "cpu_op"
    assert by_name["aten::mm"]["args"]["Input Dims"] == [[4, 6], [6, 3]]
    r, m = by_name["tpu_test_range"], by_name["aten::mm"]
    assert r["ts"] <= m["ts"] and m["ts"] + m["dur"] <= r["ts"] + r["dur"]


FRESH_PROFILE = r"""
import threading, torch
from torch.profiler import ProfilerActivity, profile

def profiled(tag):
    x = torch.ones(4, 4, device="tpu")
    m = torch.nn.Linear(4, 4).tpu()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        m(x).sum().backward()
        y = (x @ x).cpu()
    keys = {e.key for e in prof.key_averages()}
    print(tag, "aten::mm" in keys, y.sum().item(), m.weight.grad.sum().item())

profiled("main")  # the first synchronize of the process is torch.profiler's own, at its exit
t = threading.Thread(target=profiled, args=("thread",))  # a thread whose first sync is inside the profile
t.start(); t.join()
"""


def test_profile_in_a_fresh_process_and_thread() -> None:
    """torch.profiler's exit synchronizes the tpu before it pops its own thread-local state; the synchronize must
    not leave torch_tpu's state above it ("Expected debug info of type PROFILER_STATE" for a thread whose first
    synchronize was that one, as in any fresh process)."""
    out = run_python(FRESH_PROFILE)
    assert out.returncode == 0, out.stderr[-3000:]
    x, m = torch.ones(4, 4), torch.nn.Linear(4, 4)
    m(x).sum().backward()
    values = f"True {(x @ x).sum().item()} {m.weight.grad.sum().item()}"  # CPU's
    assert f"main {values}" in out.stdout and f"thread {values}" in out.stdout, out.stdout


def test_annotate_is_a_record_function_range() -> None:
    x = torch.ones(3, 3, device="tpu")

    @torch.tpu.profiler.annotate("decorated_step")
    def step(a: torch.Tensor) -> torch.Tensor:
        return a * 3

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        with torch.tpu.profiler.annotate("outer_block"):
            y = step(x) + 1
    assert torch.equal(y.cpu(), torch.full((3, 3), 4.0))
    names = [e.name for e in prof.events()]
    assert "outer_block" in names and "decorated_step" in names and "aten::mul" in names


# ---- program names ----

def _module_name(lowered_text: str) -> str:
    first = lowered_text.split("\n", 1)[0]  # module @jit_<name> attributes {...} {
    return first.split("@", 1)[1].split(" ", 1)[0]


def test_eager_program_is_named_after_the_aten_op() -> None:
    x = torch.randn(5, 5, device="tpu")
    torch.add(x, x)  # a slow call installs the fast-path entry: the callable the C++ kernel runs on a hit
    kernel = _eager.KERNELS["add.Tensor"]
    assert kernel._fast
    arr = _storage.read(x)
    # Every fast-path entry (other tests may have added in-place or scalar forms) carries the overload's name;
    # the program of this call's form (two tensors, functional) is named after it.
    assert {fn.__name__ for fn in kernel._fast.values()} == {"aten_add_Tensor"}
    assert _module_name(kernel._fast[(2, 0, None)].lower(arr, arr).as_text()) == "jit_aten_add_Tensor"
    y = torch.mm(x, x)
    mm = _eager.KERNELS["mm"]
    fn = mm._fast[(2, 0, None)]
    assert _module_name(fn.lower(arr, arr).as_text()) == "jit_aten_mm"
    torch.testing.assert_close(y.cpu(), x.cpu() @ x.cpu())


def _device_trace(tmp_path, fn):
    try:
        with torch.tpu.profiler.trace(tmp_path):
            out = fn()
    except Exception as e:  # noqa: BLE001 - a jax without the profiler plugin
        if "profil" in str(e).lower() and "already running" not in str(e):
            pytest.skip(f"jax profiler unavailable: {e}")
        raise
    return out, torch.tpu.profiler.device_programs(tmp_path)


def test_device_trace_names_every_kind_of_program(tmp_path) -> None:
    x = torch.arange(12.0).reshape(3, 4).div(10)
    xt = x.to("tpu")
    compiled = torch.compile(lambda a: (a.sin() @ a.t()).cos(), backend="tpu")

    def work():
        with torch.tpu.profiler.annotate("trace_step"):
            eager = (xt @ xt.t()).relu()
        with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
            fused = (xt * 2).exp().sum(1)
            fused_cpu = fused.cpu()
        return eager.cpu(), fused_cpu, compiled(xt).cpu()

    (eager, fused, comp), programs = _device_trace(tmp_path, work)
    torch.testing.assert_close(eager, (x @ x.t()).relu())
    torch.testing.assert_close(fused, (x * 2).exp().sum(1))
    torch.testing.assert_close(comp, (x.sin() @ x.t()).cos())
    names = set(programs)
    assert {"jit_aten_mm", "jit_aten_relu"} <= names, sorted(names)
    assert "jit_torch_tpu_fused_3_ops_mul_Tensor_exp_sum_dim_IntList" in names, sorted(names)
    graphs = [n for n in names if n.startswith("jit_torch_tpu_inference_graph_")]
    assert len(graphs) == 1 and "sin" in graphs[0] and "mm" in graphs[0] and "cos" in graphs[0], sorted(names)
    assert all(p.count >= 1 and p.device_ns > 0 for p in programs.values())

    # The annotation and the op programs are in the written trace itself (parsed directly, not via the helper).
    from torch_tpu._jax import jax

    data = jax.profiler.ProfileData.from_file(torch.tpu.profiler.latest_trace(tmp_path))
    seen = {ev.name for plane in data.planes for line in plane.lines for ev in line.events}
    assert "trace_step" in seen
    assert any("aten_mm" in n for n in seen), sorted(seen)[:50]


def test_trace_start_stop_errors(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="no trace is running"):
        torch.tpu.profiler.stop_trace()
    try:
        torch.tpu.profiler.start_trace(tmp_path / "a")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"jax profiler unavailable: {e}")
    try:
        with pytest.raises(RuntimeError, match="already running"):
            torch.tpu.profiler.start_trace(tmp_path / "b")
    finally:
        torch.tpu.profiler.stop_trace()
    with pytest.raises(FileNotFoundError, match="no trace"):
        torch.tpu.profiler.device_programs(tmp_path / "b")


# ---- the device rows of torch.profiler (runtime/TpuProfiler.cpp, a Kineto plugin) ----

def test_torch_profiler_has_a_device_row_per_program(tmp_path) -> None:
    x = torch.arange(35.0).reshape(5, 7).div(9)
    xt = x.to("tpu")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        y = torch.mm(xt, xt.t())  # a shape first seen here: compiled inside aten::mm, run after
        z = y.tanh().cpu()
    torch.testing.assert_close(z, (x @ x.t()).tanh())
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1]
    names = [e.name for e in device]
    assert "jit_aten_mm" in names and "jit_aten_tanh" in names, names
    host_mm = next(e for e in prof.events() if e.name == "aten::mm")
    dev_mm = next(e for e in device if e.name == "jit_aten_mm")
    # The program runs after the op queued it (its compile, inside aten::mm, comes first).
    assert dev_mm.time_range.start >= host_mm.time_range.start

    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("name") == "jit_aten_mm"]
    assert len(kernels) == 1 and kernels[0]["cat"] == "kernel", kernels
    assert kernels[0]["args"]["hlo_module"] == "jit_aten_mm"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]):
        with pytest.raises(RuntimeError, match="holds the process's one device trace"):
            torch.tpu.profiler.start_trace(tmp_path / "inner")
        with pytest.raises(RuntimeError, match="no trace is running"):
            torch.tpu.profiler.stop_trace()
    cpu_only = profile(activities=[ProfilerActivity.CPU])
    with cpu_only:
        torch.mm(xt, xt.t()).cpu()
    assert not [e for e in cpu_only.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1]


def test_device_trace_running_leaves_the_profile_without_device_rows(tmp_path) -> None:
    xt = torch.ones(4, 4, device="tpu")
    try:
        torch.tpu.profiler.start_trace(tmp_path)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"jax profiler unavailable: {e}")
    try:
        with pytest.warns(UserWarning, match="no tpu device rows"):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
                (xt * 2).cpu()
    finally:
        torch.tpu.profiler.stop_trace()
    assert "aten::mul" in {e.name for e in prof.events()}
    assert not [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1]
    assert "jit_aten_mul_Tensor" in torch.tpu.profiler.device_programs(tmp_path)


def test_legacy_profiler_times_ops_on_the_device() -> None:
    # torch.autograd.profiler.profile(use_device="tpu", use_kineto=False), torch_openreg's path: the profiler stubs
    # (runtime/TpuProfiler.cpp) wait for the device at each op's entry and exit, so an op's TPU time is real.
    from torch.autograd.profiler import profile as legacy_profile

    x = torch.arange(64.0).reshape(8, 8).div(10)
    xt = x.to("tpu")
    (xt @ xt).relu().cpu()  # compiled outside the profile
    with legacy_profile(use_device="tpu", use_kineto=False) as prof:
        out = (xt @ xt).relu().cpu()
    torch.testing.assert_close(out, (x @ x).relu())
    events = {e.key: e for e in prof.key_averages()}
    assert "aten::mm" in events and "aten::relu" in events
    assert events["aten::mm"].device_time_total > 0
    assert all(e.cpu_time_total >= 0 and e.device_time_total >= 0 for e in events.values())
