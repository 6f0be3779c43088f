"""The release path: build the wheel, check it as a package index would, install it in a clean venv from a local
index and run the 2x2 check and a short test subset there, write the artefacts a publishing job uploads, and
(only when asked) upload them.

    tools/release                         # build + checks + clean-venv smoke, artefacts in dist/
    tools/release --skip-smoke            # build + checks only (a minute)
    tools/release --publish URL           # ... then upload with twine (credentials: TWINE_USERNAME/TWINE_PASSWORD)

Run through `tools/release` (the launcher sets up .venv with tools/setup.sh first). Each failure names the check
that failed and what to do; the exit status is non-zero.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import email.parser
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NAME = "torch_tpu"
COMPONENTS = ("kernels", "compile_cache", "distributed")  # <component>/ -> torch_tpu/<component>/ (DESIGN.md)
RPATH = "$ORIGIN/../torch/lib"  # _C.so loads libtorch from the installed torch wheel
# Libraries the installed torch provides: never grafted into our wheel (as torchvision/torchaudio do).
TORCH_LIBS = ("libtorch*.so", "libc10.so")
SMOKE_TESTS = ["tests/test_wheel.py", "tests/test_autoload.py", "tests/test_device.py"]


class ReleaseError(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"release: {message}")


def say(msg: str) -> None:
    print(f"[release] {msg}", file=sys.stderr, flush=True)


def version() -> str:
    m = re.search(r'^__version__ = "([^"]+)"$', (REPO / "torch_tpu" / "_version.py").read_text(), re.M)
    if not m:
        raise ReleaseError("torch_tpu/_version.py has no `__version__ = \"X.Y.Z\"` line")
    return m.group(1)


def platform_tag() -> str:
    m = re.search(r'^PLATFORM = "([^"]+)"$', (REPO / "BUILD").read_text(), re.M)
    if not m:
        raise ReleaseError("BUILD has no `PLATFORM = \"...\"` line (the wheel's platform tag)")
    return m.group(1)


def wheel_name(ver: str | None = None) -> str:
    py = "cp%d%d" % sys.version_info[:2]
    return f"{NAME}-{ver or version()}-{py}-{py}-{platform_tag()}.whl"


def pins() -> dict[str, str]:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import build_wheel
    finally:
        sys.path.pop(0)
    return build_wheel.pinned((REPO / "tools" / "requirements.txt").read_text())


def expected_requires() -> set[str]:
    import torch

    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    p = pins()
    return {f"torch=={minor}.*", f"jax=={p['jax']}", f"jaxlib=={p['jaxlib']}", "numpy",
            f'jax[tpu]=={p["jax"]}; extra == "tpu"'}


def expected_files(ver: str) -> set[str]:
    """What the wheel must hold, no more, no less: the Python sources the BUILD globs (`**/*.py` of torch_tpu/ and
    each component folder, mapped by the layout rule), _C.so and its source stamp, and the dist-info files."""
    files = {f"{NAME}/_C.so", f"{NAME}/_C.sources.sha256"}
    for folder in (NAME, *COMPONENTS):
        for p in (REPO / folder).rglob("*.py"):
            rel = p.relative_to(REPO).as_posix()
            files.add(rel if folder == NAME else f"{NAME}/{rel}")
    dist = f"{NAME}-{ver}.dist-info"
    files |= {f"{dist}/{n}" for n in ("METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt")}
    return files


def _record_problems(zf: zipfile.ZipFile, dist: str) -> list[str]:
    problems = []
    try:
        rows = list(csv.reader(io.StringIO(zf.read(f"{dist}/RECORD").decode())))
    except KeyError:
        return [f"no {dist}/RECORD"]
    listed = {}
    for row in rows:
        if not row:
            continue
        path, digest, size = row
        if path in listed:
            problems.append(f"RECORD lists {path} twice")
        listed[path] = (digest, size)
    names = set(zf.namelist())
    for path in sorted(names - set(listed)):
        problems.append(f"RECORD does not list {path}")
    for path in sorted(set(listed) - names):
        problems.append(f"RECORD lists {path}, which the wheel does not hold")
    for path in sorted(names & set(listed)):
        digest, size = listed[path]
        if path == f"{dist}/RECORD":
            if digest or size:
                problems.append("RECORD's own line must have no hash and no size")
            continue
        data = zf.read(path)
        want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if digest != want or size != str(len(data)):
            problems.append(f"RECORD: {path} is {want},{len(data)} but RECORD says {digest},{size}")
    return problems


def _elf_info(data: bytes) -> tuple[list[str], list[str]]:
    """(DT_NEEDED, DT_RUNPATH) of a shared object."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    needed, runpath = [], []
    for section in ELFFile(io.BytesIO(data)).iter_sections():
        if isinstance(section, DynamicSection):
            for tag in section.iter_tags():
                if tag.entry.d_tag == "DT_NEEDED":
                    needed.append(tag.needed)
                elif tag.entry.d_tag in ("DT_RUNPATH", "DT_RPATH"):
                    runpath.append(tag.runpath if tag.entry.d_tag == "DT_RUNPATH" else tag.rpath)
    return needed, runpath


