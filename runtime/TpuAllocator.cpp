// Device allocator: a storage's DataPtr context is a TpuBuffer owning the storage's device array.
//
// Data pointers are names, never dereferenced: the bytes live in device memory. Each live storage gets its own
// span of round_up(nbytes, 64) addresses, disjoint from every other live storage's span, so data_ptr() is
// unique and so is every view's data_ptr() + offset * itemsize (views of a storage stay inside its span).
// torch.save, safetensors and Hugging Face's tie detection key storages by (data_ptr, nbytes), and user code
// compares view pointers: overlapping spans would alias unrelated tensors. Freed spans are reused by exact
// size, so the address range a process needs is about its peak live storage bytes (plus one span per distinct
// size that was live at the peak).
//
// Where the spans come from, and what a stray CPU read of a tpu data pointer does in each case:
//  1. A PROT_NONE reservation (MAP_NORESERVE: nothing committed), tried from 16 TiB down to 64 MiB: a read
//     faults (SIGSEGV at that address). Only when RLIMIT_AS is unlimited: reserved address space counts
//     against RLIMIT_AS like real memory, and under a limit the XLA:CPU data itself needs that room.
//  2. Then (under an address-space limit, when no reservation was granted, or once it is used up), on x86-64
//     and aarch64: a window of addresses the CPU cannot translate at all (bits 62 and 55 set: non-canonical
//     on x86-64 with 4- or 5-level paging; on aarch64, with the top byte ignored, bit 55 selects the
//     kernel's translation table and these addresses are outside its range). Nothing is mapped, so it costs
//     no address space, and a read faults (SIGSEGV) on every such CPU.
//  3. On other CPUs: further PROT_NONE reservations (at least the span, doubling), so a read still faults;
//     when the kernel refuses even the span, allocation fails with an error naming the limit.
#include "TpuRuntime.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>

