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
  // Random kernels draw from the engine when they run on a stream worker: the host reads or changes
  // the state only after the queued ones have drawn (so seeds, offsets and states mean what they say).
  // Called with the generator's mutex held (torch's Generator methods take it, with the GIL): the wait keeps the
  // GIL, or another thread given it would block on that mutex while this one waits for the GIL (deadlock).
  static void settle() {
    if (worker_stream() >= 0) return;
    KeepGilInWaits keep;
    drain_all();
  }

 public:
  explicit NeuronGeneratorImpl(int device, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(c10::Device(kNeuron, device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        engine_(at::make_generator<at::CPUGeneratorImpl>(seed)),
        order_(std::make_shared<Order>()) {}

  // CUDA's graph-safe state: a generator that *shares* this one's state (draws from either advance both);
  // set makes this generator share another's. The engine and its launch-order record are what is shared.
  c10::intrusive_ptr<c10::GeneratorImpl> graphsafe_get_state() const override {
    settle();
    auto g = c10::make_intrusive<NeuronGeneratorImpl>(device().index());
    g->engine_ = engine_;
    g->order_ = order_;
    return g;
  }
  void graphsafe_set_state(const c10::intrusive_ptr<c10::GeneratorImpl>& state) override {
    TORCH_CHECK(state && state->device().type() == kNeuron,
                "graphsafe_set_state: expected the state of a 'neuron' Generator, got one of a '",
                state ? c10::DeviceTypeName(state->device().type(), true) : std::string("null"), "' Generator");
    settle();
    auto* other = static_cast<NeuronGeneratorImpl*>(state.get());
    engine_ = other->engine_;
    order_ = other->order_;
  }

  void set_current_seed(uint64_t seed) override { settle(); engine_.set_current_seed(seed); }
  // The offset is the position in the device's random stream: the number of 32-bit draws taken from
  // the engine since it was seeded. set_offset(n) restarts the stream from the current seed and skips n
  // draws; get_offset() finds the position of the current state (bounded search, see kMaxOffsetTwists).
  void set_offset(uint64_t offset) override { settle();
    TORCH_CHECK(offset <= kMaxOffset, "neuron Generator.set_offset: offset ", offset, " is beyond the supported ",
                kMaxOffset, " draws");
    std::lock_guard<std::mutex> lock(cpu_impl()->mutex_);
    auto* cpu = cpu_impl();
    at::mt19937 e(cpu->current_seed());
    for (uint64_t i = 0; i < offset; ++i) e();
    cpu->set_current_seed(cpu->current_seed());  // also clears the cached normal samples
    cpu->set_engine(e);
  }
  uint64_t get_offset() const override { settle();
    std::lock_guard<std::mutex> lock(cpu_impl()->mutex_);
    auto* cpu = cpu_impl();
    const at::mt19937_data_pod cur = cpu->engine().data();
    at::mt19937 e(cpu->current_seed());
    if (cur.next_ == 0) return 0;  // nothing drawn since seeding
    // after k >= 1 draws: next_ == (k - 1) % N + 1 and the state array has been regenerated ceil(k / N) times
    uint64_t k = 0;
    for (int i = 0; i < cur.next_; ++i, ++k) e();
    for (uint64_t twists = 1; twists <= kMaxOffsetTwists; ++twists) {
      const at::mt19937_data_pod d = e.data();
      if (d.next_ == cur.next_ && d.left_ == cur.left_ && d.state_ == cur.state_) return k;
      for (int i = 0; i < at::MERSENNE_STATE_N; ++i, ++k) e();
    }
    TORCH_CHECK(false, "neuron Generator.get_offset: the stream position is beyond ", kMaxOffset,
                " draws from the seed (or the state was set with set_state from another seed)");
  }
  uint64_t current_seed() const override { return engine_.unsafeGetGeneratorImpl()->current_seed(); }
  uint64_t seed() override { settle(); return engine_.seed(); }
  void set_state(const c10::TensorImpl& new_state) override { settle();
    std::lock_guard<std::mutex> lock(engine_.mutex());
    engine_.unsafeGetGeneratorImpl()->set_state(new_state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override { settle();
    std::lock_guard<std::mutex> lock(engine_.unsafeGetGeneratorImpl()->mutex_);
    return engine_.unsafeGetGeneratorImpl()->get_state();
  }
  static c10::DeviceType device_type() { return kNeuron; }
  static constexpr uint64_t kMaxOffsetTwists = 1 << 16;
  static constexpr uint64_t kMaxOffset = kMaxOffsetTwists * at::MERSENNE_STATE_N;
  const at::Generator& engine() const { return engine_; }
  // The last launch that draws from this generator's engine, queued on a stream (order_random_launch below);
  // shared with the generators that share the engine (graphsafe_set_state).
  struct LastDraw {
    int device = -1;
    int stream = 0;
    uint64_t pos = 0;
  };
  struct Order {
    std::mutex mu;
    LastDraw last;
  };
  Order& order() const { return *order_; }
  at::CPUGeneratorImpl* cpu_impl() const { return static_cast<at::CPUGeneratorImpl*>(engine_.unsafeGetGeneratorImpl()); }

 private:
  NeuronGeneratorImpl* clone_impl() const override { settle();
    auto* g = new NeuronGeneratorImpl(device().index());
    g->engine_ = engine_.clone();
    return g;
  }
  at::Generator engine_;
  std::shared_ptr<Order> order_;
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

// Random draws in launch order. A kernel draws from the generator's engine when it runs on its stream's
// worker, so two random launches on different streams would draw in the order they run (a seeded program
// using several streams gave different numbers from run to run; CUDA reserves each launch's Philox offset at
// the launch). A random launch on another stream than the generator's last one is queued behind that one
// (a device-side wait: the host does not wait), so draws keep the launch order.
void order_random_launch(const at::Generator& g, int device, int stream) {
  auto* n = static_cast<NeuronGeneratorImpl*>(g.unsafeGetGeneratorImpl());
  NeuronGeneratorImpl::LastDraw last;
  {
    std::lock_guard<std::mutex> lock(n->order().mu);
    last = n->order().last;
  }
  if (last.device < 0 || (last.device == device && last.stream == stream)) return;
  if (stream_completed(last.device, last.stream) >= last.pos) return;
  enqueue_stream_wait(device, stream, last.device, last.stream, last.pos);
}

void note_random_launch(const at::Generator& g, int device, int stream, uint64_t pos) {
  auto* n = static_cast<NeuronGeneratorImpl*>(g.unsafeGetGeneratorImpl());
  std::lock_guard<std::mutex> lock(n->order().mu);
  n->order().last = {device, stream, pos};
}

}  // namespace tnl
