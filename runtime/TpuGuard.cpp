// DeviceGuardImplInterface for tpu: a per-thread current device index and one default stream per device
// (PJRT orders work per device; explicit streams come later).
#include "TpuRuntime.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace torch_tpu {
namespace {

thread_local c10::DeviceIndex t_current = 0;
std::atomic<int> g_count{-1};  // -1: runtime not started

// Starts the runtime once. The once-logic is torch_tpu._runtime.start's lock, taken under the GIL: the start
// imports JAX, which releases the GIL, so a C++ mutex held across the call would deadlock against a second
// thread waiting for that mutex while holding the GIL. A Python lock releases the GIL while it waits. Callers
// without the GIL (the autograd engine starting its device threads) take it here.
int start_runtime() {
  TORCH_CHECK(callbacks().start_runtime != nullptr,
              "torch_tpu: the runtime is not initialised (import torch_tpu first)");
  PyGILState_STATE st = PyGILState_Ensure();
  int n = g_count.load();
  if (n >= 0) {
    PyGILState_Release(st);
    return n;
  }
  PyObject* res = PyObject_CallNoArgs(callbacks().start_runtime);
  if (res == nullptr) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject* s = value ? PyObject_Str(value) : nullptr;
    std::string msg = s ? PyUnicode_AsUTF8(s) : "unknown error";
    Py_XDECREF(s);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyGILState_Release(st);
    TORCH_CHECK(false, "torch_tpu: starting the PJRT runtime failed: ", msg);
  }
  n = static_cast<int>(PyLong_AsLong(res));
  Py_DECREF(res);
  g_count.store(n);
  PyGILState_Release(st);
  return n;
}

struct TpuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  TpuGuardImpl() = default;
  explicit TpuGuardImpl(c10::DeviceType t) { TORCH_INTERNAL_ASSERT(t == kTpu); }
  c10::DeviceType type() const override { return kTpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    TORCH_INTERNAL_ASSERT(d.type() == kTpu);
    c10::Device old(kTpu, t_current);
    if (d.index() >= 0) set_current_device(d.index());
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kTpu, t_current); }
  void setDevice(c10::Device d) const override {
    TORCH_INTERNAL_ASSERT(d.type() == kTpu);
    if (d.index() >= 0) set_current_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) t_current = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    try {
      return device_count();
    } catch (...) {
      return 0;
    }
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream& s) const override { synchronizeDevice(s.device_index()); }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    if (!runtime_started() || callbacks().synchronize == nullptr) return;
    PyGILState_STATE st = PyGILState_Ensure();
    PyObject* res = PyObject_CallFunction(callbacks().synchronize, "i", static_cast<int>(device_index));
    if (res == nullptr) {
      PyErr_Print();
      PyGILState_Release(st);
      TORCH_CHECK(false, "torch_tpu: synchronizing tpu:", static_cast<int>(device_index), " failed");
    }
    Py_DECREF(res);
    PyGILState_Release(st);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, TpuGuardImpl);

}  // namespace

bool runtime_started() { return g_count.load() >= 0; }

bool g_in_bad_fork = false;
namespace {
std::string g_bad_fork_message;
}  // namespace

void mark_bad_fork(std::string message) {
  g_bad_fork_message = std::move(message);
  g_in_bad_fork = true;
}

void throw_bad_fork() { TORCH_CHECK(false, g_bad_fork_message); }

c10::DeviceIndex device_count() {
  int n = g_count.load();
  if (n < 0) n = start_runtime();
  return static_cast<c10::DeviceIndex>(n);
}

c10::DeviceIndex current_device() { return t_current; }

void check_device_index(c10::DeviceIndex index) {
  c10::DeviceIndex n = device_count();
  TORCH_CHECK_INDEX(index >= 0 && index < n, "Invalid device: tpu:", static_cast<int>(index),
                    " is out of range; torch_tpu sees ", static_cast<int>(n),
                    " tpu device(s) (indices 0..", static_cast<int>(n) - 1,
                    "). Use a smaller index, or set TORCH_TPU_NUM_DEVICES=N before the first tpu use "
                    "for N virtual devices on XLA:CPU.");
}

void set_current_device(c10::DeviceIndex index) {
  check_not_forked();
  if (index == t_current) return;
  check_device_index(index);
  t_current = index;
}

}  // namespace torch_tpu
