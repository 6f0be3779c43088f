// PrivateUse1HooksInterface: availability, device count, generators, storage resize.
#include "TpuGenerator.h"
#include "TpuRuntime.h"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>

namespace torch_tpu {
namespace {

// The host allocator PyTorch's device-generic API asks for (`torch.accelerator.empty_host_cache()`, which
// `torch.accelerator.Graph` calls on entry; without one registered that call dereferences null). Host staging memory
// is ordinary pageable memory here (PJRT copies host buffers on transfer): nothing is cached, so nothing to empty.
struct TpuHostAllocator final : public at::HostAllocator {
  c10::DataPtr allocate(size_t nbytes) override { return c10::GetCPUAllocator()->allocate(nbytes); }
  c10::DeleterFnPtr raw_deleter() const override { return c10::GetCPUAllocator()->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    c10::GetCPUAllocator()->copy_data(dest, src, count);
  }
  bool record_event(void* /*ptr*/, void* /*ctx*/, c10::Stream /*stream*/) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override { return at::HostStats{}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

TpuHostAllocator g_host_allocator;

struct TpuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex device) const override { set_current_device(device); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto old = current_device();
    set_current_device(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override { return runtime_started(); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    return default_generator(device_index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    return new_generator(device_index);
  }
  at::Device getDeviceFromPtr(void* /*data*/) const override {
    return at::Device(kTpu, current_device());
  }
  bool isPinnedPtr(const void* /*data*/) const override { return false; }
  // Host staging memory is ordinary pageable memory: PJRT copies host buffers on transfer.
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_host_allocator; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage, newsize);
  }
};

struct Registerer {
  Registerer() { at::RegisterPrivateUse1HooksInterface(new TpuHooks()); }
} g_registerer;

}  // namespace
REGISTER_HOST_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_host_allocator)
}  // namespace torch_tpu
