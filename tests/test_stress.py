"""Stress: one process compiles many varied programs (issue 11 item 9).

XLA:CPU maps memory for every kernel it compiles (about three mappings each) and a process may hold only
vm.max_map_count mappings (65530 by default). A process that kept every compiled program alive crashed with a
segfault inside XLA compilation once it reached the limit (seen running PyTorch's own test_view_ops.py whole).
torch_tpu/_programs.py collects compiled programs before that. These tests fill most of the mapping budget with
inert pages first, so the limit is reached within seconds instead of after thousands of programs, then compile
new programs (random fills of int64 and float tensors, views, in-place writes through views, elementwise ops and
reductions, in eager and fused modes, with a private compile cache) and check the values against CPU.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory mappings are counted in /proc")

STRESS = r"""
import ctypes, json, random, sys, time
import torch
from torch_tpu import _programs

seconds, leave = float(sys.argv[1]), int(sys.argv[2])

def mappings():
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")

torch.ones(1, device="tpu").cpu()  # starts the runtime (its libraries and threads take mappings too)
limit = _programs.state.limit
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
n = 0
while mappings() < limit - leave:  # inert one-page mappings; alternating protections keep them apart
    for _ in range(limit - leave - mappings()):
        assert libc.mmap(None, 4096, n % 2, 0x22, -1, 0) not in (None, 2**64 - 1)
        n += 1
_programs.set_limit(limit)  # count again at the next compile: the pages above came between two counts

rng = random.Random(0)
torch.manual_seed(0)
modes = [torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_AND_FUSE]
start = time.time()
it = checks = 0
error = None
try:
    while time.time() - start < seconds:
        it += 1
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 4)))
        dtype = rng.choice([torch.float32, torch.int64, torch.float64, torch.int32])
        torch.tpu.eager_mode = modes[it % 2]
        kind = it % 5
        if kind == 0:
            x = torch.randint(-50, 50, shape, dtype=dtype, device="tpu")
        elif kind == 1:
            x = torch.empty(shape, dtype=dtype, device="tpu")
            x.uniform_(-3, 3) if dtype.is_floating_point else x.random_(0, 100)
        elif kind == 2:
            x = torch.empty(shape, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                            device="tpu").normal_()
            x = x if dtype.is_floating_point else (x * 10).to(dtype)
        elif kind == 3:
            x = torch.randint(0, 7, shape, device="tpu").to(dtype)
        else:
            x = torch.arange(torch.Size(shape).numel(), device="tpu").to(dtype).reshape(shape)
        c = x.cpu()
        d0, d1 = rng.randrange(len(shape)), rng.randrange(len(shape))
        y, yc = x.transpose(d0, d1), c.transpose(d0, d1)
        if y.shape[0] > 1:  # an in-place write through a view
            y[0] = y[1] + 1
            yc[0] = yc[1] + 1
        k, step = rng.randint(1, 5), rng.randint(1, 3)
        z = (y * k - x.sum()).flatten()[::step]
        zc = (yc * k - c.sum()).flatten()[::step]
        x.add_(k)
        c.add_(k)
        torch.tpu.eager_mode = modes[0]
        if it % 5 == 0 or _programs.state.collections:
            checks += 1
            assert torch.equal(x.cpu(), c), (it, shape, dtype)
            if dtype.is_floating_point:
                torch.testing.assert_close(z.cpu(), zc, rtol=1e-5, atol=1e-4)
            else:
                assert torch.equal(z.cpu(), zc), (it, shape, dtype)
except RuntimeError as e:
    if "vm.max_map_count" not in str(e):
        raise
    error = str(e)
s = _programs.state
print(json.dumps({"iterations": it, "checks": checks, "compiles": s.compiles, "collections": s.collections,
                  "mappings": mappings(), "limit": limit, "headroom": s.headroom, "error": error}))
"""


def _stress(tmp_path, seconds: float, leave: str) -> dict:
    r = run_python(STRESS, env={"TORCH_TPU_CACHE_DIR": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore"},
                   timeout=300, args=[str(seconds), leave])
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _limit() -> int:
    with open("/proc/sys/vm/max_map_count") as f:
        return int(f.read())


def test_compiling_past_the_mapping_limit_collects_programs_and_keeps_values(tmp_path):
    # 700 mappings above the collection threshold (a quarter of the limit left): the first collection comes
    # after a few dozen programs; without it the process crashed once the remaining ~17000 were used up.
    limit = _limit()
    stats = _stress(tmp_path, 45, str(limit // 4 + 700))
    assert stats["error"] is None
    assert stats["collections"] >= 1, stats
    assert stats["mappings"] < limit, stats
    assert stats["checks"] >= 5, stats  # values checked against CPU, also after the collection


def test_no_mappings_left_is_a_clear_error_not_a_crash(tmp_path):
    # So few mappings left that dropping every compiled program cannot make room: a RuntimeError that names
    # vm.max_map_count, instead of the segfault XLA hits when its next mapping fails.
    stats = _stress(tmp_path, 30, "900")
    assert stats["error"] is not None, stats
    assert "vm.max_map_count" in stats["error"] and "sysctl" in stats["error"]


def test_collecting_mid_workload_keeps_pending_and_cached_values(tpu):
    # A collection drops every compiled program, also while a fused graph is pending and between an op's
    # compile and its next call: everything recompiles on demand and computes the same values as CPU.
    import torch

    from torch_tpu import _C, _programs

    a_cpu = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    a = a_cpu.to(tpu)
    before = (a * 3 + 1).sum(0).cpu()
    old = torch.tpu.eager_mode
    torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE
    try:
        b = a.t() * 2  # pending
        _programs.collect()
        c = b + a.t()
        _C._set_collect_due()  # collected at the next op's result, inside the recorded graph
        d = c.sum(1)
        torch.testing.assert_close(d.cpu(), (a_cpu.t() * 3).sum(1))
    finally:
        torch.tpu.eager_mode = old
    n = _programs.state.collections
    _C._set_collect_due()
    after = (a * 3 + 1).sum(0)
    assert _programs.state.collections == n + 1
    torch.testing.assert_close(after.cpu(), before)
