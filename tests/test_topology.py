"""One process per chip on a multi-chip TPU host (torch_tpu/_topology.py): the libtpu variables each torchrun
worker gets, per host topology, and that nothing changes on XLA:CPU or when the user set them.

The expected values are PyTorch/XLA's (`torch_xla._internal.tpu.configure_topology`) and JAX's multi-process
test launcher's: per-process chips 1,1,1, process bounds = host bounds x chips per host, ports 8476 + local
rank, task id = worker x processes per host + local rank."""

from __future__ import annotations

import os

import pytest

from conftest import run_python
from torch_tpu import _topology
from torch_tpu._topology import HOST_TOPOLOGIES, HostTopology, process_env


def _torchrun(local_rank: int, nproc: int, nnodes: int = 1, node: int = 0) -> dict[str, str]:
    return {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(nproc), "RANK": str(node * nproc + local_rank),
            "WORLD_SIZE": str(nproc * nnodes), "GROUP_RANK": str(node), "MASTER_ADDR": "10.0.0.2",
            "MASTER_PORT": "29500"}


@pytest.mark.parametrize("accel,chips,bounds", [("v4-8", 4, "2,2,1"), ("v5litepod-8", 8, "2,4,1"),
                                                ("v5e-8", 8, "2,4,1"), ("v6e-8", 8, "2,4,1")])
def test_one_process_per_chip_on_one_host(accel: str, chips: int, bounds: str) -> None:
    topo = HOST_TOPOLOGIES[accel]
    addresses = ",".join(f"localhost:{8476 + i}" for i in range(chips))
    seen = set()
    for r in range(chips):
        env = process_env(topo, _torchrun(r, chips))
        assert env == {"TPU_VISIBLE_CHIPS": str(r), "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
                       "TPU_PROCESS_BOUNDS": bounds, "TPU_PROCESS_ADDRESSES": addresses,
                       "TPU_PROCESS_PORT": str(8476 + r), "CLOUD_TPU_TASK_ID": str(r)}
        seen.add(env["TPU_VISIBLE_CHIPS"])
    assert seen == {str(c) for c in range(chips)}  # every chip to exactly one process


def test_single_process_drives_all_chips() -> None:
    for accel in ("v4-8", "v5litepod-8", "v6e-8"):
        assert process_env(HOST_TOPOLOGIES[accel], _torchrun(0, 1)) == {}  # torchrun --nproc_per_node=1
        assert process_env(HOST_TOPOLOGIES[accel], {}) == {}  # plain python


@pytest.mark.parametrize("accel,nproc,chips_pp,bounds", [("v6e-8", 2, "2,2,1", "1,2,1"),
                                                         ("v6e-8", 4, "1,2,1", "2,2,1"),
                                                         ("v4-8", 2, "1,2,1", "2,1,1")])
def test_several_chips_per_process(accel: str, nproc: int, chips_pp: str, bounds: str) -> None:
    per = HOST_TOPOLOGIES[accel].chips // nproc
    for r in range(nproc):
        env = process_env(HOST_TOPOLOGIES[accel], _torchrun(r, nproc))
        assert env["TPU_VISIBLE_CHIPS"] == ",".join(str(c) for c in range(r * per, (r + 1) * per))
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == chips_pp and env["TPU_PROCESS_BOUNDS"] == bounds
        assert env["CLOUD_TPU_TASK_ID"] == str(r)


def test_multi_host_slice() -> None:
    # v4-16: two hosts of 2x2x1 chips stacked along z; torchrun --nnodes=2 --nproc_per_node=4.
    hosts = ("10.0.0.2", "10.0.0.3")
    for node in range(2):
        topo = HostTopology("v4", (2, 2, 1), host_bounds=(1, 1, 2), worker_hostnames=hosts)
        for r in range(4):
            env = process_env(topo, _torchrun(r, 4, nnodes=2, node=node))
            assert env["TPU_PROCESS_BOUNDS"] == "2,2,2"
            assert env["TPU_PROCESS_ADDRESSES"] == ",".join(f"{h}:{8476 + p}" for h in hosts for p in range(4))
            assert env["CLOUD_TPU_TASK_ID"] == str(node * 4 + r)
            assert env["TPU_VISIBLE_CHIPS"] == str(r) and env["TPU_PROCESS_PORT"] == str(8476 + r)
    # The TPU worker id, when known, orders the tasks (not torchrun's node rank).
    topo = HostTopology("v4", (2, 2, 1), host_bounds=(1, 1, 2), worker_id=1, worker_hostnames=hosts)
    assert process_env(topo, _torchrun(3, 4, nnodes=2, node=0))["CLOUD_TPU_TASK_ID"] == "7"


