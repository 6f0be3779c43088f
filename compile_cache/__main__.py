"""python -m torch_tpu.compile_cache info|clear|prune [--dir DIR] [--max-bytes N]

info   what is in the persistent compile cache (directory, entries, bytes, cap, temporary files, problems)
clear  delete every entry (and temporary files left by writers that died)
prune  delete damaged entries and temporary files left by writers that died, then evict least-recently-used
       entries above the cap

Exit status 1, with what is wrong and what to do, when the directory is not usable (not a folder, read-only,
full) or files cannot be removed.
"""

from __future__ import annotations

import argparse
import sys

from torch_tpu import compile_cache as cc


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    try:
        return int(float(text[:-1] if mult > 1 else text) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4G, 512M, 1000000)") from None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m torch_tpu.compile_cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("info", "clear", "prune"))
    ap.add_argument("--dir", default=None, help="cache directory (default: TORCH_TPU_CACHE_DIR or the user cache)")
    ap.add_argument("--max-bytes", default=None, type=_size, help="prune: size to evict down to (e.g. 1G)")
    args = ap.parse_args(argv)
    directory = args.dir or cc.cache_dir()
    try:
        return _command(args, directory)
    except (cc.CompileCacheError, RuntimeError) as e:  # RuntimeError: a bad TORCH_TPU_CACHE_MAX_BYTES
        print(f"torch_tpu compile cache: {e}", file=sys.stderr)
        return 1


def _command(args: argparse.Namespace, directory: str) -> int:
    if args.command == "info":
        s = cc.stats(directory)
        print(f"directory: {s.directory}")
        print(f"enabled:   {s.enabled}")
        print(f"entries:   {s.entries}")
        print(f"bytes:     {s.bytes} ({s.bytes / 2**20:.1f} MiB of {s.max_bytes / 2**20:.0f} MiB cap)")
        print(f"temporary: {s.temp_files} ({s.stale_temp_files} left by writers that died; prune removes them)")
        if s.problem:
            print(f"problem:   {s.problem}")
            return 1
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
