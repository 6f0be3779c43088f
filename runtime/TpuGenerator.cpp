#include "TpuGenerator.h"

#include "TpuRuntime.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <random>

namespace torch_tpu {

constexpr size_t kStateBytes = 16;  // seed (8) + offset (8)

TpuGeneratorImpl::TpuGeneratorImpl(c10::DeviceIndex device_index)
    : c10::GeneratorImpl(c10::Device(kTpu, device_index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      seed_(c10::default_rng_seed_val) {}

void TpuGeneratorImpl::set_current_seed(uint64_t seed) {
  seed_ = seed;
  offset_ = 0;
}

uint64_t TpuGeneratorImpl::seed() {
  std::random_device rd;
  uint64_t s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  set_current_seed(s);
  return s;
}

void TpuGeneratorImpl::set_state(const c10::TensorImpl& new_state) {
  TORCH_CHECK(new_state.dtype() == caffe2::TypeMeta::Make<uint8_t>() &&
                  new_state.numel() == static_cast<int64_t>(kStateBytes) &&
                  new_state.device().is_cpu(),
              "torch_tpu: a tpu generator state is a CPU ByteTensor of ", kStateBytes,
              " bytes (seed, offset); got ", new_state.numel(), " elements of ", new_state.dtype(),
              " on ", new_state.device());
  const auto* p = static_cast<const uint8_t*>(new_state.data());
  std::memcpy(&seed_, p, 8);
  std::memcpy(&offset_, p + 8, 8);
}

c10::intrusive_ptr<c10::TensorImpl> TpuGeneratorImpl::get_state() const {
  auto t = at::detail::empty_cpu({static_cast<int64_t>(kStateBytes)}, c10::ScalarType::Byte,
                                 std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  auto* p = static_cast<uint8_t*>(t.mutable_data_ptr());
  std::memcpy(p, &seed_, 8);
  std::memcpy(p + 8, &offset_, 8);
  return t.getIntrusivePtr();
}

std::pair<uint64_t, uint64_t> TpuGeneratorImpl::philox_step(uint64_t increment) {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t off = offset_;
  offset_ += increment;
  return {seed_, off};
}

TpuGeneratorImpl* TpuGeneratorImpl::clone_impl() const {
  auto* g = new TpuGeneratorImpl(device().index());
  g->seed_ = seed_;
  g->offset_ = offset_;
  return g;
}

const at::Generator& default_generator(c10::DeviceIndex index) {
  static std::mutex mu;
  static std::deque<at::Generator> gens;  // stable addresses
  c10::DeviceIndex n = device_count();
  if (index < 0) index = current_device();
  check_device_index(index);
  std::lock_guard<std::mutex> lock(mu);
  while (static_cast<c10::DeviceIndex>(gens.size()) < n) {
    gens.emplace_back(at::make_generator<TpuGeneratorImpl>(static_cast<c10::DeviceIndex>(gens.size())));
  }
  return gens[index];
}

at::Generator new_generator(c10::DeviceIndex index) {
  if (index < 0) index = current_device();
  return at::make_generator<TpuGeneratorImpl>(index);
}

}  // namespace torch_tpu
