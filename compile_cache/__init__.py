"""torch_tpu.compile_cache: the persistent on-disk cache of compiled XLA executables, safe across processes.

On by default, in `$TORCH_TPU_CACHE_DIR` or else `$XDG_CACHE_HOME/torch_tpu/xla` (`~/.cache/torch_tpu/xla`);
`TORCH_TPU_CACHE=0` turns it off; `TORCH_TPU_CACHE_MAX_BYTES` caps its size (default 4 GiB; suffixes K, M, G).

It plugs into JAX's own persistent compilation cache: JAX computes the key (the StableHLO program, compile
options, XLA flags, jax/jaxlib versions, platform version and the devices' kind) and serialises the
executable; `DiskCache` is the storage JAX writes through, adding what JAX's file cache lacks:
- the torch_tpu, jax, jaxlib and libtpu versions mixed into the key, so a stale executable is never reused;
- atomic writes (a temporary file `.tmp-<host>-<pid>-...` renamed into place): readers in other processes
  never see a torn entry; `prune` and `clear` remove the temporary files of writers that died;
- a checksum per entry, and the entry's full key stored in it: a corrupt or truncated entry, or a whole one
  found under another entry's name, is deleted, reported (a `CompileCacheWarning`) and recompiled, never
  loaded (entries of an older format are misses and are replaced);
- a directory that cannot be written (read-only, full, removed) costs one warning: the process goes on
  compiling without storing new entries;
- least-recently-used eviction under a size cap (a hit refreshes an entry's modification time);
- statistics: `torch.tpu.compile_cache.stats()`, and `python -m torch_tpu.compile_cache info|clear|prune`.

torch_tpu also stores, in the same checksummed entries, what lets a warm start skip JAX's tracing and
lowering too: each op's output shapes under DEFER_AND_FUSE (`s-*` entries), and whole executables keyed by
what they compute (`g-*` entries, serialized with jax.experimental.serialize_executable): fused programs by
their structure (executors call `load_program` and `compile_program`) and eager ops' per-shape executables
(`persistent_jit`); `get_meta`/`put_meta` store small values. Their keys add the
JAX configuration and XLA_FLAGS, which JAX's own key covers for its entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import os
import pickle
import socket
import struct
import threading
import time
import warnings
from typing import Any, Callable

from torch_tpu import _config

__all__ = ["CompileCacheWarning", "CompileCacheError", "CacheStats", "DiskCache", "cache_dir", "enabled", "stats",
           "clear", "prune", "install", "max_bytes"]

# An entry: header, then its full key (utf-8), then the payload. The file's name is a hash of that key, so a
# whole entry copied or moved under another name is recognised on load (and by prune) and never used.
_MAGIC = b"TTPUXC02"
_OLD_MAGICS = (b"TTPUXC01",)  # older formats (no key): a miss, replaced by the next write
# magic, sha256 of key + payload, payload length, compile seconds of the entry (patched in after the compile),
# key length
_HEADER = struct.Struct("<8s32sQdQ")
_SUFFIX = ".xc"
_COMPILE_SECONDS_OFFSET = 8 + 32 + 8
# Temporary files: ".tmp-<host>-<pid>-<thread>-<ns>". One is stale (its writer died) when its process is gone
# (same host) or it is older than _TEMP_MAX_AGE seconds (another host sharing the directory, a reused pid).
_TEMP_PREFIX = ".tmp-"
_TEMP_MAX_AGE = 3600.0


class CompileCacheWarning(UserWarning):
    """A cache entry could not be used (corrupt, truncated, unreadable, stored under another key): it was
    discarded and recompiled; or the cache directory cannot be written and new programs are not stored."""


class CompileCacheError(RuntimeError):
    """`clear` or `prune` could not do their work: the directory is not a folder, or files cannot be removed."""


def enabled() -> bool:
    return _config.get("TORCH_TPU_CACHE")


def cache_dir() -> str:
    d = _config.get("TORCH_TPU_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torch_tpu", "xla")


def max_bytes() -> int:
    return _config.get("TORCH_TPU_CACHE_MAX_BYTES")


def _versions() -> str:
    """Everything outside JAX's key that changes what an executable means to torch_tpu."""
    import importlib.metadata as md

    import torch_tpu

    parts = [f"torch_tpu={torch_tpu.__version__}"]
    for pkg in ("jax", "jaxlib", "libtpu", "libtpu-nightly"):
        try:
            parts.append(f"{pkg}={md.version(pkg)}")
        except md.PackageNotFoundError:
            pass
    return ";".join(parts)


