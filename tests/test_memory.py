"""Memory statistics (torch.tpu.memory_*, torch.accelerator.memory_*) against exact byte counts of the tensors a
test makes, and torch.OutOfMemoryError from the accounting's limit and from PJRT's RESOURCE_EXHAUSTED, in
DEFER_NEVER and DEFER_AND_FUSE."""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import run_python

MiB = 1 << 20
MODES = ["DEFER_NEVER", "DEFER_AND_FUSE"]
CUDA_KEYS = [f"{stat}.{pool}.{metric}"
             for stat in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                          "active_bytes", "inactive_split_bytes", "requested_bytes")
             for pool in ("all", "small_pool", "large_pool")
             for metric in ("current", "peak", "allocated", "freed")] + [
    "num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
    "max_split_size", "oversize_allocations.current", "oversize_segments.peak"]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest):
    torch.ones(1, device="tpu").cpu()  # the runtime is up: statistics are {} before the first tpu use
    with torch.tpu.set_eager_mode(request.param):
        yield request.param
    torch.tpu.synchronize()


def settled() -> int:
    """memory_allocated once garbage from earlier tests is gone."""
    gc.collect()
    torch.tpu.synchronize()
    return torch.tpu.memory_allocated()


def test_allocated_counts_exact_storage_bytes(mode: str) -> None:
    base = settled()
    n0 = torch.tpu.memory_stats()["allocation.all.current"]
    x = torch.empty(MiB // 4, dtype=torch.float32, device="tpu")  # 1 MiB
    assert torch.tpu.memory_allocated() == base + MiB
    assert torch.tpu.memory_stats()["allocation.all.current"] == n0 + 1
    v = x[1000:].view(-1, 2)  # views share the storage: nothing more
    w = x.unsqueeze(0)
    assert torch.tpu.memory_allocated() == base + MiB
    x.fill_(2.0).add_(1.0)  # in place: the storage swaps in an array of the same size
    assert torch.tpu.memory_allocated() == base + MiB
    y = x.to(torch.float16)  # a new storage of half the size
    assert torch.tpu.memory_allocated() == base + MiB + MiB // 2
    del x, w
    assert torch.tpu.memory_allocated() == base + MiB + MiB // 2  # `v` keeps the storage alive
    assert torch.equal(v.cpu(), torch.full((MiB // 8 - 500, 2), 3.0))
    del v
    assert torch.tpu.memory_allocated() == base + MiB // 2
    assert torch.equal(y.cpu(), torch.full((MiB // 4,), 3.0, dtype=torch.float16))
    del y
    assert torch.tpu.memory_allocated() == base
    assert torch.tpu.memory_stats()["allocation.all.current"] == n0


def test_resize_and_module_moves_are_counted(mode: str) -> None:
    base = settled()
    x = torch.zeros(1000, device="tpu")
    assert torch.tpu.memory_allocated() == base + 4000
    x.resize_(3000)
    assert torch.tpu.memory_allocated() == base + 12000
    lin = torch.nn.Linear(100, 50).to("tpu")  # weight 5000 floats, bias 50
    assert torch.tpu.memory_allocated() == base + 12000 + 4 * 5050
    del x, lin
    assert settled() == base


def test_peak_reset_and_accumulated(mode: str) -> None:
    base = settled()
    torch.tpu.reset_peak_memory_stats()
    torch.tpu.reset_accumulated_memory_stats()
    assert torch.tpu.max_memory_allocated() == base
    a = torch.empty(2 * MiB, dtype=torch.uint8, device="tpu")
    b = torch.empty(MiB, dtype=torch.uint8, device="tpu")
    del a, b
    c = torch.empty(MiB, dtype=torch.uint8, device="tpu")
    s = torch.tpu.memory_stats()
    assert s["allocated_bytes.all.peak"] == base + 3 * MiB == torch.tpu.max_memory_allocated()
    assert s["allocated_bytes.all.allocated"] == 4 * MiB and s["allocated_bytes.all.freed"] == 3 * MiB
    assert s["allocation.all.allocated"] == 3 and s["allocation.all.freed"] == 2
    assert s["allocated_bytes.large_pool.allocated"] == 4 * MiB - 2 * MiB  # 2 MiB large; the 1 MiB ones small
    assert s["allocated_bytes.small_pool.allocated"] == 2 * MiB
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == base + MiB
    torch.tpu.reset_max_memory_allocated()
    assert torch.tpu.max_memory_allocated() == base + MiB
    del c
    assert torch.tpu.max_memory_allocated() == base + MiB
    torch.tpu.reset_accumulated_memory_stats()
    s = torch.tpu.memory_stats()
    assert s["allocated_bytes.all.allocated"] == s["allocated_bytes.all.freed"] == 0 and s["num_ooms"] == 0


def test_keys_and_consistency(mode: str) -> None:
    keep = torch.randn(300, 300, device="tpu")  # 360000 bytes: a small-pool block
    s = torch.tpu.memory_stats()
    missing = [k for k in CUDA_KEYS if k not in s]
    assert not missing
    assert list(s) == sorted(s)
    assert all(isinstance(v, int) and v >= 0 for v in s.values())
    for stat in ("allocated_bytes", "allocation", "reserved_bytes", "requested_bytes"):
        for m in ("current", "allocated", "freed"):
            assert s[f"{stat}.all.{m}"] == s[f"{stat}.small_pool.{m}"] + s[f"{stat}.large_pool.{m}"]
    # No caching allocator: active, requested and allocated are the same bytes.
    assert s["allocated_bytes.all.current"] == s["active_bytes.all.current"] == s["requested_bytes.all.current"]
    assert s["allocated_bytes.all.current"] == torch.tpu.memory_allocated() >= keep.numel() * 4
    if torch.tpu.platform() == "cpu":  # XLA:CPU: reserved is the same count
        assert torch.tpu.memory_reserved() == torch.tpu.memory_allocated()
        assert torch.tpu.max_memory_reserved() == torch.tpu.max_memory_allocated()
    nested = torch.tpu.memory_stats_as_nested_dict()
    assert nested["allocated_bytes"]["all"]["current"] == s["allocated_bytes.all.current"]
    free, total = torch.tpu.mem_get_info()
    assert 0 < free <= total and total == torch.tpu.get_device_properties().total_memory
    torch.tpu.empty_cache()
    assert torch.tpu.memory_allocated() == s["allocated_bytes.all.current"]


def test_memory_summary_text(mode: str) -> None:
    base = settled()
    keep = torch.empty(20 * MiB, dtype=torch.uint8, device="tpu")
    text = torch.tpu.memory_summary()
    assert "PyTorch tpu memory summary, device ID 0" in text
    line = next(ln for ln in text.splitlines() if "Allocated memory" in ln)
    cur = (base + 20 * MiB) // MiB  # (CUDA's units: KiB below 10 MiB, MiB from there)
    assert f"{cur:6d} MiB" in line, line
    assert "from large pool" in text and "tpu OOMs:" in text
    assert "from large pool" not in torch.tpu.memory_summary(abbreviated=True)
    del keep


def test_accelerator_memory_functions_agree(mode: str) -> None:
    assert torch.accelerator.current_accelerator().type == "tpu"
    base = settled()
    keep = torch.empty(3 * MiB, dtype=torch.uint8, device="tpu")
    assert torch.accelerator.memory_allocated() == torch.tpu.memory_allocated() == base + 3 * MiB
    assert torch.accelerator.memory_allocated(0) == torch.accelerator.memory_allocated("tpu:0")
    assert torch.accelerator.memory_reserved() == torch.tpu.memory_reserved()
    assert torch.accelerator.memory_stats() == torch.tpu.memory_stats()
    torch.accelerator.reset_peak_memory_stats()
    del keep
    assert torch.accelerator.max_memory_allocated() == torch.tpu.max_memory_allocated() == base + 3 * MiB
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.tpu.memory_stats()["allocated_bytes.all.freed"] == 0
    free, total = torch.accelerator.get_memory_info()
    assert total == torch.tpu.mem_get_info()[1] and 0 < free <= total
    torch.accelerator.empty_cache()


def _with_limit(extra: int) -> None:
    """Limits tpu:0's live storages to what they hold now plus about `extra` bytes."""
    total = torch.tpu.mem_get_info()[1]
    torch.tpu.set_per_process_memory_fraction((torch.tpu.memory_allocated() + extra) / total)


def test_limit_raises_out_of_memory_and_the_device_stays_usable(mode: str) -> None:
    base = settled()
    ooms = torch.tpu.memory_stats()["num_ooms"]
    x = torch.ones(MiB // 4, device="tpu")  # 1 MiB
    _with_limit(4 * MiB)
    try:
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(8 * MiB, dtype=torch.uint8, device="tpu")
        msg = str(info.value)
        assert "Tried to allocate 8.00 MiB" in msg and "tpu:0" in msg
        assert f"{(base + MiB) / MiB:.2f} MiB already allocated" in msg and "limit" in msg
        assert "set_per_process_memory_fraction" in msg and "smaller batches" in msg
        assert torch.tpu.memory_stats()["num_ooms"] == ooms + 1
        assert torch.tpu.memory_allocated() == base + MiB  # nothing leaked
        with pytest.raises(torch.OutOfMemoryError):  # an op's result past the limit (either mode: at the op)
            x.repeat(8)  # 8 MiB
        assert torch.tpu.memory_stats()["num_ooms"] == ooms + 2
        assert settled() == base + MiB
        small = torch.ones(4, device="tpu")
        (small * small).cpu(), (small + 1).cpu()  # the eager cache hits (runtime/TpuDispatch.cpp) from here on
        _with_limit(MiB // 2)
        live = torch.tpu.live_storages()
        for op in (lambda t: t * t, lambda t: t + 1):
            with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 1.00 MiB"):
                op(x)
        assert torch.tpu.memory_stats()["num_ooms"] == ooms + 4
        assert torch.tpu.live_storages() == live and settled() == base + MiB + 16  # nothing leaked
        del small
        _with_limit(4 * MiB)
        z = x * 2 + 1  # the next ops run
        assert torch.equal(z.cpu(), torch.full((MiB // 4,), 3.0))
    finally:
        torch.tpu.set_per_process_memory_fraction(1.0)
    assert torch.tpu.get_per_process_memory_fraction() == 1.0
    with pytest.raises(ValueError, match="Allowed range"):
        torch.tpu.set_per_process_memory_fraction(1.5)
    del x, z
    assert settled() == base


def test_pjrt_resource_exhausted_becomes_out_of_memory(mode: str) -> None:
    base = settled()
    ooms = torch.tpu.memory_stats()["num_ooms"]
    a = torch.ones(4, 1, dtype=torch.uint8, device="tpu")
    b = torch.ones(1, 8, dtype=torch.uint8, device="tpu")
    assert torch.equal((a + b).cpu(), torch.full((4, 8), 2, dtype=torch.uint8))  # (installs the fast path)
    big_a = torch.ones(1 << 22, 1, dtype=torch.uint8, device="tpu")
    big_b = torch.ones(1, 1 << 23, dtype=torch.uint8, device="tpu")
    held = settled()
    with pytest.raises(torch.OutOfMemoryError) as info:  # a 32 TiB result: XLA cannot allocate it
        c = big_a + big_b
        torch.tpu.synchronize()  # (DEFER_AND_FUSE: the graph runs here)
    msg = str(info.value)
    del info  # (its traceback holds the failed result)
    assert "tpu out of memory" in msg and "RESOURCE_EXHAUSTED" in msg and "tpu:0" in msg
    assert "memory_allocated" in msg and "smaller batches" in msg
    assert torch.tpu.memory_stats()["num_ooms"] == ooms + 1
    c = None
    assert settled() == held
    assert torch.equal((a + b).cpu(), torch.full((4, 8), 2, dtype=torch.uint8))  # the device stays usable
    assert int(big_a.sum().cpu()) == 1 << 22
    del a, b, big_a, big_b, c
    assert settled() == base


def test_env_limit_and_per_device_counts_in_a_fresh_process() -> None:
    code = (
        "import torch\n"
        "print('before', torch.tpu.memory_stats(), torch.accelerator.memory_allocated())\n"
        "x = torch.ones(1024, device='tpu')\n"
        "try:\n"
        "    torch.zeros(2 << 20, device='tpu')\n"
        "except torch.OutOfMemoryError as e:\n"
        "    print('OOM', e)\n"
        "print('ooms', torch.tpu.memory_stats()['num_ooms'], 'allocated', torch.tpu.memory_allocated())\n"
        "print('next', (x + 1).sum().item())\n"
        "y = x.to('tpu:1'); z = torch.empty(100, dtype=torch.int64, device='tpu:1')\n"
        "print('per device', torch.tpu.memory_allocated(0), torch.tpu.memory_allocated('tpu:1'),\n"
        "      torch.accelerator.memory_allocated(1), torch.tpu.memory_stats(1)['num_ooms'])\n"
    )
    r = run_python(code, env={"TORCH_TPU_MEMORY_LIMIT": "4M", "TORCH_TPU_NUM_DEVICES": "2"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "before OrderedDict() 0" in r.stdout  # nothing before the first tpu use (as CUDA)
    assert "OOM tpu out of memory. Tried to allocate 8.00 MiB" in r.stdout
    assert "limit 4.00 MiB (TORCH_TPU_MEMORY_LIMIT)" in r.stdout
    assert "ooms 1 allocated 4096" in r.stdout and "next 2048.0" in r.stdout
    assert "per device 4096 4896 4896 0" in r.stdout


def test_pjrt_out_of_memory_at_dispatch(mode: str) -> None:
    """A program without inputs fails to allocate at once (XLA:CPU): raised at the op (eager) or where the pending
    graph runs (DEFER_AND_FUSE)."""
    base = settled()
    ooms = torch.tpu.memory_stats()["num_ooms"]
    with pytest.raises(torch.OutOfMemoryError, match="RESOURCE_EXHAUSTED") as info:
        t = torch.ones(1 << 45, dtype=torch.uint8, device="tpu")
        if mode == "DEFER_NEVER":
            pytest.fail("no error at the op")
        torch.tpu.synchronize()
    msg = str(info.value)
    assert "tpu:0" in msg and f"allocating {1 << 45} bytes" in msg and "smaller batches" in msg
    assert ("program of a tpu kernel" in msg) == (mode == "DEFER_NEVER")  # (DEFER_AND_FUSE: the deferred graph)
    del info
    assert torch.tpu.memory_stats()["num_ooms"] == ooms + 1
    t = None
    assert settled() == base
    assert torch.equal(torch.ones(3, device="tpu").cpu(), torch.ones(3))
    del t


def test_reserved_and_info_from_pjrt_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where PJRT keeps statistics (TPU's Device.memory_stats()), reserved and mem_get_info come from them, through
    torch.tpu and through the C++ DeviceAllocator that torch.accelerator reads. XLA:CPU has none: a device
    reporting TPU-like numbers stands in for the platform (the code under test is everything above it)."""
    from torch_tpu import _runtime

    torch.ones(1, device="tpu").cpu()
    real = _runtime.device(0)

    class Reporting:
        def memory_stats(self) -> dict[str, int]:
            return {"bytes_in_use": 123456, "peak_bytes_in_use": 999999, "bytes_limit": 1 << 30}

        def __getattr__(self, name: str):
            return getattr(real, name)

    monkeypatch.setattr(_runtime, "device", lambda index: Reporting() if index == 0 else real)
    assert torch.tpu.memory_reserved() == torch.accelerator.memory_reserved() == 123456
    assert torch.tpu.max_memory_reserved() == torch.accelerator.max_memory_reserved() == 999999
    assert torch.tpu.memory_stats()["reserved_bytes.all.current"] == 123456
    assert torch.tpu.mem_get_info() == torch.accelerator.get_memory_info() == ((1 << 30) - 123456, 1 << 30)
    assert torch.tpu.get_device_properties(0).total_memory == 1 << 30
    base = torch.tpu.memory_allocated()  # allocated stays this backend's own count
    try:
        torch.tpu.set_per_process_memory_fraction(0.5)  # of bytes_limit
        with pytest.raises(torch.OutOfMemoryError, match=f"limit 512.00 MiB .*of {1 << 30} bytes"):
            torch.empty(512 * MiB + 1 - base, dtype=torch.uint8, device="tpu")
    finally:
        torch.tpu.set_per_process_memory_fraction(1.0)
