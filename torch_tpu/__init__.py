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


import torch  # noqa: E402

from torch_tpu import _C  # the C++ runtime: allocator, guard, hooks, generator, metadata kernels

__version__ = "0.2.0"

_FALLBACK_MODES = {"": 0, "0": 0, "strict": 0, "off": 0, "warn": 1, "1": 1}


def _setup() -> None:
    from torch_tpu import (_config, _deferred, _eager, _metrics, _programs, _runtime, _storage, compile_cache,
                           device_module)

    torch.utils.rename_privateuse1_backend("tpu")
    torch._register_device_module("tpu", device_module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )
    _C._set_callbacks(_runtime.start, _storage.resize_array, device_module._synchronize)
    _eager.install()  # the table's lowerings (torch_tpu.kernels) as PrivateUse1 kernels
    _C._set_resolver(_deferred.resolve)  # the storage accessors' placeholder contract (runtime/TpuPython.cpp)
    _programs.register_cache(_deferred.drop_programs)  # the program collector drops the fused programs too
    # A bad TORCH_TPU_* value must not break `import torch`: it is raised at the first tpu use (_config).
    try:
        _deferred.mode_from_env()
    except RuntimeError as e:
        _config.defer("TORCH_TPU_EAGER_MODE", str(e))
    for name, parse in (("TORCH_TPU_CACHE", compile_cache.enabled),
                        ("TORCH_TPU_CACHE_MAX_BYTES", compile_cache.max_bytes),
                        ("TORCH_TPU_RECOMPILE_WARN", _metrics._threshold)):
        try:
            parse()  # read again where used; checked here so that a bad value stops the first tpu use
        except RuntimeError as e:
            _config.defer(name, str(e))
    # Parsed again by _runtime when it starts; checked here too so that torch.tpu.is_available() raises for them
    # instead of answering False (a `"tpu" if is_available() else "cpu"` script would silently run on CPU).
    _config.read("TORCH_TPU_NUM_DEVICES", _config.positive_int, None)
    _config.read("TORCH_TPU_PLATFORM", _config.one_of(*_runtime.PLATFORMS), None)
    # torch.compile: Dynamo must run the Python kernels above as plain Python, never trace them.
    from torch_tpu import _dynamo_skip

    _dynamo_skip.skip_kernels()
    # backend="tpu" registered when Dynamo's registry is imported (its entry-point lookup races between threads).
    from torch_tpu import _dynamo_backend

    _dynamo_backend.install()
    # TPUs compute in bfloat16 natively: torch.autocast("tpu") defaults to it (runtime/TpuAutocast.cpp has the
    # per-op policy).
    torch.set_autocast_dtype("tpu", torch.bfloat16)
    # torch.distributed backend "tpu_dist" for tpu tensors (registration only: no JAX import).
    from torch_tpu import distributed

    distributed.register()

    mode = os.environ.get("TORCH_TPU_CPU_FALLBACK", "").strip().lower()
    if mode not in _FALLBACK_MODES:
        _config.defer(
            "TORCH_TPU_CPU_FALLBACK",
            f"TORCH_TPU_CPU_FALLBACK={mode!r} is not understood: use 'warn' (or 1) to run ops without a tpu kernel "
            "on CPU (warning once per op), or 'strict' (or 0, off, unset) for the strict default.",
        )
        mode = ""
    _C._set_fallback_mode(_FALLBACK_MODES[mode])


_setup()
