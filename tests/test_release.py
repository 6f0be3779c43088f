"""The release path (tools/release.py): the built wheel passes the checks an index and a consumer would make, the
checks catch a broken wheel, `--publish` uploads to an index (a local pypiserver on 127.0.0.1 started here), and
`pip install --dry-run --report "torch_tpu[tpu]"` from that index resolves the libtpu that the installed jaxlib's
jax[tpu] extra asks for. The full clean-venv install and smoke run is `tools/release` itself (minutes)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, built_wheel, version

_spec = importlib.util.spec_from_file_location("torch_tpu_release", REPO / "tools" / "release.py")
release = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(release)
sys.path.insert(0, str(REPO / "tools"))
import build_wheel  # noqa: E402

sys.path.remove(str(REPO / "tools"))


def test_built_wheel_passes_the_release_checks() -> None:
    """twine check --strict, the tag against auditwheel's policies (libtorch/libc10 left to torch), RECORD, the
    metadata and the file list all pass for the wheel Bazel built, and the tag is manylinux."""
    wheel = built_wheel()
    info = release.check_wheel(wheel)
    assert info["tag"].endswith(release.platform_tag()) and "manylinux_" in info["tag"]
    assert info["size"] == wheel.stat().st_size
    assert {"libtorch.so", "libc10.so"} <= set(info["needed"])


def test_platform_check_reads_what_objdump_reads() -> None:
    """build_wheel's own ELF reading (the build-time tag check) finds the GLIBC versions `objdump -p` lists for
    the built _C.so, refuses a tag older than the newest one and accepts BUILD's tag."""
    so = (REPO / "bazel-bin" / "runtime" / "_C.so").read_bytes()
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    dump = subprocess.run(["objdump", "-p", str(REPO / "bazel-bin" / "runtime" / "_C.so")], capture_output=True,
                          text=True, check=True, timeout=60).stdout
    refs = dump.split("Version References:")[1]
    want = sorted({tuple(int(x) for x in v.split(".")) for v in re.findall(r"\bGLIBC_(\d+(?:\.\d+)*)\b", refs)})
    assert build_wheel.glibc_versions_needed(so) == want
    newest = want[-1]
    build_wheel.check_platform(release.platform_tag(), so)
    older = f"manylinux_{newest[0]}_{newest[1] - 1}_x86_64"
    with pytest.raises(SystemExit, match=f"needs GLIBC_{newest[0]}.{newest[1]}"):
        build_wheel.check_platform(older, so)


def _rewrite(src: Path, dst: Path, change: dict[str, bytes]) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info, change.get(info.filename, zin.read(info.filename)))


def test_checks_catch_a_broken_wheel(tmp_path: Path) -> None:
    """A file changed after RECORD was written, an extra file and a plain linux tag each fail, named."""
    wheel = built_wheel()
    bad = tmp_path / wheel.name.replace(release.platform_tag(), "linux_x86_64")
    with zipfile.ZipFile(wheel) as zf:
        registry = zf.read("torch_tpu/kernels/registry.py")
    _rewrite(wheel, bad, {"torch_tpu/kernels/registry.py": registry + b"\n# changed\n"})
    with zipfile.ZipFile(bad, "a") as zf:
        zf.writestr("torch_tpu/stray.txt", b"x")
    with pytest.raises(SystemExit) as e:
        release.check_wheel(bad, twine=False, auditwheel=False)
    msg = str(e.value)
    assert "RECORD: torch_tpu/kernels/registry.py" in msg
    assert "RECORD does not list torch_tpu/stray.txt" in msg and "not expected in the wheel: torch_tpu/stray.txt" in msg
    assert "platform tag linux_x86_64" in msg


def test_publish_to_a_local_index_and_resolve_the_tpu_extra(tmp_path: Path) -> None:
    """`tools/release --publish URL` uploads the checked wheel to a pypiserver on 127.0.0.1 (byte for byte), and
    `pip install --dry-run --report "torch_tpu[tpu]"` from that index resolves torch_tpu from it, jax/jaxlib at
    the installed (tested) versions and libtpu at a version the installed jax's tpu extra accepts. The other
    projects come through pypiserver's redirect to the default index; pip reads metadata only (fast-deps)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    packages = tmp_path / "packages"
    packages.mkdir()
    wheel = built_wheel()
    with release.local_index(packages, uploads=True) as index:
        r = subprocess.run(
            [sys.executable, str(REPO / "tools" / "release.py"), "--wheel", str(wheel), "--skip-smoke",
             "--allow-dirty", "--out", str(tmp_path / "dist"), "--publish", index],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env={**os.environ, "TWINE_USERNAME": "test", "TWINE_PASSWORD": "test"},
        )
        assert r.returncode == 0, r.stderr
        assert (packages / wheel.name).read_bytes() == wheel.read_bytes()
        assert {p.name for p in (tmp_path / "dist").iterdir()} == {
            wheel.name, "SHA256SUMS", "RELEASE_NOTES.md", "release.json"}

        res = release.resolve_tpu_extra(sys.executable, index, version())
    got = res["versions"]
    assert res["torch_tpu_url"].startswith(index)
    assert got["jax"] == md.version("jax") and got["jaxlib"] == md.version("jaxlib")
    libtpu_req = next(Requirement(q.split(";")[0]) for q in md.distribution("jax").requires
                      if q.startswith("libtpu") and 'extra == "tpu"' in q)
    assert "libtpu" in got and libtpu_req.specifier.contains(got["libtpu"]), (got.get("libtpu"), str(libtpu_req))
    assert release.check_resolution(res, index) == got["libtpu"]
    # metadata only: no libtpu wheel (over 100 MB) was downloaded for a dry run
    assert not re.search(r"Downloading libtpu-\S+\.whl \(", res["log"]), res["log"]