@dataclasses.dataclass
class CacheStats:
    directory: str
    enabled: bool
    hits: int  # executables loaded from disk in this process
    misses: int  # lookups that found nothing usable (then compiled and written)
    writes: int  # entries this process wrote
    corrupt: int  # entries found corrupt or truncated (discarded and recompiled)
    evictions: int  # entries this process evicted for the size cap
    entries: int  # entries on disk now
    bytes: int  # their total size
    max_bytes: int
    compile_seconds_saved: float  # compile time the hits did not spend (as measured when each entry was written)
    temp_files: int = 0  # temporary files of writers (in progress, or left by a writer that died)
    stale_temp_files: int = 0  # of those, left by writers that died: prune and clear remove them
    problem: str = ""  # what is wrong with the directory (not a folder, not writable, full), and what to do

    def __str__(self) -> str:
        return "\n".join(f"{k}: {v}" for k, v in dataclasses.asdict(self).items())


class _Counters:
    def __init__(self) -> None:
        self.hits = self.misses = self.writes = self.corrupt = self.evictions = 0
        self.saved = 0.0


def _disk_usage(directory: str) -> tuple[list[tuple[float, int, str]], int]:
    """[(mtime, size, path)] of the entries, and their total size."""
    entries = []
    total = 0
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return [], 0
    for name in names:
        if not name.endswith(_SUFFIX):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        entries.append((st.st_mtime, st.st_size, path))
        total += st.st_size
    return entries, total


def _hostname() -> str:
    return socket.gethostname().replace("/", "_") or "localhost"


def _temp_name() -> str:
    return f"{_TEMP_PREFIX}{_hostname()}-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"


def _temp_is_stale(name: str, mtime: float, now: float) -> bool:
    """True when the temporary file `name` was left by a writer that died (see _TEMP_PREFIX)."""
    if now - mtime > _TEMP_MAX_AGE:
        return True
    parts = name[len(_TEMP_PREFIX):].rsplit("-", 3)
    if len(parts) != 4 or parts[0] != _hostname() or not parts[1].isdigit():
        return False  # another host's writer (or an unknown name): only age tells
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # exists, owned by someone else
    return False


