// Streams of the tpu device: ids with a per-thread current stream per device, as CUDA's API has them.
//
// A tpu stream owns nothing on the device. PJRT gives a device one queue: every tpu op is enqueued there
// asynchronously and XLA runs the programs in the order their data dependencies need, whatever stream was
// current when they were issued. So a stream is an id (0: the device's default stream; getNewStream and
// getStreamFromGlobalPool hand out fresh ones), the current stream is thread-local like CUDA's, and
// cross-stream waits need no device work (docs/user_guide.md, "Streams and events").
#include "TpuRuntime.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <vector>

namespace torch_tpu {
namespace {

// The calling thread's current stream id per device index (missing entries: the default stream, id 0).
thread_local std::vector<c10::StreamId> t_streams;
std::atomic<c10::StreamId> g_next_stream{1};

c10::DeviceIndex resolve(c10::DeviceIndex device) { return device < 0 ? current_device() : device; }

}  // namespace

c10::Stream current_stream(c10::DeviceIndex device) {
  device = resolve(device);
  c10::StreamId id = static_cast<size_t>(device) < t_streams.size() ? t_streams[device] : 0;
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kTpu, device), id);
}

c10::Stream default_stream(c10::DeviceIndex device) {
  return c10::Stream(c10::Stream::DEFAULT, c10::Device(kTpu, resolve(device)));
}

c10::Stream new_stream(c10::DeviceIndex device) {
  device = resolve(device);
  check_device_index(device);
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kTpu, device), g_next_stream.fetch_add(1));
}

c10::Stream exchange_stream(c10::Stream s) noexcept {
  c10::DeviceIndex device = resolve(s.device_index());
  c10::Stream old = current_stream(device);
  if (static_cast<size_t>(device) >= t_streams.size()) t_streams.resize(device + 1, 0);
  t_streams[device] = s.id();
  return old;
}

}  // namespace torch_tpu