@pytest.mark.parametrize("env,match", [
    (_torchrun(0, 3), r"share the chips evenly.*\[1, 2, 4, 8\]"),  # 3 does not divide 8
    (_torchrun(0, 16), r"share the chips evenly"),  # more processes than chips
    ({**_torchrun(0, 4), "WORLD_SIZE": "6"}, r"not a multiple of LOCAL_WORLD_SIZE"),
    (_torchrun(0, 8, nnodes=2), r"2 host\(s\).*slice has 1 host"),  # a second host the slice does not have
    ({**_torchrun(0, 8), "LOCAL_RANK": "8"}, r"LOCAL_RANK='8' is not in 0..7"),
])
def test_contradictory_setups_raise(env: dict, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        process_env(HOST_TOPOLOGIES["v6e-8"], env)


def test_multi_host_without_addresses_raises() -> None:
    topo = HostTopology("v6e", (2, 4, 1), host_bounds=(1, 2, 1))
    with pytest.raises(RuntimeError, match="TPU_WORKER_HOSTNAMES"):
        process_env(topo, _torchrun(0, 8, nnodes=2))


def _fake_pci(tmp_path, device: str, count: int) -> str:
    for i in range(count):
        d = tmp_path / f"0000:00:{i:02x}.0"
        d.mkdir()
        (d / "vendor").write_text("0x1ae0\n")
        (d / "device").write_text(device + "\n")
    other = tmp_path / "0000:01:00.0"  # a non-TPU device is ignored
    other.mkdir()
    (other / "vendor").write_text("0x8086\n")
    (other / "device").write_text("0x0063\n")
    return str(tmp_path)


def test_detect_from_pci_and_env(tmp_path) -> None:
    root = _fake_pci(tmp_path, "0x006f", 8)
    assert _topology.detect({}, pci_root=root) == HostTopology("v6e", (2, 4, 1))
    assert _topology.detect({}, pci_root=str(tmp_path / "none")) is None  # no TPU: nothing to split
    # GKE's variables win over the PCI scan.
    env = {"TPU_ACCELERATOR_TYPE": "v4-16", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_HOST_BOUNDS": "1,1,2",
           "TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "a,b"}
    assert _topology.detect(env, pci_root=root) == HostTopology("v4", (2, 2, 1), (1, 1, 2), 1, ("a", "b"))
    assert _topology.detect({"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, pci_root=root).chips_per_host == (2, 4, 1)
    with pytest.raises(RuntimeError, match="TPU_CHIPS_PER_HOST_BOUNDS='2,x' is not a TPU grid shape"):
        _topology.detect({"TPU_CHIPS_PER_HOST_BOUNDS": "2,x"}, pci_root=root)


def test_apply_sets_the_variables_on_a_tpu_host(tmp_path, monkeypatch) -> None:
    root = _fake_pci(tmp_path, "0x0063", 8)
    real_detect = _topology.detect
    monkeypatch.setattr(_topology, "detect", lambda env: real_detect(env, pci_root=root))
    for name in ("TORCH_TPU_PLATFORM", "TORCH_TPU_NUM_DEVICES", "TORCH_TPU_SPLIT_HOST"):
        monkeypatch.delenv(name, raising=False)
    env = _torchrun(5, 8)
    assert _topology.apply(env)["TPU_VISIBLE_CHIPS"] == "5"
    assert env["TPU_VISIBLE_CHIPS"] == "5" and env["TPU_PROCESS_BOUNDS"] == "2,4,1"
    # The user's values are never overridden: any one set means the user owns the topology.
    env = {**_torchrun(5, 8), "TPU_VISIBLE_CHIPS": "0,1"}
    assert _topology.apply(env) == {} and env["TPU_VISIBLE_CHIPS"] == "0,1" and "TPU_PROCESS_BOUNDS" not in env
    # Off switch, and XLA:CPU selected: nothing set.
    for name, value in (("TORCH_TPU_SPLIT_HOST", "0"), ("TORCH_TPU_PLATFORM", "cpu"), ("TORCH_TPU_NUM_DEVICES", "2")):
        monkeypatch.setenv(name, value)
        env = _torchrun(5, 8)
        assert _topology.apply(env) == {} and not set(env) & set(_topology.TPU_VARIABLES)
        monkeypatch.delenv(name)
    # A contradictory setup on a TPU host stops the start, naming the way out.
    with pytest.raises(RuntimeError, match="--nproc_per_node in"):
        _topology.apply(_torchrun(0, 3))


def test_forced_tpu_without_chips_raises(tmp_path, monkeypatch) -> None:
    real_detect = _topology.detect
    monkeypatch.setattr(_topology, "detect", lambda env: real_detect(env, pci_root=str(tmp_path)))
    monkeypatch.setenv("TORCH_TPU_PLATFORM", "tpu")
    with pytest.raises(RuntimeError, match="no TPU chips were found"):
        _topology.apply(_torchrun(0, 4))


def test_xla_cpu_runtime_start_is_unchanged() -> None:
    """Under torchrun's variables on this host (no TPU chips), the runtime starts on XLA:CPU and sets none of
    the libtpu process variables."""
    code = (
        "import os, torch\n"
        "x = torch.ones(3, device='tpu') * 2\n"
        "from torch_tpu import _runtime\n"
        "assert _runtime.platform() == 'cpu', _runtime.platform()\n"
        "assert x.cpu().tolist() == [2.0, 2.0, 2.0]\n"
        "from torch_tpu._topology import TPU_VARIABLES\n"
        "print(sorted(k for k in TPU_VARIABLES if k in os.environ))\n"
    )
    assert not set(_topology.TPU_VARIABLES) & set(os.environ)  # run_python passes ours on
    out = run_python(code, env={"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "RANK": "1", "WORLD_SIZE": "4",
                                "GROUP_RANK": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