def _temp_files(directory: str) -> list[tuple[str, bool]]:
    """[(path, stale)] of the temporary files in `directory`."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    now = time.time()
    out = []
    for name in names:
        if name.startswith(_TEMP_PREFIX):
            path = os.path.join(directory, name)
            try:
                mtime = os.stat(path).st_mtime
            except FileNotFoundError:
                continue
            out.append((path, _temp_is_stale(name, mtime, now)))
    return out


def _directory_problem(directory: str) -> str:
    """What keeps `directory` from working as a cache, with what to do; "" when nothing does."""
    fix = "set TORCH_TPU_CACHE_DIR to a writable folder (or TORCH_TPU_CACHE=0 to turn the cache off)"
    if not os.path.exists(directory):
        parent = os.path.dirname(directory.rstrip(os.sep)) or os.sep
        while not os.path.exists(parent) and os.path.dirname(parent) != parent:
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            return f"{directory} cannot be created: {parent} is not a directory; remove it or {fix}"
        return ""  # created on first use
    if not os.path.isdir(directory):
        return f"{directory} is not a directory (a file is in its place): remove that file or {fix}"
    if not os.access(directory, os.R_OK | os.X_OK):
        return f"{directory} cannot be read (permission denied): fix its permissions or {fix}"
    if not os.access(directory, os.W_OK):
        return (f"{directory} is not writable (read-only): entries are read but not written, evicted or removed; "
                f"fix its permissions or {fix}")
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    if st.f_bavail * st.f_frsize < _HEADER.size + 4096:
        return (f"the file system of {directory} is full ({st.f_bavail * st.f_frsize} bytes free): new programs "
                f"are not stored; free space (python -m torch_tpu.compile_cache prune --max-bytes SIZE) or {fix}")
    return ""


class DiskCache:
    """JAX's CacheInterface (get/put of bytes by key) over a directory of checksummed entry files."""

    def __init__(self, directory: str, cap: int) -> None:
        self.directory = directory
        self._path = directory  # JAX reads this attribute for logging
        self.cap = cap
        self.salt = _versions()
        self.counters = _Counters()
        self._lock = threading.Lock()
        self._tls = threading.local()
        # The directory's size as last scanned plus what this process wrote since: eviction scans the directory
        # only when this passes the cap (or every _RESCAN writes, to see other processes' writes).
        self._approx_bytes: int | None = None
        self._writes_since_scan = 0
        # Why this process stopped writing entries (the directory became unwritable or full), or None.
        self.write_problem: str | None = None
        os.makedirs(directory, exist_ok=True)

    def _file(self, key: str, prefix: str = "") -> tuple[str, bytes]:
        """The entry's path and its full key (stored in the entry; the file name is its hash)."""
        full = f"{key}|{self.salt}".encode()
        return os.path.join(self.directory, prefix + hashlib.sha256(full).hexdigest() + _SUFFIX), full

    # -- JAX's interface --
    def get(self, key: str) -> bytes | None:
        if getattr(self._tls, "elsewhere", 0):
            # torch_tpu is about to serialize this program itself: it must be freshly compiled, because
            # re-serializing a deserialized XLA:CPU executable loses its kernels ("Function ... not found").
            with self._lock:
                self.counters.misses += 1
            return None
        return self._get(*self._file(key), count=True)

    def _miss(self, count: bool) -> None:
        if count:
            with self._lock:
                self.counters.misses += 1

    def _get(self, path: str, key: bytes, count: bool) -> bytes | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):
            self._miss(count)
            return None
        except OSError as e:
            self._discard(path, f"unreadable ({e})", count)
            return None
        if data[:len(_MAGIC)] in _OLD_MAGICS:  # written by an older torch_tpu: a miss, replaced below
            with contextlib.suppress(OSError):
                os.unlink(path)
            self._miss(count)
            return None
        problem = _check(data, key=key)
        if problem is not None:
            self._discard(path, problem, count)
            return None
        try:
            os.utime(path)  # least recently used = oldest modification time
        except OSError:
            pass
        if count:
            seconds = _HEADER.unpack_from(data)[3]
            with self._lock:
                self.counters.hits += 1
                self.counters.saved += seconds
            from torch_tpu import _metrics

            _metrics.cache_hit()
        return data[_HEADER.size + len(key):]

    def put(self, key: str, value: bytes) -> None:
        if getattr(self._tls, "elsewhere", 0):
            return
        self._put(*self._file(key), value, count=True)

    def _put(self, path: str, key: bytes, value: bytes, count: bool, compile_seconds: float = 0.0) -> None:
        if self.write_problem is not None or os.path.exists(path):
            return
        size = _HEADER.size + len(key) + len(value)
        if size > self.cap:
            warnings.warn(
                f"torch_tpu compile cache: an entry of {size} bytes exceeds TORCH_TPU_CACHE_MAX_BYTES="
                f"{self.cap}; not cached. Raise the cap to keep it.",
                CompileCacheWarning,
                stacklevel=2,
            )
            return
        digest = hashlib.sha256(key)
        digest.update(value)
        header = _HEADER.pack(_MAGIC, digest.digest(), len(value), compile_seconds, len(key))
        tmp = os.path.join(self.directory, _temp_name())
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(key)
                f.write(value)
            os.replace(tmp, path)  # atomic: other processes see the whole entry or none
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._stop_writing(e)
            return
        if count:
            with self._lock:
                self.counters.writes += 1
            if not compile_seconds:
                self._tls.last_written = path
        with self._lock:
            if self._approx_bytes is not None:
                self._approx_bytes += size
            self._writes_since_scan += 1
            scan = (self._approx_bytes is None or self._approx_bytes > self.cap
                    or self._writes_since_scan >= _RESCAN)
        if scan:
            try:
                self.evict()
            except OSError as e:
                self._stop_writing(e)

    def _stop_writing(self, e: OSError) -> None:
        """The directory cannot take new entries (read-only, full, removed): one warning, then this process
        compiles without storing (entries already there are still read)."""
        with self._lock:
            if self.write_problem is not None:
                return
            why = "its file system is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else str(e)
            self.write_problem = f"cannot write to {self.directory}: {why}"
        warnings.warn(
            f"torch_tpu compile cache: {self.write_problem}. This process goes on compiling without storing new "
            "programs (stored ones are still used). Free space (python -m torch_tpu.compile_cache prune), fix the "
            "folder, or set TORCH_TPU_CACHE_DIR to a writable folder (TORCH_TPU_CACHE=0 turns the cache off).",
            CompileCacheWarning,
            stacklevel=3,
        )

    def clear(self) -> None:
        clear(self.directory)

    # -- torch_tpu's additions --
    def note_compile_seconds(self, seconds: float) -> None:
        """Records how long the entry this thread just wrote took to compile (JAX reports the time after
        writing it): what a later hit saves."""
        path = getattr(self._tls, "last_written", None)
        if path is None:
            return
        self._tls.last_written = None
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError:
            return
        try:
            os.pwrite(fd, struct.pack("<d", float(seconds)), _COMPILE_SECONDS_OFFSET)
        finally:
            os.close(fd)

    def _discard(self, path: str, problem: str, count: bool = True) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        with self._lock:
            self.counters.corrupt += 1
            if count:
                self.counters.misses += 1  # nothing usable was found: the program is compiled
        warnings.warn(
            f"torch_tpu compile cache: entry {os.path.basename(path)} in {self.directory} is {problem}; it was "
            "discarded and the program is compiled again.",
            CompileCacheWarning,
            stacklevel=2,
        )

    def evict(self, cap: int | None = None) -> int:
        """Deletes least-recently-used entries until the cache fits `cap` (default: its cap); returns how many."""
        cap = self.cap if cap is None else cap
        n, remaining = _evict(self.directory, cap)
        with self._lock:
            self.counters.evictions += n
            self._approx_bytes = remaining
            self._writes_since_scan = 0
        return n


