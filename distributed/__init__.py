"""torch_tpu.distributed: the `tpu_dist` torch.distributed backend.

Planned (issue "tpu_dist"): a c10d backend registered for device `tpu` whose collectives are XLA programs
over a global JAX mesh spanning all processes (jax.distributed; ICI/DCN on TPU, gloo on XLA:CPU).
Not implemented yet: `dist.init_process_group(backend="tpu_dist")` does not exist in this release.
"""