def _venv_tool(name: str) -> str:
    tool = Path(sys.executable).parent / name
    if not tool.exists():
        raise ReleaseError(f"{name} is not installed in {Path(sys.executable).parent.parent}: run tools/setup.sh "
                           "(tools/requirements.txt lists the release tools)")
    return str(tool)


def _auditwheel_problems(wheel: Path, tag: str, so: bytes) -> list[str]:
    """auditwheel's own verdict with libtorch/libc10 left to the installed torch: the lowest manylinux policy the
    wheel satisfies must be the tag it carries, and the repair must graft and patch nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [_venv_tool("auditwheel"), "repair", "-w", tmp, str(wheel)]
        for lib in TORCH_LIBS:
            cmd += ["--exclude", lib]
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if r.returncode != 0:
            return [f"auditwheel repair failed: {r.stderr.strip()[-800:]}"]
        out = list(Path(tmp).glob("*.whl"))
        if len(out) != 1:
            return [f"auditwheel wrote {[p.name for p in out]}"]
        problems = []
        got = re.sub(r"\.whl$", "", out[0].name).split("-")[-1]
        if got != tag:
            problems.append(f"the wheel is tagged {tag} but auditwheel's lowest policy for what _C.so links is {got}: "
                            f"set PLATFORM = \"{got}\" in BUILD (or build on an older glibc)")
        with zipfile.ZipFile(out[0]) as zf:
            grafted = [n for n in zf.namelist() if ".libs/" in n]
            if grafted:
                problems.append(f"auditwheel would graft libraries into the wheel: {grafted} (link them from torch, "
                                "or add them to TORCH_LIBS if torch provides them)")
            if zf.read(f"{NAME}/_C.so") != so:
                problems.append("auditwheel would patch _C.so (its rpath or needed libraries)")
    return problems


def check_wheel(wheel: Path, twine: bool = True, auditwheel: bool = True) -> dict:
    """Checks the wheel as an index and a consumer would; raises ReleaseError listing every problem found."""
    ver = version()
    problems: list[str] = []
    m = re.fullmatch(rf"{NAME}-([^-]+)-(cp\d+)-(cp\d+)-([^-]+)\.whl", wheel.name)
    if not m:
        raise ReleaseError(f"{wheel.name} is not named {NAME}-VERSION-PY-ABI-PLATFORM.whl")
    wver, py, abi, plat = m.groups()
    if wver != ver:
        problems.append(f"the wheel is version {wver}, torch_tpu/_version.py says {ver}")
    if not re.fullmatch(r"manylinux_\d+_\d+_x86_64", plat):
        problems.append(f"platform tag {plat}: an index accepts only manylinux/musllinux tags for Linux wheels")
    if plat != platform_tag():
        problems.append(f"platform tag {plat}, BUILD's PLATFORM is {platform_tag()}")
    dist = f"{NAME}-{wver}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        problems += _record_problems(zf, dist)
        want = expected_files(wver)
        for n in sorted(want - names):
            problems.append(f"missing from the wheel: {n}")
        for n in sorted(names - want):
            problems.append(f"not expected in the wheel: {n} (it holds the sources BUILD globs, _C.so, dist-info)")

        def parsed(name: str):
            return email.parser.Parser().parsestr(zf.read(name).decode()) if name in names else {}

        meta, wheel_meta = parsed(f"{dist}/METADATA"), parsed(f"{dist}/WHEEL")
        entry_points = zf.read(f"{dist}/entry_points.txt").decode() if f"{dist}/entry_points.txt" in names else ""
        so = zf.read(f"{NAME}/_C.so") if f"{NAME}/_C.so" in names else b""
    if meta:
        if meta["Name"] != NAME or meta["Version"] != wver:
            problems.append(f"METADATA names {meta['Name']} {meta['Version']}, the file name {NAME} {wver}")
        requires = set(meta.get_all("Requires-Dist") or [])
        if requires != expected_requires():
            problems.append(f"Requires-Dist {sorted(requires)}, expected {sorted(expected_requires())} (torch at "
                            "the minor it was built for, jax/jaxlib at tools/requirements.txt's pins, jax[tpu] for "
                            "the tpu extra)")
        if (meta.get_all("Provides-Extra") or []) != ["tpu"]:
            problems.append(f"Provides-Extra {meta.get_all('Provides-Extra')}, expected ['tpu']")
        if meta["Requires-Python"] != ">=3.11":
            problems.append(f"Requires-Python {meta['Requires-Python']}, expected >=3.11")
    if wheel_meta and (wheel_meta.get_all("Tag") or []) != [f"{py}-{abi}-{plat}"]:
        problems.append(f"WHEEL says Tag {wheel_meta.get_all('Tag')}, the file name {py}-{abi}-{plat}")
    if wheel_meta and wheel_meta["Root-Is-Purelib"] != "false":
        problems.append("WHEEL: Root-Is-Purelib must be false (the wheel holds _C.so)")
    if "torch_tpu = torch_tpu:_autoload" not in entry_points:
        problems.append("entry_points.txt lacks the torch.backends entry point (torch_tpu = torch_tpu:_autoload)")
    needed: list[str] = []
    if so:
        needed, runpath = _elf_info(so)
        if runpath != [RPATH]:
            problems.append(f"_C.so's runpath is {runpath}, expected ['{RPATH}'] (libtorch from the installed torch)")
        if auditwheel:
            problems += _auditwheel_problems(wheel, plat, so)
    if twine:
        r = subprocess.run([_venv_tool("twine"), "check", "--strict", str(wheel)], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            problems.append(f"twine check --strict: {(r.stdout + r.stderr).strip()[-800:]}")
    if problems:
        raise ReleaseError(f"{wheel.name} failed its checks:\n  - " + "\n  - ".join(problems))
    data = wheel.read_bytes()
    return {"wheel": wheel.name, "tag": f"{py}-{abi}-{plat}", "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "requires": sorted(expected_requires()),
            "needed": needed, "files": len(names)}


# ---- a local index ----------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_index(packages: Path, uploads: bool = False, timeout: float = 30.0) -> Iterator[str]:
    """pypiserver on 127.0.0.1 serving `packages` (and taking uploads without a password when asked); other
    projects redirect to the default index (pypiserver's fallback). Yields the root URL; stops the server."""
    port = _free_port()
    cmd = [_venv_tool("pypi-server"), "run", "-i", "127.0.0.1", "-p", str(port)]
    if uploads:
        cmd += ["-a", ".", "-P", "."]
    cmd.append(str(packages))
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(url + "simple/", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise ReleaseError(f"the local index server did not start on {url}: "
                                       f"{log.read().decode(errors='replace')[-800:]}")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def resolve_tpu_extra(python: str, index: str, ver: str, timeout: int = 300) -> dict:
    """`pip install --dry-run --report` of torch_tpu[tpu] from `index` (a fresh resolution: nothing installed
    counts). Returns {name: version} of what pip would install, torch_tpu's download URL and pip's log."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        # fast-deps: the index serves no PEP 658 metadata for libtpu, so pip would fetch its 213 MB wheel to read
        # METADATA; with HTTP range requests it reads only that.
        cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--disable-pip-version-check",
               "--use-feature=fast-deps", "--report", str(report), "--index-url", index + "simple/",
               f"{NAME}[tpu]=={ver}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp)
        if r.returncode != 0:
            raise ReleaseError(f"pip could not resolve {NAME}[tpu]=={ver} from {index}: {r.stderr.strip()[-1500:]}")
        data = json.loads(report.read_text())
    installs = {i["metadata"]["name"].lower().replace("_", "-"): i for i in data["install"]}
    return {"versions": {k: v["metadata"]["version"] for k, v in installs.items()},
            "torch_tpu_url": installs["torch-tpu"]["download_info"]["url"], "log": r.stdout + r.stderr}


def libtpu_requirement() -> str:
    """The libtpu requirement of jax's `tpu` extra, from the installed jax's metadata."""
    import importlib.metadata as md

    for req in md.distribution("jax").requires or []:
        if req.startswith("libtpu") and 'extra == "tpu"' in req:
            return req.split(";")[0].strip()
    raise ReleaseError("the installed jax declares no libtpu requirement for its tpu extra")


def check_resolution(res: dict, index: str) -> str:
    """The resolved set is what the wheel's metadata promises: libtpu matches jax[tpu]'s pin, jax/jaxlib at
    the pinned versions, torch_tpu from the local index. Returns the libtpu version."""
    from packaging.requirements import Requirement

    got = res["versions"]
    want_libtpu = Requirement(libtpu_requirement())
    problems = []
    if "libtpu" not in got:
        problems.append(f"libtpu is not in the resolution ({sorted(got)})")
    elif not want_libtpu.specifier.contains(got["libtpu"], prereleases=True):
        problems.append(f"libtpu resolved to {got['libtpu']}, jax's tpu extra needs {want_libtpu}")
    for name, pinned_version in pins().items():
        if got.get(name) != pinned_version:
            problems.append(f"{name} resolved to {got.get(name)}, the wheel pins {pinned_version}")
    if not res["torch_tpu_url"].startswith(index):
        problems.append(f"torch_tpu came from {res['torch_tpu_url']}, not the local index {index}")
    if problems:
        raise ReleaseError("the tpu extra resolves wrongly:\n  - " + "\n  - ".join(problems))
    return got["libtpu"]


# ---- steps ------------------------------------------------------------------------------------------------------

def _run(cmd: list[str], what: str, timeout: int, **kw) -> None:
    say(f"{what}: {' '.join(cmd)}")
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise ReleaseError(f"{what} took more than {timeout} s") from None
    if r.returncode != 0:
        raise ReleaseError(f"{what} failed (exit {r.returncode}); see the output above")
    say(f"{what}: done in {time.monotonic() - t0:.1f} s")


def build() -> Path:
    py = sys.executable
    _run(["bazel", "build", "//:wheel", "--config=wheel_common", "--config=no_rbe",
          f"--repo_env=TORCH_TPU_PYTHON={py}"], "bazel build", 3600, cwd=REPO,
         env=dict(os.environ, TORCH_TPU_PYTHON=py))
    wheel = REPO / "bazel-bin" / wheel_name()
    if not wheel.exists():
        raise ReleaseError(f"Bazel did not write {wheel}")
    return wheel


def check_clean_tree() -> None:
    r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise ReleaseError(f"not a git checkout ({r.stderr.strip()}): release from a clone (or pass --allow-dirty)")
    dirty = [line for line in r.stdout.splitlines() if line[3:] != "dist" and not line[3:].startswith("dist/")]
    if dirty:
        raise ReleaseError("the working tree has uncommitted changes or untracked files (they would go into the "
                           "wheel untracked):\n  " + "\n  ".join(dirty[:20]) + "\ncommit them, or pass --allow-dirty")


def release_notes(ver: str) -> str:
    path = REPO / "docs" / "changelog.md"
    if not path.exists():
        raise ReleaseError("docs/changelog.md is missing: write the release notes first")
    text = path.read_text()
    m = re.search(rf"^## {re.escape(ver)}\b.*?(?=^## |\Z)", text, re.M | re.S)
    if not m:
        raise ReleaseError(f"docs/changelog.md has no `## {ver}` section: write the release notes first")
    return m.group(0).strip() + "\n"


def smoke(wheel: Path, index: str, work: Path) -> dict:
    """A clean venv: torch==X first (never re-resolved), then torch_tpu from the local index (its deps resolved
    as a user's pip would), then the 2x2 check and a short test subset, run from outside the source tree."""
    import torch

    venv = work / "venv"
    t0 = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], "create a clean venv", 300)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, f"torch=={torch.__version__.split('+')[0]}"], "install torch in the clean venv", 1800)
    _run([*pip, "--index-url", index + "simple/", f"{NAME}=={version()}"],
         "install torch_tpu from the local index", 1800)
    _run([*pip, "pytest", "expecttest"], "install the test runner", 600)
    installed = time.monotonic() - t0
    r = subprocess.run([py, "-c", "import importlib.metadata as m, sys; d = m.distribution('torch_tpu'); "
                        "print(d.version, d.read_text('WHEEL').split('Tag: ')[1].split()[0])"],
                       capture_output=True, text=True, cwd=work, timeout=120)
    if r.returncode != 0 or r.stdout.split() != [version(), wheel.name[:-4].split("-", 2)[2]]:
        raise ReleaseError(f"the clean venv holds another torch_tpu than {wheel.name}: {r.stdout}{r.stderr}")
    t1 = time.monotonic()
    _run([py, str(REPO / "examples" / "hello_tpu.py")], "the 2x2 check in the clean venv", 600, cwd=work)
    # the venv's pytest script, not `python -m pytest`: that would put the repository root (and its source folder
    # torch_tpu/) first on sys.path
    _run([str(venv / "bin" / "pytest"), "-q", "-m", "not slow", *SMOKE_TESTS], "the smoke tests in the clean venv",
         1200, cwd=REPO)
    return {"install_s": round(installed, 1), "smoke_s": round(time.monotonic() - t1, 1), "tests": SMOKE_TESTS}