def _check(data: bytes, key: bytes | None = None, name: str | None = None) -> str | None:
    """None when `data` is a whole, intact entry stored under `key` (when given) or under a key whose hash is in
    the file name `name` (when given); else what is wrong with it."""
    if data[:len(_MAGIC)] in _OLD_MAGICS:
        return "of an older torch_tpu format (no key)"
    if len(data) < _HEADER.size:
        return f"truncated ({len(data)} bytes, shorter than its header)"
    magic, digest, length, _, key_length = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        return "not a torch_tpu cache entry (bad magic)"
    if len(data) - _HEADER.size != key_length + length:
        return f"truncated ({len(data) - _HEADER.size} of {key_length + length} key and payload bytes)"
    if hashlib.sha256(memoryview(data)[_HEADER.size:]).digest() != digest:
        return "corrupt (checksum mismatch)"
    stored = memoryview(data)[_HEADER.size:_HEADER.size + key_length]
    if key is not None and stored != key:
        return "another entry's (its stored key differs: copied or moved under this name)"
    if name is not None and not name.endswith(hashlib.sha256(stored).hexdigest() + _SUFFIX):
        return "another entry's (its stored key does not hash to its name: copied or moved under this name)"
    return None


_RESCAN = 256


def _evict(directory: str, cap: int) -> tuple[int, int]:
    """Deletes least-recently-used entries until `directory` fits `cap`: (entries deleted, bytes left)."""
    entries, total = _disk_usage(directory)
    if total <= cap:
        return 0, total
    removed = 0
    lock_path = os.path.join(directory, ".evict.lock")
    with open(lock_path, "a") as lock:  # OSError (read-only directory): the caller reports it
        fcntl.flock(lock, fcntl.LOCK_EX)  # one evicting process at a time; readers never lock
        try:
            entries, total = _disk_usage(directory)
            for _, size, path in sorted(entries):
                if total <= cap:
                    break
                try:
                    os.unlink(path)
                    removed += 1
                except FileNotFoundError:
                    pass
                total -= size
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return removed, total


_cache: DiskCache | None = None

_CONFIG_SKIP = ("jax_compilation_cache_dir", "jax_persistent_cache", "jax_enable_compilation_cache",
                "jax_compilation_cache_max_size", "jax_raise_persistent_cache_errors", "jax_explain_cache_misses")


def _config_text() -> str:
    """What JAX's key covers for its own entries and torch_tpu's entries must cover too: JAX's configuration
    (x64, default matmul precision, ...) and XLA's flags."""
    return _configuration()[0]


def _config_hash() -> str:
    """_config_text()'s sha256 (keys hold it instead of the ~5 KB text)."""
    return _configuration()[1]


def _configuration() -> tuple[str, str]:
    import jax

    from torch_tpu import _config

    values = jax.config.values
    # TORCH_TPU_PALLAS picks a kernel's path while a program is traced (kernels/pallas/_select.py): a fused
    # program stored under one setting must not be found under another.
    outside = (os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
               _config.get("TORCH_TPU_PALLAS"))
    memo = _CONFIG_MEMO
    if memo and memo[0] == values and memo[1] == outside:  # (a warm start asks once per entry it loads)
        return memo[2]
    items = sorted((k, repr(v)) for k, v in values.items() if not k.startswith(_CONFIG_SKIP))
    text = repr((items, *outside))
    result = (text, hashlib.sha256(text.encode()).hexdigest())
    memo[:] = [values, outside, result]
    return result


