"""The process-wide side of tpu_dist: JAX's multi-controller runtime (`jax.distributed`) and the device
each rank computes on.

JAX's distributed client must start before JAX creates a backend, and torch_tpu creates its backend (the
PJRT client) lazily on the first tpu use. So the default group's creation starts `jax.distributed` first and
then the tpu runtime. Under torchrun the runtime's start joins the world itself (`join_launcher_world`), so a
first tpu use may come before init_process_group; elsewhere a runtime that already started is a clear error
telling the user to call `init_process_group` first. JAX cannot re-initialise its distributed client in one process: a new default
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
    _runtime.configure_jax()
    import jax

    # XLA:CPU runs cross-process collectives over gloo; the setting only affects the CPU backend.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not os.environ.get("TORCH_TPU_NUM_DEVICES"):
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


def join_launcher_world() -> None:
    """Called by the tpu runtime just before it starts. Under torchrun (its agent hosts the c10d store at
    MASTER_ADDR:MASTER_PORT for every worker) with WORLD_SIZE > 1, joins JAX's distributed world now, so the
    first tpu use may precede init_process_group (torch.tpu.set_device(local_rank), device_id=...). Elsewhere
    nothing happens and init_process_group must come first. TORCH_TPU_DIST_EARLY_INIT=0 turns this off."""
    env = os.environ
    if _jax_dist is not None or env.get("TORCH_TPU_DIST_EARLY_INIT", "1") == "0":
        return
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        size, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return
    if size <= 1:
        return
    import torch.distributed as dist

    timeout = timedelta(seconds=300)
    # One key space per torchrun attempt: a restarted worker group must not read a stale coordinator address.
    prefix = f"tpu_dist_early/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        with _lock:
            _start_jax_distributed(dist.PrefixStore(prefix, store), rank, size, timeout.total_seconds())
    except Exception as e:
        raise RuntimeError(
            f"torch_tpu: the first tpu use under torchrun (rank {rank} of {size}) joins JAX's distributed world "
            f"through torchrun's store at {host}:{port}, and that failed: {e}. If this script does not use "
            "torch.distributed with tpu tensors, set TORCH_TPU_DIST_EARLY_INIT=0."
        ) from e


def init_world(store: Any, rank: int, size: int, timeout: timedelta | None) -> World:
    """Called when the default group is created: joins the JAX world and agrees on each rank's device."""
    global _world
    with _lock:
        timeout_s = _seconds(timeout)
        multi = size > 1
        if multi:
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