namespace torch_tpu {
namespace {

constexpr size_t kAlign = 64;
constexpr size_t kMinReservation = size_t(64) << 20;

#if defined(__x86_64__) || defined(__aarch64__)
constexpr bool kHasFaultWindow = true;
constexpr uintptr_t kFaultWindowBase = (uintptr_t(1) << 62) | (uintptr_t(1) << 55);
constexpr size_t kFaultWindowSize = size_t(1) << 55;  // the low 55 bits: adding never carries into bit 55
#else
constexpr bool kHasFaultWindow = false;
constexpr uintptr_t kFaultWindowBase = 0;
constexpr size_t kFaultWindowSize = 0;
#endif

bool address_space_limited() {
  struct rlimit lim;
  return getrlimit(RLIMIT_AS, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY;
}

void* reserve(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

class AddressSpace {
 public:
  AddressSpace() {
    if (address_space_limited()) return;  // cases 2 and 3 (see the top of this file)
    for (size_t bytes = size_t(16) << 40; bytes >= kMinReservation; bytes /= 4) {
      if (void* p = reserve(bytes)) {
        region_ = {reinterpret_cast<uintptr_t>(p), bytes, 0};
        return;
      }
    }
  }

  void* acquire(size_t nbytes) {
    size_t span = round(nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(span);
    if (it != free_.end() && !it->second.empty()) {
      uintptr_t a = it->second.back();
      it->second.pop_back();
      return reinterpret_cast<void*>(a);
    }
    if (region_.size - region_.next < span) grow(span);
    uintptr_t a = region_.base + region_.next;
    region_.next += span;
    return reinterpret_cast<void*>(a);
  }

  void release(void* p, size_t nbytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[round(nbytes)].push_back(reinterpret_cast<uintptr_t>(p));
  }

 private:
  struct Region {
    uintptr_t base = 0;
    size_t size = 0;
    size_t next = 0;
  };

  // Moves on to a fresh region with room for `span`; the old region's free spans stay reusable.
  void grow(size_t span) {
    if (kHasFaultWindow && region_.base != kFaultWindowBase) {
      region_ = {kFaultWindowBase, kFaultWindowSize, 0};
      if (span <= region_.size) return;
    }
    if (!kHasFaultWindow) {
      chunk_ = std::max(chunk_ * 2, kMinReservation);
      for (size_t bytes = std::max(chunk_, span);; bytes = std::max(bytes / 2, span)) {
        if (void* p = reserve(bytes)) {
          region_ = {reinterpret_cast<uintptr_t>(p), bytes, 0};
          return;
        }
        if (bytes == span) break;
      }
    }
    TORCH_CHECK(false, "torch_tpu: no address range left to name a tpu storage of ", span,
                " bytes (tpu data pointers are reserved, never-dereferenced addresses, one span per live "
                "storage). The address-space limit (ulimit -v / RLIMIT_AS) leaves no room for it: raise the "
                "limit or free tpu tensors.");
  }

  static size_t round(size_t n) { return n == 0 ? kAlign : (n + kAlign - 1) / kAlign * kAlign; }
  Region region_;
  size_t chunk_ = 0;
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<uintptr_t>> free_;
};

AddressSpace& address_space() {
  static auto* space = new AddressSpace();  // leaked on purpose: deleters may run at exit
  return *space;
}

// A per-thread cache of freed small spans in front of the process-wide free lists: an eager op makes one
// storage and frees its previous result's, and the shared map costs a mutex and a hash lookup each way (about
// a tenth of the C++ eager path, measured). A span is in exactly one place (live, this cache or the shared
// lists), so data pointers stay unique; a thread's cached spans go back to the shared lists when it exits.
class SpanCache {
 public:
  static constexpr size_t kClasses = 16;  // spans of 64, 128, ..., 1024 bytes
  static constexpr size_t kPerClass = 8;

  static int class_of(size_t nbytes) {
    size_t span = nbytes == 0 ? kAlign : (nbytes + kAlign - 1) / kAlign * kAlign;
    return span <= kClasses * kAlign ? static_cast<int>(span / kAlign - 1) : -1;
  }
  void* take(int c) { return count_[c] ? reinterpret_cast<void*>(slots_[c][--count_[c]]) : nullptr; }
  bool give(int c, void* p) {
    if (closed_ || count_[c] == kPerClass) return false;
    slots_[c][count_[c]++] = reinterpret_cast<uintptr_t>(p);
    return true;
  }
  ~SpanCache() {  // (a storage freed later on this thread, at its exit, goes to the shared lists)
    closed_ = true;
    for (size_t c = 0; c < kClasses; ++c)
      while (count_[c]) address_space().release(reinterpret_cast<void*>(slots_[c][--count_[c]]), (c + 1) * kAlign);
  }

 private:
  uintptr_t slots_[kClasses][kPerClass];
  uint8_t count_[kClasses] = {};
  bool closed_ = false;
};
thread_local SpanCache t_spans;

void* acquire_span(size_t nbytes) {
  int c = SpanCache::class_of(nbytes);
  if (c >= 0) {
    if (void* p = t_spans.take(c)) return p;
  }
  return address_space().acquire(nbytes);
}

void release_span(void* p, size_t nbytes) {
  int c = SpanCache::class_of(nbytes);
  if (c >= 0 && t_spans.give(c, p)) return;
  address_space().release(p, nbytes);
}

std::atomic<int64_t> g_live{0};

// ---- memory accounting (torch.tpu.memory_stats, torch.accelerator.memory_*) ----
// Every live tpu storage counts its byte size on its device from the moment its DataPtr is made (allocate(),
// make_storage(), a resize's new buffer) until its deleter runs: one block per storage, CUDA's key names. An
// in-place op swaps the storage's array for one of the same byte size (set_buffer_array), which changes nothing
// here; views share their storage and count nothing. There is no caching allocator in front of PJRT: "active",
// "allocated" and "requested" are the same bytes, and "reserved"/"segment" count them again (on XLA:CPU each
// buffer is its own host allocation). Where PJRT reports its own statistics (TPU), getDeviceStats replaces
// reserved_bytes.current/peak with its bytes_in_use/peak_bytes_in_use (torch_tpu/_memory.py).
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingAllocator::StatType;
constexpr size_t kSmallSize = size_t(1) << 20;  // CUDA's pool split: blocks up to 1 MiB are "small_pool"
constexpr int kMaxDevices = 128;                  // c10::DeviceIndex is an int8_t

struct DeviceMemory {
  std::mutex mu;
  DeviceStats stats;
  int64_t limit = -1;      // bytes the live storages may hold on this device; -1: no limit of ours
  std::string limit_what;  // what set it, for the out-of-memory message
};

DeviceMemory& device_memory(c10::DeviceIndex device) {
  static auto* table = new DeviceMemory[kMaxDevices];  // leaked on purpose: deleters may run at exit
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "torch_tpu: invalid tpu device index ", int(device));
  return table[device];
}

void update(c10::CachingAllocator::StatArray& a, size_t pool, size_t amount, bool up) {
  for (size_t i : {static_cast<size_t>(StatType::AGGREGATE), pool}) {
    if (up)
      a[i].increase(amount);
    else
      a[i].decrease(amount);
  }
}

void count(DeviceStats& s, size_t nbytes, bool up) {
  size_t pool = static_cast<size_t>(nbytes <= kSmallSize ? StatType::SMALL_POOL : StatType::LARGE_POOL);
  for (auto* a : {&s.allocation, &s.active, &s.segment}) update(*a, pool, 1, up);
  for (auto* a : {&s.allocated_bytes, &s.active_bytes, &s.requested_bytes, &s.reserved_bytes})
    update(*a, pool, nbytes, up);
  ++(up ? s.num_device_alloc : s.num_device_free);
}

std::string mib(int64_t bytes) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return text;
}

// Counts a new storage of `nbytes` on `device`, or raises torch.OutOfMemoryError (counted in num_ooms) when that
// would take the device's live storages past its limit.
void account_alloc(c10::DeviceIndex device, size_t nbytes) {
  DeviceMemory& m = device_memory(device);
  std::unique_lock<std::mutex> lock(m.mu);
  int64_t held = m.stats.allocated_bytes[0].current;
  if (m.limit >= 0 && held + static_cast<int64_t>(nbytes) > m.limit) {
    ++m.stats.num_ooms;
    int64_t limit = m.limit;
    std::string what = m.limit_what;
    lock.unlock();
    TORCH_CHECK_WITH(OutOfMemoryError, false, "tpu out of memory. Tried to allocate ", mib(nbytes), " (",
                     nbytes, " bytes) on tpu:", int(device), "; ", mib(held),
                     " already allocated by live tpu tensors, limit ", mib(limit), " (", what,
                     "). Free tensors you no longer need (del them, drop references such as stored losses or "
                     "outputs), use smaller batches, or raise the limit.");
  }
  count(m.stats, nbytes, true);
}

void account_free(c10::DeviceIndex device, size_t nbytes) {
  DeviceMemory& m = device_memory(device);
  std::lock_guard<std::mutex> lock(m.mu);
  count(m.stats, nbytes, false);
}

// torch_tpu._memory.platform_info(device) -> (reserved bytes or None, reserved peak or None, free, total): what
// PJRT reports for the device (TPU: Device.memory_stats()), None where the platform keeps no statistics (XLA:CPU).
PyObject* g_memory_info = nullptr;

py::tuple call_memory_info(c10::DeviceIndex device) {  // with the GIL held
  TORCH_CHECK(g_memory_info != nullptr, "torch_tpu: internal error: the memory info callback is not set");
  PyObject* r = PyObject_CallFunction(g_memory_info, "i", static_cast<int>(device));
  if (r == nullptr) throw python_error();
  return py::reinterpret_steal<py::tuple>(r);
}

DeviceStats device_stats(c10::DeviceIndex device) {
  DeviceStats s;
  {
    DeviceMemory& m = device_memory(device);
    std::lock_guard<std::mutex> lock(m.mu);
    s = m.stats;
  }
  if (!runtime_started() || g_in_bad_fork) return s;
  PyGILState_STATE st = PyGILState_Ensure();
  try {
    py::tuple r = call_memory_info(device);
    auto& reserved = s.reserved_bytes[static_cast<size_t>(StatType::AGGREGATE)];
    if (!r[0].is_none()) reserved.current = r[0].cast<int64_t>();
    if (!r[1].is_none()) reserved.peak = r[1].cast<int64_t>();
  } catch (...) {
    PyGILState_Release(st);
    throw;
  }
  PyGILState_Release(st);
  return s;
}

// Every counter of a device's statistics (each stat array and the oversize counters), for the resets.
template <typename F>
void for_each_stat(DeviceStats& s, F f) {
  for (auto* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
                  &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes})
    for (auto& stat : *a) f(stat);
  f(s.oversize_allocations);
  f(s.oversize_segments);
}

void reset_peak_stats(c10::DeviceIndex device) {
  DeviceMemory& m = device_memory(device);
  std::lock_guard<std::mutex> lock(m.mu);
  for_each_stat(m.stats, [](auto& stat) { stat.reset_peak(); });
}

void reset_accumulated_stats(c10::DeviceIndex device) {
  DeviceMemory& m = device_memory(device);
  std::lock_guard<std::mutex> lock(m.mu);
  DeviceStats& s = m.stats;
  for_each_stat(s, [](auto& stat) { stat.reset_accumulated(); });
  s.num_alloc_retries = 0;
  s.num_ooms = 0;
  s.num_sync_all_streams = 0;
  s.num_device_alloc = 0;
  s.num_device_free = 0;
  s.num_oom_rejections = 0;
}

void drop_array(PyObject* array) {
  if (array == nullptr) return;
  // Deleters run on any thread (the autograd engine's device threads too) and possibly during
  // interpreter shutdown, when touching Python objects is no longer allowed.
  if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
  // In a forked child the array's PJRT buffer belongs to the parent's client: releasing it could wait on
  // threads that did not survive fork(). Leak it; the child's memory goes with the child.
  if (g_in_bad_fork) return;
  PyGILState_STATE st = PyGILState_Ensure();
  Py_DECREF(array);
  PyGILState_Release(st);
}

void delete_buffer(void* ctx) {
  auto* buf = static_cast<TpuBuffer*>(ctx);
  drop_array(buf->array);
  release_span(buf->addr, buf->nbytes);
  account_free(buf->device, buf->nbytes);
  g_live.fetch_sub(1, std::memory_order_relaxed);
  delete buf;
}

// Takes ownership of `buf`: on an error (bad fork, out of memory) it drops the buffer and its array.
c10::DataPtr make_data_ptr(TpuBuffer* buf) {
  if (C10_UNLIKELY(g_in_bad_fork)) {
    delete buf;
    throw_bad_fork();
  }
  try {
    account_alloc(buf->device, buf->nbytes);
  } catch (...) {
    drop_array(buf->array);
    delete buf;
    throw;
  }
  buf->addr = acquire_span(buf->nbytes);
  g_live.fetch_add(1, std::memory_order_relaxed);
  return c10::DataPtr(buf->addr, buf, &delete_buffer, c10::Device(kTpu, buf->device));
}

// c10::DeviceAllocator: what torch.accelerator.memory_* and torch.accelerator.empty_cache call for PrivateUse1.
class TpuAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    auto* buf = new TpuBuffer();
    buf->nbytes = nbytes;
    buf->device = current_device();
    return make_data_ptr(buf);
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {
    TORCH_CHECK(false, "torch_tpu: tpu storage bytes live in device memory and cannot be copied as "
                "host memory; copy tensors with .copy_() or .to() instead");
  }

