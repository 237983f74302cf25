// Device guard: a per-thread current device and current stream per device; streams and events of the
// asynchronous device (queue.cpp).
#include "neuron.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace tnl {

namespace {
thread_local int tls_current_device = 0;
}

int current_device() { return tls_current_device; }
void set_current_device(int index) {
  check_device_index(index);
  tls_current_device = index;
}

struct NeuronGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNeuron; }
  // A stream query's device: the current one for an index-less device; an index that does not exist raises
  // (as CUDA's check_device) instead of reading another device's stream table.
  static int index_of(c10::Device d) {
    const int i = d.has_index() ? d.index() : current_device();
    check_device_index(i);
    return i;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kNeuron, tls_current_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kNeuron, "expected a neuron device, got ", d);
    if (d.index() >= 0) set_current_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) tls_current_device = d.index();
  }
  // Streams (queue.cpp): id 0 is each device's default stream; every stream has its own FIFO queue and
  // worker thread. The current stream is per thread and per device, as in CUDA.
  c10::Stream getStream(c10::Device d) const override {
    const int i = index_of(d);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNeuron, i), current_stream(i));
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    const int i = index_of(d);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNeuron, i), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool isHighPriority = false) const override {
    const int i = index_of(d);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNeuron, i), pool_stream(i, isHighPriority));
  }
  // A new stream comes from the device's pool, round robin per priority, as CUDA's getNewStream: creating
  // streams in a loop never runs out (each stream of the pool has its own worker thread).
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override {
    const int i = index_of(d);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNeuron, i), pool_stream(i, priority < 0));
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const int i = s.device_index();
    const c10::Stream old(c10::Stream::UNSAFE, c10::Device(kNeuron, i), current_stream(i));
    set_current_stream(i, static_cast<int>(s.id()));
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(device_count());
  }
  // Events: a marker at a stream position (queue.cpp). `flag` decides whether it stamps the time.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "Event device index ",
                static_cast<int>(device_index), " does not match recording stream's device index ",
                static_cast<int>(stream.device_index()), ".");
    auto* ev = static_cast<NeuronEvent*>(*event);
    if (ev == nullptr) {
      ev = new_event(flag == c10::EventFlag::BACKEND_DEFAULT);
      *event = ev;
    }
    record_event(ev, stream.device_index(), static_cast<int>(stream.id()));
  }
  void block(void* event, const c10::Stream& stream) const override {
    stream_wait_event(stream.device_index(), static_cast<int>(stream.id()), static_cast<NeuronEvent*>(event));
  }
  bool queryEvent(void* event) const override { return event_done(static_cast<NeuronEvent*>(event)); }
  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    destroy_event(static_cast<NeuronEvent*>(event));  // its queued markers keep their own stamps: no wait
  }
  bool queryStream(const c10::Stream& s) const override {
    return stream_idle(s.device_index(), static_cast<int>(s.id()));
  }
  void synchronizeStream(const c10::Stream& s) const override {
    warn_or_error_on_sync("sync: Stream.synchronize()");  // as CUDAStream::synchronize (not Event's, not the device's)
    synchronize_stream(s.device_index(), static_cast<int>(s.id()), "sync: Stream.synchronize()");
  }
  void synchronizeEvent(void* event) const override {
    auto* ev = static_cast<NeuronEvent*>(event);
    if (ev == nullptr || ev->pos == 0) return;
    wait_position(ev->device, ev->stream, ev->pos, "sync: Event.synchronize()");
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    synchronize_device(device_index < 0 ? current_device() : device_index, "sync: torch.neuron.synchronize()");
  }
  void recordDataPtrOnStream(const c10::DataPtr& data_ptr, const c10::Stream& s) const override {
    if (data_ptr.get() == nullptr) return;
    record_block_stream(data_ptr.get(), s.device_index(), static_cast<int>(s.id()));
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    return event_elapsed_ms(static_cast<NeuronEvent*>(start), static_cast<NeuronEvent*>(end));
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl);

}  // namespace tnl
