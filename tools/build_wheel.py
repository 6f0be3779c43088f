"""Writes the torch_tpu wheel from the monorepo's sources, byte-for-byte reproducibly.

Each input path is mapped by the layout rule of DESIGN.md: `torch_tpu/x` -> `torch_tpu/x`,
`runtime/_C.so` -> `torch_tpu/_C.so` (and the hash of its sources, `runtime/_C.sources.sha256`, beside it),
`<component>/x` -> `torch_tpu/<component>/x`. Entries are sorted and carry a fixed timestamp and mode, so the
same sources give the same bytes.

The metadata pins jax/jaxlib to the versions tools/requirements.txt installs (what the tests run with), and the
`tpu` extra asks for `jax[tpu]` at that version, which brings the libtpu that jaxlib release needs. The platform
tag (`--plat`) must be true of `_C.so`: a `manylinux_X_Y` tag fails the build when `_C.so` needs a glibc symbol
version newer than X.Y (tools/release checks the whole auditwheel policy on top).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import struct
import zipfile
from pathlib import Path

NAME = "torch_tpu"
FIXED_TIME = (1980, 1, 1, 0, 0, 0)
COMPONENTS = ("kernels", "compile_cache", "distributed")


def archive_path(src: str) -> str | None:
    path = re.sub(r"^bazel-out/[^/]+/bin/", "", src)
    if path in ("README.md", "tools/requirements.txt"):  # read for the metadata, not packed
        return None
    if path in ("runtime/_C.so", "runtime/_C.sources.sha256"):
        return f"{NAME}/{path.split('/', 1)[1]}"
    top = path.split("/", 1)[0]
    if top == NAME:
        return path
    if top in COMPONENTS:
        return f"{NAME}/{path}"
    raise SystemExit(f"build_wheel: no import path for {src!r} (see the layout rule in DESIGN.md)")


def pinned(requirements: str, names: tuple[str, ...] = ("jax", "jaxlib")) -> dict[str, str]:
    """The exact versions `name==X` that tools/requirements.txt pins for `names`."""
    found = {}
    for line in requirements.splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;#]+)", line)
        if m and m.group(1).lower() in names:
            found[m.group(1).lower()] = m.group(2)
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"build_wheel: tools/requirements.txt pins no exact version of {', '.join(missing)} "
                         "(write `name==X.Y.Z`): the wheel pins jax/jaxlib to the versions the tests run with")
    return found


def glibc_versions_needed(elf: bytes) -> list[tuple[int, ...]]:
    """The GLIBC_x.y symbol versions an ELF64 little-endian shared object needs (its SHT_GNU_verneed entries,
    what auditwheel and `objdump -p` read)."""
    if elf[:4] != b"\x7fELF" or len(elf) < 64 or elf[4] != 2 or elf[5] != 1:
        raise SystemExit("build_wheel: _C.so is not an ELF64 little-endian file; cannot check its platform tag "
                         "(build with --plat linux_x86_64 to claim nothing)")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    out = set()
    for _name, typ, _flags, _addr, off, _size, link, info, _align, _entsize in sections:
        if typ != 0x6FFFFFFE:  # SHT_GNU_verneed: one Verneed per library, one Vernaux per version
            continue
        strtab = sections[link][4]
        entry = off
        for _ in range(info):
            _ver, cnt, _file, aux, nxt = struct.unpack_from("<HHIII", elf, entry)
            a = entry + aux
            for _ in range(cnt):
                _hash, _vflags, _other, name, anext = struct.unpack_from("<IHHII", elf, a)
                sym = elf[strtab + name:elf.index(b"\0", strtab + name)].decode()
                if re.fullmatch(r"GLIBC_\d+(\.\d+)*", sym):
                    out.add(tuple(int(x) for x in sym[len("GLIBC_"):].split(".")))
                a += anext
            entry += nxt
    return sorted(out)


def check_platform(plat: str, so: bytes) -> None:
    """A `manylinux_X_Y_x86_64` tag promises that glibc X.Y is enough: refuse a _C.so that needs newer symbols."""
    if plat == "linux_x86_64":
        return  # a plain linux tag claims nothing (and an index refuses it for upload)
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", plat)
    if not m:
        raise SystemExit(f"build_wheel: unsupported platform tag {plat!r} (use manylinux_X_Y_x86_64 or linux_x86_64)")
    limit = (int(m.group(1)), int(m.group(2)))
    newer = [v for v in glibc_versions_needed(so) if v[:2] > limit]
    if newer:
        need = ".".join(map(str, max(newer)))
        raise SystemExit(
            f"build_wheel: _C.so needs GLIBC_{need}, newer than its tag {plat} promises (glibc {limit[0]}.{limit[1]}). "
            "Build on an older glibc (a manylinux image), or raise PLATFORM in BUILD to the lowest tag "
            "`auditwheel show` names for the built wheel"
        )


def metadata(version: str, torch_minor: str, readme: str, pins: dict[str, str]) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {NAME}",
        f"Version: {version}",
        "Summary: A native PyTorch backend for Google TPUs over PJRT/XLA (XLA:CPU without a TPU)",
        "License: BSD-3-Clause",
        "Requires-Python: >=3.11",
        # The C++ extension is built against one torch minor version: its ABI is not stable across minors.
        f"Requires-Dist: torch=={torch_minor}.*",
        # torch_tpu uses jax internals (jax._src, the compilation cache): only the tested release is allowed.
        f"Requires-Dist: jax=={pins['jax']}",
        f"Requires-Dist: jaxlib=={pins['jaxlib']}",
        "Requires-Dist: numpy",
        "Provides-Extra: tpu",
        # jax's own tpu extra pins the libtpu its jaxlib is built for (and jaxlib itself).
        f"Requires-Dist: jax[tpu]=={pins['jax']}; extra == \"tpu\"",
        "Description-Content-Type: text/markdown",
        "",
        readme,
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--torch-minor", required=True)
    ap.add_argument("--py-tag", required=True)
    ap.add_argument("--plat", default="linux_x86_64", help="platform tag, e.g. manylinux_2_34_x86_64")
    ap.add_argument("srcs", nargs="+")
    args = ap.parse_args()

    files: dict[str, bytes] = {}
    readme = ""
    pins = None
    for src in args.srcs:
        if src.endswith("README.md"):
            readme = Path(src).read_text()
        if src.endswith("tools/requirements.txt"):
            pins = pinned(Path(src).read_text())
        dst = archive_path(src)
        if dst is None:
            continue
        if dst in files:
            raise SystemExit(f"build_wheel: two sources map to {dst}")
        files[dst] = Path(src).read_bytes()

    if pins is None:
        raise SystemExit("build_wheel: tools/requirements.txt is not among the sources (the jax/jaxlib pins come "
                         "from it)")
    declared = re.search(rb'^__version__ = "([^"]+)"', files.get(f"{NAME}/_version.py", b""), re.M)
    if declared and declared.group(1).decode() != args.version:
        raise SystemExit(f"build_wheel: --version {args.version} but torch_tpu/_version.py says "
                         f"{declared.group(1).decode()} (the one place the version is written)")
    if f"{NAME}/_C.so" in files:
        check_platform(args.plat, files[f"{NAME}/_C.so"])

    dist_info = f"{NAME}-{args.version}.dist-info"
    files[f"{dist_info}/METADATA"] = metadata(args.version, args.torch_minor, readme, pins).encode()
    files[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: torch_tpu build_wheel (bazel)\nRoot-Is-Purelib: false\n"
        f"Tag: {args.py_tag}-{args.py_tag}-{args.plat}\n"
    ).encode()
    # Loaded automatically by `import torch` (torch.backends entry point), unless
    # TORCH_DEVICE_BACKEND_AUTOLOAD=0.
    # torch.compile(backend="tpu"): Dynamo finds the backend in the torch_dynamo_backends group and imports it
    # only then.
    files[f"{dist_info}/entry_points.txt"] = (
        b"[torch.backends]\ntorch_tpu = torch_tpu:_autoload\n\n"
        b"[torch_dynamo_backends]\ntpu = torch_tpu._compile:tpu_backend\n"
    )
    files[f"{dist_info}/top_level.txt"] = f"{NAME}\n".encode()

    record_lines = []
    for name in sorted(files):
        digest = base64.urlsafe_b64encode(hashlib.sha256(files[name]).digest()).rstrip(b"=").decode()
        record_lines.append(f"{name},sha256={digest},{len(files[name])}")
    record = f"{dist_info}/RECORD"
    record_lines.append(f"{record},,")
    files[record] = ("\n".join(record_lines) + "\n").encode()

    with zipfile.ZipFile(args.out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            executable = name.endswith(".so")
            info.external_attr = ((0o755 if executable else 0o644) | 0o100000) << 16
            info.create_system = 3
            zf.writestr(info, files[name])


if __name__ == "__main__":
    main()
