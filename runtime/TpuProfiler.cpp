// The profiler hooks: the tpu device rows of torch.profiler (ProfilerActivity.PrivateUse1), and, at the end, the
// profiler stubs of the legacy autograd profiler (use_device="tpu", use_kineto=False).
//
// PyTorch 2.13 takes a PrivateUse1 backend's device activities from a Kineto activity-profiler plugin
// (torch/csrc/profiler/standalone/privateuse1_profiler.h). This one runs XLA's own tracer (JAX's profiler) for the
// profiled region and hands Kineto one device activity per XLA program execution it saw: named after the program
// (`jit_aten_mm`, `jit_torch_tpu_fused_...`: torch_tpu/_profiler.py program_name), on the device's row, with the
// program's device-side start and end. The tracing itself is Python (torch_tpu/_profiler.py, `_device_session_*`);
// this file is the Kineto side only. The activities are not linked to the aten op that queued them (PJRT's run
// ids are not PyTorch's correlation ids), so they appear in the trace and in `prof.events()`, not under an op's
// device-time column of key_averages (docs/user_guide.md, "Profiling").
#define USE_KINETO 1
#define FMT_HEADER_ONLY 1  // libtorch does not export fmt, which kineto's GenericTraceActivity formats with

#include "TpuRuntime.h"

#include <c10/util/ApproximateClock.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#include <torch/csrc/profiler/stubs/base.h>
#include <pybind11/pybind11.h>

#include <IActivityProfiler.h>
#include <libkineto.h>  // CpuTraceBuffer, complete for the session's unique_ptr
#include <output_base.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace py = pybind11;

namespace torch_tpu {
namespace {

// Activities keep a pointer to their span; Kineto's trace buffers copy the activities and may outlive a session.
const libkineto::TraceSpan& device_span() {
  static const libkineto::TraceSpan* span = new libkineto::TraceSpan(0, 0, "tpu");
  return *span;
}

// Calls torch_tpu._profiler.<fn>() and hands its result to `use`, all under the GIL; a Python error becomes an
// entry of `errors` (Kineto reports them), never an exception through Kineto.
template <typename Use>
void call_python(const char* fn, std::vector<std::string>& errors, Use use) {
  if (!Py_IsInitialized()) {
    return;
  }
  py::gil_scoped_acquire gil;
  std::string error;
  try {
    use(py::module_::import("torch_tpu._profiler").attr(fn)());
    return;
  } catch (py::error_already_set& e) {
    error = e.what();
  } catch (std::exception& e) {
    error = e.what();
  }
  // The profile goes on without (some of) its device rows: said to Kineto and, as a warning, to the user.
  error = std::string("torch_tpu profiler: the tpu device rows of this profile are incomplete: ") + fn +
          " failed: " + error;
  errors.push_back(error);
  if (PyErr_WarnEx(PyExc_RuntimeWarning, error.c_str(), 1) < 0) {
    PyErr_Clear();  // warnings turned into errors: there is no Python caller here to raise it to
  }
}

void ignore(const py::object&) {}

class TpuProfilerSession : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    call_python("_device_session_start", errors_, ignore);
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    call_python("_device_session_stop", errors_, ignore);
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return errors_; }

  void processTrace(libkineto::ActivityLogger& logger) override {
    collect();
    for (const auto& a : activities_) {
      logger.handleGenericActivity(*a);
    }
    status_ = errors_.empty() ? libkineto::TraceStatus::READY : libkineto::TraceStatus::WARNING;
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override { return nullptr; }
  std::vector<libkineto::ResourceInfo> getResourceInfos() override { return {}; }
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return nullptr; }

