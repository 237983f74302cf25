// PrivateUse1 hooks: what ATen and torch.accelerator ask of the neuron backend.
#include "neuron.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>

namespace tnl {

struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    return default_generator(device_index < 0 ? current_device() : device_index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    return new_generator(device_index);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    const int d = device_of_ptr(data);
    return c10::Device(kNeuron, d < 0 ? current_device() : d);
  }
  bool isPinnedPtr(const void* data) const override { return data != nullptr && is_pinned_host_ptr(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return pinned_host_allocator(); }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override { return runtime_started(); }
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(device_count()); }
  void setCurrentDevice(c10::DeviceIndex device) const override { set_current_device(device); }
  c10::DeviceIndex getCurrentDevice() const override { return static_cast<c10::DeviceIndex>(current_device()); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const int old = current_device();
    set_current_device(device);
    return static_cast<c10::DeviceIndex>(old);
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    // UntypedStorage.resize_(-1) arrives as a huge size_t: reject it before it reaches the allocator
    TORCH_CHECK(static_cast<int64_t>(newsize) >= 0, "Storage.resize_: the new size must be a non-negative ",
                "number of bytes, got ", static_cast<int64_t>(newsize));
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    const int d = impl->device().index() < 0 ? current_device() : impl->device().index();
    if (worker_stream() < 0 && impl->nbytes() > 0 && newsize > 0)
      synchronize_stream(d, current_stream(d), "sync: storage resize_");  // its bytes are copied on the host
    HostNowGuard now;
    c10::DataPtr fresh = allocate_on(d, newsize);
    const size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0 && impl->data() != nullptr) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

void install_hooks() {
  static bool done = false;
  if (done) return;
  done = true;
  at::RegisterPrivateUse1HooksInterface(new NeuronHooks());
  install_fork_handlers();
}

}  // namespace tnl
