"""The runtime half of Inductor's Pallas code generator for device `tpu` (torch/_inductor/codegen/pallas.py).

The code Inductor generates for each kernel exports its JAX wrapper with `jax.export.export(..., platforms=['tpu'])`
and then calls, in this order:

    if not lookup_custom_kernel(name, key):
        register_custom_kernel(name, key, serialized_mlir_module=exported.mlir_module_serialized)
    results = call_custom_kernel(name, key, inputs=[tpu tensors], output_shapes=[empty tpu tensors],
                                 donate_argnums=[input positions])

`register_custom_kernel` deserializes the StableHLO module once per (name, key) and reads its signature;
`call_custom_kernel` compiles it for the tpu device's PJRT client once per (name, key, donation), keeps the compiled
executable (the generated code calls `jax.clear_caches()` before every kernel, so JAX's own caches cannot be relied
on), runs it on the inputs' device arrays and returns new tpu tensors owning the results.

Donation (`donate_argnums`): an input's array is handed to the program only when its storage holds the sole
reference (DESIGN.md's storage model; otherwise it is copied as usual). A donated input is the output buffer
Inductor aliases (`out_ptr*_alias`): its storage then takes the result of the same shape and dtype, so it never
holds a deleted array.

A module with a Mosaic kernel (`tpu_custom_call`, what Pallas emits for a TPU) runs only when the tpu device is a
real TPU: on XLA:CPU (or CUDA) `register_custom_kernel` refuses it with an error naming the kernel. There, default
`torch.compile` does not reach this module: tpu graphs go to the `tpu` backend (torch_tpu/_inductor_route.py).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

import numpy as np
import torch

from torch_tpu import _C, _runtime, _storage
from torch_tpu._jax import jax

__all__ = ["lookup_custom_kernel", "register_custom_kernel", "call_custom_kernel"]

# StableHLO element types -> numpy dtypes (what a module's signature can hold).
_ELEMENT = {
    "f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": jax.numpy.bfloat16,
    "i64": np.int64, "i32": np.int32, "i16": np.int16, "i8": np.int8, "i1": np.bool_,
    "ui64": np.uint64, "ui32": np.uint32, "ui16": np.uint16, "ui8": np.uint8,
    "complex<f32>": np.complex64, "complex<f64>": np.complex128,
}

Aval = tuple[tuple[int, ...], Any]  # shape, numpy dtype


@dataclasses.dataclass
class _Kernel:
    name: str
    key: str
    module: bytes
    mosaic: bool
    ins: list[Aval]
    outs: list[Aval]
    compiled: dict[tuple, Any] = dataclasses.field(default_factory=dict)  # (out dtypes, donated) -> executable


_KERNELS: dict[tuple[str, str], _Kernel] = {}
_LOCK = threading.Lock()


def _show(avals: Sequence[Aval]) -> str:
    return "[" + ", ".join(f"{np.dtype(d).name}{list(s)}" for s, d in avals) + "]"


def _signature(name: str, key: str, module: bytes) -> tuple[bool, list[Aval], list[Aval]]:
    """(has a Mosaic kernel, argument avals, result avals) of the module's public main function."""
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    try:
        with mlir.make_ir_context():
            mod = _jax.mlir.deserialize_portable_artifact(module)
            text = mlir.module_to_string(mod)
            main = next(op for op in mod.body.operations
                        if ir.StringAttr(op.attributes["sym_name"]).value == "main")
            ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)

            def aval(t: Any) -> Aval:
                rt = ir.RankedTensorType(t)
                elem = str(rt.element_type)
                if elem not in _ELEMENT:
                    raise ValueError(f"element type {elem}")
                return tuple(rt.shape), np.dtype(_ELEMENT[elem])

            ins = [aval(t) for t in ftype.inputs]
            outs = [aval(t) for t in ftype.results]
    except Exception as e:  # not a StableHLO artifact, no main, dynamic shapes, tokens...
        raise ValueError(f"tpu_torch_pallas.register_custom_kernel({name!r}, {key!r}): the module is not a "
                         f"serialized StableHLO module with a static-shaped main function ({type(e).__name__}: "
                         f"{e}); pass jax.export.export(...)(...).mlir_module_serialized") from e
    return "tpu_custom_call" in text, ins, outs


