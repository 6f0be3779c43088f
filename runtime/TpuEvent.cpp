// Events of the tpu device. An event handle (the void* of c10's event interface) is an owned reference to a
// torch_tpu._streams mark: the device work enqueued before the record, as the device arrays still being
// computed then (PJRT has no event object of its own; torch_tpu/_streams.py says what each call means).
// The calls go up to Python with the GIL taken here: c10::Event releases it around its calls.
#include "TpuRuntime.h"

#include <c10/util/Exception.h>
#include <torch/csrc/Exceptions.h>

namespace torch_tpu {
namespace {

// Calls torch_tpu._streams.<name>(*args) (args: a new tuple reference, stolen) with the GIL held; returns a
// new reference. A Python error is rethrown as itself (python_error), so an out-of-range index of an earlier
// op surfaces with its own type at event.synchronize().
PyObject* call_streams(const char* name, PyObject* args) {
  static PyObject* module = nullptr;  // torch_tpu._streams, imported on the first event use
  if (module == nullptr) module = PyImport_ImportModule("torch_tpu._streams");
  PyObject* res = nullptr;
  if (module != nullptr && args != nullptr) {
    PyObject* fn = PyObject_GetAttrString(module, name);
    if (fn != nullptr) {
      res = PyObject_CallObject(fn, args);
      Py_DECREF(fn);
    }
  }
  Py_XDECREF(args);
  if (res == nullptr) {
    python_error err;
    err.persist();
    throw err;
  }
  return res;
}

struct Gil {
  PyGILState_STATE st = PyGILState_Ensure();
  ~Gil() { PyGILState_Release(st); }
};

}  // namespace

void event_record(void** event, c10::DeviceIndex device, bool timing) {
  check_not_forked();
  Gil gil;
  PyObject* mark = call_streams("record", Py_BuildValue("(iO)", static_cast<int>(device), timing ? Py_True : Py_False));
  PyObject* old = static_cast<PyObject*>(*event);
  *event = mark;  // a re-record replaces the mark: waits and queries see the latest record, as CUDA's
  Py_XDECREF(old);
}

void event_destroy(void* event) noexcept {
  if (event == nullptr || !Py_IsInitialized()) return;  // at interpreter exit the mark goes with the interpreter
  PyGILState_STATE st = PyGILState_Ensure();
  Py_DECREF(static_cast<PyObject*>(event));
  PyGILState_Release(st);
}

bool event_query(void* event) {
  if (event == nullptr) return true;
  check_not_forked();
  Gil gil;
  PyObject* res = call_streams("query", Py_BuildValue("(O)", static_cast<PyObject*>(event)));
  bool done = PyObject_IsTrue(res) == 1;
  Py_DECREF(res);
  return done;
}

void event_synchronize(void* event) {
  if (event == nullptr) return;
  check_not_forked();
  Gil gil;
  Py_DECREF(call_streams("synchronize", Py_BuildValue("(O)", static_cast<PyObject*>(event))));
}

double event_elapsed_ms(void* start, void* end) {
  TORCH_CHECK(start != nullptr && end != nullptr,
              "tpu Event.elapsed_time: both events must be recorded before calculating elapsed time.");
  Gil gil;
  PyObject* res = call_streams("elapsed_ms", Py_BuildValue("(OO)", static_cast<PyObject*>(start),
                                                          static_cast<PyObject*>(end)));
  double ms = PyFloat_AsDouble(res);
  Py_DECREF(res);
  return ms;
}

bool stream_query(c10::DeviceIndex device) {
  if (!runtime_started()) return true;
  check_not_forked();
  Gil gil;
  PyObject* res = call_streams("query_device", Py_BuildValue("(i)", static_cast<int>(device)));
  bool done = PyObject_IsTrue(res) == 1;
  Py_DECREF(res);
  return done;
}

}  // namespace torch_tpu
