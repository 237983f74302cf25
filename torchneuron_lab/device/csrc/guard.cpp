// Device guard: a per-thread current device; one synchronous default stream per device.
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
    return static_cast<c10::DeviceIndex>(device_count());
  }
  // Kernels run synchronously on the host: events and streams are always complete.
  void record(void** /*event*/, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {}
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* /*event*/, const c10::DeviceIndex /*device_index*/) const noexcept override {}
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const c10::DeviceIndex /*device_index*/) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const c10::Stream& /*stream*/) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl);

}  // namespace tnl
