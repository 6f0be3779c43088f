"""`torch.compile(model, backend="tpu")`: each aten graph becomes one jitted XLA program.

Dynamo captures the Python code; AOTAutograd (with `decompositions()`) turns each captured graph into functional
aten graphs, one for the forward and one for the backward (or one inference graph). Each aten graph is lowered here
into a single `jax.jit` program: an FX interpreter calls the kernel registry's lowering of every node on JAX
tracers (`_trace.trace_call`, the same table the eager kernels use; views and composites are trace-only
lowerings in kernels/views.py). Jitted programs go through JAX's compilation cache, so the persistent compile
cache applies to them.

- Shapes: every XLA program has static shapes. When Dynamo hands over symbolic sizes (`dynamic=True`,
  `mark_dynamic`, or its automatic dynamic shapes after a size changed) they enter the program as static
  arguments: the Dynamo/AOT graph is reused and XLA compiles one program per distinct concrete size (no padding).
- Mutation: functionalized graphs end with `copy_(input, new_value)` for mutated inputs (optimizer state, batch
  norm running stats in inference graphs); the program returns the new values and they are written back into the
  inputs' storages. Outputs that are graph inputs are returned as the same tensors (aliasing kept); user outputs
  whose expected strides are a permutation of a dense layout get those strides.
- CPU tensors in a graph (a non-capturable optimizer's step counts) stay on the host where they can; random ops
  (dropout) draw a fresh key per call from the tpu generator.
- Higher-order ops (flex_attention and its backward) call the registry's HIGHER_ORDER lowerings, their subgraphs
  traced through the same table. A graph with functional collectives (`_c10d_functional`) becomes one SPMD program
  over the group's mesh (`_spmd_program`), its collectives XLA collectives inside it (distributed/_compiled.py).
- Missing lowerings: compiling a graph with an aten op that has no traceable lowering raises NotImplementedError
  naming the op, its input shapes/dtypes and the ways out. With `TORCH_TPU_COMPILE_FALLBACK=eager` (or
  `options={"fallback": "eager"}`) such a graph instead runs op by op in tpu eager, with a warning.
- Inspecting: `TORCH_TPU_DUMP_DIR=dir` (or `options={"dump_dir": dir}`) writes each aten graph
  (`<graph>.fx.txt`) and each XLA program it became (`<graph>.stablehlo.mlir`).

This module imports torch._dynamo, so it is loaded only when Dynamo looks the backend up (the
`torch_dynamo_backends` entry point), never at `import torch`.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.fx
from torch._dynamo.device_interface import DeviceInterface, register_interface_for_device
from torch._dynamo.utils import counters

from torch_tpu import _C, _checks, _executor, _memory, _programs, _rng, _runtime, _storage, _trace
from torch_tpu._jax import jax
from torch_tpu._profiler import graph_program_name
from torch_tpu.kernels import registry
from torch_tpu.kernels._schema import _overload

aten = torch.ops.aten

__all__ = ["tpu_backend", "decompositions", "TpuInterface"]


# =====================================================================================================================
# ---- the boundary with tensors: the only place this module reads, writes or creates tpu tensors ----

def _read_inputs(ts: list[torch.Tensor], donate: tuple[int, ...] = ()) -> tuple[list[Any], int]:
    """The device arrays of tpu tensor inputs (the per-call path: no checks here), and a bitmask over `donate`
    (positions in `ts` of inputs the program writes back): bit j set when input donate[j]'s array may be donated
    to the program, its storage holding the only reference (DESIGN.md's storage model). One C++ call when every
    input views its whole array; else one by one, and then only the written-back inputs are asked (they usually
    are whole: parameters, optimizer state, next to gradients an eager backward left as views), an array reaching
    the program twice never donated. Under DEFER_AND_FUSE a compiled program is its own XLA program: values still
    pending are computed first."""
    if _executor.recording():
        return [_executor.concrete(_storage.read(t), "compiled_graph") for t in ts], 0
    mask = _donatable(ts, donate)
    fast = _C._whole_arrays(ts, donate[:64])
    if fast is not None:
        return list(fast[0]), fast[1] | mask
    mask = _donatable([ts[i] for i in donate], tuple(range(len(donate))), start=0) if donate else 0
    read = _storage.read
    arrays = [read(t) for t in ts]
    if mask:
        seen: dict[int, int] = {}
        for a in arrays:
            seen[id(a)] = seen.get(id(a), 0) + 1
        for j, i in enumerate(donate):
            if mask >> j & 1 and seen[id(arrays[i])] > 1:
                mask &= ~(1 << j)
    return arrays, mask


def _donatable(ts: list[torch.Tensor], donate: tuple[int, ...], start: int = 64) -> int:
    """The donation bits of donate[start:] (`_C._whole_arrays` answers for 64 candidates per call; each call's
    tuple is dropped before the next, as it holds a reference that would make every array look shared); 0 when
    some tensor does not view its whole array."""
    mask = 0
    for k in range(start, len(donate), 64):
        part = _C._whole_arrays(ts, donate[k:k + 64])
        if part is None:
            return 0
        mask |= part[1] << k
        del part
    return mask


def _read_input(t: torch.Tensor, index: int) -> Any:
    """The device array of a graph input; a CPU tensor (e.g. a step count) becomes a private numpy copy that the
    jitted call moves to the device (cheaper than a device_put of its own)."""
    if t.device.type == "tpu":
        return _executor.concrete(_storage.read(t), "compiled_graph")
    try:
        return np.array(t.detach().numpy(), copy=True)
    except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16...), conjugate or negative views
        return np.array(_runtime.host_to_numpy(t), copy=True)


def _write_mutation(t: torch.Tensor, value: Any) -> None:
    """Writes the new value of a mutated graph input into its storage (a CPU input, like a non-capturable
    optimizer's step count, is copied back to the host)."""
    if t.device.type == "tpu":
        _storage.write(t, value)
    else:
        t.copy_(_cpu_output(value))


def _write_mutations(ts: list[torch.Tensor], values: Sequence[Any]) -> None:
    """Writes the new values of mutated graph inputs: one C++ call swaps in the arrays of inputs that view their
    whole storage; the others (views, CPU inputs) are written one by one."""
    for i in _C._write_wholes(ts, values):
        _write_mutation(ts[i], values[i])


def _wrap_outputs(values: Sequence[Any], index: int) -> tuple[torch.Tensor, ...]:
    """New tpu tensors owning the program's output arrays (one C++ call)."""
    return _C._wrap_all(values, index)


def _cpu_output(value: Any) -> torch.Tensor:
    """A CPU tensor for a program output the graph expects on the host (waits for it)."""
    return _runtime.download(value)


def _write_host_mutations(ts: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """CPU inputs updated from values computed on the host (an optimizer's step counts): one foreach copy."""
    torch._foreach_copy_(ts, values)


# =====================================================================================================================
# ---- registration ----

class TpuInterface(DeviceInterface):
    """Dynamo's view of the tpu device runtime (device index, count, synchronize)."""

    class Event:  # XLA orders work per device; events are not needed by the tpu backend
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError("tpu events are not supported")

    class Stream:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError("tpu streams are not supported")

    class Worker:
        @staticmethod
        def set_device(device: int) -> None:
            torch.tpu.set_device(device)

        @staticmethod
        def current_device() -> int:
            return torch.tpu.current_device()

        @staticmethod
        def get_device_properties(device: Any = None) -> Any:
            return torch.tpu.get_device_properties(device)

    @staticmethod
    def current_device() -> int:
        return torch.tpu.current_device()

    @staticmethod
    def set_device(device: Any) -> None:
        torch.tpu.set_device(device)

    @staticmethod
    def maybe_exchange_device(device: int) -> int:
        prev = torch.tpu.current_device()
        if device != prev:
            torch.tpu.set_device(device)
        return prev

    @staticmethod
    def exchange_device(device: int) -> int:
        return TpuInterface.maybe_exchange_device(device)

    @staticmethod
    def device_count() -> int:
        return torch.tpu.device_count()

    @staticmethod
    def is_available() -> bool:
        return torch.tpu.is_available()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        torch.tpu.synchronize(device)

    @classmethod
    def get_device_properties(cls, device: Any = None) -> Any:
        return torch.tpu.get_device_properties(device)

    @staticmethod
    def get_compute_capability(device: Any = None) -> str:
        return ""

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return torch.tpu.memory_allocated(device)

    @staticmethod
    def is_triton_capable(device: Any = None) -> bool:
        return False


def _register() -> None:
    from torch._dynamo import trace_rules

    register_interface_for_device("tpu", TpuInterface)
    # User code that calls torch.tpu.* inside a compiled function graph-breaks there instead of being traced (JAX's
    # packages are on Dynamo's skip list from its start: torch_tpu/_dynamo_skip.py).
    trace_rules.add("torch_tpu")


_register()


# =====================================================================================================================
# ---- the backend ----

_GRAPH_IDS = itertools.count()


def _options(options: dict[str, Any] | None) -> dict[str, Any]:
    from torch_tpu import _config

    opts = {"dump_dir": _config.get("TORCH_TPU_DUMP_DIR"), "fallback": _config.get("TORCH_TPU_COMPILE_FALLBACK")}
    for k, v in (options or {}).items():
        if k not in opts:
            raise ValueError(f"torch.compile(backend='tpu'): unknown option {k!r}; known: {', '.join(opts)}")
        opts[k] = v
    if opts["fallback"] not in (None, "eager", "strict", "0", "off"):
        raise ValueError(f"torch.compile(backend='tpu'): fallback={opts['fallback']!r}: use 'eager' (graphs with "
                         "ops that have no tpu lowering run op by op) or leave it unset (they raise)")
    return opts


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """The Dynamo backend "tpu": AOTAutograd, then one jitted XLA program per aten graph."""
    from torch._dynamo.backends.common import aot_autograd

    from torch_tpu.compile_cache import aot

    opts = _options(kwargs.get("options"))
    gid = next(_GRAPH_IDS)
    # A warm start loads the aten graphs from PyTorch's AOTAutograd cache instead of tracing them again
    # (torch_tpu.compile_cache.aot); graphs with symbolic sizes, or with the cache off, compile as before.
    stored = aot.cacheable(gm, example_inputs)

    def compiler(kind: str) -> Callable[..., Any]:
        def compile_graph(g: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
            name = f"graph{gid}_{kind}"
            return compile_aten_graph(g, inputs, name, opts, _user_outputs(name))

        if stored:
            name = f"graph{gid}_{kind}"
            return aot.serializable(_build_graph, lambda: (name, _user_outputs(name)), opts)
        return compile_graph

    from functorch.compile import min_cut_rematerialization_partition

    # The min-cut partitioner saves fewer activations for the backward and recomputes cheap elementwise ops there
    # instead: XLA fuses the recomputation, and every saved tensor is one more program output and input.
    backend = aot_autograd(
        fw_compiler=compiler("forward"), bw_compiler=compiler("backward"), inference_compiler=compiler("inference"),
        decompositions=decompositions(), keep_inference_input_mutations=True,
        partition_fn=min_cut_rematerialization_partition,
    )
    if not stored:
        return backend(gm, example_inputs)
    with aot.caching(opts):
        return backend(gm, example_inputs)


@functools.cache
def decompositions() -> dict[Any, Callable[..., Any]]:
    """PyTorch's core-aten decompositions, plus batch norm's functional forms, minus every op the registry lowers
    itself (a lowering is one XLA op where a decomposition would be several)."""
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = dict(core_aten_decompositions())
    table.update(get_decompositions([
        aten._native_batch_norm_legit_functional, aten._native_batch_norm_legit, aten.native_batch_norm,
        aten._batch_norm_with_update, aten._batch_norm_with_update_functional, aten.native_dropout,
    ]))
    for op in list(table):
        if isinstance(op, torch._ops.OpOverload) and _trace.overload_name(op) in registry.LOWERINGS:
            del table[op]
    for name, fn in registry.GRAPH_DECOMPOSITIONS.items():
        table[_overload(name)] = fn  # direct kernels' graph forms (their result depends on the layout)
    return table


# =====================================================================================================================
# ---- one aten graph -> one jitted program ----

def _describe(node: torch.fx.Node) -> str:
    """The node's tensor inputs as `shape dtype device` (from the graph's fake tensors)."""
    parts = []
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            parts.append(f"{a.name}: {list(v.shape)} {v.dtype} {v.device}")
        elif v is not None:
            parts.append(f"{a.name}: {v!r}")
    return "; ".join(parts) or "no tensor inputs"


def _is_mutation(node: torch.fx.Node) -> bool:
    return node.target is aten.copy_.default and node.args[0].op == "placeholder"


def _check_lowerings(gm: torch.fx.GraphModule, name: str) -> list[str]:
    """Problems that stop this graph from becoming one XLA program, each naming the op and its inputs."""
    problems = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if _is_mutation(node):
            continue
        if isinstance(target, torch._ops.OpOverload):
            op = _trace.overload_name(target)
            if not _trace.traceable(op):  # (other namespaces' ops are traceable when registered: torch.tpu.jax_op)
                qualified = op if "::" in op else f"{target.namespace}::{op}"
                problems.append(f"{qualified} (node {node.name}; inputs {_describe(node)})")
            elif target in (aten.as_strided.default, aten.as_strided_copy.default):
                src = node.args[0].meta.get("val")
                if (isinstance(src, torch.Tensor) and not _symbolic(src)
                        and not (src.is_contiguous() and src.storage_offset() == 0)):
                    problems.append(f"aten::{op} of a non-contiguous input (node {node.name}; inputs "
                                    f"{_describe(node)})")
        elif isinstance(target, torch._ops.HigherOrderOperator):
            problems.extend(_higher_order_problems(node))
        elif isinstance(target, torch._ops.OperatorBase):
            problems.append(f"{target} (node {node.name}; inputs {_describe(node)})")
        # Anything else (operator.getitem, SymInt arithmetic, math.*) runs as Python at trace time.
    devices = sorted({str(v.device) for n in gm.graph.nodes for v in [n.meta.get("val")]
                      if isinstance(v, torch.Tensor) and v.device.type == "tpu"})
    if len(devices) > 1:  # one XLA program runs on one device
        problems.append(f"tensors on several devices in one graph ({', '.join(devices)}): move the .to() between "
                        "devices out of the compiled function")
    return problems


def _higher_order_problems(node: torch.fx.Node) -> list[str]:
    """A higher-order op (flex_attention...) needs a graph lowering (kernels' HIGHER_ORDER) and subgraphs whose
    aten ops are all traceable."""
    name = node.target.name()
    if not _trace.traceable_higher_order(name):
        return [f"torch.ops.higher_order.{name} (node {node.name}; inputs {_describe(node)})"]
    problems = []
    seen: list[torch.fx.Node] = []
    torch.fx.node.map_arg(_trace.higher_order_traced_args(name, node.args), lambda n: seen.append(n) or n)
    gm = node.graph.owning_module
    for a in seen:
        sub = getattr(gm, a.target, None) if a.op == "get_attr" else None
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for sn in sub.graph.nodes:
            if (sn.op == "call_function" and isinstance(sn.target, torch._ops.OpOverload)
                    and not _trace.traceable(_trace.overload_name(sn.target))):
                op = _trace.overload_name(sn.target)
                problems.append(f"{op if '::' in op else 'aten::' + op} in the {a.target} subgraph of "
                                f"torch.ops.higher_order.{name} (node {node.name})")
    return problems


def _symbolic(val: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride(), val.storage_offset()))


def _stride_plan(val: Any) -> tuple[int, ...] | None:
    """For an output expected with a dense, permuted layout: the dims in memory order (outermost first)."""
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or _symbolic(val):
        return None  # symbolic sizes: returned contiguous (reading them would specialize the graph)
    sizes, strides = [int(s) for s in val.shape], [int(s) for s in val.stride()]
    offset = int(val.storage_offset())
    if offset != 0 or math.prod(sizes) <= 1:
        return None
    order = tuple(sorted(range(len(sizes)), key=lambda d: (-strides[d], d)))
    if order == tuple(range(len(sizes))):
        return None
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return None  # overlapping, expanded or gapped: returned contiguous
        expected *= sizes[d]
    return order


def _user_outputs(name: str) -> int | None:
    """Forward graphs return the user's outputs, then activations saved for the backward graph: those are read back
    by value, so only the user's outputs get their expected strides (a permuted output costs a transpose here and
    another read in the backward). How many are the user's, from AOTAutograd's tracing context; None for other
    graphs."""
    if not name.endswith("_forward"):
        return None
    tc = torch._guards.TracingContext.try_get()
    meta = getattr(tc, "fw_metadata", None)
    return getattr(meta, "num_forward", None)


def _build_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str, n_user: int | None,
                 opts: dict[str, Any], key: str | None = None) -> Callable[..., Any]:
    """compile_aten_graph for torch_tpu.compile_cache.aot: when a graph is compiled, and again when a later process
    loads it from AOTAutograd's cache (with the n_user of the first process); `key` names the program's executable
    in the compile cache (StoredGraph._program_key)."""
    return compile_aten_graph(gm, example_inputs, name, opts, n_user, key)


def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str,
                       opts: dict[str, Any], n_user: int | None, key: str | None = None) -> Callable[..., Any]:
    """One AOTAutograd graph -> a boxed callable running it as one jitted XLA program; `n_user`: a forward graph's
    count of user outputs (`_user_outputs`); `key`: a text naming the graph the same in every process (see
    _StoredProgram), or None."""
    counters["tpu"]["graphs"] += 1
    dump_dir = Path(opts["dump_dir"]) if opts.get("dump_dir") else None
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        shapes = [f"{list(x.shape)} {x.dtype} {x.device}" if isinstance(x, torch.Tensor) else repr(x)
                  for x in example_inputs]
        (dump_dir / f"{name}.fx.txt").write_text(
            "# inputs:\n" + "".join(f"#   {i}: {s}\n" for i, s in enumerate(shapes))
            + gm.print_readable(print_output=False))

    _load_collective_lowerings(gm)
    problems = _check_lowerings(gm, name)
    if problems:
        listing = "\n  ".join(problems)
        if opts.get("fallback") == "eager":
            warnings.warn(f"torch.compile(backend='tpu'): {name} runs op by op in tpu eager (fallback='eager') "
                          f"because it cannot become one XLA program:\n  {listing}")
            counters["tpu"]["eager_fallback_graphs"] += 1
            return _boxed(lambda args: gm(*args))
        raise NotImplementedError(
            f"torch.compile(backend='tpu'): the {name} aten graph cannot become one XLA program:\n  {listing}\n"
            "Ways out: add a lowering in kernels/ (docs/adding_kernels.md); or move that code out of the compiled "
            "region (torch._dynamo.disable or torch.compiler.disable); or set TORCH_TPU_COMPILE_FALLBACK=eager "
            "(or options={'fallback': 'eager'}) to run such graphs op by op in tpu eager.")

    return _GraphProgram(gm, example_inputs, name, dump_dir, n_user, key).boxed()


class _StoredProgram:
    """A graph's program whose executable is kept whole in torch_tpu's compile cache, under a key that means the same
    in every process (`structure`: StoredGraph._program_key, the index checks and the donation mask), so a warm start
    loads it instead of tracing and lowering the graph again (what AOTAutograd's cache cannot skip: it stores the
    graph, not its XLA program). The first call loads the executable stored for its statics and inputs, or compiles
    and stores it; later calls with the same statics run it (a call whose inputs differ in shape or dtype fails the
    executable's own check before it runs, and then, like a call with other statics, runs through jax.jit as
    before)."""

    __slots__ = ("jitted", "structure", "index", "program", "statics", "__weakref__")

    _NONE = object()
    _live: "weakref.WeakSet[_StoredProgram]" = weakref.WeakSet()

    def __init__(self, jitted: Any, structure: str, index: int) -> None:
        self.jitted = jitted
        self.structure = structure
        self.index = index
        self.program: Any = None
        self.statics: Any = self._NONE
        _StoredProgram._live.add(self)

    def __call__(self, statics: tuple, *arrays: Any) -> Any:
        program = self.program
        if program is None:
            program = self._first(statics, list(arrays))
        if statics == self.statics:
            try:
                return program(*arrays)
            except TypeError:  # other input shapes or dtypes (checked before anything runs): jax.jit from now on
                self.statics = self._NONE
        return self.jitted(statics, *arrays)

    @classmethod
    def drop(cls) -> None:
        """Forgets every loaded executable (torch_tpu/_programs.py's collection); the next call loads it again."""
        for p in list(cls._live):
            p.program = None
            p.statics = cls._NONE

    def _first(self, statics: tuple, arrays: list) -> Any:
        from torch_tpu import compile_cache

        device = _runtime.device(self.index)
        structure = repr((self.structure, statics))
        program = compile_cache.load_program(structure, device, arrays)
        if program is not None:
            counters["tpu"]["programs_loaded"] += 1
        else:
            program = compile_cache.compile_program(structure, device, self.jitted, arrays, statics=(statics,))
        self.program, self.statics = program, statics
        return program


_programs.register_cache(_StoredProgram.drop)  # the program collector drops these executables too


def _match_none(value: Any, expected: Any) -> Any:
    """`value` with None wherever the graph's metadata `expected` has None (outputs nobody computes)."""
    if expected is None:
        return None
    if isinstance(expected, (tuple, list)) and isinstance(value, (tuple, list)) and len(value) == len(expected):
        return type(value)(_match_none(v, e) for v, e in zip(value, expected))
    return value


def _boxed(fn: Callable[[list], Any]) -> Callable[[list], Any]:
    def call(args: list) -> Any:
        return fn(args)

    call._boxed_call = True  # type: ignore[attr-defined]
    return call


_PACKABLE = (torch.float32, torch.float64, torch.int64, torch.int32)  # dtypes of host scalars fed packed


def _on_host(val: Any) -> bool:
    """A CPU tensor value (or a tuple of them) in the graph's metadata."""
    if isinstance(val, (tuple, list)):
        return bool(val) and all(_on_host(v) for v in val)
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"


# ---- functional collectives: a graph with collectives is one SPMD program over the group's devices ----

def _has_collectives(nodes: Any) -> bool:
    return any(n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
               for n in nodes)


def _load_collective_lowerings(gm: torch.fx.GraphModule) -> None:
    """The functional collectives' graph lowerings live with tpu_dist (distributed/_compiled.py): registered when
    a graph first has one."""
    if _has_collectives(gm.graph.nodes):
        from torch_tpu.distributed import _compiled  # noqa: F401  (registers the lowerings)


def _collective_mesh(nodes: Sequence[torch.fx.Node], name: str) -> tuple[Any, Any] | None:
    """(mesh, process group) when the graph has functional collectives, else None."""
    if not _has_collectives(nodes):
        return None
    from torch_tpu.distributed import _compiled

    return _compiled.program_mesh(nodes, name)


def _wait_for_group(pg: Any) -> None:
    from torch_tpu.distributed import _compiled

    _compiled.wait_for_group(pg)


def _spmd_program(run: Callable[..., Any], mesh: Any, index: int) -> Callable[..., Any]:
    """`run(statics, *arrays)` as one program over `mesh` (`jax.shard_map` on its one axis): each rank passes its
    local arrays and gets its local results, the program's collectives run across the ranks. The local arrays
    become the shards of global arrays (concatenated along axis 0: no copy); 0-d values travel as shape (1,)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from torch_tpu.distributed import _compiled

    spec = PartitionSpec(_compiled.axis_name())
    sharding = NamedSharding(mesh, spec)
    n = mesh.size
    scalar_outs: dict[tuple, list[bool]] = {}  # (statics, scalar inputs) -> which output leaves are 0-d

    def body(statics: tuple, scalars: tuple, *local: Any) -> Any:
        local = tuple(a.reshape(()) if s else a for a, s in zip(local, scalars))
        leaves, tree = jax.tree.flatten(run(statics, *local))
        scalar_outs[(statics, scalars)] = [v.ndim == 0 for v in leaves]
        return jax.tree.unflatten(tree, [v.reshape((1,)) if v.ndim == 0 else v for v in leaves])

    def spmd(statics: tuple, scalars: tuple, *glob: Any) -> Any:
        return jax.shard_map(functools.partial(body, statics, scalars), mesh=mesh, in_specs=spec, out_specs=spec,
                             check_vma=False)(*glob)

    spmd.__name__ = getattr(run, "__name__", "program")
    jitted = jax.jit(spmd, static_argnums=(0, 1))
    device = _runtime.device(index)

    def global_arrays(arrays: Sequence[Any]) -> tuple[tuple, list[Any]]:
        local = [jax.device_put(a, device) if isinstance(a, np.ndarray) else a for a in arrays]
        scalars = tuple(a.ndim == 0 for a in local)
        local = [a.reshape((1,)) if s else a for a, s in zip(local, scalars)]
        return scalars, [jax.make_array_from_single_device_arrays((n * a.shape[0],) + tuple(a.shape[1:]),
                                                                  sharding, [a]) for a in local]

    def call(statics: tuple, *arrays: Any) -> Any:
        scalars, glob = global_arrays(arrays)
        leaves, tree = jax.tree.flatten(jitted(statics, scalars, *glob))
        flags = scalar_outs[(statics, scalars)]
        local = [v.addressable_shards[0].data for v in leaves]
        return jax.tree.unflatten(tree, [v.reshape(()) if f else v for v, f in zip(local, flags)])

    def lower(statics: tuple, *arrays: Any) -> Any:
        scalars, glob = global_arrays(arrays)
        return jitted.lower(statics, scalars, *glob)

    call.lower = lower  # type: ignore[attr-defined]
    return call


class _GraphProgram:
    """The jitted program of one aten graph and the glue that feeds it tensors.

    CPU tensors in a tpu graph (a non-capturable optimizer's step counts) stay on the host: the nodes computed
    from CPU inputs alone run there first, op by op, and only the values the device part needs are sent. A CPU
    input updated from host values is then updated on the host, with no wait for the device."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str,
                 dump_dir: Path | None, n_user_outputs: int | None = None, key: str | None = None) -> None:
        self.gm = gm
        self.name = name
        self.key = key
        self.dump_dir = dump_dir
        self.nodes = list(gm.graph.nodes)
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.placeholder_pos = {n: i for i, n in enumerate(placeholders)}
        self.tensor_idx: list[int] = []  # tpu tensor inputs (fed as device arrays)
        self.static_idx: list[int] = []  # number inputs (SymInts...): static arguments
        self.index = -1
        host: dict[torch.fx.Node, None] = {}  # nodes evaluated on the host, in graph order
        for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
            if isinstance(x, torch.Tensor):
                if x.device.type == "tpu":
                    self.tensor_idx.append(i)
                    if self.index < 0:
                        self.index = x.device.index or 0
                else:
                    host[node] = None
            else:
                self.static_idx.append(i)
        if self.index < 0:  # no tpu inputs: the device the graph creates its tensors on
            devices = [v.device for n in self.nodes for v in [n.meta.get("val")]
                       if isinstance(v, torch.Tensor) and v.device.type == "tpu"]
            self.index = (devices[0].index or 0) if devices else _C._current_device()
        # Host-computable nodes (CPU values from CPU inputs alone); only those that CPU inputs' updates need run
        # on the host (op by op costs more than in the program).
        computable = dict(host)
        for node in self.nodes:
            if (node.op == "call_function" and not _is_mutation(node) and _on_host(node.meta.get("val"))
                    and all(a in computable for a in node.all_input_nodes)):
                computable[node] = None
        needed: set[torch.fx.Node] = set()
        stack = [n.args[1] for n in self.nodes if n.op == "call_function" and _is_mutation(n)
                 and n.args[0] in host and n.args[1] in computable]
        while stack:
            n = stack.pop()
            if n not in needed:
                needed.add(n)
                stack.extend(n.all_input_nodes)
        host.update((n, None) for n in self.nodes if n in needed and n not in host)
        host = {n: None for n in self.nodes if n in host}  # graph order
        self.host = host
        # Host values the device part reads, fed as extra arguments.
        self.host_feeds = [n for n in host if any(u not in host and u.op != "output" and not
                                                  (_is_mutation(u) and u.args[0] in host and u.args[1] in host)
                                                  for u in n.users)]
        # Scalar host values of one dtype (an optimizer's step counts) travel as one array: one transfer per call.
        vals = [n.meta.get("val") for n in self.host_feeds]
        self.feeds_packed = (len(vals) > 1 and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in vals)
                             and len({v.dtype for v in vals}) == 1 and vals[0].dtype in _PACKABLE)
        # Constants held by the graph module (get_attr): read once, fed as extra arguments.
        self.constants: list[Any] = []
        self.constant_nodes: list[torch.fx.Node] = []
        for node in self.nodes:
            if node.op == "get_attr":
                value = getattr(gm, node.target)
                if isinstance(value, torch.Tensor):
                    self.constant_nodes.append(node)
                    self.constants.append(_read_input(value, self.index))
        # Mutated inputs: copy_(placeholder, value), in graph order; on the host when both sides are.
        mutations = [n for n in self.nodes if n.op == "call_function" and _is_mutation(n)]
        self.host_mutations = [(self.placeholder_pos[n.args[0]], n.args[1]) for n in mutations
                               if n.args[0] in host and n.args[1] in host]
        self.device_mutations = {n for n in mutations if not (n.args[0] in host and n.args[1] in host)}
        self.skip = set(host) | {n for n in mutations if n not in self.device_mutations}
        self.mutated = [self.placeholder_pos[n.args[0]] for n in mutations if n in self.device_mutations]
        # Outputs: ("input", i) an input returned as is; ("host", node) a host value; ("array", k, plan) the
        # program's k-th array output; ("value", j) a non-tensor value (a SymInt...) fixed per static key; ("none",).
        out_node = next(n for n in self.nodes if n.op == "output")
        outs = out_node.args[0]
        self.out_tuple = isinstance(outs, (tuple, list))
        self.out_spec: list[tuple] = []
        k = j = 0
        for pos, o in enumerate(outs if self.out_tuple else (outs,)):
            saved = n_user_outputs is not None and pos >= n_user_outputs
            if o is None:
                self.out_spec.append(("none",))
            elif isinstance(o, torch.fx.Node) and o.op == "placeholder":
                self.out_spec.append(("input", self.placeholder_pos[o]))
            elif isinstance(o, torch.fx.Node) and o in host:
                self.out_spec.append(("host", o))
            elif isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
                cpu = o.meta["val"].device.type == "cpu"  # a CPU value computed in the program: sent back
                plan = None if cpu or saved else _stride_plan(o.meta["val"])
                self.out_spec.append(("array", k, plan, cpu))
                k += 1
            else:
                self.out_spec.append(("value", j))
                j += 1
        self.out_values: dict[tuple, list[Any]] = {}  # static key -> the non-tensor outputs
        self.seen: set[tuple] = set()  # static keys called (counters["tpu"]["xla_programs"] counts each once)
        if j:  # non-tensor outputs are known only from a trace: a program loaded whole would not have them
            self.key = None
        # Random ops (dropout...): each call draws a (seed, offset) from the device's tpu generator, as eager does.
        self.random = any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                          and torch.Tag.nondeterministic_seeded in n.target.tags for n in self.nodes)
        # Donation: a tpu input the program writes back whole (optimizer state, parameters, running stats) gives
        # its buffer to the program for the new value, when its storage holds the only reference (checked per
        # call, _read_inputs); positions in tensor_idx, in the order of the donation bitmask.
        pos_in = {p: k for k, p in enumerate(self.tensor_idx)}
        donate = []
        for n in mutations:
            if n not in self.device_mutations or self.placeholder_pos[n.args[0]] not in pos_in:
                continue
            dst = n.args[0].meta.get("val")
            if isinstance(dst, torch.Tensor) and not _symbolic(dst):
                donate.append(pos_in[self.placeholder_pos[n.args[0]]])
        self.donate = tuple(dict.fromkeys(donate))
        # Functional collectives: the program is one SPMD program over the group's mesh (_spmd_program).
        self.spmd = _collective_mesh(self.nodes, name)
        if self.spmd is not None:
            self.donate = ()  # the program's inputs are global arrays built around the local buffers
        # Programs by (index checks on, donation bitmask): with the index checks (the default) and without (the
        # unsafe opt-out, see _checks); one per set of donated inputs (in a steady loop: all of them).
        self._programs: dict[tuple[bool, int], Any] = {}
        # What `_dump` lowers (index checks on, nothing donated): the SPMD program itself, else the plain jax.jit.
        self.jitted = self._program(True, 0) if self.spmd is not None else self._jitted(True, 0)
        self.dumped: set[tuple] = set()

    def _jitted(self, checked: bool, mask: int) -> Any:
        kwargs: dict[str, Any] = {"static_argnums": 0}
        if mask:
            kwargs["donate_argnums"] = tuple(1 + k for j, k in enumerate(self.donate) if mask >> j & 1)
        if not self.tensor_idx:  # nothing to follow: place the outputs on the graph's device
            kwargs["out_shardings"] = jax.sharding.SingleDeviceSharding(_runtime.device(self.index))
        return jax.jit(self._named_run, **kwargs)

    def _program(self, checked: bool, mask: int) -> Any:
        prog = self._programs.get((checked, mask))
        if prog is None and self.spmd is not None:
            prog = self._programs[(checked, mask)] = _spmd_program(self._named_run, self.spmd[0], self.index)
        if prog is None:
            prog = self._jitted(checked, mask)
            if self.key is not None:
                prog = _StoredProgram(prog, repr((self.key, checked, mask)), self.index)
            self._programs[(checked, mask)] = prog
        return prog

    # -- the traced function: the FX interpreter over JAX values --
    @functools.cached_property
    def _named_run(self) -> Callable[..., Any]:
        """`_run` under the program's name (jax.jit names it `jit_<name>`): the graph's kind and its first distinct
        aten ops, e.g. `torch_tpu_forward_graph_12_ops_addmm_relu` (torch_tpu/_profiler.py graph_program_name),
        the same in every process (JAX's persistent cache key starts with it, so no per-process graph number)."""
        run = self._run

        def program(statics: tuple, *arrays: Any) -> tuple[tuple, tuple, dict]:
            return run(statics, *arrays)

        calls = [n for n in self.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
        kind = self.name.rpartition("_")[2] or "graph"
        program.__name__ = graph_program_name(f"torch_tpu_{kind}_graph_{len(calls)}_ops_",
                                              (n.target.name() for n in calls))
        return program

    def _run(self, statics: tuple, *arrays: Any) -> tuple[tuple, tuple, dict]:
        # The index checks of the graph's ops are outputs of the program (registered after each call).
        with _checks.collecting() as checks:
            if not self.random:
                outs, muts = self._interpret(statics, arrays)
            else:
                # The call passes (inputs, host feeds, rng seed and offset, constants): the draw sits before the
                # graph's constants, not at the end.
                at = len(arrays) - len(self.constants) - 2
                with _rng.trace_random(_rng.key(*arrays[at:at + 2])):
                    outs, muts = self._interpret(statics, arrays[:at] + arrays[at + 2:])
        return outs, muts, dict(checks)

    def _interpret(self, statics: tuple, arrays: tuple) -> tuple[tuple, tuple]:
        env: dict[torch.fx.Node, Any] = {}
        n_in, n_host = len(self.tensor_idx), len(self.host_feeds)
        inputs = dict(zip(self.tensor_idx, arrays[:n_in]))
        inputs.update(zip(self.static_idx, statics))
        if self.feeds_packed:
            env.update((n, arrays[n_in][k]) for k, n in enumerate(self.host_feeds))
            n_host = 1
        else:
            env.update(zip(self.host_feeds, arrays[n_in:n_in + n_host]))
        env.update(zip(self.constant_nodes, arrays[n_in + n_host:]))
        mutations: list[Any] = []
        result: Any = None
        for node in self.nodes:
            if node in env or node in self.skip:
                continue
            if node.op == "placeholder":
                env[node] = inputs[self.placeholder_pos[node]]
            elif node.op == "get_attr":
                env[node] = getattr(self.gm, node.target)
            elif node.op == "call_function":
                args = torch.fx.node.map_arg(node.args, env.__getitem__)
                kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
                env[node] = self._call(node, args, kwargs, mutations)
            elif node.op == "output":
                result = torch.fx.node.map_arg(node.args[0], lambda n: None if n in self.host else env[n])
            else:
                raise NotImplementedError(f"torch.compile(backend='tpu'): FX node kind {node.op!r} ({node.name})")
        values = result if self.out_tuple else (result,)
        arrays_out, others = [], []
        for spec, v in zip(self.out_spec, values):
            if spec[0] == "array":
                plan = spec[2]
                arrays_out.append(v if plan is None else v.transpose(plan))
            elif spec[0] == "value":
                others.append(v)
        self.out_values[statics] = others
        return tuple(arrays_out), tuple(mutations)

    def _call(self, node: torch.fx.Node, args: Any, kwargs: Any, mutations: list[Any]) -> Any:
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            return self._call_higher_order(node, args, kwargs)
        if not isinstance(target, torch._ops.OpOverload):
            return target(*args, **kwargs)  # operator.getitem, SymInt arithmetic
        if node in self.device_mutations:
            new = _trace.trace_call("copy", [args[0], args[1]], {})
            mutations.append(new)
            return new
        op = _trace.overload_name(target)
        try:
            return _trace.trace_call(op, args, kwargs)
        except Exception as e:
            msg = (f"torch.compile(backend='tpu'): lowering aten::{op} failed in {self.name} at node {node.name} "
                   f"(inputs {_describe(node)}): {type(e).__name__}: {e}")
            try:
                err = type(e)(msg)
            except Exception:  # exception types with other constructors (JAX's tracer errors)
                err = RuntimeError(msg)
            raise err from e

    def _call_higher_order(self, node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
        """A higher-order op (flex_attention): its registry lowering, with the subgraphs lowered as JAX callables.
        Outputs the graph expects as None (a buffer's gradient it does not need) stay None."""
        name = node.target.name()
        try:
            out = _trace.trace_higher_order(name, args, kwargs)
        except Exception as e:
            msg = (f"torch.compile(backend='tpu'): lowering torch.ops.higher_order.{name} failed in {self.name} at "
                   f"node {node.name} (inputs {_describe(node)}): {type(e).__name__}: {e}")
            try:
                err = type(e)(msg)
            except Exception:
                err = RuntimeError(msg)
            raise err from e
        return _match_none(out, node.meta.get("val"))

    def _host_part(self) -> tuple[Callable[..., tuple], list[int], dict[torch.fx.Node, int]]:
        """The host nodes as one generated Python function (torch.fx code, no interpreter per node): it takes the
        CPU inputs (positions returned) and returns the host values the call needs (index of each node)."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in self.host:
            env[node] = graph.node_copy(node, env.__getitem__)
        wanted = list(dict.fromkeys([*self.host_feeds, *(v for _, v in self.host_mutations),
                                     *(s[1] for s in self.out_spec if s[0] == "host")]))
        graph.output(tuple(env[n] for n in wanted))
        module = torch.fx.GraphModule(self.gm, graph)
        return module.forward, [self.placeholder_pos[n] for n in self.host if n.op == "placeholder"], \
            {n: k for k, n in enumerate(wanted)}

    # -- the call --
    def boxed(self) -> Callable[[list], Any]:
        tensor_idx, static_idx, mutated = self.tensor_idx, self.static_idx, self.mutated
        constants, index, out_spec = self.constants, self.index, self.out_spec
        out_tuple, out_values, seen = self.out_tuple, self.out_values, self.seen
        host, feeds_packed = self.host, self.feeds_packed
        # The host part (CPU values from CPU inputs) as one generated function; what it returns, by position.
        host_fn, host_args, at = self._host_part() if host else (None, [], {})
        feeds = [at[n] for n in self.host_feeds]
        host_dst = [i for i, _ in self.host_mutations]
        host_new = [at[v] for _, v in self.host_mutations]

        donate, programs, spmd = self.donate, self._programs, self.spmd
        # Mutated tpu inputs written back by one C++ call; the arrays wrapped as new tensors by another.
        wrapped = [s[1] for s in out_spec if s[0] == "array" and not s[3]]

        def call(args: list) -> Any:
            statics = tuple(args[i] for i in static_idx)
            arrays, mask = _read_inputs([args[i] for i in tensor_idx], donate)
            hv = host_fn(*[args[i] for i in host_args]) if host else ()
            if feeds_packed:
                arrays.append(np.array(torch.stack([hv[k] for k in feeds]).numpy(), copy=True))
            elif feeds:
                arrays += [_read_input(hv[k], index) for k in feeds]
            if self.random:
                arrays += _rng.program_draw(index)
            if self.dump_dir is not None and statics not in self.dumped:
                self._dump(statics, arrays)
            if statics not in seen:  # a program traced and compiled, or loaded whole (_StoredProgram)
                seen.add(statics)
                counters["tpu"]["xla_programs"] += 1
            checked = _checks.enabled
            if mask:
                counters["tpu_donation"]["inputs"] += mask.bit_count()  # apart: counters["tpu"] counts compiles
            program = programs.get((checked, mask)) or self._program(checked, mask)
            if spmd is not None:
                _wait_for_group(spmd[1])
            try:
                outs, muts, checks = program(statics, *arrays, *constants)
            except RuntimeError:  # PJRT's RESOURCE_EXHAUSTED becomes torch.OutOfMemoryError
                _memory.raise_if_oom(index, f"the compiled graph {self.name}")
                raise
            del arrays  # the donated arrays are gone
            if checks:
                _checks.register(checks)
            if host_dst:
                _write_host_mutations([args[i] for i in host_dst], [hv[k] for k in host_new])
            if mutated:
                _write_mutations([args[i] for i in mutated], muts)
            tensors = dict(zip(wrapped, _wrap_outputs([outs[k] for k in wrapped], index))) if wrapped else None
            results = []
            for spec in out_spec:
                kind = spec[0]
                if kind == "array" and spec[3]:
                    results.append(_cpu_output(outs[spec[1]]))
                elif kind == "array":
                    t = tensors[spec[1]]
                    plan = spec[2]
                    if plan is not None:  # back to the logical order, with the expected strides
                        t = t.permute(tuple(plan.index(d) for d in range(len(plan))))
                    results.append(t)
                elif kind == "input":
                    results.append(args[spec[1]])
                elif kind == "host":
                    results.append(hv[at[spec[1]]])
                elif kind == "value":
                    results.append(out_values[statics][spec[1]])
                else:
                    results.append(None)
            args.clear()
            return results if out_tuple else results[0]

        call._boxed_call = True  # type: ignore[attr-defined]
        return call

    def _dump(self, statics: tuple, arrays: list[Any]) -> None:
        self.dumped.add(statics)
        suffix = "" if not statics else "_" + "_".join(str(s) for s in statics)
        text = self.jitted.lower(statics, *arrays, *self.constants).as_text()
        (self.dump_dir / f"{self.name}{suffix}.stablehlo.mlir").write_text(text)
