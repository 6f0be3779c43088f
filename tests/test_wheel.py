"""The wheel: metadata, entry point, layout, and reproducible bytes."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO, built_wheel, version


def test_installed_metadata() -> None:
    """The installed wheel's metadata: its version from torch_tpu/_version.py, torch at the minor it was built
    against, jax/jaxlib exactly at the versions the tests run with (the installed ones, tools/requirements.txt's
    pins), and a tpu extra that asks for jax[tpu] at that version (which brings jax's libtpu pin)."""
    dist = md.distribution("torch_tpu")
    assert dist.version == version()
    eps = [e for e in dist.entry_points if e.group == "torch.backends"]
    assert [(e.name, e.value) for e in eps] == [("torch_tpu", "torch_tpu:_autoload")]
    reqs = dist.requires or []
    torch_minor = ".".join(md.version("torch").split("+")[0].split(".")[:2])
    assert f"torch=={torch_minor}.*" in reqs
    jax, jaxlib = md.version("jax"), md.version("jaxlib")
    assert f"jax=={jax}" in reqs and f"jaxlib=={jaxlib}" in reqs
    assert f"jax=={jax}" in (REPO / "tools" / "requirements.txt").read_text().splitlines()
    assert f'jax[tpu]=={jax}; extra == "tpu"' in reqs
    assert not any(r.startswith("libtpu") for r in reqs)  # jax's own extra pins libtpu
    assert dist.metadata.get_all("Provides-Extra") == ["tpu"]


def test_installed_layout() -> None:
    import torch_tpu
    import torch_tpu.compile_cache
    import torch_tpu.distributed
    import torch_tpu.kernels

    root = Path(torch_tpu.__file__).parent
    assert (root / "_C.so").exists()
    assert Path(torch_tpu.kernels.__file__).parent == root / "kernels"
    assert torch_tpu.__version__ == version() == md.version("torch_tpu")


def test_every_kernel_module_is_installed_and_imported() -> None:
    """Each module under kernels/, the family packages' (kernels/nn/, kernels/indexing/) included, is in the
    installed wheel and imported with the kernels: a module its package's __init__.py leaves out registers
    nothing, silently."""
    import torch_tpu.kernels

    root = Path(torch_tpu.kernels.__file__).parent
    sources = sorted(p.relative_to(REPO / "kernels").as_posix() for p in (REPO / "kernels").rglob("*.py"))
    installed = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    assert "nn/__init__.py" in sources and "indexing/__init__.py" in sources
    assert sources == installed
    for rel in sources:
        name = "torch_tpu.kernels." + rel[: -len(".py")].replace("/", ".")
        name = name[: -len(".__init__")] if name.endswith(".__init__") else name
        assert name in sys.modules, f"{name} is not imported by torch_tpu.kernels (add it to its package's __init__.py)"


def _build(tmp: Path, name: str) -> bytes:
    src = tmp / "src"
    for rel, text in {"torch_tpu/__init__.py": "x = 1\n", "kernels/a.py": "y = 2\n",
                      "distributed/__init__.py": "", "README.md": "# readme\n",
                      "tools/requirements.txt": "jax==0.10.2\njaxlib==0.10.2\n"}.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    so = src / "bazel-out" / "k8-opt" / "bin" / "runtime" / "_C.so"
    so.parent.mkdir(parents=True, exist_ok=True)
    so.write_bytes(b"\x7fELF fake")
    out = tmp / name
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "build_wheel.py"), "--out", str(out), "--version", "0.2.0",
         "--torch-minor", "2.13", "--py-tag", "cp311", "torch_tpu/__init__.py", "kernels/a.py",
         "distributed/__init__.py", "README.md", "bazel-out/k8-opt/bin/runtime/_C.so", "tools/requirements.txt"],
        check=True, cwd=src,
    )
    return out.read_bytes()


def test_wheel_builder_is_reproducible_and_maps_the_layout(tmp_path: Path) -> None:
    first = _build(tmp_path, "a.whl")
    second = _build(tmp_path, "b.whl")
    assert hashlib.sha256(first).hexdigest() == hashlib.sha256(second).hexdigest()
    names = zipfile.ZipFile(tmp_path / "a.whl").namelist()
    assert "torch_tpu/_C.so" in names and "torch_tpu/kernels/a.py" in names
    assert "torch_tpu/distributed/__init__.py" in names and "torch_tpu/__init__.py" in names
    assert "torch_tpu-0.2.0.dist-info/entry_points.txt" in names
    assert names == sorted(names)


def test_built_wheel_matches_installed_sources() -> None:
    import torch_tpu

    root = Path(torch_tpu.__file__).parent
    with zipfile.ZipFile(built_wheel()) as zf:
        assert zf.read("torch_tpu/kernels/registry.py") == (root / "kernels" / "registry.py").read_bytes()
        assert zf.read("torch_tpu/kernels/registry.py") == (REPO / "kernels" / "registry.py").read_bytes()
