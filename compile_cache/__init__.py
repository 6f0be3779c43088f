"""torch_tpu.compile_cache: the persistent on-disk cache of compiled XLA executables, safe across processes.

On by default, in `$TORCH_TPU_CACHE_DIR` or else `$XDG_CACHE_HOME/torch_tpu/xla` (`~/.cache/torch_tpu/xla`);
`TORCH_TPU_CACHE=0` turns it off; `TORCH_TPU_CACHE_MAX_BYTES` caps its size (default 4 GiB; suffixes K, M, G).

It plugs into JAX's own persistent compilation cache: JAX computes the key (the StableHLO program, compile
options, XLA flags, jax/jaxlib versions, platform version and the devices' kind) and serialises the
executable; `DiskCache` is the storage JAX writes through, adding what JAX's file cache lacks:
- the torch_tpu, jax, jaxlib and libtpu versions mixed into the key, so a stale executable is never reused;
- atomic writes (a temporary file renamed into place): readers in other processes never see a torn entry;
- a checksum per entry: a corrupt or truncated entry is deleted, reported (a `CompileCacheWarning`) and
  recompiled, never loaded;
- least-recently-used eviction under a size cap (a hit refreshes an entry's modification time);
- statistics: `torch.tpu.compile_cache.stats()`, and `python -m torch_tpu.compile_cache info|clear|prune`.

torch_tpu also stores, in the same checksummed entries, what lets a warm start skip JAX's tracing and
lowering too: each op's output shapes under DEFER_AND_FUSE (`s-*` entries) and whole fused programs keyed by
their structure (`g-*` entries, serialized with jax.experimental.serialize_executable). Their keys add the
JAX configuration and XLA_FLAGS, which JAX's own key covers for its entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import pickle
import struct
import threading
import time
import warnings
from typing import Any

__all__ = ["CompileCacheWarning", "CacheStats", "DiskCache", "cache_dir", "enabled", "stats", "clear", "prune",
           "install", "max_bytes"]

_MAGIC = b"TTPUXC01"
# magic, sha256 of the payload, payload length, compile seconds of the entry (patched in after the compile)
_HEADER = struct.Struct("<8s32sQd")
_SUFFIX = ".xc"
_COMPILE_SECONDS_OFFSET = 8 + 32 + 8


class CompileCacheWarning(UserWarning):
    """A cache entry could not be used (corrupt, truncated, unreadable): it was discarded and recompiled."""


def enabled() -> bool:
    return os.environ.get("TORCH_TPU_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> str:
    d = os.environ.get("TORCH_TPU_CACHE_DIR")
    if d:
        return os.path.abspath(os.path.expanduser(d))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torch_tpu", "xla")


def max_bytes() -> int:
    raw = os.environ.get("TORCH_TPU_CACHE_MAX_BYTES", "").strip()
    if not raw:
        return 4 << 30
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1].upper(), 1)
    try:
        return int(float(raw[:-1] if mult > 1 else raw) * mult)
    except ValueError:
        raise RuntimeError(f"TORCH_TPU_CACHE_MAX_BYTES={raw!r} is not a size (e.g. 4G, 512M, 1000000)") from None


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
    except FileNotFoundError:
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
        os.makedirs(directory, exist_ok=True)

    def _file(self, key: str, prefix: str = "") -> str:
        digest = hashlib.sha256(f"{key}|{self.salt}".encode()).hexdigest()
        return os.path.join(self.directory, prefix + digest + _SUFFIX)

    # -- JAX's interface --
    def get(self, key: str) -> bytes | None:
        if getattr(self._tls, "elsewhere", 0):
            # torch_tpu is about to serialize this program itself: it must be freshly compiled, because
            # re-serializing a deserialized XLA:CPU executable loses its kernels ("Function ... not found").
            with self._lock:
                self.counters.misses += 1
            return None
        return self._get(self._file(key), count=True)

    def _get(self, path: str, count: bool) -> bytes | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            if count:
                with self._lock:
                    self.counters.misses += 1
            return None
        except OSError as e:
            self._discard(path, f"unreadable ({e})", count)
            return None
        problem = _check(data)
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
        return data[_HEADER.size:]

    def put(self, key: str, value: bytes) -> None:
        if getattr(self._tls, "elsewhere", 0):
            return
        self._put(self._file(key), value, count=True)

    def _put(self, path: str, value: bytes, count: bool, compile_seconds: float = 0.0) -> None:
        if os.path.exists(path):
            return
        if len(value) + _HEADER.size > self.cap:
            warnings.warn(
                f"torch_tpu compile cache: an executable of {len(value)} bytes exceeds TORCH_TPU_CACHE_MAX_BYTES="
                f"{self.cap}; not cached. Raise the cap to keep it.",
                CompileCacheWarning,
                stacklevel=2,
            )
            return
        header = _HEADER.pack(_MAGIC, hashlib.sha256(value).digest(), len(value), compile_seconds)
        tmp = os.path.join(self.directory, f".tmp-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(value)
            os.replace(tmp, path)  # atomic: other processes see the whole entry or none
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            warnings.warn(f"torch_tpu compile cache: could not write {path}: {e}", CompileCacheWarning, stacklevel=2)
            return
        if count:
            with self._lock:
                self.counters.writes += 1
            if not compile_seconds:
                self._tls.last_written = path
        with self._lock:
            if self._approx_bytes is not None:
                self._approx_bytes += len(value) + _HEADER.size
            self._writes_since_scan += 1
            scan = (self._approx_bytes is None or self._approx_bytes > self.cap
                    or self._writes_since_scan >= _RESCAN)
        if scan:
            self.evict()

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
        try:
            os.unlink(path)
        except OSError:
            pass
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


def _check(data: bytes) -> str | None:
    """None when `data` is a whole, intact entry; else what is wrong with it."""
    if len(data) < _HEADER.size:
        return f"truncated ({len(data)} bytes, shorter than its header)"
    magic, digest, length, _ = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        return "not a torch_tpu cache entry (bad magic)"
    if len(data) - _HEADER.size != length:
        return f"truncated ({len(data) - _HEADER.size} of {length} payload bytes)"
    if hashlib.sha256(memoryview(data)[_HEADER.size:]).digest() != digest:
        return "corrupt (checksum mismatch)"
    return None


_RESCAN = 256


def _evict(directory: str, cap: int) -> tuple[int, int]:
    """Deletes least-recently-used entries until `directory` fits `cap`: (entries deleted, bytes left)."""
    entries, total = _disk_usage(directory)
    if total <= cap:
        return 0, total
    removed = 0
    lock_path = os.path.join(directory, ".evict.lock")
    with open(lock_path, "a") as lock:
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
    import jax

    items = sorted((k, repr(v)) for k, v in jax.config.values.items() if not k.startswith(_CONFIG_SKIP))
    return repr((items, os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", "")))


_SOURCE_HASH: list[str] = []


def _source_hash() -> str:
    """A hash of torch_tpu's Python sources: op shapes and fused programs are keyed by the structure of Python
    calls, so a changed kernel must not find the entries of the old one (a version bump is not enough while
    developing). JAX's own entries are keyed by the program itself and need no such thing."""
    if not _SOURCE_HASH:
        import torch_tpu

        root = os.path.dirname(os.path.abspath(torch_tpu.__file__))
        h = hashlib.sha256()
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
        _SOURCE_HASH.append(h.hexdigest())
    return _SOURCE_HASH[0]


