// torch.distributed collectives on neuron tensors: the `neuron` process-group backend (README.md,
// "Collectives").
//
// As NCCL runs a collective on its own stream, each NeuronBackend has a communication stream per device: a
// collective called on the host is enqueued there, after a device-side wait for the caller's current stream
// (so it reads what was launched before it), and the host returns at once. The stream's worker runs the
// collective on host aliases of the device memory (the device's memory is host memory: zero-copy) through
// a Gloo process group over the same store, and blocks until the peers are done, as a NCCL kernel occupies
// its stream. `Work.wait()` makes the caller's current stream wait for it (no host wait, as NCCL);
// `barrier()` and a receive from any source wait on the host. Every collective of a process group goes
// through the one communication stream of its device, so the ranks' Gloo calls are made in the order the
// program made them (the order collectives must agree on across ranks, as with NCCL).
#include "neuron.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Utils.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>

#include <algorithm>
#include <map>
#include <thread>
#include <tuple>
#include <unordered_set>

namespace tnl {
namespace {

using c10d::OpType;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using HostPtr = c10::intrusive_ptr<c10d::Backend>;

at::Tensor host_alias(const at::Tensor& t) {
  if (!t.defined() || t.is_cpu()) return t;  // a CPU tensor of the group goes to Gloo as it is
  if (t.numel() == 0) return at::empty(t.sizes(), t.options().device(c10::kCPU));
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::kCPU));
}
std::vector<at::Tensor> host_aliases(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(host_alias(t));
  return out;
}
std::vector<std::vector<at::Tensor>> host_aliases(const std::vector<std::vector<at::Tensor>>& ts) {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(ts.size());
  for (const auto& v : ts) out.push_back(host_aliases(v));
  return out;
}

class NeuronWork : public c10d::Work {
 public:
  NeuronWork(int rank, OpType op, int device, int stream, uint64_t pos, std::vector<at::Tensor> outputs,
             c10::intrusive_ptr<c10::ivalue::Future> future, std::shared_ptr<std::atomic<int>> source,
             bool host_waits)
      : c10d::Work(rank, op),
        device_(device),
        stream_(stream),
        pos_(pos),
        outputs_(std::move(outputs)),
        future_(std::move(future)),
        source_(std::move(source)),
        host_waits_(host_waits || source_ != nullptr) {}

