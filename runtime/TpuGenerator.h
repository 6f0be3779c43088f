// The tpu random generator: a (seed, offset) pair, like CUDA's Philox state. Kernels turn it into a JAX
// PRNG key (seed) folded with the offset, then advance the offset, so runs are reproducible under a seed
// and get_state/set_state round-trip.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

#include <utility>

namespace torch_tpu {

struct TpuGeneratorImpl : public c10::GeneratorImpl {
  explicit TpuGeneratorImpl(c10::DeviceIndex device_index);
  void set_current_seed(uint64_t seed) override;
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override;
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  // Returns (seed, offset) for one random op and advances the offset by `increment`.
  std::pair<uint64_t, uint64_t> philox_step(uint64_t increment);
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

 private:
  TpuGeneratorImpl* clone_impl() const override;
  uint64_t seed_;
  uint64_t offset_ = 0;
};

const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);

}  // namespace torch_tpu