def _meta_file(kind: str, text: str) -> str | None:
    if _cache is None:
        return None
    return _cache._file(f"{kind}|{text}|{_config_text()}|{_source_hash()}", prefix=kind[0] + "-")


def get_meta(kind: str, text: str) -> Any:
    """A Python value torch_tpu stored under (kind, text) in an earlier process, or None."""
    path = _meta_file(kind, text)
    if path is None:
        return None
    data = _cache._get(path, count=False)
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - a damaged entry that passed the checksum: discard, recompute
        _cache._discard(path, f"unreadable ({type(e).__name__}: {e})", count=False)
        return None


def put_meta(kind: str, text: str, value: Any) -> None:
    path = _meta_file(kind, text)
    if path is not None:
        _cache._put(path, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), count=False)


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
    path = _meta_file("graph", text)
    if path is None:
        return None
    data = _cache._get(path, count=False)  # a miss is counted by the compile that follows (JAX's lookup)
    if data is None:
        return None
    try:
        from jax.experimental import serialize_executable

        program = serialize_executable.deserialize_and_load(*pickle.loads(data), execution_devices=[device])
    except Exception as e:  # noqa: BLE001 - e.g. written by an incompatible runtime: recompile
        _cache._discard(path, f"not loadable ({type(e).__name__}: {e})", count=False)
        return None
    with open(path, "rb") as f:
        seconds = _HEADER.unpack(f.read(_HEADER.size))[3]
    with _cache._lock:
        _cache.counters.hits += 1
        _cache.counters.saved += seconds
    from torch_tpu import _metrics

    _metrics.cache_hit()
    return program


