"""python -m torch_tpu.compile_cache info|clear|prune [--dir DIR] [--max-bytes N]

info   what is in the persistent compile cache (directory, entries, bytes, cap)
clear  delete every entry
prune  delete corrupt entries and stale temporary files, then evict least-recently-used entries above the cap
"""

from __future__ import annotations

import argparse
import sys

from torch_tpu import compile_cache as cc


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m torch_tpu.compile_cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("info", "clear", "prune"))
    ap.add_argument("--dir", default=None, help="cache directory (default: TORCH_TPU_CACHE_DIR or the user cache)")
    ap.add_argument("--max-bytes", default=None, type=_size, help="prune: size to evict down to (e.g. 1G)")
    args = ap.parse_args(argv)
    directory = args.dir or cc.cache_dir()
    if args.command == "info":
        s = cc.stats(directory)
        print(f"directory: {s.directory}")
        print(f"enabled:   {s.enabled}")
        print(f"entries:   {s.entries}")
        print(f"bytes:     {s.bytes} ({s.bytes / 2**20:.1f} MiB of {s.max_bytes / 2**20:.0f} MiB cap)")
    elif args.command == "clear":
        print(f"removed {cc.clear(directory)} entries from {directory}")
    else:
        damaged, evicted = cc.prune(directory, args.max_bytes)
        s = cc.stats(directory)
        print(f"removed {damaged} damaged or stale files, evicted {evicted} entries; {s.entries} entries, "
              f"{s.bytes} bytes left in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