_CONFIG_MEMO: list = []  # [JAX's configuration values, the settings outside it, (_config_text(), its hash)]

_SOURCE_HASH: list[str] = []


def _source_hash() -> str:
    """A hash of torch_tpu's Python sources: op shapes and fused programs are keyed by the structure of Python
    calls, so a changed kernel must not find the entries of the old one (a version bump is not enough while
    developing). JAX's own entries are keyed by the program itself and need no such thing."""
    if not _SOURCE_HASH:
        import torch_tpu

        h = hashlib.sha256()
        for root, inside in torch_tpu._SOURCE_FOLDERS:  # the package, and in the source tree its components
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for name in sorted(filenames):
                    if name.endswith(".py"):
                        path = os.path.join(dirpath, name)
                        h.update(os.path.join(inside, os.path.relpath(path, root)).encode())
                        with open(path, "rb") as f:
                            h.update(f.read())
        _SOURCE_HASH.append(h.hexdigest())
    return _SOURCE_HASH[0]


def _meta_file(kind: str, text: str) -> tuple[str, bytes] | tuple[None, None]:
    if _cache is None:
        return None, None
    # The configuration enters the key as a hash: the key is stored in every entry, the configuration is ~5 KB.
    config = _config_hash()
    return _cache._file(f"{kind}|{text}|config={config}|source={_source_hash()}", prefix=kind[0] + "-")


def get_meta(kind: str, text: str) -> Any:
    """A Python value torch_tpu stored under (kind, text) in an earlier process, or None."""
    path, key = _meta_file(kind, text)
    if path is None:
        return None
    data = _cache._get(path, key, count=False)
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - a damaged entry that passed the checksum: discard, recompute
        _cache._discard(path, f"unreadable ({type(e).__name__}: {e})", count=False)
        return None


def put_meta(kind: str, text: str, value: Any) -> None:
    path, key = _meta_file(kind, text)
    if path is not None:
        _cache._put(path, key, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), count=False)


@contextlib.contextmanager
def storing_elsewhere():
    """JAX's compile inside this block neither reads nor writes the cache: torch_tpu stores the program itself,
    and only a freshly compiled executable serializes whole."""
    if _cache is None:
        yield
        return
    tls = _cache._tls
    tls.elsewhere = getattr(tls, "elsewhere", 0) + 1
    try:
        yield
    finally:
        tls.elsewhere -= 1


def load_executable(text: str, device: Any) -> Any:
    """The compiled program stored under `text` by store_executable in an earlier process, loaded onto
    `device` (the one it was compiled for), or None."""
    path, key = _meta_file("graph", text)
    if path is None:
        return None
    data = _cache._get(path, key, count=False)  # a miss is counted by the compile that follows (JAX's lookup)
    if data is None:
        return None
    try:
        from jax.experimental import serialize_executable

        program = serialize_executable.deserialize_and_load(*pickle.loads(data), execution_devices=[device])
    except Exception as e:  # noqa: BLE001 - e.g. written by an incompatible runtime: recompile
        _cache._discard(path, f"not loadable ({type(e).__name__}: {e})", count=False)
        return None
    try:
        with open(path, "rb") as f:
            seconds = _HEADER.unpack(f.read(_HEADER.size))[3]
    except (OSError, struct.error):  # removed or replaced meanwhile by another process
        seconds = 0.0
    with _cache._lock:
        _cache.counters.hits += 1
        _cache.counters.saved += seconds
    from torch_tpu import _metrics

    _metrics.cache_hit()
    return program


def discard_executable(text: str, problem: str) -> None:
    """Deletes the program stored under `text` (it loaded but cannot run), with a CompileCacheWarning."""
    path, _ = _meta_file("graph", text)
    if path is not None:
        with _cache._lock:
            _cache.counters.hits -= 1  # counted when it loaded: it was no use
        _cache._discard(path, problem)


def store_executable(text: str, compiled: Any, warn: bool = True) -> None:
    path, key = _meta_file("graph", text)
    if path is None:
        return
    from jax.experimental import serialize_executable

    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - a program the runtime cannot serialize: keep it in memory only
        if not warn:
            return
        warnings.warn(f"torch_tpu compile cache: could not serialize a fused program ({e}); it is not cached.",
                      CompileCacheWarning, stacklevel=2)
        return
    _cache._put(path, key, blob, count=True, compile_seconds=getattr(_cache._tls, "last_compile_seconds", 0.0))


# ---- whole programs of an executor (DEFER_AND_FUSE's fused graphs) ----