 private:
  // (name, start_ns, end_ns, device, resource, metadata json pairs) per program execution.
  void collect() {
    if (collected_) {
      return;
    }
    collected_ = true;
    call_python("_device_session_events", errors_, [this](const py::object& events) {
      int32_t id = 0;
      for (py::handle h : events) {
        auto t = h.cast<py::tuple>();
        auto a = std::make_unique<libkineto::GenericTraceActivity>(
            device_span(), libkineto::ActivityType::CONCURRENT_KERNEL, t[0].cast<std::string>());
        a->startTime = t[1].cast<int64_t>();
        a->endTime = t[2].cast<int64_t>();
        a->device = t[3].cast<int32_t>();
        a->resource = t[4].cast<int32_t>();
        a->threadId = a->resource;
        a->id = id++;
        a->flow.id = 0;
        a->flow.type = 0;
        a->flow.start = 0;
        for (py::handle kv : t[5].cast<py::list>()) {
          auto pair = kv.cast<py::tuple>();
          a->addMetadataQuoted(pair[0].cast<std::string>(), pair[1].cast<std::string>());
        }
        activities_.push_back(std::move(a));
      }
    });
  }

  bool collected_ = false;
  std::vector<std::string> errors_;
  std::vector<std::unique_ptr<libkineto::GenericTraceActivity>> activities_;
};

class TpuActivityProfiler : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }

  const std::set<libkineto::ActivityType>& availableActivities() const override { return activities_; }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      const std::set<libkineto::ActivityType>& activity_types, const libkineto::Config& config) override {
    if (!activity_types.count(libkineto::ActivityType::CONCURRENT_KERNEL)) {
      return nullptr;  // a profile without the device activity (ProfilerActivity.CPU alone)
    }
    return std::make_unique<TpuProfilerSession>();
  }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      int64_t ts_ms, int64_t duration_ms, const std::set<libkineto::ActivityType>& activity_types,
      const libkineto::Config& config) override {
    return configure(activity_types, config);
  }

 private:
  std::string name_ = "torch_tpu";
  std::set<libkineto::ActivityType> activities_ = {libkineto::ActivityType::CONCURRENT_KERNEL};
};

REGISTER_PRIVATEUSE1_PROFILER(TpuActivityProfiler);

// ---- the legacy profiler: torch.autograd.profiler.profile(use_device="tpu", use_kineto=False) ----
// Its device time of an op is the time between two events recorded on the device's stream at the op's entry and
// exit. PJRT has no events to record into a queue, so an event here is the host time at which the device had
// finished all work queued so far: each record waits for the device (torch_tpu._runtime.synchronize), and an op's
// device time is the time its own queued work took, measured with the work serialized. DEFER_AND_FUSE's pending
// graphs are not device work yet: their time falls to the op that runs them (docs/user_guide.md, "Profiling").
void wait_for_device(c10::DeviceIndex index) {
  if (!runtime_started() || !Py_IsInitialized()) {
    return;
  }
  py::gil_scoped_acquire gil;
  try {
    py::module_::import("torch_tpu._runtime").attr("synchronize")(static_cast<int>(index));
  } catch (py::error_already_set& e) {
    TORCH_CHECK(false, "torch_tpu profiler: waiting for tpu:", static_cast<int>(index), " failed: ", e.what());
  }
}

struct TpuProfilerStubs final : torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    c10::DeviceIndex index = current_device();
    if (device) {
      *device = index;
    }
    if (cpu_ns) {
      *cpu_ns = c10::getTime();
    }
    wait_for_device(index);
    *event = std::make_shared<int64_t>(c10::getTime());
  }

  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* event,
                const torch::profiler::impl::ProfilerVoidEventStub* event2) const override {
    TORCH_CHECK(event && *event && event2 && *event2, "torch_tpu profiler: elapsed() of an unrecorded event");
    auto start = *static_cast<const int64_t*>(event->get());
    auto end = *static_cast<const int64_t*>(event2->get());
    return static_cast<float>(end - start) / 1000.0f;  // microseconds, as the profiler expects
  }

  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }

  void onEachDevice(std::function<void(int)> op) const override {
    c10::DeviceIndex saved = current_device();
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      set_current_device(i);
      op(i);
    }
    set_current_device(saved);
  }

  void synchronize() const override { wait_for_device(-1); }
};

struct RegisterStubs {
  RegisterStubs() {
    static TpuProfilerStubs stubs;
    torch::profiler::impl::registerPrivateUse1Methods(&stubs);
  }
};
RegisterStubs register_stubs;

}  // namespace
}  // namespace torch_tpu