def _x64() -> None:
    """The generated code turns JAX's x64 mode off before it exports each kernel (jax.config is per process) and
    leaves it off; tpu tensors need it (int64, float64: DESIGN.md), so each entry here turns it back on, after the
    export and before any tpu op runs."""
    if not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)


def lookup_custom_kernel(name: str, key: str) -> bool:
    """Whether kernel `name` is registered for `key` (its shapes)."""
    _x64()
    return (name, key) in _KERNELS


def register_custom_kernel(name: str, key: str, serialized_mlir_module: bytes | None = None, **kwargs: Any) -> None:
    """Registers the exported StableHLO module of kernel `name` for `key`; registering the same (name, key) again
    keeps the first one (the generated code registers only after a failed lookup)."""
    _x64()
    if serialized_mlir_module is None:
        serialized_mlir_module = kwargs.pop("mlir_module", None)
    if kwargs:
        raise TypeError(f"tpu_torch_pallas.register_custom_kernel({name!r}): unexpected arguments {sorted(kwargs)}")
    if not isinstance(serialized_mlir_module, (bytes, bytearray)):
        raise TypeError(f"tpu_torch_pallas.register_custom_kernel({name!r}, {key!r}): serialized_mlir_module must "
                        f"be bytes (jax.export's mlir_module_serialized), got {type(serialized_mlir_module).__name__}")
    if (name, key) in _KERNELS:
        return
    module = bytes(serialized_mlir_module)
    mosaic, ins, outs = _signature(name, key, module)
    platform = _runtime.platform()
    if mosaic and platform != "tpu":
        raise RuntimeError(
            f"tpu_torch_pallas.register_custom_kernel({name!r}): kernel {name!r} (inputs {_show(ins)}, outputs "
            f"{_show(outs)}) is a Mosaic (Pallas TPU) kernel, which only a TPU can run, and the tpu device runs on "
            f"XLA:{platform.upper()} here. Default torch.compile sends tpu graphs to the 'tpu' backend on this "
            "platform (TORCH_TPU_INDUCTOR=auto); to run Inductor's Pallas code, use a TPU host.")
    with _LOCK:
        _KERNELS.setdefault((name, key), _Kernel(name, key, module, mosaic, ins, outs))


def _executable(k: _Kernel, out_dtypes: tuple[Any, ...], donated: tuple[int, ...], index: int) -> Any:
    """The kernel compiled for the tpu client, casting each result to the dtype the caller's tensor has (the
    generated code exports with 32-bit types, e.g. int32 for an int64 output)."""
    ck = (out_dtypes, donated, index)
    exe = k.compiled.get(ck)
    if exe is not None:
        return exe
    device = _runtime.device(index)
    platform = _runtime.platform()
    in_specs = [jax.ShapeDtypeStruct(s, d) for s, d in k.ins]
    out_specs = tuple(jax.ShapeDtypeStruct(s, d) for s, d in k.outs)
    # jax.export's own Exported for a function of the same signature on this platform, carrying this module:
    # Exported.call embeds the module into a program that JAX compiles like any other.
    def same_signature(*_: Any) -> tuple[Any, ...]:
        return tuple(jax.numpy.zeros(o.shape, o.dtype) for o in out_specs)

    template = jax.export.export(jax.jit(same_signature, keep_unused=True), platforms=[platform])(*in_specs)
    exported = dataclasses.replace(template, fun_name=k.name, mlir_module_serialized=k.module,
                                   module_kept_var_idx=tuple(range(len(k.ins))))

    def run(*arrays: Any) -> tuple[Any, ...]:
        return tuple(r.astype(d) if r.dtype != d else r for r, d in zip(exported.call(*arrays), out_dtypes))

    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in k.ins]
    try:
        exe = jax.jit(run, donate_argnums=donated).lower(*args).compile()
    except Exception as e:
        raise RuntimeError(f"tpu_torch_pallas: compiling kernel {k.name!r} (inputs {_show(k.ins)}, outputs "
                           f"{_show(k.outs)}) for XLA:{platform.upper()} failed: {e}") from e
    with _LOCK:
        k.compiled[ck] = exe
    return exe


