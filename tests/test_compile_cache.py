"""The persistent compile cache: a fresh process reuses executables compiled by an earlier one; corrupt,
truncated or deleted entries are recompiled with a warning and right results; concurrent processes share one
cache without torn entries; the size cap evicts; a changed compiler option or version misses."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_python

# A small program: eager ops (one executable each) and a fused graph; prints its results and the cache stats.
PROGRAM = r"""
import json, sys, warnings
warnings.simplefilter("always")
import torch
import torch_tpu
if len(sys.argv) > 1 and sys.argv[1] == "new-version":
    torch_tpu.__version__ = "0.2.0+other"
x = torch.arange(12.0).reshape(3, 4).tpu()
eager = ((x * 2 + 1).sin() @ x.t()).sum(0)
with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
    fused = (x.exp() - x / 3).relu().amax(1)
s = torch.tpu.compile_cache.stats()
print("RESULT " + json.dumps({"eager": eager.cpu().tolist(), "fused": fused.cpu().tolist(),
                             "hits": s.hits, "misses": s.misses, "writes": s.writes, "corrupt": s.corrupt,
                             "entries": s.entries, "bytes": s.bytes, "evictions": s.evictions,
                             "saved": s.compile_seconds_saved}))
"""


def _expected() -> dict:
    x = torch.arange(12.0).reshape(3, 4)
    return {"eager": ((x * 2 + 1).sin() @ x.t()).sum(0).tolist(), "fused": (x.exp() - x / 3).relu().amax(1).tolist()}


def _run(cache: Path, *args: str, env: dict | None = None, check: bool = True) -> tuple[dict, str]:
    e = {"TORCH_TPU_CACHE_DIR": str(cache), **(env or {})}
    out = run_python(PROGRAM if not args else PROGRAM, env=e, args=list(args))
    assert out.returncode == 0, out.stderr
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    if check:
        exp = _expected()
        torch.testing.assert_close(torch.tensor(result["eager"]), torch.tensor(exp["eager"]), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(torch.tensor(result["fused"]), torch.tensor(exp["fused"]), rtol=1e-5, atol=1e-5)
    return result, out.stderr


@pytest.fixture(scope="module")
def _cold(tmp_path_factory) -> tuple[dict, Path]:
    """The program's first run into an empty cache (its stats and the folder), made once for the tests below that
    start from a filled cache (a process start costs several seconds); each takes a copy of it with _filled."""
    cache = tmp_path_factory.mktemp("cold") / "cache"
    return _run(cache)[0], cache


_copies = itertools.count()


def _filled(cold: tuple[dict, Path]) -> tuple[dict, Path]:
    """(the cold run's stats, a copy of its cache folder as that run left it). The copy is at a new path: a cache
    folder copied or moved elsewhere (a CI cache, a container image) must still hit."""
    stats, folder = cold
    copy = folder.with_name(f"{folder.name}.{next(_copies)}")
    shutil.copytree(folder, copy)
    return stats, copy


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.xc"))


def _executables(cache: Path) -> list[Path]:
    """Compiled programs: JAX's entries and torch_tpu's fused programs (g-*), not op shapes (s-*)."""
    return [p for p in _entries(cache) if not p.name.startswith("s-")]


def test_second_process_loads_instead_of_compiling(_cold) -> None:
    first, cache = _filled(_cold)
    assert first["hits"] == 0 and first["misses"] > 0 and first["writes"] == first["misses"]
    assert len(_executables(cache)) == first["writes"] and first["entries"] == len(_entries(cache))
    assert any(p.name.startswith("g-") for p in _entries(cache)), "the fused graph was not stored whole"
    second, err = _run(cache)
    assert second["misses"] == 0 and second["hits"] == first["writes"] and second["writes"] == 0
    assert second["saved"] > 0
    assert "CompileCacheWarning" not in err


# Eager ops in the variants that key an executable: Python scalars (weak types) next to tensors, integer and
# bfloat16 tensors, static arguments (dims, keepdim), views read inside the op's program, tensor lists, a CPU
# scalar tensor (the slow path), creation ops (no array argument)
VARIANT_OPS = """
def ops(x, i, h):
    return [x + 1, x + 1.5, x * torch.tensor(2.0), i + 1, i + 1.5, i * 2, x.sum(0), x.sum(1), x.sum(1, keepdim=True),
            x.amax(0), h + 1, h * 0.5, (x @ x.t()).relu(), x.softmax(-1), x.softmax(0), torch.where(x > 3, x, -x),
            x[1:, ::2] * 3, torch.cat([x, x], 1), x.to(torch.int32) // 2, torch.zeros(2, 3, device=x.device) + x[0, :3],
            x.unsqueeze(0).expand(2, 3, 4).sum(), (x - 5).abs().sqrt(), x.mean(1),
            torch.full((2,), 7.0, device=x.device), x.index_select(0, i[0, :2]), torch.gather(x, 1, i[:, :2] % 4),
            torch.nn.functional.cross_entropy(x, i[:, 0] % 4)]
"""

VARIANTS = r"""
import json, logging
import jax
import torch
import torch_tpu

jax.config.update("jax_log_compiles", True)  # JAX logs each function it traces
traced = []

class Traced(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Finished tracing "):
            traced.append(record.getMessage().split()[2])

logging.getLogger("jax").addHandler(Traced())
""" + VARIANT_OPS + r"""
x = torch.arange(12.0).reshape(3, 4).tpu()
out = ops(x, torch.arange(12).reshape(3, 4).tpu(), x.to(torch.bfloat16))
out = [o.cpu() for o in out]
try:  # an index check of a loaded executable still fires
    x.index_select(0, torch.arange(2).tpu() + 5).cpu()
    raised = ""
except IndexError as e:
    raised = str(e)
s = torch.tpu.compile_cache.stats()
print("RESULT " + json.dumps({"out": [o.double().tolist() for o in out], "dtypes": [str(o.dtype) for o in out],
                             "traced": traced, "hits": s.hits, "raised": raised}))
"""


def test_warm_eager_ops_load_their_executables_without_tracing(tmp_path) -> None:
    """A warm DEFER_NEVER start loads each eager op's executable whole (keyed by the op, what its entry bakes in and
    the arguments' shapes, dtypes and weak types): no op is traced again, and every result is CPU's."""
    namespace: dict = {"torch": torch}
    exec(VARIANT_OPS, namespace)
    x = torch.arange(12.0).reshape(3, 4)
    expected = namespace["ops"](x, torch.arange(12).reshape(3, 4), x.to(torch.bfloat16))
    runs = []
    for _ in range(2):
        out = run_python(VARIANTS, env={"TORCH_TPU_CACHE_DIR": str(tmp_path / "cache")})
        assert out.returncode == 0, out.stderr
        runs.append(json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    cold, warm = runs
    for run in runs:
        assert "out of range" in run["raised"] or "out of bounds" in run["raised"], run["raised"]
        assert run["dtypes"] == [str(e.dtype) for e in expected]
        for got, exp in zip(run["out"], expected):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), exp.double(), rtol=1e-5, atol=1e-5)
    ops_traced = [name for name in cold["traced"] if name.startswith("aten_")]
    assert len(ops_traced) >= 20, cold["traced"]  # (JAX's log reached the listener)
    assert [name for name in warm["traced"] if name.startswith("aten_")] == [], warm["traced"]
    assert warm["hits"] >= len(ops_traced)


def test_corrupt_truncated_and_deleted_entries_are_recompiled(_cold) -> None:
    _, cache = _filled(_cold)
    files = _executables(cache)
    assert len(files) >= 3
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle of the executable
    files[0].write_bytes(bytes(data))
    files[1].write_bytes(files[1].read_bytes()[: len(data) // 3])  # a torn write
    files[2].unlink()
    result, err = _run(cache)
    assert "CompileCacheWarning" in err and "corrupt (checksum mismatch)" in err and "truncated" in err
    assert result["corrupt"] == 2 and result["misses"] == 3 and result["writes"] == 3
    again, err = _run(cache)
    assert again["misses"] == 0 and again["corrupt"] == 0 and "CompileCacheWarning" not in err


def test_concurrent_processes_share_the_cache(tmp_path) -> None:
    from torch_tpu.compile_cache import _check

    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(tmp_path), PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd="/") for _ in range(4)]
    exp = _expected()
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        result = json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
        torch.testing.assert_close(torch.tensor(result["fused"]), torch.tensor(exp["fused"]), rtol=1e-5, atol=1e-5)
    assert not list(tmp_path.glob(".tmp-*")), "a temporary file was left behind"
    for f in _entries(tmp_path):
        assert _check(f.read_bytes()) is None, f"torn entry {f.name}"
    after, _ = _run(tmp_path)
    assert after["misses"] == 0 and after["corrupt"] == 0


def test_size_cap_evicts_least_recently_used(tmp_path, _cold) -> None:
    full = _cold[0]
    cap = full["bytes"] // 2
    capped, _ = _run(tmp_path / "capped", env={"TORCH_TPU_CACHE_MAX_BYTES": str(cap)})
    assert capped["evictions"] > 0 and capped["bytes"] <= cap and capped["entries"] < full["entries"]


def test_changed_compiler_option_or_version_misses(_cold) -> None:
    first, cache = _filled(_cold)
    flags, _ = _run(cache, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert flags["hits"] == 0 and flags["misses"] == first["misses"]
    version, _ = _run(cache, "new-version")
    assert version["hits"] == 0 and version["misses"] == first["misses"]
    same, _ = _run(cache)
    assert same["misses"] == 0


def test_disabled_writes_nothing(tmp_path) -> None:
    result, _ = _run(tmp_path, env={"TORCH_TPU_CACHE": "0"})
    assert result["hits"] == result["misses"] == result["writes"] == 0
    assert not _entries(tmp_path)


def test_command_line(_cold) -> None:
    _, cache = _filled(_cold)
    n = len(_entries(cache))
    assert n > 0

    def cli(*args: str) -> str:
        out = run_python("import runpy, sys; sys.argv[0] = 'compile_cache'; "
                         "runpy.run_module('torch_tpu.compile_cache', run_name='__main__')",
                         args=[*args, "--dir", str(cache)])
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert f"entries:   {n}" in cli("info")
    (cache / _entries(cache)[0].name).write_bytes(b"garbage")
    assert "removed 1 damaged" in cli("prune")
    assert "evicted" in cli("prune", "--max-bytes", "0") and not _entries(cache)
    _run(cache)
    assert f"removed {n} entries" in cli("clear") and not _entries(cache)


def test_stats_api_in_process() -> None:
    s = torch.tpu.compile_cache.stats()
    assert s.enabled and s.directory and s.max_bytes > 0
    assert "hits:" in str(s)


# ---- entries carry their key; temporary files of dead writers; unusable directories ----

def _cli(directory: Path | str, *args: str) -> subprocess.CompletedProcess:
    return run_python("import runpy, sys; sys.argv[0] = 'compile_cache'; "
                      "runpy.run_module('torch_tpu.compile_cache', run_name='__main__')",
                      args=[*args, "--dir", str(directory)])


def test_whole_entry_under_another_name_is_a_miss(_cold) -> None:
    _, cache = _filled(_cold)
    shapes = [p for p in _entries(cache) if p.name.startswith("s-")]
    programs = _executables(cache)
    assert len(shapes) >= 2 and len(programs) >= 2
    # a stored op shape and a stored executable, each copied whole (checksum-valid) over another entry's name
    shapes[1].write_bytes(shapes[0].read_bytes())
    programs[1].write_bytes(programs[0].read_bytes())
    result, err = _run(cache)  # right results (checked in _run), no size mismatch
    assert err.count("copied or moved under this name") == 2, err
    assert result["corrupt"] == 2 and result["writes"] >= 1
    again, err = _run(cache)
    assert again["misses"] == 0 and again["corrupt"] == 0 and "CompileCacheWarning" not in err
    # prune recognises such an entry without knowing its key: the stored key does not hash to the name
    programs[1].write_bytes(programs[0].read_bytes())
    out = _cli(cache, "prune")
    assert out.returncode == 0 and "removed 1 damaged" in out.stdout, out.stdout + out.stderr
    assert not programs[1].exists() and programs[0].exists()


def test_entries_of_the_older_format_are_misses(_cold) -> None:
    import hashlib
    import struct

    from torch_tpu.compile_cache import _HEADER, _MAGIC

    _, cache = _filled(_cold)
    old = _executables(cache)[0]
    data = old.read_bytes()
    _, _, length, seconds, key_length = _HEADER.unpack_from(data)
    payload = data[_HEADER.size + key_length:]
    # the format before keys were stored: magic, sha256 of the payload, payload length, compile seconds
    old.write_bytes(struct.pack("<8s32sQd", b"TTPUXC01", hashlib.sha256(payload).digest(), length, seconds)
                    + payload)
    result, err = _run(cache)
    assert result["misses"] == 1 and result["writes"] == 1 and result["corrupt"] == 0
    assert "CompileCacheWarning" not in err
    assert old.read_bytes()[:8] == _MAGIC  # replaced by an entry of the current format


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=60)
    return p.pid


def test_temporary_files_of_dead_writers_are_counted_and_removed(_cold) -> None:
    import socket
    import time

    _, cache = _filled(_cold)
    n = len(_entries(cache))
    host = socket.gethostname()
    dead = cache / f".tmp-{host}-{_dead_pid()}-1-1"  # its writer was killed mid-write
    old = cache / ".tmp-otherhost-123-1-1"  # another host's writer, two hours ago
    live = cache / f".tmp-{host}-{os.getpid()}-1-1"  # a writer still at work
    for p in (dead, old, live):
        p.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    s = torch.tpu.compile_cache.stats(str(cache))
    assert s.temp_files == 3 and s.stale_temp_files == 2 and s.entries == n
    out = _cli(cache, "info")
    assert out.returncode == 0 and "temporary: 3 (2 left by writers that died" in out.stdout, out.stdout
    out = _cli(cache, "prune")
    assert out.returncode == 0 and "removed 2 damaged or stale files" in out.stdout, out.stdout + out.stderr
    assert live.exists() and not dead.exists() and not old.exists() and len(_entries(cache)) == n
    dead.write_bytes(b"partial")
    out = _cli(cache, "clear")
    assert out.returncode == 0 and f"removed {n} entries" in out.stdout
    assert live.exists() and not dead.exists() and not _entries(cache)


def test_directory_that_is_a_file(tmp_path) -> None:
    d = tmp_path / "cache"
    d.write_text("not a folder")
    s = torch.tpu.compile_cache.stats(str(d))
    assert "is not a directory" in s.problem and s.entries == 0
    for cmd in ("info", "prune", "clear"):
        out = _cli(d, cmd)
        assert out.returncode == 1 and "is not a directory" in out.stdout + out.stderr, (cmd, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr and "TORCH_TPU_CACHE_DIR" in out.stdout + out.stderr
    # a process using it compiles without the cache (one warning) and computes right
    result, err = _run(d, check=True)
    assert err.count("CompileCacheWarning") == 1 and result["writes"] == 0


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB file system of its own (a tmpfs: needs root), unmounted afterwards."""
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, "1M"):
        pytest.skip("needs root to mount a tmpfs (the ENOSPC case is also covered by test_running_process_*)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_full_directory(small_fs) -> None:
    d = small_fs / "cache"
    _run(d)
    n = len(_entries(d))
    filler = small_fs / "filler"
    with open(filler, "wb") as f:  # fill the file system
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    s = torch.tpu.compile_cache.stats(str(d))
    assert "is full" in s.problem
    out = _cli(d, "info")
    assert out.returncode == 1 and "is full" in out.stdout and "Traceback" not in out.stderr, out.stdout + out.stderr
    # a run with a new compiler option misses everything and cannot store: one warning, right results
    result, err = _run(d, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert result["writes"] == 0 and err.count("CompileCacheWarning") == 1 and "full" in err, err
    assert len(_entries(d)) == n and not list(d.glob(".tmp-*"))
    out = _cli(d, "prune", "--max-bytes", "0")  # deleting works on a full file system
    assert out.returncode == 0 and not _entries(d), out.stdout + out.stderr


def test_read_only_directory(small_fs) -> None:
    d = small_fs / "cache"
    _run(d)
    n = len(_entries(d))
    assert subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True,
                          timeout=30).returncode == 0
    s = torch.tpu.compile_cache.stats(str(d))
    assert "not writable" in s.problem and s.entries == n
    out = _cli(d, "info")
    assert out.returncode == 1 and "not writable" in out.stdout and "Traceback" not in out.stderr
    for cmd in ("clear", "prune"):
        args = (cmd, "--max-bytes", "0") if cmd == "prune" else (cmd,)
        out = _cli(d, *args)
        assert out.returncode == 1 and "Traceback" not in out.stderr, (cmd, out.stdout, out.stderr)
        assert "could not" in out.stderr and "not writable" in out.stderr, out.stderr
    assert len(_entries(d)) == n
    same, err = _run(d)  # stored entries are still used
    assert same["misses"] == 0 and same["hits"] > 0 and "CompileCacheWarning" not in err
    result, err = _run(d, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert result["writes"] == 0 and err.count("CompileCacheWarning") == 1, err


def test_running_process_whose_directory_fills_up(tmp_path) -> None:
    # Without root: every write in the cache directory fails with ENOSPC from the first op on.
    code = ("import errno, os\n"
            "def full(*a, **k): raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "import torch_tpu.compile_cache as cc\n"
            "cc.os.replace = full\n" + PROGRAM)
    out = run_python(code, env={"TORCH_TPU_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    result = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    exp = _expected()
    torch.testing.assert_close(torch.tensor(result["fused"]), torch.tensor(exp["fused"]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(result["eager"]), torch.tensor(exp["eager"]), rtol=1e-5, atol=1e-4)
    assert out.stderr.count("CompileCacheWarning") == 1 and "file system is full" in out.stderr, out.stderr
    assert result["writes"] == 0 and not _entries(tmp_path) and not list(tmp_path.glob(".tmp-*"))


# ---- torch.compile(backend="tpu"): the aten graphs come back from PyTorch's AOTAutograd cache ----

COMPILED = r"""
import json, sys, warnings
warnings.simplefilter("always")
import torch
import torch_tpu
from torch._dynamo.utils import counters
if len(sys.argv) > 1 and sys.argv[1] == "new-version":
    torch_tpu.__version__ = "0.2.0+other"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 3))
x = torch.randn(5, 8)
model = model.tpu()
fwd = torch.compile(model, backend="tpu")
out = fwd(x.tpu())
out.square().mean().backward()
s = torch.tpu.compile_cache.stats()
print("RESULT " + json.dumps({"out": out.detach().cpu().tolist(),
                             "grads": [p.grad.cpu().tolist() for p in model.parameters()],
                             "aot": dict(counters["aot_autograd"]), "graphs": counters["tpu"]["graphs"],
                             "loaded": counters["tpu"]["programs_loaded"],
                             "misses": s.misses, "writes": s.writes,
                             "inductor_codegen": "torch._inductor.select_algorithm" in sys.modules}))
"""


def _compiled_expected() -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 3))
    x = torch.randn(5, 8)
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad for p in model.parameters()]


def _run_compiled(tmp: Path, *args: str, env: dict | None = None) -> tuple[dict, str]:
    e = {"TORCH_TPU_CACHE_DIR": str(tmp / "tpu"), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), **(env or {})}
    out = run_python(COMPILED, env=e, args=list(args))
    assert out.returncode == 0, out.stderr
    result = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    exp_out, exp_grads = _compiled_expected()
    torch.testing.assert_close(torch.tensor(result["out"]), exp_out, rtol=1e-5, atol=1e-5)
    for got, exp in zip(result["grads"], exp_grads):
        torch.testing.assert_close(torch.tensor(got), exp, rtol=1e-4, atol=1e-5)
    return result, out.stderr


def _aot_entries(tmp: Path) -> list[Path]:
    return sorted(p for p in (tmp / "inductor" / "aotautograd").rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def _cold_compiled(tmp_path_factory) -> tuple[dict, Path]:
    """COMPILED's first run into empty caches, made once (as _cold); each test takes it with _filled."""
    tmp = tmp_path_factory.mktemp("cold_compiled") / "caches"
    tmp.mkdir()
    return _run_compiled(tmp)[0], tmp


def test_compiled_model_warm_start_loads_its_graphs(_cold_compiled) -> None:
    first, caches = _filled(_cold_compiled)
    assert first["aot"].get("autograd_cache_miss") == 1 and first["graphs"] == 2  # forward and backward
    assert len(_aot_entries(caches)) == 1
    assert first["loaded"] == 0 and first["writes"] >= 2  # both programs stored whole
    second, err = _run_compiled(caches)
    # AOTAutograd skipped, the programs' executables loaded whole: nothing traced by AOTAutograd, no graph traced or
    # lowered again by JAX, nothing compiled
    assert second["aot"].get("autograd_cache_hit") == 1 and not second["aot"].get("autograd_cache_miss")
    assert second["loaded"] == 2
    assert second["misses"] == 0 and second["writes"] == 0
    assert second["out"] == first["out"] and second["grads"] == first["grads"]
    assert "CompileCacheWarning" not in err
    # The cache key of a tpu graph does not import Inductor's code generators (seconds of a warm start)
    assert not second["inductor_codegen"]


def test_inductor_codegen_registration_still_runs_outside_the_tpu_backend() -> None:
    import torch._inductor.codecache as codecache
    from torch._inductor.codegen.common import get_scheduling_for_device

    from torch_tpu.compile_cache import aot

    before = get_scheduling_for_device("cpu")  # None unless Inductor registered its backends in this process
    with aot.caching(None):  # the tpu backend's key computation: skipped
        codecache.init_backend_registration()
        assert get_scheduling_for_device("cpu") is before
    codecache.init_backend_registration()  # anyone else (Inductor's own compiles): PyTorch's registration
    assert get_scheduling_for_device("cpu") is not None


def test_compiled_model_damaged_entry_is_compiled_again(_cold_compiled) -> None:
    import pickle

    _, caches = _filled(_cold_compiled)
    [entry] = _aot_entries(caches)
    data = entry.read_bytes()
    stored = pickle.loads(data).compiled_fw.result  # the forward graph torch_tpu stored
    at = data.index(stored._data) + len(stored._data) // 2
    entry.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])  # one byte of the graph flipped
    result, err = _run_compiled(caches)  # right values (checked), from a fresh compile
    assert "CompileCacheWarning" in err and "corrupt (checksum mismatch)" in err, err
    assert not result["aot"].get("autograd_cache_hit") and result["graphs"] == 2
    entry.write_bytes(data[: len(data) // 3])  # a torn entry: not loadable at all
    result, _ = _run_compiled(caches)
    assert not result["aot"].get("autograd_cache_hit") and result["graphs"] == 2


def test_compiled_model_entry_of_another_version_or_disabled_cache(tmp_path, _cold_compiled) -> None:
    _, filled = _filled(_cold_compiled)
    other, _ = _run_compiled(filled, "new-version")  # torch_tpu's version is in the key: a miss
    assert other["aot"].get("autograd_cache_miss") == 1 and not other["aot"].get("autograd_cache_hit")
    off, _ = _run_compiled(tmp_path / "off", env={"TORCH_TPU_CACHE": "0"})
    assert not off["aot"].get("autograd_cache_hit") and not off["aot"].get("autograd_cache_miss")
    assert not _aot_entries(tmp_path / "off")


CUSTOM_OP = r"""
import json, warnings
warnings.simplefilter("ignore")
import torch
from torch._dynamo.utils import counters

@torch.library.custom_op("ttpu_cache_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2

@twice.register_fake
def _(x):
    return torch.empty_like(x)

fn = torch.compile(lambda x: twice(x.sin()) + 1, backend="tpu", options={"fallback": "eager"})
x = torch.arange(6.0).reshape(2, 3)
print("RESULT " + json.dumps({"out": fn(x.tpu()).cpu().tolist(), "aot": dict(counters["aot_autograd"])}))
"""


def test_compiled_graph_with_a_custom_op_is_not_stored(tmp_path) -> None:
    env = {"TORCH_TPU_CACHE_DIR": str(tmp_path / "tpu"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    x = torch.arange(6.0).reshape(2, 3)
    for _ in range(2):  # the graph (run op by op: fallback='eager') cannot be pickled: no entry, no hit, no noise
        out = run_python(CUSTOM_OP, env=env)
        assert out.returncode == 0, out.stderr
        result = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
        torch.testing.assert_close(torch.tensor(result["out"]), x.sin() * 2 + 1)
        assert not result["aot"].get("autograd_cache_hit") and "unable to serialize" not in out.stderr, out.stderr
    assert not _aot_entries(tmp_path)


def test_pallas_setting_is_part_of_torch_tpus_keys(monkeypatch) -> None:
    """Fused programs and op metadata are keyed by Python call structure; the Pallas path is chosen while a
    program is traced (TORCH_TPU_PALLAS), so an entry stored under one setting must miss under another."""
    from torch_tpu import compile_cache

    monkeypatch.setenv("TORCH_TPU_PALLAS", "reference")
    reference = compile_cache._config_text()
    monkeypatch.setenv("TORCH_TPU_PALLAS", "interpret")
    assert compile_cache._config_text() != reference


def test_a_stored_program_runs_other_shapes_and_statics_through_jit() -> None:
    """A compiled graph's stored program (torch_tpu._compile._StoredProgram) runs the executable made for its first
    call's statics and input shapes; a call with other statics, or inputs the executable does not take, runs through
    jax.jit, with the right values either way."""
    import uuid

    import jax
    import jax.numpy as jnp

    from torch_tpu import _compile

    def f(statics, x):
        return x * statics[0] + 1

    jitted = jax.jit(f, static_argnums=0)
    prog = _compile._StoredProgram(jitted, repr(("test", uuid.uuid4().hex)), 0)
    x = jnp.arange(4.0)
    assert prog((2.0,), x).tolist() == [1.0, 3.0, 5.0, 7.0]
    first = prog.program
    assert first is not None and prog.statics == (2.0,)
    assert prog((3.0,), x).tolist() == [1.0, 4.0, 7.0, 10.0]  # other statics: jax.jit
    assert prog((2.0,), jnp.arange(3.0)).tolist() == [1.0, 3.0, 5.0]  # another shape: jax.jit from now on
    assert prog((2.0,), x).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert prog.program is first
    # The program collector (torch_tpu/_programs.py) drops the executables; the next call loads the stored one.
    from torch._dynamo.utils import counters

    again = _compile._StoredProgram(jitted, prog.structure, 0)
    loaded = counters["tpu"]["programs_loaded"]
    assert again((2.0,), x).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert counters["tpu"]["programs_loaded"] == loaded + 1, "stored by the first program's first call"
    _compile._StoredProgram.drop()
    assert again.program is None
    assert again((2.0,), x).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert counters["tpu"]["programs_loaded"] == loaded + 2 and again.program is not None
