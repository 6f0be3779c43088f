"""The source tree works in place (docs/contributing.md, the development loop): from the repository root
`import torch` loads torch_tpu from the source folders, with the C++ extension built from the current runtime/
sources, and a Python edit takes effect without a wheel rebuild. A stale _C never loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

_WHERE = """
import torch, torch_tpu
import torch_tpu.kernels, torch_tpu.compile_cache, torch_tpu.distributed
for m in (torch_tpu, torch_tpu.kernels, torch_tpu.compile_cache, torch_tpu.distributed, torch_tpu._C):
    print(m.__name__, m.__file__)
print("value", (torch.arange(4.0, device="tpu") * 2 + 1).cpu().tolist())
"""


def _run_at(root: Path, code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -c code` with cwd = root (so root's torch_tpu/ comes first on sys.path), TORCH_TPU_* unset."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_TPU_")}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _files(out: str) -> dict[str, Path]:
    return {ln.split()[0]: Path(ln.split()[1]) for ln in out.splitlines() if ln.startswith("torch_tpu")}


def test_import_torch_from_the_repository_root() -> None:
    r = _run_at(REPO, "import torch; print(torch.randn(2, device='tpu'))")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("tensor([") and "device='tpu:0'" in r.stdout, r.stdout


def test_source_folders_are_used_in_place() -> None:
    r = _run_at(REPO, _WHERE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "value [1.0, 3.0, 5.0, 7.0]" in r.stdout, r.stdout  # CPU oracle: arange(4) * 2 + 1
    files = _files(r.stdout)
    assert files["torch_tpu"] == REPO / "torch_tpu" / "__init__.py"
    for comp in ("kernels", "compile_cache", "distributed"):  # DESIGN.md: torch_tpu.<x> lives in <x>/
        assert files[f"torch_tpu.{comp}"] == REPO / comp / "__init__.py", files
    so = files["torch_tpu._C"].resolve()
    assert so.name == "_C.so" and ("site-packages" in str(so) or so == (REPO / "bazel-bin/runtime/_C.so").resolve())


def test_component_folders_do_not_shadow_top_level_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the repository root, `kernels` and `distributed` are not top-level packages (the root is on sys.path,
    but those folders are torch_tpu's): `import kernels` finds another installed package of that name (Hugging
    Face's kernel hub, which transformers probes for) or nothing, and torch_tpu's own components still load."""
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'the other kernels package'\n")
    code = """
import importlib.util, sys, torch, torch_tpu.kernels
print("distributed", importlib.util.find_spec("distributed") is None)
import kernels
print("kernels", kernels.WHO)
print("ours", torch_tpu.kernels.__file__)
"""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    r = _run_at(REPO, code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "distributed True" in r.stdout and "kernels the other kernels package" in r.stdout, r.stdout
    assert f"ours {REPO / 'kernels' / '__init__.py'}" in r.stdout, r.stdout


def _copy_tree(dst: Path) -> Path:
    """A copy of the source tree's Python and C++ sources (the built _C is found through bazel-bin or the wheel)."""
    for name in ("torch_tpu", "kernels", "compile_cache", "distributed", "runtime"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "MODULE.bazel", dst / "MODULE.bazel")
    if (REPO / "bazel-bin").exists():
        (dst / "bazel-bin").symlink_to((REPO / "bazel-bin").resolve())
    return dst


def test_python_edit_takes_effect_without_rebuild(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path / "src")
    init = root / "kernels" / "__init__.py"
    init.write_text(init.read_text() + "\nEDITED_IN_PLACE = 'yes'\n")
    r = _run_at(root, _WHERE + "print('edited', torch_tpu.kernels.EDITED_IN_PLACE)")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "edited yes" in r.stdout and "value [1.0, 3.0, 5.0, 7.0]" in r.stdout, r.stdout
    assert _files(r.stdout)["torch_tpu.kernels"] == init


def test_stale_extension_is_refused(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path / "src")
    cpp = sorted((root / "runtime").glob("*.cpp"))[0]
    cpp.write_text(cpp.read_text() + "\n// edited after the build\n")
    r = _run_at(root, "import torch")
    assert r.returncode != 0
    assert "built from other runtime/ sources" in r.stderr and "bash tools/setup.sh" in r.stderr, r.stderr[-3000:]


def test_missing_extension_says_what_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_tpu import _source_tree

    root = _copy_tree(tmp_path / "src")
    (root / "bazel-bin").unlink(missing_ok=True)
    monkeypatch.setattr(sys, "path", [str(root)])  # no installed wheel either
    with pytest.raises(ImportError, match=r"_C is not built: run `bash tools/setup.sh`"):
        _source_tree.extension_path(str(root))


def test_wheel_carries_the_hash_of_its_runtime_sources() -> None:
    import torch_tpu
    from torch_tpu import _source_tree

    stamp = Path(torch_tpu.__file__).parent / _source_tree.STAMP
    assert stamp.read_text().strip() == _source_tree.runtime_hash(str(REPO / "runtime"))
