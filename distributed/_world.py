"""The process-wide side of tpu_dist: JAX's multi-controller runtime (`jax.distributed`) and the device
each rank computes on.

JAX's distributed client must start before JAX creates a backend, and torch_tpu creates its backend (the
PJRT client) lazily on the first tpu use. So the default group's creation starts `jax.distributed` first and
then the tpu runtime. Under torchrun the runtime's start joins the world itself (`join_launcher_world`), so a
first tpu use may come before init_process_group; both paths use the same keys of torchrun's store, so the ranks
meet whichever each takes. Elsewhere a runtime that already started is a clear error telling the user to call
`init_process_group` first. Before JAX's client starts, the ranks check in through the store (`_rendezvous`), so a
rank that never comes is a Python error within the timeout instead of JAX aborting the process. JAX cannot re-initialise its distributed client in one process: a new default
group after `destroy_process_group` reuses it, which works for the same world (size and rank) and is an
error otherwise.

One process per device: rank r computes on `tpu:LOCAL_RANK` of process r (tpu:0 when the process sees fewer
devices). On XLA:CPU each process gets LOCAL_WORLD_SIZE virtual devices so `torch.tpu.set_device(local_rank)`
works as on a host with that many chips, and collectives run over gloo.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from datetime import timedelta
from typing import Any

import numpy as np

from torch_tpu import _config

_lock = threading.RLock()


@dataclasses.dataclass
class World:
    rank: int
    size: int
    local_index: int  # this rank's tpu device index
    device_ids: list[int]  # global JAX device id of each rank's device
    jax_distributed: bool  # False for a one-process world (nothing to coordinate)


_world: World | None = None
_jax_dist: tuple[int, int] | None = None  # (size, rank) jax.distributed was initialised with


def world() -> World:
    if _world is None:
        raise RuntimeError(
            "tpu_dist: no default process group: call torch.distributed.init_process_group(backend='tpu_dist') "
            "first."
        )
    return _world


def _seconds(timeout: timedelta | float | None, default: float = 1800.0) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        return max(timeout.total_seconds(), 1.0)
    return max(float(timeout), 1.0)


def _coordinator_host() -> str:
    host = os.environ.get("MASTER_ADDR")
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _rendezvous(store: Any, rank: int, size: int, timeout_s: float) -> None:
    """Every rank checks in through the c10d store, with its world size, before any of them starts JAX's
    distributed client: a rank that never comes or a different world is then a Python error within the timeout
    (JAX's client would abort the process with SIGABRT when its connection times out)."""
    from datetime import timedelta

    store.set(f"tpu_dist/arrived/{rank}", str(size))
    keys = [f"tpu_dist/arrived/{r}" for r in range(size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - c10d raises DistStoreError or RuntimeError
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(
            f"tpu_dist: rank {rank} of {size} waited {timeout_s:.0f} s for the other ranks to join the tpu world, "
            f"but rank(s) {missing} never came (they did not call init_process_group, died, or use another store "
            f"or world size). Start every rank with the same WORLD_SIZE and call init_process_group on each; raise "
            f"init_process_group(timeout=...) if they are just slow. ({e})"
        ) from e
    sizes = {r: int(store.get(k).decode()) for r, k in enumerate(keys)}
    other = {r: n for r, n in sizes.items() if n != size}
    if other:
        raise RuntimeError(
            f"tpu_dist: rank {rank} joins a world of {size} ranks, but rank(s) {sorted(other)} joined with world "
            f"size(s) {sorted(set(other.values()))}. Start every rank with the same WORLD_SIZE."
        )


def _start_jax_distributed(store: Any, rank: int, size: int, timeout_s: float) -> None:
    """Initialises jax.distributed for this world (rank 0 hosts the coordinator; its address goes through
    the c10d store), then starts the tpu runtime."""
    global _jax_dist
    from torch_tpu import _C, _runtime

    if _jax_dist is not None:
        if _jax_dist != (size, rank):
            raise RuntimeError(
                f"tpu_dist: this process already joined a JAX distributed world as rank {_jax_dist[1]} of "
                f"{_jax_dist[0]}, and JAX cannot re-initialise its distributed client in one process; a new "
                f"default group must have the same world (rank {_jax_dist[1]} of {_jax_dist[0]}), not rank "
                f"{rank} of {size}. Start a new process for a different world."
            )
        return
    if _C._runtime_started():
        raise RuntimeError(
            "tpu_dist: the tpu runtime already started in this process (a tpu tensor was created, or "
            "torch.tpu.set_device/device_count was called) before torch.distributed.init_process_group("
            "backend='tpu_dist'). JAX's distributed client must start before the runtime: call "
            "init_process_group first, then torch.tpu.set_device(local_rank) and create tpu tensors."
        )
    _rendezvous(store, rank, size, timeout_s)
    _runtime.configure_jax()
    import jax

    # XLA:CPU runs cross-process collectives over gloo; the setting only affects the CPU backend.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not _config.get("TORCH_TPU_NUM_DEVICES"):
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        if local_world > 1:
            jax.config.update("jax_num_cpu_devices", local_world)
    key = "tpu_dist/jax_coordinator"
    if rank == 0:
        store.set(key, f"{_coordinator_host()}:{_free_port()}")
    address = store.get(key).decode()
    t = int(timeout_s)
    jax.distributed.initialize(
        coordinator_address=address, num_processes=size, process_id=rank,
        initialization_timeout=max(t, 10), heartbeat_timeout_seconds=max(min(t, 100), 10),
        shutdown_timeout_seconds=max(min(t, 300), 10),
    )
    _jax_dist = (size, rank)


def _launcher_world() -> tuple[int, int, str, int, str] | None:
    """(size, rank, host, port, key prefix) when torchrun started this process (its agent hosts the c10d store at
    MASTER_ADDR:MASTER_PORT for every worker) with WORLD_SIZE > 1, unless TORCH_TPU_DIST_EARLY_INIT=0."""
    env = os.environ
    if not _config.get("TORCH_TPU_DIST_EARLY_INIT") or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        size, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    if size <= 1:
        return None
    # One key space per torchrun attempt: a restarted worker group must not read a stale coordinator address.
    prefix = f"tpu_dist_early/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return size, rank, host, port, prefix


def _join_through_launcher(launcher: tuple[int, int, str, int, str], timeout_s: float, first_use: bool) -> None:
    size, rank, host, port, prefix = launcher
    import torch.distributed as dist

    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        with _lock:
            _start_jax_distributed(dist.PrefixStore(prefix, store), rank, size, timeout_s)
    except Exception as e:
        hint = (" If this script does not use torch.distributed with tpu tensors, set TORCH_TPU_DIST_EARLY_INIT=0."
                if first_use else "")
        when = "The first tpu use" if first_use else "init_process_group"
        raise RuntimeError(
            f"torch_tpu: {when} under torchrun (rank {rank} of {size}) joins JAX's distributed world through "
            f"torchrun's store at {host}:{port}, and that failed: {e}{hint}"
        ) from e


def join_launcher_world() -> None:
    """Called by the tpu runtime just before it starts. Under torchrun (see `_launcher_world`) joins JAX's
    distributed world now, so the first tpu use may precede init_process_group (torch.tpu.set_device(local_rank),
    device_id=...). Elsewhere nothing happens and init_process_group must come first.

    Every rank of a torchrun world joins through the same store keys, whether its first tpu use or its
    init_process_group comes first (`init_world`): set_device(0) does not start the runtime, so with the user
    guide's order rank 0 joins in init_process_group while the others join at set_device."""
    launcher = _launcher_world()
    if _jax_dist is not None or launcher is None:
        return
    _join_through_launcher(launcher, 300.0, first_use=True)


def init_world(store: Any, rank: int, size: int, timeout: timedelta | None) -> World:
    """Called when the default group is created: joins the JAX world and agrees on each rank's device."""
    global _world
    with _lock:
        timeout_s = _seconds(timeout)
        multi = size > 1
        if multi:
            launcher = _launcher_world()
            if _jax_dist is None and launcher is not None and launcher[:2] == (size, rank):
                _join_through_launcher(launcher, timeout_s, first_use=False)  # the keys an early join uses
            else:
                _start_jax_distributed(store, rank, size, timeout_s)
        from torch_tpu import _runtime

        local = _runtime.devices()
        want = os.environ.get("LOCAL_RANK")
        index = int(want) if want and int(want) < len(local) else 0
        store.set(f"tpu_dist/device/{rank}", str(local[index].id))
        ids = [int(store.get(f"tpu_dist/device/{r}").decode()) for r in range(size)]
        _world = World(rank=rank, size=size, local_index=index, device_ids=ids, jax_distributed=multi)
        _meshes.clear()
        return _world


def forget_world() -> None:
    """The default group was destroyed (jax.distributed stays up for a new group over the same world)."""
    global _world
    with _lock:
        _world = None
        _meshes.clear()


_meshes: dict[tuple[int, ...], Any] = {}


def mesh(ranks: tuple[int, ...]) -> Any:
    """A one-axis ("r") JAX mesh over the devices of the given global ranks, in that order."""
    m = _meshes.get(ranks)
    if m is None:
        import jax
        from jax.sharding import Mesh

        w = world()
        by_id = {d.id: d for d in jax.devices()}
        m = Mesh(np.array([by_id[w.device_ids[r]] for r in ranks]), ("r",))
        _meshes[ranks] = m
    return m