  bool initialized() override { return runtime_started(); }
  // Nothing is cached: a storage's device array is released when the storage dies.
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {}
  // PJRT keeps a buffer alive until the work that uses it has finished: nothing to record.
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}
  DeviceStats getDeviceStats(c10::DeviceIndex device) override { return device_stats(device); }
  void resetAccumulatedStats(c10::DeviceIndex device) override { reset_accumulated_stats(device); }
  void resetPeakStats(c10::DeviceIndex device) override { reset_peak_stats(device); }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_device_index(device);
    PyGILState_STATE st = PyGILState_Ensure();
    std::pair<size_t, size_t> info;
    try {
      py::tuple r = call_memory_info(device);
      info = {r[2].cast<size_t>(), r[3].cast<size_t>()};
    } catch (...) {
      PyGILState_Release(st);
      throw;
    }
    PyGILState_Release(st);
    return info;
  }
};

TpuAllocator g_allocator;

}  // namespace

// c10::GetAllocator(PrivateUse1): used by torch.UntypedStorage(n, device="tpu") and storage resizes.
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

c10::Allocator* tpu_allocator() { return &g_allocator; }

bool is_buffer(const c10::Storage& storage) {
  const c10::DataPtr& dp = storage.data_ptr();
  return dp.device().type() == kTpu && dp.get_deleter() == &delete_buffer;
}

