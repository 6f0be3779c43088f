"""One process per chip on a multi-chip TPU host: the libtpu variables each torchrun worker needs.

`torchrun --nproc_per_node=N` on a TPU VM with 4 or 8 chips starts N processes on one host. libtpu lets a chip
belong to one process only, so each process must be told, before libtpu starts (before the PJRT client is
created), which chips are its own and where the other processes of the slice listen:

- `TPU_VISIBLE_CHIPS`: this process's chips (`LOCAL_RANK` with one chip per process);
- `TPU_CHIPS_PER_PROCESS_BOUNDS`: the shape of one process's chips (`1,1,1`);
- `TPU_PROCESS_BOUNDS`: the shape of the grid of processes over the whole slice (host grid x per-host grid);
- `TPU_PROCESS_ADDRESSES`: `host:port` of every process, in task order; `TPU_PROCESS_PORT`: this one's port;
- `CLOUD_TPU_TASK_ID`: this process's index in that order (`worker * LOCAL_WORLD_SIZE + LOCAL_RANK`).

These are the values PyTorch/XLA (`torch_xla._internal.tpu.configure_topology`) and JAX's multi-process tests
(`jax._src.test_multiprocess`) give: process bounds = host bounds x (chips per host / chips per process), ports
from libtpu's default 8476 upwards, task id = TPU worker id x processes per host + local rank.

`process_env(topology, env)` is the pure function (a host topology and torchrun's variables -> the variables to
set); `apply()` runs it once, from the runtime's start (`torch_tpu._runtime.configure_jax`), only when a TPU
platform may be chosen, the host has TPU chips, several processes share the host, and the user set none of the
variables (theirs are never overridden: a user who sets any of them owns the topology). One process per host
(plain `python`, or `--nproc_per_node=1`) sets nothing: libtpu then gives that process every chip.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
from typing import Mapping, MutableMapping

from torch_tpu import _config

# The variables libtpu reads for a multi-process host (what `apply` sets, and what a user may set instead).
TPU_VARIABLES = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_PROCESS_ADDRESSES",
                 "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID")
BASE_PORT = 8476  # libtpu's default TPU_PROCESS_PORT; process i of a host listens on BASE_PORT + i

Bounds = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class HostTopology:
    """The chips of one TPU host and, for a multi-host slice, where the host sits in it."""

    generation: str  # "v4", "v5e", "v5p", "v6e"
    chips_per_host: Bounds  # shape of this host's chips, e.g. (2, 4, 1) for v5e-8/v6e-8
    host_bounds: Bounds = (1, 1, 1)  # shape of the slice's grid of hosts
    worker_id: int | None = None  # this host's TPU worker id (None: torchrun's GROUP_RANK)
    worker_hostnames: tuple[str, ...] = ()  # every host of the slice in worker-id order (multi-host only)

    @property
    def chips(self) -> int:
        return math.prod(self.chips_per_host)

    @property
    def hosts(self) -> int:
        return math.prod(self.host_bounds)


# Single-host TPU VMs by accelerator type (v4 chips are megacore: one device per chip).
HOST_TOPOLOGIES: dict[str, HostTopology] = {
    "v4-8": HostTopology("v4", (2, 2, 1)),
    "v5p-8": HostTopology("v5p", (2, 2, 1)),
    "v5litepod-1": HostTopology("v5e", (1, 1, 1)),
    "v5litepod-4": HostTopology("v5e", (2, 2, 1)),
    "v5litepod-8": HostTopology("v5e", (2, 4, 1)),
    "v6e-1": HostTopology("v6e", (1, 1, 1)),
    "v6e-4": HostTopology("v6e", (2, 2, 1)),
    "v6e-8": HostTopology("v6e", (2, 4, 1)),
}
HOST_TOPOLOGIES["v5e-1"] = HOST_TOPOLOGIES["v5litepod-1"]
HOST_TOPOLOGIES["v5e-4"] = HOST_TOPOLOGIES["v5litepod-4"]
HOST_TOPOLOGIES["v5e-8"] = HOST_TOPOLOGIES["v5litepod-8"]

# The chips of one host of each generation, by how many the host has (PCI scan or a multi-host type).
_CHIPS_PER_HOST: dict[str, dict[int, Bounds]] = {
    "v4": {4: (2, 2, 1)},
    "v5p": {4: (2, 2, 1)},
    "v5e": {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)},
    "v6e": {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)},
}
# One process's chips when a host's chips are split among processes (JAX's multi-process tests use these).
_CHIPS_PER_PROCESS: dict[int, Bounds] = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1)}

_GOOGLE_PCI_VENDOR = "0x1ae0"
_PCI_DEVICE_GENERATION = {"0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e", "0x006f": "v6e"}


def parse_bounds(text: str, what: str) -> Bounds:
    parts = text.replace("x", ",").split(",")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) == 2:
        dims = (*dims, 1)
    if len(dims) != 3 or min(dims) < 1:
        raise RuntimeError(f"torch_tpu: {what}={text!r} is not a TPU grid shape: use three positive integers "
                           "'x,y,z' (e.g. '2,4,1').")
    return dims  # type: ignore[return-value]


def _fmt(b: Bounds) -> str:
    return ",".join(str(d) for d in b)


def _int_env(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"torch_tpu: {name}={raw!r} is not an integer; torchrun sets it: start the script "
                           "with torchrun, or unset it.") from None


def process_env(topology: HostTopology, env: Mapping[str, str], base_port: int = BASE_PORT) -> dict[str, str]:
    """The libtpu variables of the torchrun worker described by `env` (LOCAL_RANK, LOCAL_WORLD_SIZE, RANK,
    WORLD_SIZE, GROUP_RANK) on a host with `topology`. Empty with one process per host: libtpu then gives the
    process every chip of its host. Raises on a setup that cannot split the host (see the messages)."""
    local_world = _int_env(env, "LOCAL_WORLD_SIZE", 1)
    assert local_world is not None
    if local_world <= 1:
        return {}
    local_rank = _int_env(env, "LOCAL_RANK", None)
    world = _int_env(env, "WORLD_SIZE", local_world)
    assert world is not None
    chips = topology.chips
    where = (f"this {topology.generation} host has {chips} chips ({_fmt(topology.chips_per_host)}), and torchrun "
             f"started {local_world} processes on it (--nproc_per_node={local_world})")
    if local_rank is None or not 0 <= local_rank < local_world:
        raise RuntimeError(f"torch_tpu: LOCAL_RANK={env.get('LOCAL_RANK')!r} is not in 0..{local_world - 1} "
                           f"(LOCAL_WORLD_SIZE={local_world}); start the script with torchrun.")
    if local_world > chips or chips % local_world:
        divisors = [d for d in range(1, chips + 1) if chips % d == 0]
        raise RuntimeError(
            f"torch_tpu: {where}: a chip belongs to one process only, so the processes must share the chips "
            f"evenly. Use --nproc_per_node in {divisors} ({chips} for one process per chip, 1 for one process "
            f"driving all chips), or set TPU_VISIBLE_CHIPS and the other TPU_* process variables yourself.")
    per_process = chips // local_world
    chips_per_process = _CHIPS_PER_PROCESS.get(per_process)
    per_host_grid = None
    if chips_per_process is not None and all(h % p == 0 for h, p in zip(topology.chips_per_host, chips_per_process)):
        per_host_grid = tuple(h // p for h, p in zip(topology.chips_per_host, chips_per_process))
    if per_host_grid is None:
        raise RuntimeError(
            f"torch_tpu: {where}: {per_process} chips per process do not tile the host's "
            f"{_fmt(topology.chips_per_host)} chips in a way libtpu accepts. Use --nproc_per_node={chips} (one chip "
            "per process) or 1 (all chips), or set TPU_CHIPS_PER_PROCESS_BOUNDS and the other TPU_* process "
            "variables yourself.")
    if world % local_world:
        raise RuntimeError(
            f"torch_tpu: WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}: every TPU host "
            "must run the same number of processes (torchrun --nnodes=H --nproc_per_node=N on each host).")
    hosts = world // local_world
    if hosts != topology.hosts:
        raise RuntimeError(
            f"torch_tpu: torchrun runs {hosts} host(s) of {local_world} processes (WORLD_SIZE={world}), but the "
            f"TPU slice has {topology.hosts} host(s) ({_fmt(topology.host_bounds)}): libtpu needs a process on every "
            "host of the slice. Start torchrun on every host with the same --nproc_per_node "
            "(--nnodes equal to the slice's hosts).")
    worker = topology.worker_id
    if worker is None:
        worker = _int_env(env, "GROUP_RANK", 0) or 0
    if not 0 <= worker < hosts:
        raise RuntimeError(f"torch_tpu: this host's worker id {worker} is not in 0..{hosts - 1} (the slice's "
                           "hosts); set TPU_WORKER_ID to this host's TPU worker id.")
    if hosts == 1:
        names: tuple[str, ...] = ("localhost",)
    else:
        names = topology.worker_hostnames
        if len(names) != hosts:
            raise RuntimeError(
                f"torch_tpu: a slice of {hosts} hosts needs every host's address for TPU_PROCESS_ADDRESSES, and "
                f"{len(names)} are known ({','.join(names) or 'none'}). Set TPU_WORKER_HOSTNAMES to the hosts' "
                "addresses in TPU worker order (GKE sets it), or set the TPU_* process variables yourself.")
    ports = [base_port + i for i in range(local_world)]
    first = local_rank * per_process
    return {
        "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in range(first, first + per_process)),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": _fmt(chips_per_process),
        "TPU_PROCESS_BOUNDS": _fmt(tuple(h * g for h, g in zip(topology.host_bounds, per_host_grid))),  # type: ignore[arg-type]
        "TPU_PROCESS_ADDRESSES": ",".join(f"{n}:{p}" for n in names for p in ports),
        "TPU_PROCESS_PORT": str(ports[local_rank]),
        "CLOUD_TPU_TASK_ID": str(worker * local_world + local_rank),
    }


def _pci_chips(root: str = "/sys/bus/pci/devices") -> tuple[str | None, int]:
    """(generation, count) of the TPU chips attached to this host over PCI ((None, 0) when there are none)."""
    found: dict[str, int] = {}
    for vendor_path in glob.glob(os.path.join(root, "*", "vendor")):
        try:
            with open(vendor_path) as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor_path), "device")) as f:
                gen = _PCI_DEVICE_GENERATION.get(f.read().strip())
        except OSError:
            continue
        if gen is not None:
            found[gen] = found.get(gen, 0) + 1
    if not found:
        return None, 0
    gen = max(found, key=lambda g: found[g])
    return gen, found[gen]


def _generation_of(accelerator_type: str) -> str | None:
    m = re.match(r"^(v\d+[a-z]*?)(?:litepod|lite)?-\d+$", accelerator_type.strip().lower())
    if not m:
        return None
    gen = m.group(1)
    return {"v5": "v5e"}.get(gen, gen) if "lite" in accelerator_type.lower() else gen


def detect(env: Mapping[str, str] | None = None, pci_root: str = "/sys/bus/pci/devices") -> HostTopology | None:
    """This host's topology: from TPU_ACCELERATOR_TYPE / TPU_CHIPS_PER_HOST_BOUNDS / TPU_HOST_BOUNDS /
    TPU_WORKER_ID / TPU_WORKER_HOSTNAMES when set (GKE sets them), else from the TPU chips on the PCI bus.
    None when the host has no TPU chips and nothing says otherwise."""
    env = os.environ if env is None else env
    accel = env.get("TPU_ACCELERATOR_TYPE", "").strip().lower()
    known = HOST_TOPOLOGIES.get(accel)
    gen = known.generation if known else (_generation_of(accel) if accel else None)
    chips_per_host = known.chips_per_host if known else None
    raw_chips = env.get("TPU_CHIPS_PER_HOST_BOUNDS", "").strip()
    if raw_chips:
        chips_per_host = parse_bounds(raw_chips, "TPU_CHIPS_PER_HOST_BOUNDS")
    if chips_per_host is None:
        pci_gen, count = _pci_chips(pci_root)
        gen = gen or pci_gen
        if count == 0:
            return None
        chips_per_host = _CHIPS_PER_HOST.get(gen or "", {}).get(count)
        if chips_per_host is None:
            raise RuntimeError(
                f"torch_tpu: this host has {count} TPU chips of generation {gen or 'unknown'}, a layout torch_tpu "
                "does not know; set TPU_CHIPS_PER_HOST_BOUNDS (e.g. '2,2,1'), or the TPU_* process variables "
                "(TPU_VISIBLE_CHIPS, ...) yourself.")
    raw_hosts = env.get("TPU_HOST_BOUNDS", "").strip()
    host_bounds = parse_bounds(raw_hosts, "TPU_HOST_BOUNDS") if raw_hosts else (1, 1, 1)
    worker = _int_env(env, "TPU_WORKER_ID", None)
    names = tuple(n.strip() for n in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if n.strip())
    return HostTopology(gen or "tpu", chips_per_host, host_bounds, worker, names)


_applied: dict[str, str] | None = None


def apply(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets this torchrun worker's libtpu variables (see the module doc) once, before libtpu starts; returns
    what it set. Nothing on XLA:CPU (TORCH_TPU_PLATFORM=cpu|cuda, TORCH_TPU_NUM_DEVICES, or no TPU chips), with
    one process per host, with TORCH_TPU_SPLIT_HOST=0, or when the user set any of the variables."""
    global _applied
    if _applied is not None and environ is None:
        return _applied
    env = os.environ if environ is None else environ
    result: dict[str, str] = {}
    platform = _config.get("TORCH_TPU_PLATFORM")
    tpu_possible = platform in (None, "tpu") and not _config.get("TORCH_TPU_NUM_DEVICES")
    several = (_int_env(env, "LOCAL_WORLD_SIZE", 1) or 1) > 1
    if (tpu_possible and several and _config.get("TORCH_TPU_SPLIT_HOST")
            and not any(env.get(v, "").strip() for v in TPU_VARIABLES)):
        topology = detect(env)
        if topology is None and platform == "tpu":
            raise RuntimeError(
                "torch_tpu: TORCH_TPU_PLATFORM=tpu with several processes on this host (LOCAL_WORLD_SIZE="
                f"{env.get('LOCAL_WORLD_SIZE')}), but no TPU chips were found on the PCI bus to split among them. "
                "Set TPU_ACCELERATOR_TYPE (e.g. v6e-8) or TPU_CHIPS_PER_HOST_BOUNDS, or the TPU_* process "
                "variables yourself.")
        if topology is not None:
            result = process_env(topology, env)
            env.update(result)
    if environ is None:
        _applied = result
    return result