def _program_text(structure: str, device: Any, inputs: list[Any]) -> str:
    """The key of a whole program: the executor's structural key, plus what the executable is specific to (its
    inputs' types, shapes and dtypes, and the device it was compiled for)."""
    import jax

    specs = [(type(a).__name__, tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", ""))) for a in inputs]
    return repr((structure, specs, device.platform, device.device_kind, device.id, jax.process_count()))


def load_program(structure: str, device: Any, inputs: list[Any]) -> Any:
    """The program an earlier process compiled (`compile_program`) for the executor's structural key
    `structure` (a text meaning the same in every process) and these `inputs`, loaded onto `device`, or None.
    On XLA:CPU a loaded program is run once on zeros shaped like `inputs` first (see `_runs`)."""
    text = _program_text(structure, device, inputs)
    program = load_executable(text, device)
    if program is None:
        return None
    from torch_tpu import _programs

    _programs.note_loaded()  # it holds mappings as a compiled one does (XLA:CPU): the collector counts it
    if device.platform == "cpu" and not _runs(program, inputs, text):
        return None
    return program


def compile_program(structure: str, device: Any, jitted: Any, inputs: list[Any], statics: tuple = ()) -> Any:
    """Compiles the jitted function `jitted` for `inputs` (after its static leading arguments `statics`, which the
    executable then no longer takes: `structure` must name them) outside JAX's cache and stores the executable
    whole under (`structure`, inputs, device), for `load_program` in later processes; returns the executable."""
    with storing_elsewhere():  # stored below as a whole program: JAX's copy would be a duplicate
        compiled = jitted.lower(*statics, *inputs).compile()
    store_executable(_program_text(structure, device, inputs), compiled)
    return compiled


def _runs(program: Any, inputs: list[Any], text: str) -> bool:
    """XLA:CPU only: runs a program loaded from disk once on zeros shaped like `inputs` (the real inputs may be
    donated). An XLA:CPU executable that was itself deserialized before it was serialized lacks its kernels
    ("Function ... not found"), which only shows when it runs; storing_elsewhere() prevents writing such
    entries, and this catches any that still exist. A program that fails is dropped from the cache."""
    import jax
    import numpy as np

    try:
        # numpy zeros placed on the device: no program of its own to compile
        dry = [jax.device_put(np.zeros(a.shape, a.dtype), next(iter(a.devices()))) if hasattr(a, "devices")
               else a for a in inputs]
        jax.block_until_ready(program(*dry))
        return True
    except Exception as e:  # noqa: BLE001 - any failure: recompile instead
        discard_executable(text, f"not runnable ({type(e).__name__}: {str(e)[:200]})")
        return False


# ---- eager ops' executables, per shape (a warm DEFER_NEVER start skips tracing and lowering) ----

def _leaf_spec(leaf: Any) -> tuple | None:
    """What an executable is specific to in one argument: an array's shape, dtype and weak type, a Python
    scalar's type (a weak-typed constant of the program); None for anything else (not persisted)."""
    import jax

    if isinstance(leaf, jax.core.Tracer):
        return None
    if isinstance(leaf, jax.Array):
        return (tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)))
    if type(leaf) in (bool, int, float, complex):
        return (type(leaf).__name__,)
    return None


def _call_text(structure: str, args: tuple, device: Any) -> tuple[str, Any] | None:
    """(the key of the executable `structure` compiles for these arguments, their device), or None when they
    cannot be keyed (an argument of another kind, no array to say the device and no `device` given)."""
    import jax
    import torch

    leaves, treedef = jax.tree_util.tree_flatten(args)
    specs = []
    where = None  # the first array's device
    for leaf in leaves:
        spec = _leaf_spec(leaf)
        if spec is None:
            return None
        specs.append(spec)
        if where is None and len(spec) == 3:
            devices = leaf.devices()
            if len(devices) != 1:
                return None
            where = next(iter(devices))
    if where is None:
        where = device
    if where is None or (device is not None and where != device):
        return None
    # torch's default dtype: a lowering may read it while it is traced (a Python scalar's dtype)
    text = repr((structure, str(treedef), specs, str(torch.get_default_dtype()), where.platform,
                 where.device_kind, where.id, jax.process_count()))
    return text, where


