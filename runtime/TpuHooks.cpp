// PrivateUse1HooksInterface: availability, device count, generators, storage resize.
#include "TpuGenerator.h"
#include "TpuRuntime.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>

namespace torch_tpu {
namespace {

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
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage, newsize);
  }
};

struct Registerer {
  Registerer() { at::RegisterPrivateUse1HooksInterface(new TpuHooks()); }
} g_registerer;

}  // namespace
}  // namespace torch_tpu
