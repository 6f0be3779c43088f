"""Warm starts of `torch.compile(backend="tpu")`: PyTorch's own AOTAutograd cache stores what the backend made.

A fresh process compiling a model spends most of its first step in Dynamo and AOTAutograd (tracing the joint
graph, the min-cut partitioner, which imports most of Inductor), not in XLA. PyTorch's AOTAutogradCache skips all
of AOTAutograd on a hit, for a backend whose compilers return a serializable `OutputCode` and with its "bundled"
mode, where the entry holds that output itself (as `torch._functorch.aot_autograd.aot_compile_joint_with_descriptors`
does for precompile). `StoredGraph` is that output for one aten graph: it keeps the graph (with its nodes'
metadata, through torch.fx's GraphPickler) and what the backend's builder needs, and a loaded entry builds the
jitted program again, whose executable then comes from the persistent compile cache.

Safety of an entry (PyTorch's key covers the Dynamo graph, the inputs' metadata, torch's own sources and configs):
- the key also gets torch_tpu's salt (torch_tpu/jax/jaxlib/libtpu versions, torch_tpu's sources, JAX's
  configuration and XLA_FLAGS, the backend's options) as the uuid of a custom graph pass, the hook PyTorch's key
  offers for code it cannot see; a stale entry is a miss, and Inductor's entries for the same graph never match;
- each entry carries its graph's sha256 and the salt, checked again on load: a damaged entry is not loaded
  (AOTAutograd then compiles the graph afresh, `CompileCacheWarning`);
- graphs with symbolic sizes are not stored (their guards would need the shape environment of the first process);
- it follows TORCH_TPU_CACHE: off, nothing is stored or loaded. The entries live in PyTorch's cache directory
  (`TORCHINDUCTOR_CACHE_DIR`, `.../aotautograd`), a few KB per graph, written atomically by PyTorch.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.output_code import OutputCode

__all__ = ["StoredGraph", "serializable", "caching", "cacheable"]


def _salt(options: Any) -> str:
    from torch_tpu import compile_cache

    return repr((compile_cache._versions(), compile_cache._source_hash(),
                 compile_cache._config_hash(), options))


class _Salt(CustomGraphPass):
    """Never run (Inductor does not run for the tpu backend): its uuid puts torch_tpu's salt in PyTorch's key."""

    def __init__(self, salt: str) -> None:
        self.salt = salt

    def __call__(self, graph: torch.fx.Graph) -> None:  # pragma: no cover - never called
        return None

    def uuid(self) -> Any:
        return self.salt


def _describe_inputs(example_inputs: Sequence[Any]) -> list[Any]:
    """Where each graph input lives ("tpu:0", "cpu") or None for a number: what the builder reads of them."""
    return [str(x.device) if isinstance(x, torch.Tensor) else None for x in example_inputs]


def _stand_ins(described: list[Any]) -> list[Any]:
    return [torch.empty(0, device=d) if d is not None else 0 for d in described]


class StoredGraph(OutputCode):
    """One aten graph compiled by `build(gm, example_inputs, *args)` (a module-level function, pickled by name),
    as AOTAutogradCache stores it: the graph and the builder's arguments, never the built program."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 build: Callable[..., Callable[[list], Any]], args: tuple, options: Any, salt: str) -> None:
        super().__init__()
        self._gm: torch.fx.GraphModule | None = gm
        self._inputs = _describe_inputs(example_inputs)
        self._build = build
        self._args = args
        self._options = options
        self._salt = salt
        self._data: bytes | None = None
        self._digest = ""
        self._boxed_call = True
        self._pickle()  # the digest names the built program's executable in the compile cache (_program_key)
        self._call: Callable[[list], Any] | None = build(gm, example_inputs, *args, options,
                                                         key=self._program_key())

    def _pickle(self) -> None:
        from torch.fx._graph_pickler import GraphPickler

        try:
            self._data = GraphPickler.dumps(self._gm)  # only aten ops: graphs with custom ops are not stored
        except Exception as e:  # noqa: BLE001 - not storable (prepare_for_serialization says so to AOTAutograd)
            # (its text only: the exception's frames would keep the graph's fake tensors alive)
            self._data, self._problem = None, f"{type(e).__name__}: {e}"
            return
        self._digest = hashlib.sha256(self._data).hexdigest()

    def _program_key(self) -> str | None:
        """What the built program's executable is stored under in torch_tpu's compile cache (with its inputs'
        shapes and the call's statics, compile_cache._program_text): the graph (its pickle's digest, nodes'
        metadata included), torch_tpu's salt, the builder's arguments past the program's name (the first, which
        holds a per-process graph number and changes nothing in the program) and where the inputs live. None when
        the graph cannot be pickled: its program is traced and compiled as before."""
        if not self._digest:
            return None
        return repr(("aot-graph", self._digest, self._salt, self._args[1:], self._inputs))

    def __call__(self, inputs: list) -> Any:
        return self._call(inputs)  # type: ignore[misc]

    def prepare_for_serialization(self) -> None:
        # Called on a shallow copy (AOTAutogradCache's pre_save): the live object keeps its program.
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

        gm = self._gm
        if gm is None or any(n.op == "placeholder" and "val" not in n.meta for n in gm.graph.nodes):
            raise BypassAOTAutogradCache("torch_tpu: the graph's metadata is gone; not stored")
        if self._data is None:  # (pickled when it was compiled: _pickle)
            raise BypassAOTAutogradCache(f"torch_tpu: graph not storable ({getattr(self, '_problem', '?')})")
        self._gm = None
        self._call = None

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        if self._call is not None:
            return
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

        from torch_tpu.compile_cache import CompileCacheWarning

        problem = None
        if self._data is None or hashlib.sha256(self._data).hexdigest() != self._digest:
            problem = "corrupt (checksum mismatch)"
        elif self._salt != _salt(self._options):
            problem = "stored by another torch_tpu, jax or configuration"
        if problem is not None:
            warnings.warn(f"torch_tpu compile cache: a stored compiled graph is {problem}; compiling it again.",
                          CompileCacheWarning, stacklevel=2)
            raise BypassAOTAutogradCache(problem)
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler

        fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
        gm = GraphPickler.loads(self._data, fake_mode)
        if any(n.op == "placeholder" and "val" not in n.meta for n in gm.graph.nodes):
            raise BypassAOTAutogradCache("torch_tpu: a stored graph lacks its metadata")
        gm.recompile()
        self._gm = gm
        self._call = self._build(gm, _stand_ins(self._inputs), *self._args, self._options, key=self._program_key())

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass


