"""torch_tpu.compile_cache: the persistent on-disk cache of compiled XLA executables, safe across processes.

Planned (issue "Execution modes and the persistent compilation cache"): on by default in the user cache
directory (TORCH_TPU_CACHE_DIR, TORCH_TPU_CACHE=0), keyed by program, compiler options, jax/jaxlib/libtpu
versions, platform, device kind and torch_tpu version; atomic, checksummed entries; an LRU size cap;
`torch.tpu.compile_cache.stats()` and `python -m torch_tpu.compile_cache info|clear|prune`.
Nothing is cached on disk yet: every process compiles its programs afresh.
"""
