// Shared declarations of the emulated NeuronCore runtime (one concern per .cpp file; see README.md).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/util/ApproximateClock.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>

#include "frames.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <tuple>
#include <string>
#include <vector>

namespace c10 {
class OperatorHandle;
}  // namespace c10

namespace tnl {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// ---- configuration (config.cpp: fixed at first use) ----
struct Config {
  int num_devices = 2;
  int64_t hbm_bytes = 24LL << 30;
};
Config& config();
void configure(int num_devices, int64_t hbm_bytes);  // errors once a device was used
bool runtime_started();
void mark_runtime_started();
int device_count();
void check_device_index(int64_t index);

// ---- clock ----
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---- guard.cpp ----
int current_device();
void set_current_device(int index);

// ---- allocator.cpp ----
c10::Allocator* neuron_allocator();   // allocates on the current device
c10::DataPtr allocate_on(int device, size_t nbytes);
// Stream-ordered reuse (allocator.cpp): `ptr` (a live block) is also used on `stream`; its memory is not
// reused until the work enqueued on that stream before the block is freed has completed.
void record_block_stream(void* ptr, int device, int stream);
c10::Allocator* redirect_cpu_allocator();  // CPU allocator that diverts to a neuron device inside a kernel
bool is_neuron_data_ptr(const c10::DataPtr& p);
int device_of_ptr(const void* ptr);  // -1 if unknown
// RAII: while alive on this thread, CPU allocations go to neuron device `device`.
struct RedirectGuard {
  explicit RedirectGuard(int device);
  ~RedirectGuard();
  int prev_;
};
// RAII: device memory allocated on this (host) thread while alive is written by the host at once (a
// resize's copy), not by kernels in stream order: it takes only blocks whose last use has completed.
struct HostNowGuard {
  HostNowGuard();
  ~HostNowGuard();
};
// RAII: while alive on this thread (and no RedirectGuard diverts it), a CPU allocation of exactly a
// slot's size is placed in that slot's memory, once per slot: a kernel run functionally on the device
// worker allocates its result directly in the output block the host allocated at the launch, so no copy
// is needed. The memory stays owned by the output (freeing a placed pointer is a no-op).
struct PlacementGuard {
  struct Slot {
    void* ptr;
    size_t nbytes;
    bool used;
  };
  PlacementGuard(Slot* slots, size_t n);
  ~PlacementGuard();
  PlacementGuard(const PlacementGuard&) = delete;
  PlacementGuard& operator=(const PlacementGuard&) = delete;
  Slot* slots_;
  size_t n_;
  PlacementGuard* prev_;
};
void install_redirect_cpu_allocator();
c10::Allocator* pinned_host_allocator();  // host memory pinned for neuron (pin_memory("neuron"))
bool is_pinned_host_ptr(const void* ptr);
// A use of the pinned block holding `ptr` by queued work: a DataPtr to `ptr` whose deleter ends the use; the
// block's memory stays until its last use ends, even if its storage frees it (null if `ptr` is not pinned).
c10::DataPtr pinned_use(void* ptr);
// fork safety (pthread_atfork): no allocator lock is held across fork(); a child forked after the
// device was initialised gets CUDA's "Cannot re-initialize ... in forked subprocess" error on use.
void install_fork_handlers();
bool in_bad_fork();
void check_not_in_bad_fork();
void reset_queue_locks_after_fork();  // queue.cpp; the allocator's fork handler calls it in the child
void init_devices();  // torch.neuron.init(): creates every device's allocator state

// ---- generator.cpp ----
const at::Generator& default_generator(int device);
at::Generator new_generator(int device);
at::Generator cpu_engine_of(const at::Generator& neuron_gen);  // the CPU engine a neuron generator drives
// Random launches draw in launch order across streams (generator.cpp): before a launch that draws from the
// neuron generator `g` on (device, stream), queues it behind g's last random launch on another stream; after
// it, notes its position.
void order_random_launch(const at::Generator& g, int device, int stream);
void note_random_launch(const at::Generator& g, int device, int stream, uint64_t pos);

// ---- recorder.cpp ----
enum class Engine : uint8_t { Tensor = 0, Vector, Scalar, GpSimd, Dma, Host };
enum class EventKind : uint8_t { Kernel = 0, Dma, Sync, Marker };
enum class Direction : uint8_t { None = 0, H2D, D2H, D2D };

struct EventRecord {
  EventKind kind = EventKind::Kernel;
  Engine engine = Engine::Scalar;
  Direction direction = Direction::None;
  bool new_signature = false;
  int8_t device = 0;
  int32_t name_id = -1;
  int32_t shapes_id = -1;
  int32_t dtypes_id = -1;
  int32_t subgraph = -1;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t flops = 0;
  // Asynchronous execution (queue.cpp): the stream a kernel ran on (-1: a host-side event such as a
  // sync), the host-side span of the op call that launched it, and the launch id linking the two.
  int32_t stream = 0;
  int64_t host_start_ns = 0;
  int64_t host_end_ns = 0;
  uint64_t correlation = 0;
};

// Bit 0: the lab's recorder is on; bit 1: a torch.profiler (Kineto) session is collecting.
constexpr uint32_t kRecorderBit = 1;
constexpr uint32_t kKinetoBit = 2;
extern std::atomic<uint32_t> g_recording_flags;
inline bool recording() {
  return g_recording_flags.load(std::memory_order_relaxed) != 0;
}
// torch.profiler (profiler.cpp): an event for the Kineto session, with the correlation id of the profiler's
// op that launched it (the launching thread's, carried by the launch: a queued kernel runs on a worker).
void kineto_capture(const EventRecord& ev, uint64_t correlation);
uint64_t kineto_correlation();  // this thread's current profiler correlation id (0: none)
bool record_shapes_enabled();
bool with_stack_enabled();
int32_t intern_string(const std::string& s);
std::string string_of(int32_t id);
void push_event(EventRecord ev);  // stamps seq/thread, captures a stack when with_stack is on
// The same for an event launched by another thread (a kernel run by a stream worker): the launching
// thread's hash and the stack captured at launch are stored instead of the caller's.
void push_event_from(EventRecord ev, uint32_t thread, int32_t stack, uint64_t kineto_corr);
uint32_t thread_hash();
// The calling thread's Python stack (innermost `max_depth` frames) as a stack-table id (kNoStack if none).
int32_t capture_stack(size_t max_depth = SIZE_MAX);
constexpr size_t kLaunchSiteDepth = 32;  // frames kept for a launch site when stacks are not recorded
// Launch-site frames of a stack id, innermost first. Takes the GIL.
struct SiteFrame {
  std::string file;
  int line = 0;
  std::string name;
  int first_line = 0;  // the code's co_firstlineno (Dynamo's code for a compiled function runs its graph there)
};
std::vector<SiteFrame> stack_frames(int32_t id);
bool release_stacks_if_unreferenced();
struct StackTableStats {
  size_t stacks;        // interned now
  uint64_t auto_clears; // times maybe_auto_clear_stacks emptied it
  uint64_t tries;       // times it was large enough to try
};
StackTableStats stack_table_stats();
// The table's generation (bumped by each clear), and the one the calling thread's last captured id belongs to:
// an id captured before a clear names another stack after it (a launch carries its generation).
uint64_t stack_generation();
uint64_t last_capture_generation();
// Empties the launch-stack table once it is large and nothing references it (recorder.cpp); takes the GIL.
void maybe_auto_clear_stacks(bool at_sync);
// Before the stack table is cleared: a pending asynchronous error keeps its launch frames (GIL not held).
void resolve_pending_error_sites();
bool queues_look_idle();  // the same, read without locks (a hint: all_queues_idle decides)
bool all_queues_idle();  // no launch queued or running on any stream of any device
// Inside a catch block that takes any error of a Meta kernel as its refusal: rethrows a Ctrl-C
// (KeyboardInterrupt raised while a Python Meta kernel ran), which is the user's, not the kernel's.
void rethrow_if_interrupt();
// PyErr_Clear (GIL held) for the lab's own Python calls; a KeyboardInterrupt among the errors is made pending again
// (PyErr_SetInterrupt), so the next signal check raises it: cleared, the user's Ctrl-C was lost.
void clear_python_error_keeping_interrupt();
void set_site_mapper(void* callable);  // PyObject*: user frame -> source for asynchronous errors (GIL held)
// A new signature noted on this thread: its shapes/dtypes string ids, consumed (false if none pending).
bool take_pending_signature(int32_t name_id, int32_t* shapes_id, int32_t* dtypes_id);
// One recorded event as stored in the recorder's chunks; `stack` indexes the stack table.
constexpr int32_t kNoStack = -1;
constexpr int32_t kStackTableFull = -2;
struct RecorderSlot {
  EventRecord ev;
  uint64_t seq = 0;
  uint32_t thread = 0;
  int32_t stack = kNoStack;
};
void recorder_start(size_t capacity, bool record_shapes, bool with_stack, size_t keep_first);
std::vector<RecorderSlot> recorder_copy();  // oldest first
std::vector<std::string> strings_snapshot();  // interned strings, indexed by id
std::vector<std::vector<StackFrameRef>> stacks_snapshot();  // interned stacks, innermost first (GIL held)
void release_stacks(std::vector<std::vector<StackFrameRef>>& snapshot);  // GIL held
std::pair<int64_t, int64_t> recorder_dropped_window();  // [first start, last end] of dropped events
size_t recorder_slot_bytes();
// Eager op signatures per device; returns true if this signature is new on that device.
bool note_signature(int device, uint64_t hash, const std::function<std::string()>& describe);

// ---- kernels.cpp: running host code (e.g. compiled kernels) on device memory ----
// Converts neuron tensors to zero-copy CPU aliases and maps results back: views of an input keep its
// neuron storage, memory allocated while the call ran (RedirectGuard) is adopted without a copy.
// Whether `alias` (a CPU alias made earlier) views exactly the bytes, dtype and layout of neuron tensor t.
bool alias_matches(const at::Tensor& t, const at::Tensor& alias);
class HostCall {
 public:
  // Waits for the device's current stream first (host code reads and writes device memory), unless
  // `wait` is false (metadata only).
  explicit HostCall(int device, bool wait = true);
  ~HostCall();
  at::Tensor in(const at::Tensor& t);   // neuron -> CPU alias (others unchanged)
  // neuron -> CPU alias, reusing `prev` (an alias this made for an earlier call, no longer referenced
  // elsewhere) when it views the same bytes with the same dtype and layout; `prev` is updated.
  at::Tensor in_reusing(const at::Tensor& t, at::Tensor& prev);
  at::Tensor out(const at::Tensor& t);  // CPU result -> neuron tensor
  int device() const { return device_; }