def persistent_jit(fun: Callable[..., Any], structure: str, device: Any = None, **jit_kwargs: Any) -> Any:
    """`jax.jit(fun)`, whose executable for each new argument shape is loaded whole from the cache when an
    earlier process stored it (no tracing, no lowering: what a warm eager start spends most on) and otherwise
    compiled and stored. `structure` is a text that names `fun` completely in every process (the op, its entry's
    key and the arguments baked into it); the arguments' shapes, dtypes, weak types and device are added per
    call. After the first call of a shape, calls take jax.jit's own C++ path: the executable is handed to it as
    jax.jit's own cache miss would. `device`: where the program runs when no argument is an array (then also
    its `out_shardings`). Without a cache, plain `jax.jit(fun, **jit_kwargs)`."""
    import jax

    jitted = jax.jit(fun, **jit_kwargs)
    if _cache is None or " at 0x" in structure:  # (an object without a stable text: not keyable)
        return jitted
    import jax.monitoring
    from jax._src import config, core, dispatch, pjit, stages, tree_util
    from jax._src.interpreters import pxla
    from jax._src.lib import _jax

    info = jitted._jit_info
    standard_miss = jitted._cache_miss

    def cache_miss(*args: Any, **kwargs: Any) -> Any:
        # (inside another trace, jax.jit's own path stages the call into it; JAX's NaN/Inf debugging reruns
        # through it)
        clean = (not kwargs and _cache is not None and core.trace_state_clean() and not config.debug_nans.value
                 and not config.debug_infs.value)
        keyed = _call_text(structure, args, device) if clean else None
        if keyed is None:
            return standard_miss(*args, **kwargs)
        text, where = keyed
        started = time.perf_counter()
        program = load_executable(text, where)
        if program is not None and where.platform == "cpu" and not _runs_tree(program, args, text):
            program = None
        if program is not None:
            # JAX's own cache reports a hit as a compile event too: torch_tpu's metrics, recompilation warnings,
            # the doctor and the program collector count it (a new shape at a call site is one, warm or cold)
            jax.monitoring.record_event_duration_secs(dispatch.BACKEND_COMPILE_EVENT, time.perf_counter() - started)
        if program is None:
            with storing_elsewhere():  # stored below whole: JAX's copy would be a duplicate
                program = jitted.lower(*args).compile()
            store_executable(text, program, warn=False)  # (one that cannot be serialized is compiled each time)
        params = program._params
        outs, out_flat, args_flat = stages.Compiled.call(params, *args)
        fastpath = pjit._get_fastpath_data(program._executable, params.out_tree, args_flat, out_flat, [], [], None,
                                           params.const_args)
        return outs, fastpath, False

    # jax.jit's own construction (jax/_src/pjit.py _cpp_pjit) with the cache miss above
    cache_key = pxla.JitGlobalCppCacheKeys(
        donate_argnums=info.donate_argnums, donate_argnames=info.donate_argnames, device=info.device,
        backend=info.backend, in_shardings_treedef=info.in_shardings_treedef,
        in_shardings_leaves=info.in_shardings_leaves, out_shardings_treedef=info.out_shardings_treedef,
        out_shardings_leaves=info.out_shardings_leaves, in_layouts_treedef=info.in_layouts_treedef,
        in_layouts_leaves=info.in_layouts_leaves, out_layouts_treedef=info.out_layouts_treedef,
        out_layouts_leaves=info.out_layouts_leaves, compiler_options_kvs=info.compiler_options_kvs)
    f = _jax.pjit(pjit.fun_name(fun), fun, cache_miss, info.static_argnums, info.static_argnames, cache_key,
                  tree_util.dispatch_registry, pxla.cc_shard_arg,
                  pjit._get_cpp_global_cache(cache_key.contains_explicit_attributes))
    f = functools.wraps(fun)(f)
    f._fun = fun
    f._jit_info = info
    return f