def cacheable(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether this Dynamo graph may use the cache: the cache is on and no size is symbolic."""
    from torch_tpu import compile_cache

    if not compile_cache.enabled():
        return False
    for x in example_inputs:
        if isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride(), x.storage_offset()))):
            return False
    return True


def serializable(build: Callable[..., Callable[[list], Any]], args: Callable[[], tuple], options: Any) -> Any:
    """An AOTAutograd compiler whose outputs AOTAutogradCache can store: a graph compiles as
    `build(gm, example_inputs, *args(), options)`; `args()` runs when the graph is compiled (in AOTAutograd's
    tracing context) and what it returns is stored for the later processes that load the graph. `options` (the
    backend's) are part of the salt."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

    salt = _salt(options)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> StoredGraph:
        return StoredGraph(gm, example_inputs, build, args(), options, salt)

    return SerializableAOTDispatchCompiler(StoredGraph, compile_graph)


_tls = threading.local()  # .on: this thread is computing a key for the tpu backend (inside `caching`)
_installed: list[Any] = []


def _skip_inductor_codegen_registration() -> None:
    """PyTorch's cache key (FxGraphHashDetails) calls Inductor's `init_backend_registration` to hash the custom
    passes of Inductor's device code generators; that imports all of them (C++, Triton, CUTLASS, Pallas... about
    3 s here, most of a warm first step). No Inductor code generator ever runs for the tpu backend, and torch_tpu's
    own salt is in the key, so for the tpu backend's lookups (this thread, inside `caching`) the registration is
    skipped: the key then omits passes registered by nobody. Everywhere else (Inductor's own compiles, other
    threads) the original runs. In a process where Inductor registered its backends first the key differs: a miss,
    never a wrong hit."""
    import torch._inductor.codecache as codecache

    if _installed:
        return
    original = codecache.init_backend_registration

    def init_backend_registration() -> None:
        if not getattr(_tls, "on", False):
            original()

    _installed.append(original)
    codecache.init_backend_registration = init_backend_registration


@contextlib.contextmanager
def caching(options: Any) -> Iterator[None]:
    """The configuration under which AOTAutograd looks the graph up and stores it (bundled entries, the backward
    compiled with the forward so the entry holds both, torch_tpu's salt in the key)."""
    _skip_inductor_codegen_registration()
    before = getattr(_tls, "on", False)
    _tls.on = True
    try:
        with torch._functorch.config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True), \
                torch._inductor.config.patch(post_grad_custom_post_pass=_Salt(_salt(options))):
            yield
    finally:
        _tls.on = before
