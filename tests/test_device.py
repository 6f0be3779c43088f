"""The tpu device and the torch.tpu device module."""

from __future__ import annotations

import pytest
import torch

from conftest import run_python


def test_device_module_registered() -> None:
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    assert torch._C._get_privateuse1_backend_name() == "tpu"
    assert torch.device("tpu").type == "tpu"


def test_current_and_set_device() -> None:
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device(0)
    torch.tpu.set_device("tpu:0")
    torch.tpu.set_device(torch.device("tpu", 0))
    assert torch.tpu.current_device() == 0


def test_device_index_out_of_range() -> None:
    n = torch.tpu.device_count()
    with pytest.raises(IndexError, match=f"tpu:{n} is out of range"):
        torch.tpu.set_device(n)
    with pytest.raises(IndexError, match="TORCH_TPU_NUM_DEVICES"):
        torch.empty(2, device=f"tpu:{n + 3}")
    with pytest.raises(IndexError):
        torch.tpu.get_device_properties(n)
    with pytest.raises(ValueError, match="Expected a tpu device"):
        torch.tpu.set_device("cpu")


def test_device_context_manager() -> None:
    with torch.tpu.device(0):
        assert torch.tpu.current_device() == 0
        assert torch.empty(1, device="tpu").device == torch.device("tpu:0")
    assert torch.tpu.current_device() == 0


def test_device_name_and_properties() -> None:
    name = torch.tpu.get_device_name()
    plat = torch.tpu.platform()
    assert plat in ("cpu", "tpu", "cuda")
    assert name.endswith(f"({plat})")
    if plat == "cpu":
        assert name == "XLA:CPU (cpu)"
    props = torch.tpu.get_device_properties(0)
    assert props.index == 0 and props.platform == plat and props.total_memory > 0
    assert props.name == name


def test_synchronize_and_seed() -> None:
    x = torch.randn(4, device="tpu")
    torch.tpu.synchronize()
    torch.tpu.synchronize(0)
    torch.tpu.manual_seed(123)
    a = torch.randn(8, device="tpu").cpu()
    torch.tpu.manual_seed(123)
    b = torch.randn(8, device="tpu").cpu()
    assert torch.equal(a, b)
    torch.manual_seed(7)  # seeds tpu generators too, like cuda
    c = torch.randn(8, device="tpu").cpu()
    torch.manual_seed(7)
    assert torch.equal(c, torch.randn(8, device="tpu").cpu())
    assert not torch.equal(a, c)
    assert torch.tpu.initial_seed() == 7
    del x


def test_synchronize_waits_for_every_array_in_flight() -> None:
    # torch.tpu.synchronize waits for all live arrays in one C++ call (and, where that raises, one by one): after
    # it, every result of the queued programs is computed, whichever tensor holds it.
    import jax

    from torch_tpu import _C, _runtime

    base = torch.randn(256, 256, device="tpu")
    outs = []
    for i in range(64):
        y = base
        for _ in range(4):
            y = torch.tanh(y @ base + i)
        outs.append(y)
    torch.tpu.synchronize()
    arrays = [_C._array(t) for t in outs]
    assert all(a is not None and a.is_ready() for a in arrays)
    assert all(a.is_ready() for a in jax.live_arrays(_runtime.platform()))
    cpu = base.cpu()
    want = cpu
    for _ in range(4):
        want = torch.tanh(want @ cpu + 63)
    torch.testing.assert_close(outs[-1].cpu(), want, rtol=1e-4, atol=1e-4)


def test_rng_state_roundtrip() -> None:
    torch.tpu.manual_seed(5)
    state = torch.tpu.get_rng_state()
    assert state.device.type == "cpu" and state.dtype == torch.uint8
    a = torch.rand(16, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(a, torch.rand(16, device="tpu").cpu())
    g = torch.Generator("tpu")
    g.manual_seed(9)
    x = torch.randn(5, device="tpu", generator=g).cpu()
    g.manual_seed(9)
    assert torch.equal(x, torch.randn(5, device="tpu", generator=g).cpu())


def test_random_distributions_match_moments() -> None:
    torch.tpu.manual_seed(0)
    n = torch.randn(200_000, device="tpu").cpu()
    assert abs(n.mean().item()) < 0.01 and abs(n.std().item() - 1) < 0.01
    u = torch.rand(200_000, device="tpu", dtype=torch.float64).cpu()
    assert u.min().item() >= 0 and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.01
    b = torch.randn(1000, device="tpu", dtype=torch.bfloat16)
    assert b.dtype == torch.bfloat16


def test_accelerator_api() -> None:
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("tpu")
    assert torch.accelerator.device_count() == torch.tpu.device_count()
    assert torch.accelerator.current_device_index() == 0
    torch.accelerator.set_device_index(0)
    torch.randn(3, device="tpu")
    torch.accelerator.synchronize()


def test_generated_methods() -> None:
    x = torch.ones(3)
    y = x.tpu()
    assert y.is_tpu and not x.is_tpu and y.device == torch.device("tpu:0")
    m = torch.nn.Linear(3, 2).tpu()
    assert m.weight.device.type == "tpu"
    s = torch.UntypedStorage(8).tpu()
    assert s.is_tpu and s.device.type == "tpu"


def test_accelerator_host_cache_calls() -> None:
    """torch.accelerator.empty_host_cache() (torch.accelerator.Graph calls it on entry) needs a host allocator
    registered for the device: without one it dereferenced null and killed the process (so: a fresh process)."""
    r = run_python("import torch\ntorch.zeros(1, device='tpu')\ntorch.accelerator.empty_host_cache()\n"
                   "x = torch.ones(3).pin_memory()\nprint(x.sum().item())\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("3.0")


def test_virtual_devices() -> None:
    r = run_python(
        """
import torch
assert torch.tpu.device_count() == 2, torch.tpu.device_count()
a = torch.arange(4.0, device="tpu:1")
assert a.device == torch.device("tpu:1")
b = a.to("tpu:0")
assert b.device == torch.device("tpu:0")
with torch.tpu.device(1):
    c = torch.ones(4, device="tpu")
    assert c.device.index == 1
assert torch.equal((a + c).cpu(), torch.arange(4.0) + 1)
try:
    a + b
except RuntimeError as e:
    assert "same device" in str(e) and "tpu:1" in str(e) and "tpu:0" in str(e), e
else:
    raise AssertionError("mixing tpu:0 and tpu:1 did not raise")
print("ok")
""",
        env={"TORCH_TPU_NUM_DEVICES": "2"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")


def test_bad_platform_env() -> None:
    r = run_python("import torch; torch.zeros(1, device='tpu')", env={"TORCH_TPU_PLATFORM": "gpu9"})
    assert r.returncode != 0
    assert "TORCH_TPU_PLATFORM='gpu9' is not one of cpu, tpu, cuda" in r.stderr


def test_forced_cpu_platform() -> None:
    r = run_python("import torch; torch.zeros(1, device='tpu'); print(torch.tpu.get_device_name())",
                   env={"TORCH_TPU_PLATFORM": "cpu"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "XLA:CPU (cpu)"


def test_inductor_reads_the_device_properties() -> None:
    """Inductor's DeviceProperties (its reduction-split heuristic, for any device) reads multi_processor_count:
    missing, a compiled reduction on tpu raised AttributeError whenever Inductor split it."""
    from torch._inductor.runtime.hints import DeviceProperties

    props = torch.tpu.get_device_properties(0)
    assert props.multi_processor_count >= 1
    assert DeviceProperties.create(torch.device("tpu", 0)).multi_processor_count == props.multi_processor_count