 private:
  struct Impl;
  Impl* impl_;
  int device_;
};

// ---- queue.cpp: asynchronous execution (see README.md "Asynchronous execution") ----
// Work enqueued on a stream: runs on that stream's worker thread, in stream order.
struct Launch {
  uint64_t id = 0;             // correlation id (unique per launch)
  int32_t stack = kNoStack;    // the host's Python stack at launch (stack table id)
  uint64_t stack_gen = 0;      // the table's generation `stack` belongs to (stack_generation())
  // `stack`, or kNoStack when the table was cleared since its capture (between the capture and the enqueue, by
  // another thread's sync): an id from an older generation names another stack, so the site is unknown, not wrong
  int32_t current_stack() const { return stack >= 0 && stack_gen == stack_generation() ? stack : kNoStack; }
  uint32_t thread = 0;         // the launching host thread
  int64_t host_start_ns = 0;   // the op call's start on the host
  int64_t host_end_ns = 0;     // when the host enqueued it
  int32_t name_id = -1;        // what ran (for errors and records)
  // The launching thread's interrupt count (queue.cpp, "Ctrl-C") and its value at the launch: a Ctrl-C in a
  // wait of that thread drops its launches still queued; other threads' launches run.
  const std::atomic<uint64_t>* interrupts = nullptr;
  uint64_t interrupts_seen = 0;
  uint64_t profiler_corr = 0;  // torch.profiler's correlation id of the op that launched it (0: not profiling)
};
// True when the thread that launched `l` was interrupted (Ctrl-C in a host wait) after the launch.
inline bool launch_dropped(const Launch& l) {
  return l.interrupts != nullptr && l.interrupts->load(std::memory_order_relaxed) != l.interrupts_seen;
}
struct Work {
  std::function<void(const Launch&)> run;
  Launch launch;
  int device = 0;
  int stream = 0;
};
constexpr int kMaxStreamsPerDevice = 1024;
bool launch_blocking();
// After a kernel ran on the host, on a thread that is neither the main thread nor a worker (autograd's
// device threads): ends that thread's OpenMP pool (queue.cpp, "OpenMP thread pools").
struct SpinThrottleStats {
  std::string mode;
  int wants;
  bool held;
  uint64_t engaged, released, windows, windows_starved, windows_ahead, windows_host_blocked;
  uint64_t pools_spread;  // worker pools whose helpers were placed off the worker's CPU (spread_omp_pool)
  bool spread;            // that placement is on (TORCHNEURON_LAB_SPREAD_POOL=off or set_pool_spread(False))
  int spread_worker_cpu, spread_helper_cpu;  // the last placement: the worker's CPU, its first helper's (-1: none)
};
void set_pool_spread(bool on);
void spread_thread_pool();  // this host thread's OpenMP pool, made with its helpers placed (queue.cpp)
void set_spin_throttle(const std::string& mode);  // "auto" | "on" | "off" (queue.cpp, the spin throttle)
SpinThrottleStats spin_throttle_stats();
void end_host_thread_pool();                // TORCHNEURON_LAB_LAUNCH_BLOCKING=1: every launch waits for its kernel
void set_launch_blocking(bool on);
int current_stream(int device);        // this thread's current stream on `device` (0: default stream)
void set_current_stream(int device, int stream);
int new_stream(int device, int priority);
int pool_stream(int device, bool high_priority);
int stream_priority(int device, int stream);
void check_stream(int device, int stream);
// Records a kernel that ran from start_ns to end_ns on `stream` for launch `l`: its device span, the launch's
// host span and correlation id, and the launch's Python stack when stacks are recorded.
void push_launched_event(EventRecord ev, int64_t start_ns, int64_t end_ns, int stream, const Launch& l);
// Begins a launch on the host: stamps the id, start time and launch site.
Launch begin_launch(int32_t name_id);
// Enqueues `w` (stamps host_end_ns); returns the stream position it takes (1-based).
uint64_t enqueue(Work w);
uint64_t stream_enqueued(int device, int stream);
uint64_t stream_completed(int device, int stream);
uint64_t stream_overflowed(int device, int stream);  // launches that found the ring full (queue.cpp)
bool stream_idle(int device, int stream);
// Host waits (GIL released while waiting, bounded by TORCHNEURON_LAB_SYNC_TIMEOUT): until `stream` has
// completed position `pos`; until the stream is empty; until every stream of the device is empty.
// A wait that blocked is recorded as a sync event named `what`; a pending asynchronous error of the
// device is raised afterwards (and cleared: the device stays usable).
// `record_always` false (a host-path op, not a sync point): recorded only if kernels were launched on the
// stream since the last recorded wait, whether or not the host actually blocked (deterministic counts).
// raise_errors=false: an error a queued kernel raised stays pending for the program's next synchronisation
// point (a wait the emulator needs, not one CUDA has, must not raise it from an unrelated op)
void wait_position(int device, int stream, uint64_t pos, const char* what, bool record_always = true,
                   bool raise_errors = true);
void synchronize_stream(int device, int stream, const char* what, bool record_always = true,
                        bool raise_errors = true);
void wait_position_quiet(int device, int stream, uint64_t pos);  // no record, no async error raised
void synchronize_device(int device, const char* what);
// torch.cuda.set_sync_debug_mode's modes: 0 off (default), 1 warn, 2 error. `warn_or_error_on_sync(what)` is
// called by the program's synchronizing operations CUDA checks (item(), a blocking copy between host and device,
// an op with a data-dependent result, Stream.synchronize()) before they wait or copy: in mode 1 it issues a
// warning, in mode 2 it raises, "called a synchronizing neuron operation (...)". Not on a device worker.
int sync_debug_mode();
void set_sync_debug_mode(int mode);
void warn_or_error_on_sync(const char* what);
void synchronize_all(const char* what);
// Waits for every queued kernel of every device, recording nothing and raising nothing (reading the
// recorder, interpreter exit). GIL released while waiting.
// Waits for every queued launch of every device. A Ctrl-C in the wait drops this thread's queued launches (as
// every host wait does); raise_interrupt: then raises the KeyboardInterrupt once all is drained, else drops it.
void drain_all(bool raise_interrupt = false);
// While alive, this thread's host waits keep the GIL (workers never need it). For waits made under a lock
// that a thread holding the GIL may take: a generator's mutex, which torch's Generator methods take with the
// GIL held -- released in the wait, the GIL went to such a thread, which then blocked on the mutex (deadlock).
struct KeepGilInWaits {
  KeepGilInWaits();
  ~KeepGilInWaits();
};
void raise_async_error(int device);
// On a worker: the stream and launch being executed (stream -1 and nullptr on host threads).
int worker_stream();
// Stamps `l` with this thread's interrupt count (begin_launch does; for launches built by hand).
void stamp_launcher(Launch& l);
// torch's native_functions.yaml: which ops CUDA registers with a device check (kernels.cpp, exact_device_ops).
void set_native_functions_yaml(const std::string& path);
uint64_t worker_position();
// The CPU settings torch keeps per thread, as the user last set them through torch (device/__init__.py
// wraps torch.set_num_threads and torch.set_flush_denormal): intra-op threads (0: never set) and
// flush-denormal (-1: never set). A thread adopts them before it runs a kernel (adopt_host_cpu_settings).
void set_host_cpu_settings(int threads, int flush_denormal);
void adopt_host_cpu_settings();
// What a compiled graph's host code is launching (graphs.cpp): while it runs, the kernels it launches
// (its fused kernels and the ATen ops it calls) are recorded with the graph's registry id, and a call the
// graph's code names ("extern: aten::mm") under that name. -1: none (eager code).
struct LaunchTag {
  int32_t subgraph = -1;
  int32_t name_id = -1;
};
LaunchTag& launch_tag();  // this thread's
// Frames under this directory are not the user's (Inductor's generated code): launch sites skip them.
void add_internal_path(const std::string& dir);
// Events (c10 event handles point at these). Each record stamps its own cell: a re-record takes a new one,
// so a marker of an earlier record still queued cannot overwrite the event's time, and a destroyed event
// leaves its queued markers a live cell (destruction does not wait for them, as cudaEventDestroy).
struct NeuronEvent {
  int device = -1;
  int stream = 0;
  uint64_t pos = 0;           // stream position of the latest record's marker; 0 = never recorded
  bool timing = false;
  std::shared_ptr<std::atomic<int64_t>> stamp;  // device time the latest record's marker ran (timing events)
};
NeuronEvent* new_event(bool timing);     // registered as live (event_elapsed_ms checks its arguments)
void destroy_event(NeuronEvent* ev);     // does not wait for queued markers
NeuronEvent* live_event(int64_t id);     // the live event at address `id`, or nullptr
double event_elapsed_ms(const NeuronEvent* a, const NeuronEvent* b);
void record_event(NeuronEvent* ev, int device, int stream);
void stream_wait_event(int device, int stream, const NeuronEvent* ev);  // enqueues a device-side wait
// Enqueues on (device, stream) a device-side wait until (other_device, other_stream) completes `pos`; it
// ends early if the waiting device's queued work is dropped (Ctrl-C during a host wait).
void enqueue_stream_wait(int device, int stream, int other_device, int other_stream, uint64_t pos);
bool event_done(const NeuronEvent* ev);

// ---- layouts.cpp ----
// The NotImplementedError for a sparse, quantized or nested tensor an op would make on neuron (`what`: its kind).
[[noreturn]] void unsupported_layout_named(const std::string& what, const std::string& op);
// Runs an op on sparse COO neuron tensors (or one making them from dense neuron tensors) on the host as CPU
// runs it, on SparseCPU twins over zero-copy aliases of their members (kernels.cpp, "Sparse COO tensors").
void sparse_host_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

// ---- profiler.cpp ----
void install_profiler_stubs();

// ---- hooks.cpp / guard.cpp registration ----
void install_hooks();
void install_backend_meta_serialization();  // serialization.cpp
int route_composites_to_fallback();
int route_foreach_to_launch();  // kernels.cpp: one launch per `_foreach_*` op
// kernels.cpp: launches per path since start (queued, fast, foreach, plan_check, host_wait, host_now)
std::vector<std::pair<std::string, uint64_t>> launch_path_counts();
// Plans checked on the host at their first launch, and the host time their waits for the stream took (the
// emulator's own cost, not a sync of the program: kernels.cpp, "Plans are checked against the CPU kernel").
std::pair<uint64_t, int64_t> plan_check_waits();

}  // namespace tnl
