"""The persistent compile cache: a fresh process reuses executables compiled by an earlier one; corrupt,
truncated or deleted entries are recompiled with a warning and right results; concurrent processes share one
cache without torn entries; the size cap evicts; a changed compiler option or version misses."""

from __future__ import annotations

import json
import os
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


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.xc"))


def _executables(cache: Path) -> list[Path]:
    """Compiled programs: JAX's entries and torch_tpu's fused programs (g-*), not op shapes (s-*)."""
    return [p for p in _entries(cache) if not p.name.startswith("s-")]


def test_second_process_loads_instead_of_compiling(tmp_path) -> None:
    first, _ = _run(tmp_path)
    assert first["hits"] == 0 and first["misses"] > 0 and first["writes"] == first["misses"]
    assert len(_executables(tmp_path)) == first["writes"] and first["entries"] == len(_entries(tmp_path))
    assert any(p.name.startswith("g-") for p in _entries(tmp_path)), "the fused graph was not stored whole"
    second, err = _run(tmp_path)
    assert second["misses"] == 0 and second["hits"] == first["writes"] and second["writes"] == 0
    assert second["saved"] > 0
    assert "CompileCacheWarning" not in err


def test_corrupt_truncated_and_deleted_entries_are_recompiled(tmp_path) -> None:
    _run(tmp_path)
    files = _executables(tmp_path)
    assert len(files) >= 3
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle of the executable
    files[0].write_bytes(bytes(data))
    files[1].write_bytes(files[1].read_bytes()[: len(data) // 3])  # a torn write
    files[2].unlink()
    result, err = _run(tmp_path)
    assert "CompileCacheWarning" in err and "corrupt (checksum mismatch)" in err and "truncated" in err
    assert result["corrupt"] == 2 and result["misses"] == 3 and result["writes"] == 3
    again, err = _run(tmp_path)
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


def test_size_cap_evicts_least_recently_used(tmp_path) -> None:
    full, _ = _run(tmp_path / "full")
    cap = full["bytes"] // 2
    capped, _ = _run(tmp_path / "capped", env={"TORCH_TPU_CACHE_MAX_BYTES": str(cap)})
    assert capped["evictions"] > 0 and capped["bytes"] <= cap and capped["entries"] < full["entries"]


def test_changed_compiler_option_or_version_misses(tmp_path) -> None:
    first, _ = _run(tmp_path)
    flags, _ = _run(tmp_path, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert flags["hits"] == 0 and flags["misses"] == first["misses"]
    version, _ = _run(tmp_path, "new-version")
    assert version["hits"] == 0 and version["misses"] == first["misses"]
    same, _ = _run(tmp_path)
    assert same["misses"] == 0


def test_disabled_writes_nothing(tmp_path) -> None:
    result, _ = _run(tmp_path, env={"TORCH_TPU_CACHE": "0"})
    assert result["hits"] == result["misses"] == result["writes"] == 0
    assert not _entries(tmp_path)


def test_command_line(tmp_path) -> None:
    _run(tmp_path)
    n = len(_entries(tmp_path))
    assert n > 0

    def cli(*args: str) -> str:
        out = run_python("import runpy, sys; sys.argv[0] = 'compile_cache'; "
                         "runpy.run_module('torch_tpu.compile_cache', run_name='__main__')",
                         args=[*args, "--dir", str(tmp_path)])
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert f"entries:   {n}" in cli("info")
    (tmp_path / _entries(tmp_path)[0].name).write_bytes(b"garbage")
    assert "removed 1 damaged" in cli("prune")
    assert "evicted" in cli("prune", "--max-bytes", "0") and not _entries(tmp_path)
    _run(tmp_path)
    assert f"removed {n} entries" in cli("clear") and not _entries(tmp_path)


def test_stats_api_in_process() -> None:
    s = torch.tpu.compile_cache.stats()
    assert s.enabled and s.directory and s.max_bytes > 0
    assert "hits:" in str(s)
