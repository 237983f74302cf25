// Per-device random generators. A neuron generator owns a CPU-style engine (mt19937 state, as the
// CPU backend uses) so kernels executed on host code draw from the neuron device's own stream:
// torch.neuron.manual_seed(s) makes torch.randn(..., device="neuron") reproducible and independent
// of torch.random's CPU generator state.
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <c10/core/GeneratorImpl.h>

#include <mutex>

namespace tnl {

class NeuronGeneratorImpl final : public c10::GeneratorImpl {
 public:
  explicit NeuronGeneratorImpl(int device, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(c10::Device(kNeuron, device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        engine_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

  void set_current_seed(uint64_t seed) override { engine_.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { engine_.set_offset(offset); }
  uint64_t get_offset() const override { return engine_.unsafeGetGeneratorImpl()->get_offset(); }
  uint64_t current_seed() const override { return engine_.unsafeGetGeneratorImpl()->current_seed(); }
  uint64_t seed() override { return engine_.seed(); }
  void set_state(const c10::TensorImpl& new_state) override {
    std::lock_guard<std::mutex> lock(engine_.mutex());
    engine_.unsafeGetGeneratorImpl()->set_state(new_state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    std::lock_guard<std::mutex> lock(engine_.unsafeGetGeneratorImpl()->mutex_);
    return engine_.unsafeGetGeneratorImpl()->get_state();
  }
  static c10::DeviceType device_type() { return kNeuron; }
  const at::Generator& engine() const { return engine_; }

 private:
  NeuronGeneratorImpl* clone_impl() const override {
    auto* g = new NeuronGeneratorImpl(device().index());
    g->engine_ = engine_.clone();
    return g;
  }
  at::Generator engine_;
};

const at::Generator& default_generator(int device) {
  static std::once_flag once;
  static std::vector<at::Generator> gens;
  std::call_once(once, [] {
    for (int d = 0; d < device_count(); ++d) {
      gens.push_back(at::make_generator<NeuronGeneratorImpl>(d));
      gens.back().seed();  // non-deterministic until the user seeds, like torch.cuda
    }
  });
  check_device_index(device);
  return gens[device];
}

at::Generator new_generator(int device) {
  if (device < 0) device = current_device();
  check_device_index(device);
  return at::make_generator<NeuronGeneratorImpl>(device);
}

at::Generator cpu_engine_of(const at::Generator& g) {
  TORCH_CHECK(g.device().type() == kNeuron, "Expected a 'neuron' device type for generator but found '",
              g.device().type(), "'");
  return static_cast<NeuronGeneratorImpl*>(g.unsafeGetGeneratorImpl())->engine();
}

}  // namespace tnl
