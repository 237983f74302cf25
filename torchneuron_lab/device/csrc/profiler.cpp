// torch.profiler integration: a Kineto activity profiler for the PrivateUse1 device, so the kernels and
// DMA transfers the recorder sees also appear in torch.profiler.profile(activities=[CPU, PrivateUse1])
// (key_averages' device columns, export_chrome_trace's "kernel"/"gpu_memcpy" rows with flow arrows
// to the CPU op that launched them).
#include "neuron.h"

#include <c10/util/ApproximateClock.h>
#include <libkineto.h>
#include <GenericTraceActivity.h>
#include <IActivityProfiler.h>
#include <output_base.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#include <torch/csrc/profiler/stubs/base.h>

#include <mutex>
#include <set>

namespace tnl {

std::string string_of(int32_t id);  // recorder.cpp

namespace {

thread_local std::vector<uint64_t> tls_correlation;

struct KinetoSink {
  std::mutex mu;
  std::vector<std::pair<EventRecord, uint64_t>> events;
  bool active = false;
};
KinetoSink& sink() {
  static KinetoSink s;
  return s;
}

class NeuronProfilerSession final : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    status_ = libkineto::TraceStatus::RECORDING;
    // Map our steady clock onto the profiler's wall clock (c10::getTime, ns).
    offset_ns_ = c10::getTime() - now_ns();
    {
      std::lock_guard<std::mutex> lock(sink().mu);
      sink().events.clear();
      sink().active = true;
    }
    g_recording_flags.fetch_or(kKinetoBit);
  }
  void stop() override {
    // Kernels launched in this session finish and are recorded in it: torch's profile.__exit__ synchronises
    // only the current device, so a kernel still queued on another (or behind a long one) was lost, or landed
    // in the next session with this one's correlation ids.
    drain_all();
    g_recording_flags.fetch_and(~kKinetoBit);
    std::lock_guard<std::mutex> lock(sink().mu);
    sink().active = false;
    events_ = std::move(sink().events);
    sink().events.clear();
    status_ = libkineto::TraceStatus::PROCESSING;
  }
  std::vector<std::string> errors() override { return {}; }
  void processTrace(libkineto::ActivityLogger& logger) override {
    processTrace(logger, [](int32_t) -> const libkineto::ITraceActivity* { return nullptr; }, 0, 0);
  }
  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked,
                    int64_t startTime, int64_t endTime) override {
    // Kineto's window arrives in ns (recent) or us (older); follow whichever this build uses.
    const int64_t div = (startTime != 0 && startTime < 100000000000000000LL) ? 1000 : 1;
    trace_ = std::make_unique<libkineto::CpuTraceBuffer>();
    trace_->span = libkineto::TraceSpan(startTime, endTime, "neuron");
    for (const auto& [ev, corr] : events_) {
      const auto type = ev.kind == EventKind::Dma ? libkineto::ActivityType::GPU_MEMCPY
                                                  : libkineto::ActivityType::CONCURRENT_KERNEL;
      trace_->emplace_activity(trace_->span, type, ascii_name(string_of(ev.name_id)));
      auto& a = libkineto::CpuTraceBuffer::toRef(trace_->activities.back());
      a.startTime = (ev.start_ns + offset_ns_) / div;
      a.endTime = std::max(ev.end_ns + offset_ns_, ev.start_ns + offset_ns_ + 1) / div;
      a.device = ev.device;
      // one track per stream and engine (CUDA's traces have one per stream): kernels of two streams overlap
      a.resource = resource_of(ev);
      a.addMetadata("stream", std::to_string(ev.stream));
      a.id = static_cast<int32_t>(corr);
      a.flow.id = static_cast<uint32_t>(corr);
      a.flow.type = libkineto::kLinkAsyncCpuGpu;
      a.flow.start = 0;
      a.linked = corr != 0 ? linked(static_cast<int32_t>(corr)) : nullptr;
      a.addMetadata("device", std::to_string(ev.device));
      a.addMetadata("bytes read", std::to_string(ev.bytes_read));
      a.addMetadata("bytes written", std::to_string(ev.bytes_written));
      if (ev.flops) a.addMetadata("flops", std::to_string(ev.flops));
      a.addMetadataQuoted("engine", engine_label(ev.engine));
      logger.handleActivity(a);
    }
  }
  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    return std::make_unique<libkineto::DeviceInfo>(libkineto::DeviceInfo{0, 0, "neuron", "Emulated NeuronCore"});
  }
  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::set<std::pair<int, int32_t>> seen;
    std::vector<libkineto::ResourceInfo> out;
    for (const auto& [ev, corr] : events_) {
      const int32_t r = resource_of(ev);
      if (!seen.insert({ev.device, r}).second) continue;
      out.push_back({r, r, ev.device, "stream " + std::to_string(ev.stream) + " " + engine_label(ev.engine)});
    }
    return out;
  }
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return std::move(trace_); }
  void pushCorrelationId(uint64_t id) override { tls_correlation.push_back(id); }
  void popCorrelationId() override {
    if (!tls_correlation.empty()) tls_correlation.pop_back();
  }

 private:
  static int32_t resource_of(const EventRecord& ev) {
    return std::max(ev.stream, 0) * 8 + static_cast<int32_t>(ev.engine);
  }
  // Kineto's JSON writer replaces a name with a non-ASCII character by "unknown" (every DMA's "device→host")
  static std::string ascii_name(std::string name) {
    for (size_t at; (at = name.find("\u2192")) != std::string::npos;) name.replace(at, 3, "->");
    for (char& c : name)
      if (static_cast<unsigned char>(c) >= 0x80) c = '?';
    return name;
  }
  static std::string engine_label(Engine e) {
    static const char* names[] = {"tensor", "vector", "scalar", "gpsimd", "dma", "host"};
    return names[static_cast<int>(e)];
  }
  int64_t offset_ns_ = 0;
  std::vector<std::pair<EventRecord, uint64_t>> events_;
  std::unique_ptr<libkineto::CpuTraceBuffer> trace_;
};

class NeuronActivityProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<libkineto::ActivityType>& availableActivities() const override { return types_; }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<libkineto::ActivityType>&,
                                                                 const libkineto::Config&) override {
    return std::make_unique<NeuronProfilerSession>();
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t, int64_t,
                                                                 const std::set<libkineto::ActivityType>& t,
                                                                 const libkineto::Config& c) override {
    return configure(t, c);
  }

 private:
  std::string name_ = "__neuron_profiler__";
  std::set<libkineto::ActivityType> types_ = {
      libkineto::ActivityType::CONCURRENT_KERNEL, libkineto::ActivityType::GPU_MEMCPY,
      libkineto::ActivityType::GPU_MEMSET, libkineto::ActivityType::PRIVATEUSE1_RUNTIME,
      libkineto::ActivityType::PRIVATEUSE1_DRIVER};
};

// The legacy autograd profiler (torch.autograd.profiler.profile(use_device="neuron")) times each op on
// the device through these stubs, as it does with CUDA events: `record` puts a timing marker on the
// current stream (an event record: it stamps the device time when the work launched before it has run),
// `elapsed` waits for both markers and returns the device time between them. Until 2026-12-05 a record was
// a host timestamp, so an op's "device time" was its launch on the host (microseconds for a queued matmul
// that ran for milliseconds). On a device worker (a kernel's own nested ops) a record stays a host timestamp.
struct StubEvent {
  NeuronEvent* ev = nullptr;  // a timing marker (null: host timestamp)
  int64_t host_ns = 0;
  ~StubEvent() { destroy_event(ev); }
};

struct NeuronProfilerStubs final : public torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    const int d = current_device();
    if (device != nullptr) *device = static_cast<c10::DeviceIndex>(d);
    if (event != nullptr) {
      auto e = std::make_shared<StubEvent>();
      e->host_ns = now_ns();
      if (worker_stream() < 0) {
        e->ev = new_event(/*timing=*/true);
        record_event(e->ev, d, current_stream(d));
      }
      *event = std::move(e);
    }
    if (cpu_ns != nullptr) *cpu_ns = c10::getTime();
  }
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* e1,
                const torch::profiler::impl::ProfilerVoidEventStub* e2) const override {
    if (e1 == nullptr || e2 == nullptr || !*e1 || !*e2) return 0.f;
    const auto* a = static_cast<const StubEvent*>(e1->get());
    const auto* b = static_cast<const StubEvent*>(e2->get());
    if (a->ev != nullptr && b->ev != nullptr && a->ev->device == b->ev->device) {
      wait_position_quiet(a->ev->device, a->ev->stream, a->ev->pos);
      wait_position_quiet(b->ev->device, b->ev->stream, b->ev->pos);
      const double ms = event_elapsed_ms(a->ev, b->ev);
      return static_cast<float>(std::max(ms, 0.0) * 1000.0);  // microseconds, as CUDA's stub
    }
    return static_cast<float>(std::max<int64_t>(b->host_ns - a->host_ns, 0)) / 1000.f;
  }
  void mark(const char* /*name*/) const override {}
  void rangePush(const char* /*name*/) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }
  void onEachDevice(std::function<void(int)> op) const override {
    const int prev = current_device();
    for (int d = 0; d < device_count(); ++d) {
      set_current_device(d);
      op(d);
    }
    set_current_device(prev);
  }
  void synchronize() const override { drain_all(); }
};

}  // namespace

uint64_t kineto_correlation() { return tls_correlation.empty() ? 0 : tls_correlation.back(); }

// `corr`: the correlation id of the profiler op that launched the event (read on the launching thread: a
// queued kernel is recorded by a device worker, whose own correlation stack is empty).
void kineto_capture(const EventRecord& ev, uint64_t corr) {
  if (ev.kind != EventKind::Kernel && ev.kind != EventKind::Dma) return;  // syncs are host-side waits
  std::lock_guard<std::mutex> lock(sink().mu);
  if (sink().active) sink().events.emplace_back(ev, corr);
}

void install_profiler_stubs() {
  static bool done = false;
  if (done) return;
  done = true;
  static NeuronProfilerStubs stubs;
  torch::profiler::impl::registerPrivateUse1Methods(&stubs);
  torch::profiler::impl::PrivateUse1ProfilerRegistry::instance().registerFactory(
      []() -> std::unique_ptr<libkineto::IActivityProfiler> { return std::make_unique<NeuronActivityProfiler>(); });
}

}  // namespace tnl