def discard_executable(text: str, problem: str) -> None:
    """Deletes the program stored under `text` (it loaded but cannot run), with a CompileCacheWarning."""
    path = _meta_file("graph", text)
    if path is not None:
        with _cache._lock:
            _cache.counters.hits -= 1  # counted when it loaded: it was no use
        _cache._discard(path, problem)


def store_executable(text: str, compiled: Any) -> None:
    path = _meta_file("graph", text)
    if path is None:
        return
    from jax.experimental import serialize_executable

    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - a program the runtime cannot serialize: keep it in memory only
        warnings.warn(f"torch_tpu compile cache: could not serialize a fused program ({e}); it is not cached.",
                      CompileCacheWarning, stacklevel=2)
        return
    _cache._put(path, blob, count=True, compile_seconds=getattr(_cache._tls, "last_compile_seconds", 0.0))


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
    """Counters of this process's cache, and what is on disk now."""
    d = directory or (_cache.directory if _cache is not None else cache_dir())
    entries, total = _disk_usage(d)
    c = _cache.counters if _cache is not None and _cache.directory == d else _Counters()
    return CacheStats(
        directory=d, enabled=enabled(), hits=c.hits, misses=c.misses, writes=c.writes, corrupt=c.corrupt,
        evictions=c.evictions, entries=len(entries), bytes=total,
        max_bytes=_cache.cap if _cache is not None else max_bytes(),
        compile_seconds_saved=round(c.saved, 6),
    )


def clear(directory: str | None = None) -> int:
    """Deletes every entry; returns how many."""
    d = directory or cache_dir()
    entries, _ = _disk_usage(d)
    n = 0
    for _, _, path in entries:
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    return n


def prune(directory: str | None = None, cap: int | None = None) -> tuple[int, int]:
    """Deletes corrupt entries, stale temporary files, and least-recently-used entries above `cap`.
    Returns (entries removed as damaged or stale, entries evicted)."""
    d = directory or cache_dir()
    damaged = 0
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return 0, 0
    now = time.time()
    for name in names:
        path = os.path.join(d, name)
        try:
            if name.startswith(".tmp-"):
                if now - os.stat(path).st_mtime > 3600:  # a writer that died mid-write
                    os.unlink(path)
                    damaged += 1
            elif name.endswith(_SUFFIX):
                with open(path, "rb") as f:
                    if _check(f.read()) is not None:
                        os.unlink(path)
                        damaged += 1
        except FileNotFoundError:
            pass
    return damaged, _evict(d, max_bytes() if cap is None else cap)[0]