  bool isCompleted() override { return stream_completed(device_, stream_) >= pos_; }
  bool isSuccess() const override { return true; }  // a failure is the device's asynchronous error
  std::vector<at::Tensor> result() override { return outputs_; }
  int sourceRank() const override {
    const int r = source_ ? source_->load() : -1;
    TORCH_CHECK(r >= 0, "sourceRank() is only available for a receive from any source that has completed");
    return r;
  }
  // The caller's current stream waits for the collective (no host wait), as NCCL's wait().
  void synchronize() override { block_current_stream(); }
  // With a timeout (as Gloo's wait): the host waits for the collective, at most `timeout`, and raises
  // "Operation timed out!" after it. Without: the caller's stream waits (no host wait), as NCCL's wait().
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout.count() > 0) {  // (0: no timeout, kNoTimeout)
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (stream_completed(device_, stream_) < pos_) {
        TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "Operation timed out!");
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      wait_position(device_, stream_, pos_, host_waits_ && source_ ? "sync: recv (any source)" : "sync: Work.wait()");
      return true;
    }
    if (host_waits_) {  // a barrier, or a receive from any source (the host needs the sender's rank)
      wait_position(device_, stream_, pos_, source_ ? "sync: recv (any source)" : "sync: barrier");
      return true;
    }
    block_current_stream();
    return true;
  }
  void blockCurrentStream() override { block_current_stream(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  void block_current_stream() {
    const int cur = current_stream(device_);
    if (cur != stream_) enqueue_stream_wait(device_, cur, device_, stream_, pos_);
  }
  int device_;
  int stream_;
  uint64_t pos_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<std::atomic<int>> source_;
  bool host_waits_;
};

class NeuronBackend : public c10d::Backend {
 public:
  NeuronBackend(HostPtr host, int rank, int size) : c10d::Backend(rank, size), host_(std::move(host)) {
    comm_stream_.fill(-1);
  }

  const std::string getBackendName() const override { return "neuron"; }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    check_root(opts.rootRank, "broadcast");
    gloo_checks("broadcast", {opts.rootRank}, [&](auto& m) { host_->broadcast(m, opts); }, tensors);
    auto h = host_aliases(tensors);
    return launch("broadcast", OpType::BROADCAST, tensors, tensors,
                  [h, opts](c10d::Backend& b) mutable { return b.broadcast(h, opts); });
  }

  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    check_gloo_reduce(opts.reduceOp, tensors);
    gloo_checks("allreduce", {op_code(opts.reduceOp)}, [&](auto& m) { host_->allreduce(m, sum_of(opts)); }, tensors);
    auto h = host_aliases(tensors);
    c10d::AllreduceOptions o = opts;
    auto factor = premul_factor(o.reduceOp);  // in place: the tensors are scaled, then summed
    return launch("all_reduce", OpType::ALLREDUCE, tensors, tensors, [h, o, factor](c10d::Backend& b) mutable {
      scale_in_place(h, factor);
      return b.allreduce(h, o);
    });
  }

  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceCoalescedOptions& opts) override {
    check_gloo_reduce(opts.reduceOp, tensors);
    gloo_checks("allreduce_coalesced", {op_code(opts.reduceOp)},
                [&](auto& m) { host_->allreduce_coalesced(m, sum_of(opts)); }, tensors);
    auto h = host_aliases(tensors);
    c10d::AllreduceCoalescedOptions o = opts;
    auto factor = premul_factor(o.reduceOp);
    return launch("all_reduce_coalesced", OpType::COALESCED, tensors, tensors,
                  [h, o, factor](c10d::Backend& b) mutable {
                    scale_in_place(h, factor);
                    return b.allreduce_coalesced(h, o);
                  });
  }

  WorkPtr reduce(std::vector<at::Tensor>& given, const c10d::ReduceOptions& opts) override {
    check_root(opts.rootRank, "reduce");
    std::vector<at::Tensor> tensors = real_views("reduce", opts.reduceOp, given);
    check_gloo_reduce(opts.reduceOp, tensors);
    gloo_checks("reduce", {op_code(opts.reduceOp), opts.rootRank}, [&](auto& m) { host_->reduce(m, sum_of(opts)); },
                tensors);
    auto h = host_aliases(tensors);
    c10d::ReduceOptions o = opts;
    auto factor = premul_factor(o.reduceOp);  // scaled copies reduced, then the root's copied back (NCCL's
    const bool root = o.rootRank == getRank();  // reduce leaves the other ranks' tensors as they were)
    return launch("reduce", OpType::REDUCE, tensors, tensors, [h, o, factor, root](c10d::Backend& b) mutable {
      if (!factor) return b.reduce(h, o);
      std::vector<at::Tensor> s = scaled(h, factor);
      WorkPtr w = b.reduce(s, o);
      w->wait();
      if (root) h[0].copy_(s[0]);
      return w;
    });
  }

  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions& opts) override {
    gloo_checks("allgather", {}, [&](auto& o, auto& i) { host_->allgather(o, i, opts); }, outputs, inputs);
    auto ho = host_aliases(outputs);
    auto hi = host_aliases(inputs);
    return launch("all_gather", OpType::ALLGATHER, inputs, flatten(outputs),
                  [ho, hi, opts](c10d::Backend& b) mutable { return b.allgather(ho, hi, opts); });
  }

  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK(output.numel() == input.numel() * getSize(), "output tensor size must be equal to world_size "
                "times input tensor size (all_gather_into_tensor): got ", output.numel(), " and ",
                input.numel(), " x ", getSize());
    TORCH_CHECK(output.scalar_type() == input.scalar_type(),
                "output tensor must have the same type as input tensor (all_gather_into_tensor)");
    // (after the checks above, which are Gloo's own, with its messages)
    gloo_checks("_allgather_base", {}, [&](auto& o, auto& i) { host_->_allgather_base(o, i, opts); }, output, input);
    at::Tensor ho = host_alias(output), hi = host_alias(input);
    return launch("all_gather_into_tensor", OpType::_ALLGATHER_BASE, {input}, {output},
                  [ho, hi, opts](c10d::Backend& b) mutable { return b._allgather_base(ho, hi, opts); });
  }

  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions& opts) override {
    // Gloo's allgather_coalesced takes a tag before it refuses a device, so its checks are mirrored (its messages)
    if (neuron_in(inputs) || neuron_in(outputs)) {
      const std::string what = "ProcessGroupGloo::allgather_coalesced: ";
      TORCH_CHECK(!inputs.empty(), what, "requires non-empty input tensor list");
      TORCH_CHECK(outputs.size() == static_cast<size_t>(getSize()), what, "output lists should be equal to world size");
      for (const auto& list : outputs) {
        TORCH_CHECK(list.size() == inputs.size(), what, "invalid output size: (expected length ", inputs.size(),
                    ", got ", list.size(), ")");
        for (size_t i = 0; i < list.size(); ++i) {
          TORCH_CHECK(list[i].sizes() == inputs[i].sizes(), what, "invalid size of output tensor at index ", i,
                      " (expected length ", c10d::toString(inputs[i].sizes()), ", got ",
                      c10d::toString(list[i].sizes()), ")");
          TORCH_CHECK(inputs[i].options().type_equal(list[i].options()), what, "invalid tensor type at index ", i,
                      " (expected ", inputs[i].toString(), ", got ", list[i].toString(), ")");
        }
      }
    }
    auto ho = host_aliases(outputs);
    auto hi = host_aliases(inputs);
    return launch("all_gather_coalesced", OpType::ALLGATHER_COALESCED, inputs, flatten(outputs),
                  [ho, hi, opts](c10d::Backend& b) mutable { return b.allgather_coalesced(ho, hi, opts); });
  }

  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions& opts) override {
    auto ho = host_aliases(outputs);
    auto hi = host_aliases(inputs);
    return launch("all_gather_into_tensor_coalesced", OpType::COALESCED, inputs, outputs,
                  [ho, hi, opts](c10d::Backend& b) mutable {
                    return b.allgather_into_tensor_coalesced(ho, hi, opts);
                  });
  }

  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override {
    check_root(opts.rootRank, "gather");
    gloo_checks("gather", {opts.rootRank}, [&](auto& o, auto& i) { host_->gather(o, i, opts); }, outputs, inputs);
    auto ho = host_aliases(outputs);
    auto hi = host_aliases(inputs);
    return launch("gather", OpType::GATHER, inputs, flatten(outputs),
                  [ho, hi, opts](c10d::Backend& b) mutable { return b.gather(ho, hi, opts); });
  }

  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override {
    check_root(opts.rootRank, "scatter");
    gloo_checks("scatter", {opts.rootRank}, [&](auto& o, auto& i) { host_->scatter(o, i, opts); }, outputs, inputs);
    auto ho = host_aliases(outputs);
    auto hi = host_aliases(inputs);
    return launch("scatter", OpType::SCATTER, flatten(inputs), outputs,
                  [ho, hi, opts](c10d::Backend& b) mutable { return b.scatter(ho, hi, opts); });
  }

  WorkPtr reduce_scatter(std::vector<at::Tensor>& given_outputs, std::vector<std::vector<at::Tensor>>& given_inputs,
                         const c10d::ReduceScatterOptions& opts) override {
    std::vector<at::Tensor> outputs = real_views("all_reduce", opts.reduceOp, given_outputs);
    std::vector<std::vector<at::Tensor>> inputs;
    for (const auto& v : given_inputs) inputs.push_back(real_views("all_reduce", opts.reduceOp, v));
    check_gloo_reduce(opts.reduceOp, flatten(inputs));
    gloo_checks("reduce_scatter", {op_code(opts.reduceOp)},
                [&](auto& o, auto& i) { host_->reduce_scatter(o, i, sum_of(opts)); }, outputs, inputs);
    auto ho = host_aliases(outputs);
    auto hi = host_aliases(inputs);
    c10d::ReduceScatterOptions o = opts;
    auto factor = premul_factor(o.reduceOp);  // the inputs' scaled copies are summed (the inputs are kept)
    return launch("reduce_scatter", OpType::REDUCE_SCATTER, flatten(inputs), outputs,
                  [ho, hi, o, factor](c10d::Backend& b) mutable {
                    for (auto& v : hi) v = scaled(v, factor);
                    return b.reduce_scatter(ho, hi, o);
                  });
  }

  WorkPtr _reduce_scatter_base(at::Tensor& given_output, at::Tensor& given_input,
                               const c10d::ReduceScatterOptions& opts) override {
    const std::vector<at::Tensor> real = real_views("all_reduce", opts.reduceOp, {given_output, given_input});
    at::Tensor output = real[0], input = real[1];
    check_gloo_reduce(opts.reduceOp, {input});
    TORCH_CHECK(input.numel() == output.numel() * getSize(), "input tensor size must be equal to world_size "
                "times output tensor size (reduce_scatter_tensor): got ", input.numel(), " and ",
                output.numel(), " x ", getSize());
    TORCH_CHECK(output.scalar_type() == input.scalar_type(),
                "input tensor must be the same type as the output tensor (reduce_scatter_tensor)");
    // (after the checks above, which are Gloo's own, with its messages)
    gloo_checks("_reduce_scatter_base", {op_code(opts.reduceOp)},
                [&](auto& o, auto& i) { host_->_reduce_scatter_base(o, i, sum_of(opts)); }, output, input);
    at::Tensor ho = host_alias(output), hi = host_alias(input);
    c10d::ReduceScatterOptions o = opts;
    auto factor = premul_factor(o.reduceOp);
    return launch("reduce_scatter_tensor", OpType::_REDUCE_SCATTER_BASE, {input}, {output},
                  [ho, hi, o, factor](c10d::Backend& b) mutable {
                    std::vector<at::Tensor> in = scaled({hi}, factor);
                    return b._reduce_scatter_base(ho, in[0], o);
                  });
  }

  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    check_gloo_reduce(opts.reduceOp, inputs);
    auto ho = host_aliases(outputs);
    auto hi = host_aliases(inputs);
    c10d::ReduceScatterOptions o = opts;
    auto factor = premul_factor(o.reduceOp);
    return launch("reduce_scatter_tensor_coalesced", OpType::COALESCED, inputs, outputs,
                  [ho, hi, o, factor](c10d::Backend& b) mutable {
                    std::vector<at::Tensor> in = scaled(hi, factor);
                    return b.reduce_scatter_tensor_coalesced(ho, in, o);
                  });
  }

  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override {
    if (neuron_in(input) || neuron_in(output)) {
      // (Gloo's alltoall_base takes a tag before it refuses a device: its checks are these, made in its work:
      // c10d's own check of the splits, its messages, and without splits equal sizes)
      c10d::checkSplitSizes(input_splits, input, getSize());
      c10d::checkSplitSizes(output_splits, output, getSize());
      TORCH_CHECK(!input_splits.empty() || !output_splits.empty() || input.numel() == output.numel(),
                  "all_to_all_single: the input and output tensors must have the same number of elements when no ",
                  "split sizes are given, got ", input.numel(), " and ", output.numel());
    }
    at::Tensor ho = host_alias(output), hi = host_alias(input);
    return launch("all_to_all_single", OpType::ALLTOALL_BASE, {input}, {output},
                  [ho, hi, output_splits, input_splits, opts](c10d::Backend& b) mutable {
                    return b.alltoall_base(ho, hi, output_splits, input_splits, opts);
                  });
  }

  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions& opts) override {
    gloo_checks("alltoall", {}, [&](auto& o, auto& i) { host_->alltoall(o, i, opts); }, outputs, inputs);
    auto ho = host_aliases(outputs);
    auto hi = host_aliases(inputs);
    return launch("all_to_all", OpType::ALLTOALL, inputs, outputs,
                  [ho, hi, opts](c10d::Backend& b) mutable { return b.alltoall(ho, hi, opts); });
  }

  WorkPtr send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    check_peer(dst, "send");
    auto h = host_aliases(tensors);
    return launch("send", OpType::SEND, tensors, {},
                  [h, dst, tag](c10d::Backend& b) mutable { return b.send(h, dst, tag); }, nullptr, P2P{dst, true});
  }

  WorkPtr recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    check_peer(src, "recv");
    // (Gloo has no pair to a rank's self: its receive fails at the call; on a stream it would wait for the
    // group's timeout and fail at the next sync)
    TORCH_CHECK(src != getRank() || !neuron_in(tensors), "recv: rank ", src, " cannot receive from itself");
    auto h = host_aliases(tensors);
    return launch("recv", OpType::RECV, {}, tensors,
                  [h, src, tag](c10d::Backend& b) mutable { return b.recv(h, src, tag); }, nullptr, P2P{src, false});
  }

  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    auto h = host_aliases(tensors);
    auto source = std::make_shared<std::atomic<int>>(-1);
    return launch(
        "recv (any source)", OpType::RECVANYSOURCE, {}, tensors,
        // (one wait per Gloo receive: a second waits for another message; the worker's wait stores the sender)
        [h, tag](c10d::Backend& b) mutable { return b.recvAnysource(h, tag); },
        source, P2P{-1, false});
  }

  // The host waits, as NCCL's barrier: every rank's collectives launched before it have run.
  WorkPtr barrier(const c10d::BarrierOptions& opts) override {
    const int device = opts.device_ids.empty() ? current_device() : static_cast<int>(opts.device_ids.front());
    check_device_index(device);
    c10d::BarrierOptions o = opts;
    o.device_ids.clear();
    return launch_on(device, "barrier", OpType::BARRIER, {}, {},
                     [o](c10d::Backend& b) mutable { return b.barrier(o); }, nullptr, std::nullopt);
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    host_->monitoredBarrier(opts, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override { host_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return host_->getSequenceNumberForGroup(); }
  void setTimeout(std::chrono::milliseconds timeout) override { host_->setTimeout(timeout); }

  // The communication stream of `device` (made at first use), for the timeline and tests.
  int comm_stream(int device) {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(device < static_cast<int>(comm_stream_.size()), "neuron:", device, ": too many devices");
    int& s = comm_stream_[device];
    if (s < 0) s = new_stream(device, 0);
    return s;
  }

 private:
  // A point-to-point operation: its peer (-1: any source) and direction. Each (device, peer, direction) has
  // its own stream, in order: a send blocks its stream until the peer has received, so two ranks that each
  // send before they receive (isend/irecv, batch_isend_irecv) would deadlock on one stream.
  struct P2P {
    int peer;
    bool send;
  };
  int p2p_stream(int device, const P2P& p) {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mu_);
    int& s = p2p_streams_[std::make_tuple(device, p.peer, p.send)];
    if (s == 0) s = new_stream(device, 0);
    return s;
  }
  // Where the group's last collective was enqueued: the next one, on any device, waits for it, so every Gloo
  // call is made in the order the program made them (a group used from two devices, or with CPU tensors).
  struct Position {
    int device = -1;
    int stream = 0;
    uint64_t pos = 0;
  };

 private:
  using Body = std::function<WorkPtr(c10d::Backend&)>;

  // NCCL's PREMUL_SUM (Gloo has none): each rank's input scaled by the factor, then summed. Returns the
  // factor (a double or a 0-dim tensor) and makes `op` a SUM; nullopt for any other op (Gloo's own: AVG too).
  static std::optional<c10::Scalar> premul_factor(c10d::ReduceOp& op) {
    if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return std::nullopt;
    auto* sup = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK(sup != nullptr, "ReduceOp.PREMUL_SUM without a factor");
    c10::Scalar f = sup->tensor_factor.defined() ? sup->tensor_factor.cpu().item() : c10::Scalar(sup->double_factor);
    op = c10d::ReduceOp(c10d::ReduceOp::SUM);
    return f;
  }
  static void scale_in_place(std::vector<at::Tensor>& ts, const std::optional<c10::Scalar>& f) {
    if (!f) return;
    for (auto& t : ts) t.mul_(*f);
  }
  static std::vector<at::Tensor> scaled(const std::vector<at::Tensor>& ts, const std::optional<c10::Scalar>& f) {
    if (!f) return ts;
    std::vector<at::Tensor> out;
    out.reserve(ts.size());
    for (const auto& t : ts) out.push_back(t.mul(*f));
    return out;
  }

  static std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& vs) {
    std::vector<at::Tensor> out;
    for (const auto& v : vs) out.insert(out.end(), v.begin(), v.end());
    return out;
  }

  // Gloo's own checks of a collective's arguments (list lengths against the group's size, tensor sizes and
  // types against each other, roots) are made when its method is called, before it takes a tag: on a
  // communication stream they would run with the collective, as the asynchronous error of the next sync.
  // They are run at the call instead, by Gloo itself, on meta stand-ins of the tensors (same sizes, strides,
  // dtypes): every check passes or raises Gloo's own error, then Gloo refuses the meta device ("unsupported
  // device type meta") before it takes a tag or touches a peer. torch 2.13's ProcessGroupGloo checks the
  // device last, before its tag, in every collective method but allgather_coalesced and alltoall_base (their
  // checks are mirrored below); tests/test_distributed.py compares the errors with a Gloo group's and checks
  // that every collective takes exactly one of the group's sequence numbers.
  // A key of everything Gloo's checks read (the collective, its tensors' dtypes, sizes and strides, list
  // lengths, root, op): a call whose key passed before is not checked again (the checks cost ~10 us, a
  // training step repeats the same few collectives).
  struct Sig {
    std::string s;
    explicit Sig(const char* name) : s(name) {}
    Sig& add(int64_t v) {
      s += '|';
      s += std::to_string(v);
      return *this;
    }
    Sig& add(const at::Tensor& t) {
      s += t.defined() ? "|t" + std::to_string(static_cast<int>(t.scalar_type())) : std::string("|u");
      if (t.defined()) {
        for (int64_t v : t.sizes()) add(v);
        s += '/';
        for (int64_t v : t.strides()) add(v);
      }
      return *this;
    }
    Sig& add(const std::vector<at::Tensor>& ts) {
      s += "|[";
      for (const auto& t : ts) add(t);
      s += ']';
      return *this;
    }
    Sig& add(const std::vector<std::vector<at::Tensor>>& vs) {
      s += "|[";
      for (const auto& v : vs) add(v);
      s += ']';
      return *this;
    }
  };
  // `call` (Gloo's method) on meta stand-ins of `tensors`, unless none is on neuron or the same key passed.
  template <typename F, typename... T>
  void gloo_checks(const char* name, std::initializer_list<int64_t> extra, const F& call, const T&... tensors) {
    if (!(neuron_in(tensors) || ...)) return;  // CPU tensors: Gloo's own work makes its own checks
    Sig key(name);
    (key.add(tensors), ...);
    for (int64_t v : extra) key.add(v);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (checked_.count(key.s) != 0) return;
    }
    auto metas = std::make_tuple(meta(tensors)...);
    try {
      std::apply(call, metas);
      TORCH_INTERNAL_ASSERT(false, "Gloo accepted meta tensors: its argument checks cannot be run at the call");
    } catch (const c10::Error& e) {
      if (std::string(e.what_without_backtrace()).find("unsupported device type meta") == std::string::npos) throw;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (checked_.size() >= 4096) checked_.clear();
    checked_.insert(key.s);
  }
  static at::Tensor meta(const at::Tensor& t) {
    if (!t.defined()) return t;
    return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
  }
  static std::vector<at::Tensor> meta(const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> out;
    out.reserve(ts.size());
    for (const auto& t : ts) out.push_back(meta(t));
    return out;
  }
  static std::vector<std::vector<at::Tensor>> meta(const std::vector<std::vector<at::Tensor>>& vs) {
    std::vector<std::vector<at::Tensor>> out;
    out.reserve(vs.size());
    for (const auto& v : vs) out.push_back(meta(v));
    return out;
  }
  // The options with NCCL's PREMUL_SUM as Gloo's SUM (the backend composes it), for Gloo's checks.
  template <typename O>
  static O sum_of(const O& opts) {
    O o = opts;
    if (o.reduceOp.op_ == c10d::ReduceOp::PREMUL_SUM) o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    return o;
  }
  static bool neuron_in(const at::Tensor& t) { return t.defined() && t.device().type() == kNeuron; }
  static bool neuron_in(const std::vector<at::Tensor>& ts) {
    return std::any_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return neuron_in(t); });
  }
  static bool neuron_in(const std::vector<std::vector<at::Tensor>>& vs) {
    return std::any_of(vs.begin(), vs.end(), [](const std::vector<at::Tensor>& v) { return neuron_in(v); });
  }
  static int64_t op_code(const c10d::ReduceOp& op) { return static_cast<int64_t>(op.op_); }

  // Gloo's refusals of a dtype or a reduce op, raised at the call as NCCL raises its own (Gloo raises them in
  // its work, at work.wait(); on a communication stream that would be the asynchronous error of the next sync,
  // after the program had gone on). The messages are Gloo's (ProcessGroupGloo.cpp, 2.13), so a program sees
  // the error a "cpu:gloo" group gives it; tests/test_distributed.py compares every dtype and op with Gloo's.
  static bool gloo_dtype(at::ScalarType t) {
    switch (t) {
      case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kChar: case at::kByte:
      case at::kInt: case at::kLong: case at::kBool:
        return true;
      default:
        return false;
    }
  }
  static void check_gloo_dtypes(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    for (const auto* v : {&a, &b})
      for (const auto& t : *v)
        TORCH_CHECK(!t.defined() || t.is_cpu() || gloo_dtype(t.scalar_type()), "Invalid scalar type");
  }
  static void check_gloo_reduce(const c10d::ReduceOp& op, const std::vector<at::Tensor>& tensors) {
    for (const auto& t : tensors) {
      if (!t.defined() || t.is_cpu()) continue;  // Gloo's own work: its own errors
      const at::ScalarType dt = t.scalar_type();
      TORCH_CHECK(gloo_dtype(dt), "Invalid scalar type");
      const bool integral = at::isIntegralType(dt, /*includeBool=*/true);
      const char* bitwise = op.op_ == c10d::ReduceOp::BAND  ? "BAND"
                            : op.op_ == c10d::ReduceOp::BOR ? "BOR"
                            : op.op_ == c10d::ReduceOp::BXOR ? "BXOR"
                                                             : nullptr;
      TORCH_CHECK(bitwise == nullptr || integral, "Cannot use ReduceOp.", bitwise, " with non-integral dtype");
      // AVG is a SUM divided in place by the group's size: a true division an integral tensor cannot hold
      TORCH_CHECK(op.op_ != c10d::ReduceOp::AVG || !integral, "result type Float can't be cast to the desired ",
                  "output type ", c10::toString(dt));
      // NCCL's PREMUL_SUM (composed here: Gloo has none) takes floating tensors only, with NCCL's error
      TORCH_CHECK_TYPE(op.op_ != c10d::ReduceOp::PREMUL_SUM || at::isFloatingType(dt),
                       "PreMulSum Data type must be half, float, bfloat16 or double");
    }
  }

  // Complex tensors of the reduce collectives the Python layer passes as they are (reduce, reduce_scatter,
  // reduce_scatter_tensor), as Gloo takes them: viewed as real for the ops that allow it (SUM, AVG), refused
  // for the others (Gloo's message spells the op as its enum's byte; this one names it).
  static std::vector<at::Tensor> real_views(const char* name, const c10d::ReduceOp& op, std::vector<at::Tensor> ts) {
    for (auto& t : ts) {
      if (!t.defined() || t.is_cpu() || !t.is_complex()) continue;
      TORCH_CHECK(op.op_ == c10d::ReduceOp::SUM || op.op_ == c10d::ReduceOp::AVG ||
                      op.op_ == c10d::ReduceOp::PREMUL_SUM,  // (a real factor scales each part)
                  name, " does not support ", reduce_op_name(op), " on complex tensors");
      t = at::view_as_real(t);
    }
    return ts;
  }
  static const char* reduce_op_name(const c10d::ReduceOp& op) {
    switch (op.op_) {
      case c10d::ReduceOp::SUM: return "SUM";
      case c10d::ReduceOp::AVG: return "AVG";
      case c10d::ReduceOp::PRODUCT: return "PRODUCT";
      case c10d::ReduceOp::MIN: return "MIN";
      case c10d::ReduceOp::MAX: return "MAX";
      case c10d::ReduceOp::BAND: return "BAND";
      case c10d::ReduceOp::BOR: return "BOR";
      case c10d::ReduceOp::BXOR: return "BXOR";
      case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
      default: return "UNUSED";
    }
  }

  void check_root(int64_t root, const char* op) const {
    TORCH_CHECK_VALUE(root >= 0 && root < getSize(), op, ": invalid root rank ", root, " for a group of ",
                      getSize());
  }
  void check_peer(int peer, const char* op) const {
    TORCH_CHECK_VALUE(peer >= 0 && peer < getSize(), op, ": invalid peer rank ", peer, " for a group of ",
                      getSize());
  }

  // Every tensor of a collective: on one neuron device, dense and non-overlapping (NCCL's rules), or all on
  // the CPU (-1: Gloo runs them as it would in a "cpu:gloo" group).
  static int device_of(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const char* op) {
    int device = -1;
    bool cpu = false;
    for (const auto* v : {&a, &b}) {
      for (const auto& t : *v) {
        TORCH_CHECK(t.defined(), op, ": undefined tensor");
        if (t.is_cpu()) {
          cpu = true;
          continue;
        }
        TORCH_CHECK(t.device().type() == kNeuron, op, ": the neuron backend takes neuron and CPU tensors, got a ",
                    "tensor on ", t.device());
        TORCH_CHECK(t.layout() == c10::kStrided, op, ": tensors must be dense for the neuron backend, got ",
                    t.layout());
        TORCH_CHECK(t.is_non_overlapping_and_dense(), op, ": tensors must be non-overlapping and dense");
        const int d = t.device().index();
        TORCH_CHECK(device < 0 || device == d, op, ": tensors must all be on the same neuron device (neuron:",
                    device, " and neuron:", d, ")");
        device = d;
      }
    }
    TORCH_CHECK(!(cpu && device >= 0), op, ": tensors must all be on one device (neuron:", device,
                " and cpu were given)");
    return device;
  }

  WorkPtr launch(const char* name, OpType op, const std::vector<at::Tensor>& inputs,
                 const std::vector<at::Tensor>& outputs, Body body,
                 std::shared_ptr<std::atomic<int>> source = nullptr, std::optional<P2P> p2p = std::nullopt) {
    const int device = device_of(inputs, outputs, name);
    if (device >= 0 && !p2p && op != OpType::BARRIER) check_gloo_dtypes(inputs, outputs);
    if (device < 0 && !(inputs.empty() && outputs.empty())) {
      // CPU tensors: Gloo's own work, called on this thread once the group's queued collectives have made their
      // Gloo calls (a host wait), so that the ranks' calls keep the program's order (object collectives too)
      Position last;
      {
        std::lock_guard<std::mutex> lock(order_mu_);
        last = last_;
      }
      if (!p2p && last.device >= 0) {
        wait_position(last.device, last.stream, last.pos, "sync: collective on CPU tensors", false);
      }
      return body(*host_);
    }
    return launch_on(device < 0 ? current_device() : device, name, op, inputs, outputs, std::move(body),
                     std::move(source), p2p);
  }

  WorkPtr launch_on(int device, const char* name, OpType op, const std::vector<at::Tensor>& inputs,
                    const std::vector<at::Tensor>& outputs, Body body, std::shared_ptr<std::atomic<int>> source,
                    std::optional<P2P> p2p) {
    const int cs = p2p ? p2p_stream(device, *p2p) : comm_stream(device);
    const int cur = current_stream(device);
    // The collective reads what the caller's stream launched before it.
    enqueue_stream_wait(device, cs, device, cur, stream_enqueued(device, cur));
    // Held until it is enqueued: the group's collectives keep one order (see Position).
    std::unique_lock<std::mutex> order(order_mu_);
    if (!p2p && last_.device >= 0 && (last_.device != device || last_.stream != cs)) {
      enqueue_stream_wait(device, cs, last_.device, last_.stream, last_.pos);
    }
    // A block the host frees after this call is reused only once the collective has run (stream-ordered).
    int64_t read = 0, written = 0;
    for (const auto& t : inputs) {
      if (t.numel() > 0) record_block_stream(t.storage().data_ptr().get(), device, cs);
      read += static_cast<int64_t>(t.numel()) * t.element_size();
    }
    for (const auto& t : outputs) {
      if (t.numel() > 0) record_block_stream(t.storage().data_ptr().get(), device, cs);
      written += static_cast<int64_t>(t.numel()) * t.element_size();
    }
    const int32_t name_id = intern_string(std::string("collective: ") + name);  // (thread-safe)
    Work w;
    w.device = device;
    w.stream = cs;
    w.launch = begin_launch(name_id);
    w.run = [host = host_, body = std::move(body), device, cs, name_id, read, written, source](const Launch& l) {
      const int64_t t0 = now_ns();
      {
        RedirectGuard host_memory(-1);  // Gloo's scratch memory is the emulator's, not the device's
        WorkPtr gw = body(*host);
        gw->wait();
        if (source) source->store(gw->sourceRank());
      }
      const int64_t t1 = now_ns();
      if (recording()) {
        EventRecord e;
        e.kind = EventKind::Kernel;
        e.engine = Engine::Dma;
        e.device = static_cast<int8_t>(device);
        e.name_id = name_id;
        e.bytes_read = read;
        e.bytes_written = written;
        push_launched_event(e, t0, t1, cs, l);
      }
    };
    uint64_t pos;
    {
      // A full queue makes the host wait: without the GIL (torch's bindings have released it already; the
      // reducer of DistributedDataParallel calls from autograd's threads, which do not hold it).
      PyThreadState* saved = (Py_IsInitialized() && PyGILState_Check()) ? PyEval_SaveThread() : nullptr;
      try {
        pos = enqueue(std::move(w));
      } catch (...) {
        if (saved != nullptr) PyEval_RestoreThread(saved);
        throw;
      }
      if (saved != nullptr) PyEval_RestoreThread(saved);
    }
    if (!p2p) last_ = Position{device, cs, pos};
    order.unlock();
    // A future completed on the communication stream: waiting on it (or a callback of it) makes the
    // waiter's current stream wait for the collective, as a CUDA future does with NCCL.
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                           std::vector<c10::Device>{c10::Device(kNeuron, device)});
    {
      c10::StreamGuard on_comm(c10::Stream(c10::Stream::UNSAFE, c10::Device(kNeuron, device), cs));
      future->markCompleted(c10::IValue(outputs));
    }
    return c10::make_intrusive<NeuronWork>(getRank(), op, device, cs, pos, outputs, future, std::move(source),
                                           op == OpType::BARRIER);
  }

  HostPtr host_;
  std::mutex mu_;
  std::unordered_set<std::string> checked_;  // argument signatures Gloo's checks passed (gloo_checks)
  std::array<int, 64> comm_stream_{};
  std::map<std::tuple<int, int, bool>, int> p2p_streams_;
  std::mutex order_mu_;
  Position last_;
};

}  // namespace

void init_collective_bindings(py::module& m) {
  m.def(
      "make_neuron_backend",
      [](const HostPtr& host, int rank, int size) -> HostPtr {
        TORCH_CHECK(host, "make_neuron_backend: no host process group");
        return c10::make_intrusive<NeuronBackend>(host, rank, size);
      },
      py::arg("host"), py::arg("rank"), py::arg("size"));
  m.def(
      "collective_stream",
      [](const HostPtr& backend, int device) {
        auto* nb = dynamic_cast<NeuronBackend*>(backend.get());
        TORCH_CHECK(nb != nullptr, "collective_stream: not a neuron backend");
        return nb->comm_stream(device);
      },
      py::arg("backend"), py::arg("device"));
}

}  // namespace tnl