def publish(wheel: Path, url: str) -> None:
    """twine upload to `url`; credentials from TWINE_USERNAME / TWINE_PASSWORD (or ~/.pypirc)."""
    cmd = [_venv_tool("twine"), "upload", "--non-interactive", "--disable-progress-bar", "--repository-url", url,
           str(wheel)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise ReleaseError(f"upload to {url} failed: {(r.stdout + r.stderr).strip()[-1500:]}\n"
                           "check the URL and the credentials (TWINE_USERNAME / TWINE_PASSWORD)")
    say(f"uploaded {wheel.name} to {url}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/release", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "dist"), help="artefact folder (default: dist/)")
    ap.add_argument("--wheel", help="check this wheel instead of building one")
    ap.add_argument("--skip-smoke", action="store_true", help="no clean-venv install and tests")
    ap.add_argument("--allow-dirty", action="store_true", help="release from a tree with uncommitted changes")
    ap.add_argument("--publish", metavar="URL", help="upload the checked wheel to this index (twine upload URL)")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    ver = version()
    if not args.allow_dirty:
        check_clean_tree()
    notes = release_notes(ver)
    wheel = Path(args.wheel) if args.wheel else build()
    say(f"checking {wheel.name}")
    info = check_wheel(wheel)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{NAME}-*.whl"):
        old.unlink()
    dist_wheel = out / wheel.name
    shutil.copyfile(wheel, dist_wheel)
    (out / "SHA256SUMS").write_text(f"{info['sha256']}  {wheel.name}\n")
    (out / "RELEASE_NOTES.md").write_text(notes)
    say(f"checks passed: {info['tag']}, {info['size']} bytes, {info['files']} files")

    if not args.skip_smoke:
        with tempfile.TemporaryDirectory() as packages, tempfile.TemporaryDirectory() as work:
            shutil.copyfile(dist_wheel, Path(packages) / wheel.name)
            with local_index(Path(packages)) as index:
                say(f"local index {index}: resolving {NAME}[tpu] (pip --dry-run --report)")
                res = resolve_tpu_extra(sys.executable, index, ver)
                info["libtpu"] = check_resolution(res, index)
                info["resolved"] = res["versions"]
                say(f"{NAME}[tpu] resolves libtpu {info['libtpu']} ({libtpu_requirement()})")
                info["smoke"] = smoke(dist_wheel, index, Path(work))
    info["elapsed_s"] = round(time.monotonic() - t0, 1)
    (out / "release.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    if args.publish:
        publish(dist_wheel, args.publish)
    say(f"done in {info['elapsed_s']} s: {out}/ holds {wheel.name}, SHA256SUMS, RELEASE_NOTES.md, release.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