TpuBuffer* buffer_of(const c10::Storage& storage) {
  const c10::DataPtr& dp = storage.data_ptr();
  TORCH_CHECK(is_buffer(storage), "torch_tpu: expected a tpu storage, got one on ", dp.device());
  check_not_forked();  // every read and write of a storage's array comes here
  return static_cast<TpuBuffer*>(dp.get_context());
}

void set_buffer_array(TpuBuffer* buf, PyObject* array, c10::ScalarType dtype,
                      std::vector<int64_t> shape) {
  Py_XINCREF(array);
  PyObject* old = buf->array;
  buf->array = array;
  buf->array_dtype = dtype;
  buf->array_shape = std::move(shape);
  Py_XDECREF(old);
}

c10::Storage make_storage(PyObject* array, c10::ScalarType dtype, std::vector<int64_t> shape,
                          size_t nbytes, c10::DeviceIndex device) {
  auto* buf = new TpuBuffer();
  buf->nbytes = nbytes;
  buf->device = device;
  set_buffer_array(buf, array, dtype, std::move(shape));
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, make_data_ptr(buf),
                      tpu_allocator(), /*resizable=*/true);
}

int64_t live_buffers() { return g_live.load(); }

namespace {

py::dict stat_dict(const c10::CachingAllocator::Stat& stat) {
  py::dict d;
  d["current"] = stat.current;
  d["peak"] = stat.peak;
  d["allocated"] = stat.allocated;
  d["freed"] = stat.freed;
  return d;
}

py::dict stat_array_dict(const c10::CachingAllocator::StatArray& a) {
  py::dict d;
  d["all"] = stat_dict(a[static_cast<size_t>(StatType::AGGREGATE)]);
  d["small_pool"] = stat_dict(a[static_cast<size_t>(StatType::SMALL_POOL)]);
  d["large_pool"] = stat_dict(a[static_cast<size_t>(StatType::LARGE_POOL)]);
  return d;
}

}  // namespace

