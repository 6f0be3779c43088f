"""Default `torch.compile(model)` (Inductor) on tpu tensors: which compiler a graph with tpu tensors goes to.

PyTorch's Inductor generates Pallas code for device `tpu` and runs it through
`torch_tpu._internal.pallas.tpu_torch_pallas`. Pallas code for a TPU is a Mosaic kernel, which only a TPU can run;
on XLA:CPU (the default without a TPU) or CUDA, Inductor's tpu code cannot execute. So with TORCH_TPU_INDUCTOR=auto
(the default) a graph that has tpu tensors goes to Inductor when the tpu device is a TPU, and to the `tpu` backend
(AOTAutograd + one XLA program per aten graph, torch_tpu._compile) on every other platform; `pallas` and `tpu`
force one route. Graphs without tpu tensors (CPU, CUDA) always go to Inductor unchanged.

PyTorch has no per-device hook in front of Inductor's graph compiler (`register_backend_for_device` acts below the
graph, at kernel scheduling), so this wraps the one entry both `torch.compile(model)` and
`torch.compile(backend="inductor")` use: `torch._TorchCompileInductorWrapper.__call__`. The routing is counted in
`torch._dynamo.utils.counters["tpu"]["inductor_to_tpu_backend"]` and logged once per process; Inductor options
(`mode=`, `options=`) do not apply to a graph the `tpu` backend compiles, and a warning says so when they are given.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Sequence

import torch

_log = logging.getLogger("torch_tpu.inductor")
_logged = False
_warned_options = False


def _on_tpu(gm: Any, example_inputs: Sequence[Any]) -> bool:
    """Whether the graph has a tpu tensor among its inputs or its nodes' values (factory ops on tpu)."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type == "tpu":
            return True
    graph = getattr(gm, "graph", None)
    for node in graph.nodes if graph is not None else ():
        val = node.meta.get("example_value", node.meta.get("val"))
        for v in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(v, torch.Tensor) and v.device.type == "tpu":
                return True
    return False


def route(gm: Any, example_inputs: Sequence[Any]) -> str:
    """"inductor" or "tpu": where default torch.compile sends this graph."""
    if not _on_tpu(gm, example_inputs):
        return "inductor"
    from torch_tpu import _config, _runtime

    choice = _config.get("TORCH_TPU_INDUCTOR")
    if choice == "pallas":
        return "inductor"
    if choice == "tpu":
        return "tpu"
    return "inductor" if _runtime.platform() == "tpu" else "tpu"


def _routed(wrapper: Any, gm: Any, example_inputs: Sequence[Any]) -> Any:
    global _logged, _warned_options
    from torch._dynamo.utils import counters

    from torch_tpu import _runtime
    from torch_tpu._compile import tpu_backend

    counters["tpu"]["inductor_to_tpu_backend"] += 1
    if not _logged:
        _logged = True
        _log.info("torch.compile: graphs with tpu tensors compile with backend 'tpu' on XLA:%s (Inductor's Pallas "
                  "code needs a TPU; TORCH_TPU_INDUCTOR=auto)", _runtime.platform().upper())
    if wrapper.config and not _warned_options:
        _warned_options = True
        warnings.warn(f"torch.compile: Inductor options {sorted(wrapper.config)} (from mode= or options=) do not "
                      f"apply to graphs with tpu tensors on XLA:{_runtime.platform().upper()}: they compile with "
                      "backend 'tpu' (TORCH_TPU_INDUCTOR=auto; see docs/user_guide.md, 'Default torch.compile')",
                      stacklevel=2)
    return tpu_backend(gm, example_inputs)


def install() -> None:
    """Wraps Inductor's torch.compile entry once (it lives in torch/__init__.py: importing it costs nothing)."""
    cls = getattr(torch, "_TorchCompileInductorWrapper", None)
    if cls is None or getattr(cls.__call__, "_torch_tpu_route", False):
        return
    inductor_call = cls.__call__

    def __call__(self: Any, model_: Any, inputs_: Any, *args: Any, **kwargs: Any) -> Any:
        # Only torch.compile's own entry: AOTInductor's subclass (torch.compile(..., mode="aot...") packaging) needs
        # Inductor's artifacts, which a tpu-backend program is not.
        if type(self) is cls and route(model_, inputs_) == "tpu":
            return _routed(self, model_, inputs_)
        return inductor_call(self, model_, inputs_, *args, **kwargs)

    __call__._torch_tpu_route = True  # type: ignore[attr-defined]
    __call__.__wrapped__ = inductor_call  # type: ignore[attr-defined]
    cls.__call__ = __call__
