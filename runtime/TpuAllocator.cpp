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

#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>

#include <algorithm>
#include <atomic>
#include <mutex>
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
  g_live.fetch_sub(1, std::memory_order_relaxed);
  delete buf;
}

c10::DataPtr make_data_ptr(TpuBuffer* buf) {
  if (C10_UNLIKELY(g_in_bad_fork)) {
    delete buf;
    throw_bad_fork();
  }
  buf->addr = acquire_span(buf->nbytes);
  g_live.fetch_add(1, std::memory_order_relaxed);
  return c10::DataPtr(buf->addr, buf, &delete_buffer, c10::Device(kTpu, buf->device));
}

class TpuAllocator final : public c10::Allocator {
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
};

TpuAllocator g_allocator;

}  // namespace

// c10::GetAllocator(PrivateUse1): used by torch.UntypedStorage(n, device="tpu") and storage resizes.
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

c10::Allocator* tpu_allocator() { return &g_allocator; }

TpuBuffer* buffer_of(const c10::Storage& storage) {
  const c10::DataPtr& dp = storage.data_ptr();
  TORCH_CHECK(dp.device().type() == kTpu && dp.get_deleter() == &delete_buffer,
              "torch_tpu: expected a tpu storage, got one on ", dp.device());
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
