"""Writes the torch_tpu wheel from the monorepo's sources, byte-for-byte reproducibly.

Each input path is mapped by the layout rule of DESIGN.md: `torch_tpu/x` -> `torch_tpu/x`,
`runtime/_C.so` -> `torch_tpu/_C.so` (and the hash of its sources, `runtime/_C.sources.sha256`, beside it),
`<component>/x` -> `torch_tpu/<component>/x`. Entries are sorted and carry a fixed timestamp and mode, so the
same sources give the same bytes.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import zipfile
from pathlib import Path

NAME = "torch_tpu"
FIXED_TIME = (1980, 1, 1, 0, 0, 0)
COMPONENTS = ("kernels", "compile_cache", "distributed")


def archive_path(src: str) -> str | None:
    path = re.sub(r"^bazel-out/[^/]+/bin/", "", src)
    if path == "README.md":
        return None
    if path in ("runtime/_C.so", "runtime/_C.sources.sha256"):
        return f"{NAME}/{path.split('/', 1)[1]}"
    top = path.split("/", 1)[0]
    if top == NAME:
        return path
    if top in COMPONENTS:
        return f"{NAME}/{path}"
    raise SystemExit(f"build_wheel: no import path for {src!r} (see the layout rule in DESIGN.md)")


def metadata(version: str, torch_minor: str, readme: str) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {NAME}",
        f"Version: {version}",
        "Summary: A native PyTorch backend for Google TPUs over PJRT/XLA (XLA:CPU without a TPU)",
        "License: BSD-3-Clause",
        "Requires-Python: >=3.11",
        # The C++ extension is built against one torch minor version: its ABI is not stable across minors.
        f"Requires-Dist: torch=={torch_minor}.*",
        "Requires-Dist: jax<0.11,>=0.10.2",
        "Requires-Dist: jaxlib<0.11,>=0.10.2",
        "Requires-Dist: numpy",
        "Provides-Extra: tpu",
        'Requires-Dist: libtpu; extra == "tpu"',
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
    ap.add_argument("srcs", nargs="+")
    args = ap.parse_args()

    files: dict[str, bytes] = {}
    readme = ""
    for src in args.srcs:
        if src.endswith("README.md"):
            readme = Path(src).read_text()
        dst = archive_path(src)
        if dst is None:
            continue
        if dst in files:
            raise SystemExit(f"build_wheel: two sources map to {dst}")
        files[dst] = Path(src).read_bytes()

    dist_info = f"{NAME}-{args.version}.dist-info"
    files[f"{dist_info}/METADATA"] = metadata(args.version, args.torch_minor, readme).encode()
    files[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: torch_tpu build_wheel (bazel)\nRoot-Is-Purelib: false\n"
        f"Tag: {args.py_tag}-{args.py_tag}-linux_x86_64\n"
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
