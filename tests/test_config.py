"""One configuration module (torch_tpu/_config.py) owns every TORCH_TPU_* variable: the table, one parser per
type, deferred errors at `import torch`, and the docs table generated from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, run_python
from torch_tpu import _config

_NAME = re.compile(r"TORCH_TPU_[A-Z0-9_]*[A-Z0-9]")
_COMPONENTS = ("torch_tpu", "kernels", "compile_cache", "distributed", "runtime")
# Read by tools/setup.sh, Bazel's probe and the OpInfo suite, not by the library (docs/contributing.md).
_SETUP = {"TORCH_TPU_VENV", "TORCH_TPU_BOOTSTRAP_PYTHON", "TORCH_TPU_SKIP_BUILD", "TORCH_TPU_NO_APT",
          "TORCH_TPU_PYTHON", "TORCH_TPU_OPINFO_SAMPLES"}


def _code() -> list:
    return [p for c in _COMPONENTS for p in (REPO / c).rglob("*") if p.suffix in (".py", ".cpp", ".h")]


def _sources() -> list:
    return _code() + [REPO / "README.md", REPO / "docs" / "user_guide.md", REPO / "docs" / "migration_guide.md"]


def test_every_variable_named_in_the_sources_is_in_the_table() -> None:
    names = {v.name for v in _config.VARIABLES}
    found = {n: p for p in _sources() for n in _NAME.findall(p.read_text())}
    in_code = {n for p in _code() for n in _NAME.findall(p.read_text())}
    missing = {n: str(p.relative_to(REPO)) for n, p in found.items()
               if n not in names and (n not in _SETUP or n in in_code)}  # the docs may name setup's variables
    assert not missing, f"TORCH_TPU_* names not in torch_tpu/_config.py's VARIABLES: {missing}"
    assert names <= set(found), names - set(found)  # and no table entry that nothing mentions


def test_only_the_config_module_reads_the_environment() -> None:
    offenders = []
    for p in _code():
        if p.name == "_config.py":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if ("environ" in line or "getenv" in line) and "TORCH_TPU_" in line:
                offenders.append(f"{p.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, "read TORCH_TPU_* through torch_tpu._config.get:\n" + "\n".join(offenders)


def test_setup_variables_are_documented_for_contributors() -> None:
    text = (REPO / "docs" / "contributing.md").read_text()
    assert all(n in text for n in _SETUP), [n for n in _SETUP if n not in text]


def test_user_guide_table_is_the_generated_table() -> None:
    guide = (REPO / "docs" / "user_guide.md").read_text()
    m = re.search(r"<!-- config-table:begin -->\n(.*?)<!-- config-table:end -->", guide, re.S)
    assert m, "docs/user_guide.md lost its config-table markers"
    assert m.group(1) == _config.markdown_table(), \
        "docs/user_guide.md's table is stale: paste `python -m torch_tpu config --markdown` between its markers"
    for v in _config.VARIABLES:
        assert f"`{v.name}`" in m.group(1)


@pytest.mark.parametrize("name,raw,value", [
    # every spelling accepted before the one module existed is still accepted, with its old meaning
    *[("TORCH_TPU_CACHE", raw, True) for raw in ("1", "true", "on", "yes", "TRUE", "Yes")],
    *[("TORCH_TPU_CACHE", raw, False) for raw in ("0", "false", "off", "no", "OFF")],
    *[("TORCH_TPU_INDEX_CHECKS", raw, False) for raw in ("0", "false", "off", "no")],
    ("TORCH_TPU_INDEX_CHECKS", "1", True),
    ("TORCH_TPU_DIST_CHECKS", "0", False), ("TORCH_TPU_DIST_CHECKS", "off", False),
    ("TORCH_TPU_DIST_CHECKS", "1", True),
    ("TORCH_TPU_DIST_EARLY_INIT", "0", False), ("TORCH_TPU_DIST_EARLY_INIT", "1", True),
    ("TORCH_TPU_CACHE_MAX_BYTES", "4G", 4 << 30), ("TORCH_TPU_CACHE_MAX_BYTES", "512m", 512 << 20),
    ("TORCH_TPU_CACHE_MAX_BYTES", "1.5K", 1536), ("TORCH_TPU_CACHE_MAX_BYTES", "1000000", 1000000),
    ("TORCH_TPU_CACHE_MAX_BYTES", "1e3", 1000), ("TORCH_TPU_CACHE_MAX_BYTES", "0", 0),
    ("TORCH_TPU_FUSE_MAX_OPS", "7", 7), ("TORCH_TPU_FUSE_CACHE", " 3 ", 3), ("TORCH_TPU_NUM_DEVICES", "2", 2),
    ("TORCH_TPU_RECOMPILE_WARN", "3", 3), ("TORCH_TPU_RECOMPILE_WARN", "0", 0),
    ("TORCH_TPU_RECOMPILE_WARN", "-1", 0),
    ("TORCH_TPU_PLATFORM", "CPU", "cpu"), ("TORCH_TPU_EAGER_MODE", "defer_and_fuse", "DEFER_AND_FUSE"),
    *[("TORCH_TPU_CPU_FALLBACK", raw, 1) for raw in ("warn", "1", "WARN")],
    *[("TORCH_TPU_CPU_FALLBACK", raw, 0) for raw in ("strict", "0", "off")],
    ("TORCH_TPU_COMPILE_FALLBACK", "EAGER", "eager"), ("TORCH_TPU_COMPILE_FALLBACK", "strict", None),
    ("TORCH_TPU_COMPILE_FALLBACK", "off", None),
])
def test_accepted_values(name, raw, value, monkeypatch) -> None:
    monkeypatch.setenv(name, raw)
    assert _config.get(name) == value


def test_unset_or_empty_gives_the_default(monkeypatch) -> None:
    for v in _config.VARIABLES:
        monkeypatch.setenv(v.name, "")
        assert _config.get(v.name) == v.default
        monkeypatch.delenv(v.name)
        assert _config.get(v.name) == v.default


def test_paths_are_absolute(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_TPU_CACHE_DIR", "rel/cache")
    assert _config.get("TORCH_TPU_CACHE_DIR") == str(tmp_path / "rel" / "cache")
    monkeypatch.setenv("TORCH_TPU_DUMP_DIR", "~/dumps")
    assert _config.get("TORCH_TPU_DUMP_DIR").endswith("/dumps") and "~" not in _config.get("TORCH_TPU_DUMP_DIR")


@pytest.mark.parametrize("name,raw,valid", [
    ("TORCH_TPU_INDEX_CHECKS", "maybe", "0 (or false, off, no)"),
    ("TORCH_TPU_DIST_CHECKS", "2", "1 (or true, on, yes, unset)"),
    ("TORCH_TPU_DIST_EARLY_INIT", "never", "0 (or false, off, no)"),
    ("TORCH_TPU_CACHE_MAX_BYTES", "-1", "4G"),
    ("TORCH_TPU_CACHE_MAX_BYTES", "inf", "4G"),
    ("TORCH_TPU_NUM_DEVICES", "0", "positive integer"),
    ("TORCH_TPU_COMPILE_FALLBACK", "sometimes", "'eager'"),
])
def test_bad_value_after_load_raises_naming_variable_value_and_valid_values(name, raw, valid, monkeypatch) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(RuntimeError) as e:
        _config.get(name)
    assert f"{name}={raw!r}" in str(e.value) and valid in str(e.value), str(e.value)


def test_bad_value_of_a_use_time_variable_stops_the_first_tpu_use_not_import(tmp_path) -> None:
    code = ("import torch\nprint('imported', (torch.ones(2) + 1).tolist(), flush=True)\n"
            "torch.zeros(1, device='tpu')\n")
    r = run_python(code, env={"TORCH_TPU_DIST_CHECKS": "perhaps", "TORCH_TPU_CACHE_DIR": str(tmp_path)})
    assert "imported [2.0, 2.0]" in r.stdout, r.stderr[-3000:]
    assert r.returncode != 0 and "TORCH_TPU_DIST_CHECKS='perhaps' is not understood" in r.stderr, r.stderr[-3000:]


def test_listing_shows_every_variable_and_its_value() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_TPU_")}
    out = subprocess.run([sys.executable, "-m", "torch_tpu", "config"], capture_output=True, text=True, cwd="/",
                         env={**env, "TORCH_TPU_FUSE_MAX_OPS": "77"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for v in _config.VARIABLES:
        assert v.name in out.stdout
    assert "TORCH_TPU_FUSE_MAX_OPS = '77'" in out.stdout
    assert "Warning" not in out.stderr, out.stderr
    md = subprocess.run([sys.executable, "-m", "torch_tpu", "config", "--markdown"], capture_output=True,
                        text=True, cwd="/", env=env, timeout=300)
    assert md.returncode == 0 and md.stdout == _config.markdown_table(), md.stderr[-3000:]
