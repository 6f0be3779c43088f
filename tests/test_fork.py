"""fork() and the tpu runtime, as CUDA behaves: PJRT does not survive fork(), so a child forked after the runtime
started raises "cannot re-initialize tpu in a forked subprocess" at its first tpu use (instead of hanging) and
exits cleanly; a child forked before any tpu use starts its own runtime; 'spawn' works.

Every case runs in a fresh interpreter with a timeout (conftest.run_python), so a regression fails instead of
hanging the suite.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import run_python

ERROR = "cannot re-initialize tpu in a forked subprocess"

# Imported by the worker processes (multiprocessing needs importable functions for 'spawn').
WORKERS = '''
import torch


def tpu_sum(i):
    return (torch.ones(3, device="tpu") * i).sum().item()


class TpuDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return (torch.full((2,), float(i), device="tpu") + 1).cpu()
'''


def _run(code: str, tmp_path: Path, timeout: int = 240):
    (tmp_path / "forkwork.py").write_text(WORKERS)
    r = run_python(textwrap.dedent(code), env={"PYTHONPATH": str(tmp_path)}, timeout=timeout)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-4000:]}"
    return r.stdout


# Each use below is a child's first tpu use after the fork; the child exits through the interpreter's normal
# shutdown (sys.exit), with the tpu tensors it inherited still alive, so their deleters run there too.
USES = {
    "op": "x + 1",
    "view op": "x[1:].sum()",
    "new tensor": "torch.zeros(2, device='tpu')",
    "upload": "torch.tensor([1.0, 2.0]).to('tpu')",
    "cpu of inherited": "x.cpu()",
    "item": "x[0].item()",
    "in-place fill": "x.fill_(2.0)",
    "random": "x.normal_()",
    "arange": "torch.arange(5, device='tpu')",
    "synchronize": "torch.tpu.synchronize()",
    "set_device": "torch.tpu.set_device(0)",
    "fused": "torch.tpu.eager_mode = 'DEFER_AND_FUSE'; (x * 2).cpu()",
}


def test_fork_after_use_raises_at_first_use(tmp_path: Path) -> None:
    out = _run(f"""
        import os, sys, torch
        x = torch.arange(4.0).to("tpu")
        assert (x + 1).cpu().tolist() == [1.0, 2.0, 3.0, 4.0]
        for name, use in {USES!r}.items():
            pid = os.fork()
            if pid == 0:
                code = 1  # the use worked or raised something else: wrong
                try:
                    assert torch.tpu._is_in_bad_fork()
                    assert torch.tpu.device_count() >= 1  # answers from what the parent knew, as CUDA's does
                    exec(use)
                except RuntimeError as e:
                    code = 7 if {ERROR!r} in str(e) and "spawn" in str(e) else 2
                    if code == 2:
                        print(name, e, flush=True)
                sys.exit(code)
            _, status = os.waitpid(pid, 0)
            print(name, os.waitstatus_to_exitcode(status), flush=True)
        assert not torch.tpu._is_in_bad_fork()
        assert (x * 3).cpu().tolist() == [0.0, 3.0, 6.0, 9.0]  # the parent is unaffected
        print("parent ok")
        """, tmp_path)
    for name in USES:
        assert f"{name} 7" in out, out
    assert "parent ok" in out


def test_fork_before_any_use_starts_its_own_runtime(tmp_path: Path) -> None:
    out = _run("""
        import os, sys, torch
        assert not torch.tpu.is_initialized()
        pid = os.fork()
        if pid == 0:
            ok = not torch.tpu._is_in_bad_fork()
            y = torch.arange(6.0).reshape(2, 3).to("tpu")
            c = torch.arange(6.0).reshape(2, 3)
            ok = ok and torch.equal((y @ y.T).cpu(), c @ c.T)
            sys.exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        z = torch.ones(2, device="tpu") * 2
        assert z.cpu().tolist() == [2.0, 2.0]
        # the hook is registered once the runtime started: a fork now is a bad fork
        pid = os.fork()
        if pid == 0:
            sys.exit(7 if torch.tpu._is_in_bad_fork() else 1)
        _, status = os.waitpid(pid, 0)
        print("second child", os.waitstatus_to_exitcode(status))
        """, tmp_path)
    assert "child 0" in out and "second child 7" in out, out


def test_fork_pool_error_reaches_parent(tmp_path: Path) -> None:
    out = _run(f"""
        import multiprocessing as mp, torch, forkwork
        torch.ones(1, device="tpu").cpu()
        with mp.get_context("fork").Pool(2) as pool:
            try:
                pool.map(forkwork.tpu_sum, [1, 2])
            except RuntimeError as e:
                assert {ERROR!r} in str(e), e
                print("raised in parent")
        """, tmp_path)
    assert "raised in parent" in out, out


def test_dataloader_fork_workers_error_reaches_parent(tmp_path: Path) -> None:
    out = _run(f"""
        import torch, forkwork
        from torch.utils.data import DataLoader
        torch.ones(1, device="tpu").cpu()
        loader = DataLoader(forkwork.TpuDataset(), batch_size=2, num_workers=2, multiprocessing_context="fork")
        try:
            list(loader)
        except RuntimeError as e:
            assert {ERROR!r} in str(e), e
            print("raised in parent")
        """, tmp_path)
    assert "raised in parent" in out, out


@pytest.mark.parametrize("what", ["pool", "dataloader"])
def test_spawn_works_after_use(what: str, tmp_path: Path) -> None:
    out = _run(f"""
        import multiprocessing as mp, torch, forkwork
        from torch.utils.data import DataLoader
        if __name__ == "__main__":
            torch.ones(1, device="tpu").cpu()
            if {what!r} == "pool":
                with mp.get_context("spawn").Pool(2) as pool:
                    print("results", pool.map(forkwork.tpu_sum, [1, 2]))
            else:
                loader = DataLoader(forkwork.TpuDataset(), batch_size=2, num_workers=2,
                                    multiprocessing_context="spawn")
                print("results", [b.tolist() for b in loader])
        """, tmp_path, timeout=400)
    want = "[3.0, 6.0]" if what == "pool" else "[[[1.0, 1.0], [2.0, 2.0]], [[3.0, 3.0], [4.0, 4.0]]]"
    assert f"results {want}" in out, out
