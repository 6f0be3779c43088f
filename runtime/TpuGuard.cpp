// DeviceGuardImplInterface for tpu: a per-thread current device index, per-thread current streams and events
// (TpuStream.cpp, TpuEvent.cpp).
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
  // Streams and events: TpuStream.cpp and TpuEvent.cpp (what they mean over PJRT: docs/user_guide.md).
  c10::Stream getStream(c10::Device d) const override { return current_stream(d.index()); }
  c10::Stream getDefaultStream(c10::Device d) const override { return default_stream(d.index()); }
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override { return new_stream(d.index()); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool isHighPriority = false) const override {
    return new_stream(d.index());
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return exchange_stream(s); }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "tpu Event.record: the event ",
                "belongs to tpu:", static_cast<int>(device_index), " but the stream to tpu:",
                static_cast<int>(stream.device_index()), "; record it on a stream of its own device.");
    event_record(event, stream.device_index(), flag == c10::EventFlag::BACKEND_DEFAULT);
  }
  // Waits need no device work: values flow from one op to the next through their device arrays, and XLA runs a
  // program only once its inputs are computed, whatever stream issued it.
  void block(void* event, const c10::Stream& stream) const override {}
  bool queryEvent(void* event) const override { return event_query(event); }
  void synchronizeEvent(void* event) const override { event_synchronize(event); }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex device_index) const override {
    return event_elapsed_ms(start, end);
  }
  void destroyEvent(void* event, const c10::DeviceIndex device_index) const noexcept override {
    event_destroy(event);
  }
  // A device array is freed only once the programs using it are done (PJRT counts its uses), so there is
  // nothing for record_stream to do.
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  c10::DeviceIndex deviceCount() const noexcept override {
    try {
      return device_count();
    } catch (...) {
      return 0;
    }
  }
  // One queue per device: a stream is done when all work enqueued on its device is (a conservative answer).
  bool queryStream(const c10::Stream& s) const override { return stream_query(s.device_index()); }
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
