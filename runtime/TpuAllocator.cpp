// Device allocator: a storage's DataPtr context is a TpuBuffer owning the storage's device array.
//
// Data pointers come from a reserved PROT_NONE address range: each live storage gets its own span, so
// data_ptr() is unique (torch.save keys storages by it) and a stray CPU dereference faults instead of
// reading garbage. Freed spans are reused by size, so the range is bounded by peak live bytes.
#include "TpuRuntime.h"

#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace torch_tpu {
namespace {

constexpr size_t kAlign = 64;

class AddressSpace {
 public:
  AddressSpace() {
    // Reserve as much inaccessible address space as the kernel grants (no memory is committed).
    for (size_t gib : {size_t(16) << 10, size_t(4) << 10, size_t(1) << 10, size_t(64)}) {
      size_t bytes = gib << 30;
      void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        base_ = reinterpret_cast<uintptr_t>(p);
        size_ = bytes;
        break;
      }
    }
    TORCH_CHECK(base_ != 0, "torch_tpu: could not reserve an address range for tpu storages");
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
    TORCH_CHECK(next_ + span <= size_, "torch_tpu: the reserved address range for tpu storages is "
                "exhausted (", size_ >> 30, " GiB of live storage spans)");
    uintptr_t a = base_ + next_;
    next_ += span;
    return reinterpret_cast<void*>(a);
  }

  void release(void* p, size_t nbytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[round(nbytes)].push_back(reinterpret_cast<uintptr_t>(p));
  }

 private:
  static size_t round(size_t n) { return n == 0 ? kAlign : (n + kAlign - 1) / kAlign * kAlign; }
  uintptr_t base_ = 0;
  size_t size_ = 0;
  size_t next_ = 0;
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<uintptr_t>> free_;
};

AddressSpace& address_space() {
  static auto* space = new AddressSpace();  // leaked on purpose: deleters may run at exit
  return *space;
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
  address_space().release(buf->addr, buf->nbytes);
  g_live.fetch_sub(1, std::memory_order_relaxed);
  delete buf;
}

c10::DataPtr make_data_ptr(TpuBuffer* buf) {
  if (C10_UNLIKELY(g_in_bad_fork)) {
    delete buf;
    throw_bad_fork();
  }
  buf->addr = address_space().acquire(buf->nbytes);
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
