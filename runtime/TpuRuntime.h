// Shared declarations of the torch_tpu C++ runtime (the extension torch_tpu._C).
//
// The storage model: a tpu storage's DataPtr context is a TpuBuffer that owns one device array (a
// jax.Array, i.e. a PJRT buffer, held as a Python object). The data pointer is an address inside a
// reserved, inaccessible range: unique per live storage, never dereferenced.
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>
#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace pybind11 {
class module_;
}

namespace torch_tpu {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;

// ---- the device array owned by a storage (TpuAllocator.cpp) ----
struct TpuBuffer {
  PyObject* array = nullptr;          // owned reference; nullptr = never written (reads as zeros)
  c10::ScalarType array_dtype = c10::ScalarType::Byte;
  std::vector<int64_t> array_shape;  // the producer's shape, kept as made
  size_t nbytes = 0;
  c10::DeviceIndex device = 0;
  void* addr = nullptr;
};

c10::Allocator* tpu_allocator();
// The TpuBuffer behind a storage (throws if the storage is not a tpu storage).
TpuBuffer* buffer_of(const c10::Storage& storage);
// Whether the storage's bytes are a torch_tpu buffer (a storage that only says tpu, a functionalization
// wrapper's, is not).
bool is_buffer(const c10::Storage& storage);
// Replaces the array of a buffer (steals nothing: increments `array`).
void set_buffer_array(TpuBuffer* buf, PyObject* array, c10::ScalarType dtype,
                      std::vector<int64_t> shape);
// A new storage that owns `array` (borrowed; a reference is taken).
c10::Storage make_storage(PyObject* array, c10::ScalarType dtype, std::vector<int64_t> shape,
                          size_t nbytes, c10::DeviceIndex device);
int64_t live_buffers();
// A tensor with a lazy conjugate or negative bit stands for the conjugate/negation of its storage's elements: the
// whole-array fast paths decline it, so the Python storage layer (torch_tpu/_storage.py) resolves the bit.
inline bool has_math_bits(const c10::TensorImpl* impl) { return impl->is_conj() || impl->is_neg(); }
// True when `impl` is all of its buffer's array as it stands (offset 0, the array's dtype and shape, contiguous,
// no lazy bit): the fast paths hand the array itself to a program. False for a buffer with no array.
inline bool views_whole_array(const c10::TensorImpl* impl, const TpuBuffer* buf) {
  return buf->array != nullptr && impl->storage_offset() == 0 && buf->array_dtype == impl->dtype().toScalarType() &&
         impl->sizes().equals(buf->array_shape) && impl->is_contiguous() && !has_math_bits(impl);
}

// ---- devices (TpuGuard.cpp) ----
// Number of devices. Starts the runtime (PJRT client) on first use through a Python callback.
c10::DeviceIndex device_count();
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
void check_device_index(c10::DeviceIndex index);
bool runtime_started();

// ---- streams and events (TpuStream.cpp, TpuEvent.cpp) ----
// A stream is an id (0: the default stream) with a per-thread current stream per device; device -1 means the
// current device. An event handle is an owned Python object (a torch_tpu._streams mark).
c10::Stream current_stream(c10::DeviceIndex device);
c10::Stream default_stream(c10::DeviceIndex device);
c10::Stream new_stream(c10::DeviceIndex device);
c10::Stream exchange_stream(c10::Stream s) noexcept;
void event_record(void** event, c10::DeviceIndex device, bool timing);
void event_destroy(void* event) noexcept;
bool event_query(void* event);
void event_synchronize(void* event);
double event_elapsed_ms(void* start, void* end);
bool stream_query(c10::DeviceIndex device);  // all work enqueued on the device is done

// ---- fork (TpuGuard.cpp) ----
// PJRT's threads and connections do not survive fork(): a child forked after the runtime started cannot use
// tpu. torch_tpu._runtime marks such a child (os.register_at_fork, registered once the runtime started); from
// then on every tpu use raises CUDA's kind of error instead of hanging, and deleters skip PJRT calls.
extern bool g_in_bad_fork;
void mark_bad_fork(std::string message);  // the error every tpu use raises from then on
[[noreturn]] void throw_bad_fork();
inline void check_not_forked() {
  if (C10_UNLIKELY(g_in_bad_fork)) throw_bad_fork();
}

// ---- execution modes (TpuMode.cpp) ----
// True when tpu ops on the calling thread are recorded into a pending graph (DEFER_AND_FUSE, not suspended).
bool recording();
// The Python functions of the mode state (_mode, _recording, _set_thread_mode, ...), null-terminated.
PyMethodDef* mode_methods();
// The calling thread's effective execution mode (an EagerMode value: 0 DEFER_NEVER).
int current_mode();
// DEFER_AND_FUSE's one-op segments (TpuMode.cpp): true when the calling thread runs its next op through the eager
// cache hit instead of recording it; the cache hit then reports the op it ran with direct_ran(its result).
bool direct_dispatch();
void direct_ran(const void* result);
// A synchronization point of the calling thread that reads `value` (Py_None: all of its work), `reason` an interned
// string: it ends the segment of the op that ran directly if `value` is its result (_deferred.concrete's
// `_fuse_segment_end`; metrics count the segment as a flush for `reason`).
void segment_end(PyObject* value, PyObject* reason);
// _deferred.record(index, key, fn, args) for the op the graph's trace predicts (args: those four), in C++: the
// placeholder (a new reference); nullptr with no Python error when the op must take the Python `record`.
PyObject* fuse_record_hit(PyObject* const* args);

// ---- the eager dispatch path of cache hits (TpuDispatch.cpp) ----
PyMethodDef* dispatch_methods();
// TpuPython.cpp's accessors, shared with it: resolve a DEFER_AND_FUSE placeholder (a Python error may be set),
// run a due program collection (false with a Python error set if it raised), the {numpy dtype: torch.dtype} map.
void dispatch_resolve_pending(TpuBuffer* buf);
bool dispatch_is_array(PyObject* obj);  // a concrete device array (not a placeholder)
bool dispatch_collect_if_due();
PyObject* dispatch_dtype_map();
// `fn(array)` of tpu tensor `self`'s whole computed array (a jitted one-argument program), as a new tpu tensor of
// dtype `want` and self's shape: the cache-hit path for a kernel outside the op table (a same-device cast). An
// undefined tensor, with nothing changed, when `self` does not view its whole array, its array is a placeholder
// still to compute, or the result is not of that dtype and shape; an error of the call is raised (`what` names it
// in an out-of-memory error).
at::Tensor dispatch_call_unary(PyObject* fn, const at::Tensor& self, c10::ScalarType want, const std::string& what);

// ---- Python callbacks installed by torch_tpu at import (TpuPython.cpp) ----
struct Callbacks {
  PyObject* start_runtime = nullptr;  // () -> int device count
  PyObject* resize_array = nullptr;   // (array, dtype, old_nbytes, new_nbytes, device) -> (array, dtype, shape)
  PyObject* synchronize = nullptr;    // (device index or -1) -> None
};
Callbacks& callbacks();

// ---- memory accounting (TpuAllocator.cpp): adds _memory_stats, _set_memory_limit, ... to torch_tpu._C ----
void add_memory_methods(pybind11::module_& m);
// ---- scaled_dot_product_attention's backend choice (TpuAttention.cpp): adds _set_sdp_choice ----
void add_attention_methods(pybind11::module_& m);
// ---- same-device casts, aten::_to_copy (TpuCast.cpp): adds _set_casts ----
void add_cast_methods(pybind11::module_& m);
// With a Python error set: replaces PJRT's RESOURCE_EXHAUSTED by torch.OutOfMemoryError (counted in num_ooms of
// `device`), naming `what` ran; any other error is left as it is.
void translate_oom_error(int device, const std::string& what);

// Resizes a tpu storage to `new_nbytes`, keeping its leading bytes (TpuHooks.cpp uses it).
void resize_storage_bytes(const c10::Storage& storage, size_t new_nbytes);

// ---- missing-op policy (TpuFallback.cpp) ----
enum class FallbackMode : int { kStrict = 0, kWarn = 1 };
void set_fallback_mode(FallbackMode mode);
FallbackMode fallback_mode();
std::vector<std::pair<std::string, int64_t>> fallback_counts();
void reset_fallback_counts();

}  // namespace torch_tpu
