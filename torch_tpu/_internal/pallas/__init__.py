"""`torch_tpu._internal.pallas.tpu_torch_pallas`: the module Inductor's Pallas code for device `tpu` calls."""