def _runs_tree(program: Any, args: tuple, text: str) -> bool:
    """_runs for a program whose arguments may be lists of arrays and Python scalars."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(args)
    return _runs(lambda *flat: program(*jax.tree_util.tree_unflatten(treedef, list(flat))), leaves, text)


def install() -> DiskCache | None:
    """Makes JAX's persistent compilation cache store through a DiskCache (called when the runtime starts).
    Does nothing when TORCH_TPU_CACHE=0."""
    global _cache
    if not enabled():
        return None
    if _cache is not None:
        return _cache
    import jax
    from jax._src import compilation_cache as jcc

    directory = cache_dir()
    try:
        cache = DiskCache(directory, max_bytes())
    except OSError as e:
        warnings.warn(
            f"torch_tpu compile cache: cannot use {directory} ({e}); compiling without a persistent cache. "
            "Set TORCH_TPU_CACHE_DIR to a writable folder, or TORCH_TPU_CACHE=0.",
            CompileCacheWarning,
            stacklevel=2,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    # With the persistent cache on, JAX also points XLA's GPU autotune cache into this folder through the compile
    # options, which are part of every entry's key: a cache copied or mounted at another path (a CI cache, a
    # container image) would then miss every executable. Those caches are GPU-only; a user's explicit setting wins.
    if "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ:
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    # Cache every executable: torch_tpu's per-op programs compile in milliseconds each, but there are many.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jcc.reset_cache()
    jcc._cache = cache
    jcc._cache_initialized = True
    _cache = cache
    _listen_compile_seconds(cache)
    return cache


def _listen_compile_seconds(cache: DiskCache) -> None:
    import jax.monitoring
    from jax._src import dispatch

    event_name = dispatch.BACKEND_COMPILE_EVENT

    def on_duration(event: str, duration: float, **kwargs: Any) -> None:
        if event == event_name:
            cache._tls.last_compile_seconds = duration
            cache.note_compile_seconds(duration)

    jax.monitoring.register_event_duration_secs_listener(on_duration)


def stats(directory: str | None = None) -> CacheStats:
    """Counters of this process's cache, and what is on disk now. Never raises for the directory's state:
    `problem` says what is wrong with it (not a folder, not writable, full) and what to do."""
    d = directory or (_cache.directory if _cache is not None else cache_dir())
    entries, total = _disk_usage(d)
    temps = _temp_files(d)
    ours = _cache is not None and _cache.directory == d
    c = _cache.counters if ours else _Counters()
    problem = _directory_problem(d)
    if not problem and ours and _cache.write_problem:
        problem = f"this process stopped storing new programs: {_cache.write_problem}"
    return CacheStats(
        directory=d, enabled=enabled(), hits=c.hits, misses=c.misses, writes=c.writes, corrupt=c.corrupt,
        evictions=c.evictions, entries=len(entries), bytes=total,
        max_bytes=_cache.cap if _cache is not None else max_bytes(),
        compile_seconds_saved=round(c.saved, 6), temp_files=len(temps),
        stale_temp_files=sum(stale for _, stale in temps), problem=problem,
    )


def _listable(d: str) -> bool:
    """False when there is no cache at `d`; raises CompileCacheError when `d` is not a usable folder."""
    if not os.path.lexists(d):
        return False
    if not os.path.isdir(d):
        raise CompileCacheError(_directory_problem(d) or f"{d} is not a directory")
    return True


def _remove(paths: list[str], d: str) -> int:
    """Removes `paths`; returns how many. Raises CompileCacheError naming what could not be removed."""
    n = 0
    failed: list[OSError] = []
    for path in paths:
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
        except OSError as e:
            failed.append(e)
    if failed:
        raise CompileCacheError(
            f"could not remove {len(failed)} of {len(paths)} files in {d} ({failed[0].strerror}: "
            f"{failed[0].filename}); {n} removed. "
            + (_directory_problem(d) or "Check the folder's permissions and file system.")
        )
    return n


def clear(directory: str | None = None) -> int:
    """Deletes every entry, and temporary files left by writers that died; returns how many entries.
    Raises CompileCacheError when the directory is not a folder or files cannot be removed."""
    d = directory or cache_dir()
    if not _listable(d):
        return 0
    entries, _ = _disk_usage(d)
    n = _remove([path for _, _, path in entries], d)
    _remove([path for path, stale in _temp_files(d) if stale], d)
    return n


def prune(directory: str | None = None, cap: int | None = None) -> tuple[int, int]:
    """Deletes damaged entries (corrupt, truncated, of an older format, or under another entry's name),
    temporary files left by writers that died, and least-recently-used entries above `cap`.
    Returns (files removed as damaged or stale, entries evicted). Raises CompileCacheError when the directory
    is not a folder or files cannot be removed."""
    d = directory or cache_dir()
    if not _listable(d):
        return 0, 0
    damaged = [path for path, stale in _temp_files(d) if stale]
    for _, _, path in _disk_usage(d)[0]:
        try:
            with open(path, "rb") as f:
                if _check(f.read(), name=os.path.basename(path)) is not None:
                    damaged.append(path)
        except FileNotFoundError:
            pass
        except OSError:
            damaged.append(path)  # unreadable
    n = _remove(damaged, d)
    try:
        evicted = _evict(d, max_bytes() if cap is None else cap)[0]
    except OSError as e:
        raise CompileCacheError(
            f"could not evict entries in {d} ({e}). "
            + (_directory_problem(d) or "Check the folder's permissions and file system.")
        ) from None
    return n, evicted
