"""torch_tpu: a native PyTorch backend for Google TPUs.

`import torch` loads this package through the `torch.backends` entry point (unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0). It renames PyTorch's PrivateUse1 backend to `tpu`, registers `torch.tpu`,
the tensor/module/storage methods (`Tensor.is_tpu`, `.tpu()`, `Module.tpu()`), and the ATen kernels. The
PJRT client (TPU, or XLA:CPU without one) starts on the first tpu use, not here.
"""

from __future__ import annotations

import os


def _autoload() -> None:
    """Entry point of the `torch.backends` group: importing this package does the work. Defined before
    `import torch`, which loads this entry point while `import torch_tpu` (or `python -m torch_tpu.x`) is still
    running: the rest of this module then finishes the set-up."""


# (folder, path inside the wheel) of each Python source folder: the package itself in the wheel; from the
# source tree (`import torch` at the repository root), also the component folders it maps (_source_tree).
_SOURCE_FOLDERS = [(os.path.dirname(os.path.abspath(__file__)), "")]
if not os.path.isdir(os.path.join(_SOURCE_FOLDERS[0][0], "kernels")):
    from torch_tpu import _source_tree

    if _source_tree.is_source_tree(_SOURCE_FOLDERS[0][0]):
        _SOURCE_FOLDERS = _source_tree.install(_SOURCE_FOLDERS[0][0])

import torch  # noqa: E402

from torch_tpu import _C  # the C++ runtime: allocator, guard, hooks, generator, metadata kernels

from torch_tpu._version import __version__  # noqa: E402,F401  (the one place the version is written)


def _setup() -> None:
    from torch_tpu import _config, _deferred, _eager, _foreach, _programs, _runtime, _storage, device_module

    torch.utils.rename_privateuse1_backend("tpu")
    torch._register_device_module("tpu", device_module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )
    _C._set_callbacks(_runtime.start, _storage.resize_array, device_module._synchronize)
    _runtime.on_start(before=_join_launcher_world, after=_after_runtime_start)
    _eager.install()  # the table's lowerings (torch_tpu.kernels) as PrivateUse1 kernels
    _foreach.install()  # _foreach_* overloads: one program over the list instead of PyTorch's per-tensor loop
    _C._set_resolver(_deferred.resolve)  # the storage accessors' placeholder contract (runtime/TpuPython.cpp)
    _programs.register_cache(_deferred.drop_programs)  # the program collector drops the fused programs too
    _deferred.mode_from_env()
    _C._graph_owner()  # publishes the importing thread while its debug-info stack is empty (runtime/TpuMode.cpp)
    # torch.compile: Dynamo must run the Python kernels above as plain Python, never trace them.
    from torch_tpu import _dynamo_skip

    _dynamo_skip.skip_kernels()
    # backend="tpu" registered when Dynamo's registry is imported (its entry-point lookup races between threads).
    from torch_tpu import _dynamo_backend

    _dynamo_backend.install()
    # PyTorch's Python device allow-lists that leave tpu out of ops that run on it (FlexAttention's).
    from torch_tpu import _torch_gates

    _torch_gates.install()
    # TPUs compute in bfloat16 natively: torch.autocast("tpu") defaults to it (runtime/TpuAutocast.cpp has the
    # per-op policy).
    torch.set_autocast_dtype("tpu", torch.bfloat16)
    # torch.distributed backend "tpu_dist" for tpu tensors (registration only: no JAX import).
    from torch_tpu import distributed

    distributed.register()

    # Memory statistics and limits (runtime/TpuAllocator.cpp's accounting; torch_tpu/_memory.py).
    from torch_tpu import _memory

    _memory.install()

    _C._set_fallback_mode(_config.get("TORCH_TPU_CPU_FALLBACK"))
    # A bad TORCH_TPU_* value must not break `import torch`: every variable is parsed now (reads above gave the
    # default) and a bad one is raised at the first tpu use and by torch.tpu.is_available() (instead of
    # answering False: a `"tpu" if is_available() else "cpu"` script would silently run on CPU). See _config.
    _config.load()


def _join_launcher_world() -> None:
    """Under torchrun, joins JAX's distributed world before PJRT starts (torch_tpu.distributed), so
    torch.tpu.set_device(local_rank) or init_process_group(device_id=...) may come first, as with CUDA."""
    from torch_tpu.distributed import _world

    _world.join_launcher_world()


def _after_runtime_start() -> None:
    from torch_tpu import _deferred, _programs, compile_cache

    _deferred.watch_optimizer_steps()  # step-end flushes; DEFER_NEVER's optimizer steps run as one program
    _programs.install()  # bounds the compiled programs kept alive (XLA:CPU maps memory per kernel)
    compile_cache.install()


_setup()