PyObject* g_oom_error = nullptr;  // torch_tpu._memory.oom_error(exc, device, what) -> OutOfMemoryError or None

void translate_oom_error(int device, const std::string& what) {
  if (g_oom_error == nullptr || !PyErr_Occurred()) return;
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr) PyException_SetTraceback(value, tb);
  PyObject* oom = PyObject_CallFunction(g_oom_error, "Ois", value, device, what.c_str());
  if (oom == nullptr || oom == Py_None) {  // not an out-of-memory error (or the check failed): the original
    if (oom == nullptr) PyErr_Clear();
    Py_XDECREF(oom);
    PyErr_Restore(type, value, tb);
    return;
  }
  PyException_SetCause(oom, value);  // steals `value`
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(oom)), oom);
  Py_DECREF(oom);
  Py_XDECREF(type);
  Py_XDECREF(tb);
}

// The memory functions of torch_tpu._C (torch_tpu/_memory.py is their front).
void add_memory_methods(py::module_& m) {
  // The nested form of CUDA's torch.cuda.memory_stats (torch.tpu.memory_stats flattens it).
  m.def("_memory_stats", [](int device) {
    DeviceStats s = device_stats(static_cast<c10::DeviceIndex>(device));
    py::dict d;
    d["num_alloc_retries"] = s.num_alloc_retries;
    d["num_ooms"] = s.num_ooms;
    d["max_split_size"] = s.max_split_size;
    d["num_sync_all_streams"] = s.num_sync_all_streams;
    d["num_device_alloc"] = s.num_device_alloc;
    d["num_device_free"] = s.num_device_free;
    d["allocation"] = stat_array_dict(s.allocation);
    d["segment"] = stat_array_dict(s.segment);
    d["active"] = stat_array_dict(s.active);
    d["inactive_split"] = stat_array_dict(s.inactive_split);
    d["allocated_bytes"] = stat_array_dict(s.allocated_bytes);
    d["reserved_bytes"] = stat_array_dict(s.reserved_bytes);
    d["active_bytes"] = stat_array_dict(s.active_bytes);
    d["inactive_split_bytes"] = stat_array_dict(s.inactive_split_bytes);
    d["requested_bytes"] = stat_array_dict(s.requested_bytes);
    d["oversize_allocations"] = stat_dict(s.oversize_allocations);
    d["oversize_segments"] = stat_dict(s.oversize_segments);
    return d;
  });
  m.def("_reset_peak_memory_stats", [](int device) { reset_peak_stats(static_cast<c10::DeviceIndex>(device)); });
  m.def("_reset_accumulated_memory_stats",
        [](int device) { reset_accumulated_stats(static_cast<c10::DeviceIndex>(device)); });
  // The bytes live storages may hold on `device` (-1: every device), -1 for no limit; `what` names who set it.
  m.def("_set_memory_limit", [](int device, int64_t limit, std::string what) {
    for (int d = device < 0 ? 0 : device; d < (device < 0 ? kMaxDevices : device + 1); ++d) {
      DeviceMemory& mem = device_memory(static_cast<c10::DeviceIndex>(d));
      std::lock_guard<std::mutex> lock(mem.mu);
      mem.limit = limit;
      mem.limit_what = what;
    }
  });
  m.def("_memory_limit", [](int device) {
    DeviceMemory& mem = device_memory(static_cast<c10::DeviceIndex>(device));
    std::lock_guard<std::mutex> lock(mem.mu);
    return mem.limit;
  });
  // An out-of-memory error PJRT reported (RESOURCE_EXHAUSTED), counted as the allocator's own are.
  m.def("_count_oom", [](int device) {
    DeviceMemory& mem = device_memory(static_cast<c10::DeviceIndex>(device));
    std::lock_guard<std::mutex> lock(mem.mu);
    ++mem.stats.num_ooms;
  });
  m.def("_set_oom_error", [](py::object fn) {
    Py_XDECREF(g_oom_error);
    g_oom_error = fn.release().ptr();
  });
  m.def("_set_memory_info", [](py::object fn) {
    Py_XDECREF(g_memory_info);
    g_memory_info = fn.release().ptr();
  });
}