def call_custom_kernel(name: str, key: str, inputs: Sequence[torch.Tensor] = (),
                       output_shapes: Sequence[torch.Tensor] = (), donate_argnums: Sequence[int] = (),
                       input_output_aliases: dict[int, int] | None = None) -> list[torch.Tensor]:
    """Runs registered kernel `name`/`key` on tpu tensors `inputs`; returns new tpu tensors with the shapes and
    dtypes of `output_shapes`. `donate_argnums` (or the older `input_output_aliases`, whose keys are the donated
    inputs) lets the program reuse those inputs' buffers where nothing else holds them."""
    k = _KERNELS.get((name, key))
    if k is None:
        raise RuntimeError(f"tpu_torch_pallas.call_custom_kernel: kernel {name!r} is not registered for key "
                           f"{key!r}; call register_custom_kernel(name, key, serialized_mlir_module=...) first")
    _x64()
    inputs, output_shapes = list(inputs), list(output_shapes)
    donate = tuple(donate_argnums) if not input_output_aliases else tuple(input_output_aliases)
    got = [(tuple(t.shape), t.dtype, t.device) for t in inputs]
    want = [(s, _runtime.torch_dtype(d)) for s, d in k.ins]
    if len(got) != len(want) or any(g[:2] != w for g, w in zip(got, want)) or any(
            d.type != "tpu" for _, _, d in got):
        raise ValueError(f"tpu_torch_pallas.call_custom_kernel({name!r}): the kernel takes tpu tensors "
                         f"{_show(k.ins)}, got {[f'{dt} {list(s)} on {dv}' for s, dt, dv in got]}")
    outs = [(tuple(t.shape), t.dtype) for t in output_shapes]
    if len(outs) != len(k.outs) or any(o[0] != s for o, (s, _) in zip(outs, k.outs)):
        raise ValueError(f"tpu_torch_pallas.call_custom_kernel({name!r}): the kernel returns {_show(k.outs)}, "
                         f"output_shapes asks for {[f'{d} {list(s)}' for s, d in outs]}")
    if any(not 0 <= i < len(inputs) for i in donate):
        raise ValueError(f"tpu_torch_pallas.call_custom_kernel({name!r}): donate_argnums {list(donate)} out of "
                         f"range for {len(inputs)} inputs")
    # Each donated input is paired with the first result of its shape and dtype (the buffer it becomes); an input
    # with no such result is not donated.
    pairs: dict[int, int] = {}
    for i in donate:
        o = next((j for j, a in enumerate(k.outs) if j not in pairs.values() and a == k.ins[i]
                  and outs[j][1] == inputs[i].dtype), None)
        if o is not None and i not in pairs:
            pairs[i] = o
    donate = tuple(pairs)
    index = (inputs[0].device.index or 0) if inputs else torch.tpu.current_device()
    fast = _C._whole_arrays(inputs, donate)
    if fast is not None:
        arrays, mask = list(fast[0]), fast[1]
    else:
        arrays, mask = [_storage.read(t) for t in inputs], 0
    donated = tuple(i for j, i in enumerate(donate) if mask >> j & 1)
    out_dtypes = tuple(np.dtype(_runtime.jax_dtype(d)) for _, d in outs)
    exe = _executable(k, out_dtypes, donated, index)
    del fast
    try:
        results = exe(*arrays)
    except Exception as e:
        raise RuntimeError(f"tpu_torch_pallas.call_custom_kernel({name!r}): running the kernel on inputs "
                           f"{_show(k.ins)} failed: {e}") from e
    del arrays
    tensors = list(_C._wrap_all(results, index))
    # A donated input's storage now holds a deleted array: give it the result its buffer became.
    for i in donated:
        _C._set_array(inputs[i], results[pairs[i]], inputs[i].dtype)
    return tensors