void resize_storage_bytes(const c10::Storage& storage, size_t new_nbytes) {
  TpuBuffer* old = buffer_of(storage);
  if (new_nbytes == old->nbytes) return;
  auto* buf = new TpuBuffer();
  buf->nbytes = new_nbytes;
  buf->device = old->device;
  if (old->array != nullptr) {
    // The Python side pads or truncates the array; its dtype and shape come back from it.
    PyGILState_STATE st = PyGILState_Ensure();
    PyObject* res = PyObject_CallFunction(callbacks().resize_array, "OOnnI", old->array,
                                          reinterpret_cast<PyObject*>(torch::getTHPDtype(old->array_dtype)),
                                          static_cast<Py_ssize_t>(old->nbytes),
                                          static_cast<Py_ssize_t>(new_nbytes),
                                          static_cast<unsigned>(old->device));
    if (res == nullptr) {
      PyErr_Print();
      PyGILState_Release(st);
      delete buf;
      TORCH_CHECK(false, "torch_tpu: resizing a tpu storage from ", old->nbytes, " to ", new_nbytes,
                  " bytes failed (see the Python error above)");
    }
    // res = (array, torch.dtype, shape tuple)
    PyObject* arr = PyTuple_GetItem(res, 0);
    auto dtype = reinterpret_cast<THPDtype*>(PyTuple_GetItem(res, 1))->scalar_type;
    PyObject* shp = PyTuple_GetItem(res, 2);
    std::vector<int64_t> shape(PyTuple_Size(shp));
    for (size_t i = 0; i < shape.size(); ++i) shape[i] = PyLong_AsLongLong(PyTuple_GetItem(shp, i));
    set_buffer_array(buf, arr, dtype, std::move(shape));
    Py_DECREF(res);
    PyGILState_Release(st);
  }
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(make_data_ptr(buf));
  storage.unsafeGetStorageImpl()->set_nbytes(new_nbytes);
}

}  // namespace torch_tpu
