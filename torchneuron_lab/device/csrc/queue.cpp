// Asynchronous execution of the emulated NeuronCore: stream queues drained by device worker threads.
//
// The host launches work and returns: a launch is a Work item (a closure plus its launch record) put on
// a stream's FIFO queue; each stream has one worker thread that runs its queue in order, so kernels of
// one stream run in launch order and different streams overlap. Positions count launches per stream
// (1, 2, ...): `enqueued` is the last position launched, `completed` the last one finished. An event is
// a marker at a position; waiting for an event is waiting for `completed >= pos` on its stream. Host
// waits release the GIL, are bounded (TORCHNEURON_LAB_SYNC_TIMEOUT seconds) and are recorded as sync
// events with the time the host actually waited. A kernel that throws leaves its error with the device;
// the next synchronisation point raises it with the failed op, its stream and the launch site, and the
// device stays usable. See README.md "Asynchronous execution" for the design and its invariants.
#include "neuron.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_set>

namespace tnl {

namespace {

std::atomic<int> g_launch_blocking{-1};  // -1: read the environment at first use
std::atomic<uint64_t> g_next_launch{1};

double sync_timeout_s() {
  static const double t = [] {
    const char* v = std::getenv("TORCHNEURON_LAB_SYNC_TIMEOUT");
    if (v == nullptr || *v == '\0') return 600.0;
    char* end = nullptr;
    const double d = std::strtod(v, &end);
    return (end != v && d > 0 && std::isfinite(d)) ? d : 600.0;  // (import refuses such values: device/__init__.py)
  }();
  return t;
}

enum class ErrorClass : uint8_t { Runtime, Index, Value, Type, NotImplemented, OutOfMemory };

struct AsyncError {
  std::string message;
  ErrorClass cls = ErrorClass::Runtime;
  int32_t name_id = -1;
  int stream = 0;
  int32_t stack = kNoStack;
  // The stack's frames, read before the stack table was cleared (a recorder's clear or start, a Dynamo
  // reset): the error is reported later, and the table's ids are reused after a clear.
  std::vector<SiteFrame> frames;
  uint64_t launch = 0;
  int later = 0;  // further kernels that failed before it was reported
};

// The launch queue of a stream: a ring of launch slots, written by the launching threads (producers, one at
// a time under `pmu`) and read by the stream's worker without a lock.
//
// Why not a locked deque (as before the twenty-seventh session): the host and the worker took the same
// mutex at every launch, the host to push and the worker to take, so in a burst of small launches its
// cache line went back and forth between the two cores and the host waited for it: the queue's lock and
// unlock were 16% of the host's time per op in a chain of 64x64 adds (perf, 2 cores). Now the host writes
// a slot and publishes its position; the worker reads the slot's position, moves the work out and
// publishes what it took. The mutex `mu` stays for what is not per launch: sleeping and waking the worker,
// host waits for a position, the finished closures handed back, and the overflow.
//
// Invariants:
// - positions are 1, 2, ...; position p lives in ring slot p % kRing, or in `overflow`;
// - a slot holds position p once its `pos` reads p (stored with release after the work was written);
// - a producer writes position p into the ring only when p - taken <= kRing (the slot's previous
//   position was taken) and no position is in the overflow (positions stay in order: once one position
//   overflows, later ones follow it there until the worker has drained it);
// - the host's launches wait while kMaxQueued are pending (enqueue), so they never overflow; a worker that
//   launches onto another stream (no host to wait) may, when that stream holds kRing pending launches;
// - taken >= completed: the worker takes a batch, then completes its launches one by one.
struct StreamQueue {
  StreamQueue() { init_mutex(); }
  // The worker and host waits hold `mu` briefly; an adaptive mutex spins on contention instead of putting
  // the thread to sleep and paying a futex wake-up.
  void init_mutex() {
    for (std::mutex* m : {&mu, &pmu}) {
      pthread_mutexattr_t attr;
      pthread_mutexattr_init(&attr);
      pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
      pthread_mutex_init(m->native_handle(), &attr);
      pthread_mutexattr_destroy(&attr);
    }
  }
  static constexpr uint64_t kRing = 1024;  // = kMaxQueued: the host's launches always find their slot free
  struct Slot {
    std::atomic<uint64_t> pos{0};
    Work work;
  };
  int device = 0;
  int id = 0;
  int priority = 0;
  std::mutex mu;
  std::condition_variable cv_work;  // worker: work arrived
  std::condition_variable cv_done;  // waiters: a position completed
  // Producers: `launched`'s stores, the ring's slots to write, `worker_started` (the ring is made with the worker).
  alignas(64) std::mutex pmu;
  bool worker_started = false;
  std::unique_ptr<Slot[]> ring;
  alignas(64) std::atomic<uint64_t> taken{0};  // positions the worker took (written by the worker only)
  std::atomic<bool> sleeping{false};  // the worker is asleep, or about to sleep, on cv_work (under mu)
  std::atomic<uint64_t> overflow_n{0};
  std::deque<std::pair<uint64_t, Work>> overflow;  // under mu: positions that found the ring full
  uint64_t overflowed = 0;  // under mu: how many ever did (a test's evidence)
  // Written only by the worker, without the lock (one atomic add per kernel); a thread that waits for
  // it counts itself in `waiters` and registers its position in `wake_at` under the lock first, and the
  // worker takes the lock to notify only when a completion reaches `wake_at`, so no wake-up is lost
  // (wait_completed_locked, notify_completed).
  std::atomic<uint64_t> completed{0};
  std::atomic<int> waiters{0};
  std::atomic<uint64_t> wake_at{UINT64_MAX};  // the lowest position a sleeping waiter needs (MAX: none)
  std::atomic<uint64_t> launched{0};  // the last position published (stored by producers under pmu)
  // Finished kernels' closures, destroyed by a host thread (reap): the host allocated their captures, so
  // freeing them there keeps malloc's arena lock off the launch path (cross-thread frees contend).
  std::vector<std::function<void(const Launch&)>> spent;
  std::atomic<size_t> spent_n{0};  // spent.size(), read by a launch without the lock (it reaps past kReapAt)
  uint64_t observed = 0;  // the last position a recorded host wait reached: later launches are unobserved
};

// Launches dropped because their thread was interrupted (Ctrl-C in one of its waits), for the interrupt's message.
std::atomic<uint64_t> g_dropped_launches{0};

struct DeviceQueues {
  std::mutex mu;  // guards `streams` growth and `error`
  std::vector<StreamQueue*> streams;  // index = stream id; never shrinks, StreamQueue objects are never freed
  std::array<std::atomic<StreamQueue*>, kMaxStreamsPerDevice> by_id{};  // the same, read without the lock
  std::array<int, 2> pool_next{0, 0};
  std::vector<int> pool[2];
  std::optional<AsyncError> error;
};

constexpr int kMaxDevices = 64;
constexpr uint64_t kMaxQueued = 1024;  // launches a stream holds before the host waits
static_assert(StreamQueue::kRing >= kMaxQueued, "a host launch must find its ring slot free");
constexpr size_t kReapAt = 64;  // finished closures a launch lets pile up before it frees them
constexpr int64_t kWaitSpinNs = 30'000;  // a waiter polls this long before it sleeps (wait_on)
constexpr int kSpinRounds = 200;       // sched_yield()s (~0.3-1 us each) a worker spins before it sleeps
DeviceQueues* g_queues[kMaxDevices] = {};
std::mutex g_queues_mu;

// Leaked on purpose: worker threads may outlive static destruction at interpreter exit.
DeviceQueues& queues_of(int device) {
  check_device_index(device);
  DeviceQueues* d = g_queues[device];
  if (d != nullptr) return *d;
  std::lock_guard<std::mutex> lock(g_queues_mu);
  if (g_queues[device] == nullptr) {
    auto* nd = new DeviceQueues();
    auto* s0 = new StreamQueue();
    s0->device = device;
    nd->streams.push_back(s0);
    nd->by_id[0].store(s0, std::memory_order_release);
    g_queues[device] = nd;
  }
  return *g_queues[device];
}

// A child forked while a worker held a queue's mutex inherits it locked, by a thread the child does not have:
// anything that took it there (a stream query, an event record, an allocator's check of a stream's progress
// when an inherited tensor is freed) blocked forever. The child has one thread, so every queue lock is made
// anew (called by the allocator's fork handler in the child). The queues themselves stay as they were: no
// worker drains them, and every use of the device there raises the bad-fork error.
void reset_queue_locks_after_fork() {
  new (&g_queues_mu) std::mutex();
  for (DeviceQueues* d : g_queues) {
    if (d == nullptr) continue;
    new (&d->mu) std::mutex();
    for (StreamQueue* s : d->streams) {
      s->init_mutex();
      new (&s->cv_work) std::condition_variable();
      new (&s->cv_done) std::condition_variable();
      s->waiters.store(0);
      s->wake_at.store(UINT64_MAX);
      s->sleeping.store(false);
      s->worker_started = false;
    }
  }
}

StreamQueue& stream_of(int device, int stream) {
  DeviceQueues& d = queues_of(device);
  if (stream >= 0 && stream < kMaxStreamsPerDevice)
    if (StreamQueue* q = d.by_id[stream].load(std::memory_order_acquire)) return *q;
  std::lock_guard<std::mutex> lock(d.mu);
  TORCH_CHECK(stream >= 0 && stream < static_cast<int>(d.streams.size()), "invalid neuron stream ", stream,
              " on neuron:", device, " (", d.streams.size(), " streams exist)");
  return *d.streams[stream];
}

thread_local std::array<int, kMaxDevices> tls_stream{};
thread_local int tls_worker_stream = -1;
thread_local uint64_t tls_worker_pos = 0;
thread_local LaunchTag tls_launch_tag;
// This thread's interrupt count: a Ctrl-C in one of its host waits adds one, which drops every launch of
// this thread still queued on any stream (launch_dropped). Leaked: a queued launch may outlive its thread.
thread_local std::atomic<uint64_t>* tls_interrupts = nullptr;
std::atomic<uint64_t>& interrupts_of_this_thread() {
  if (tls_interrupts == nullptr) tls_interrupts = new std::atomic<uint64_t>(0);
  return *tls_interrupts;
}

void worker_main(StreamQueue* s);

// Under s.pmu.
void start_worker_locked(StreamQueue& s) {
  if (s.worker_started) return;
  if (!s.ring) s.ring.reset(new StreamQueue::Slot[StreamQueue::kRing]);  // kept across a fork (queued work stays)
  s.worker_started = true;
  std::thread(worker_main, &s).detach();
}

// Whether the worker has a position to take: the next one is published in its slot, or overflowed.
bool work_ready(const StreamQueue& s) {
  const uint64_t next = s.taken.load(std::memory_order_relaxed) + 1;  // (the worker's own counter)
  return s.ring[next % StreamQueue::kRing].pos.load(std::memory_order_acquire) == next ||
         s.overflow_n.load(std::memory_order_acquire) > 0;
}

// Publishes `w` at the next position; the caller holds s.pmu. Returns the position.
uint64_t push_locked(StreamQueue& s, Work&& w) {
  start_worker_locked(s);
  const uint64_t pos = s.launched.load(std::memory_order_relaxed) + 1;
  if (s.overflow_n.load(std::memory_order_acquire) == 0 &&
      pos - s.taken.load(std::memory_order_acquire) <= StreamQueue::kRing) {
    StreamQueue::Slot& slot = s.ring[pos % StreamQueue::kRing];
    slot.work = std::move(w);
    slot.pos.store(pos, std::memory_order_release);
  } else {
    std::lock_guard<std::mutex> lock(s.mu);  // the worker checks the overflow under it before it sleeps
    s.overflow.emplace_back(pos, std::move(w));
    ++s.overflowed;
    s.overflow_n.fetch_add(1, std::memory_order_release);
  }
  s.launched.store(pos, std::memory_order_release);
  return pos;
}

// The worker's side: moves position `next` from the overflow into `batch`, if it is the overflow's first.
// (A position the ring holds but had not published when the worker looked is taken at its next look.)
bool take_overflowed(StreamQueue& s, uint64_t next, std::vector<Work>& batch) {
  if (s.overflow_n.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.overflow.empty() || s.overflow.front().first != next) return false;
  batch.push_back(std::move(s.overflow.front().second));
  s.overflow.pop_front();
  s.overflow_n.fetch_sub(1, std::memory_order_release);
  return true;
}

// After a push (and after s.pmu is released): wakes the worker if it sleeps. It sets `sleeping` before it
// checks for work under `mu`, this looks at `sleeping` after the publication, both behind a full fence: either
// the worker sees the new position, or this sees it sleeping and notifies under `mu` (not lost: the worker
// checked under it).
void wake_worker(StreamQueue& s) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!s.sleeping.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(s.mu);
  s.cv_work.notify_one();
}

void note_error(StreamQueue& s, const Work& w, const std::string& what, ErrorClass cls = ErrorClass::Runtime) {
  DeviceQueues& d = queues_of(s.device);
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.error.has_value()) {
    d.error->later++;
    return;
  }
  AsyncError e;
  e.message = what;
  e.cls = cls;
  e.name_id = w.launch.name_id;
  e.stream = s.id;
  // No clear runs while this kernel's queue is busy, so the id stays valid until the error's frames are copied.
  e.stack = w.launch.current_stack();
  e.launch = w.launch.id;
  d.error = std::move(e);
}

// Kernels a worker takes from its queue under one lock (fewer lock round trips with the launching host).
constexpr size_t kWorkerBatch = 64;

// OpenMP thread pools. libgomp gives every thread that starts a parallel region its own pool of helper
// threads, kept after the region, and spins a helper between regions only while the helpers of all pools
// (libgomp's "managed threads") do not outnumber the CPUs; otherwise each region pays a futex sleep and
// wake-up per helper. A worker's pool next to the host thread's pool outnumbers 2 CPUs: every CPU kernel of
// the process -- the user's CPU code too -- then ran up to 1.7x slower (issue 12's encoder step: 9.3 ms on
// CPU alone, 15.9 ms once a neuron kernel had run). OpenMP 5's omp_pause_resource_all(omp_pause_soft)
// makes libgomp end the calling thread's pool (the next region starts a new one), so the worker ends its
// pool when it has been idle kIdleReleaseMs, and a host thread ends its own (made by its CPU ops) at a
// launch, at most every kHostReleaseNs. A host thread other than the main one (autograd's device threads)
// ends its pool after each kernel it runs on the host (end_host_thread_pool): it may never launch again,
// and its idle pool throttled the user's CPU code after training (2-3x). Thread counts per region stay
// torch's: results do not change.
// libgomp is the one torch loaded (found by soname, never loaded here); without it this does nothing.
constexpr int kIdleReleaseMs = 20;
constexpr int64_t kHostReleaseNs = 50'000'000;
// The entries of the libgomp torch loaded (found by soname, never loaded here; null without it). This module
// is built without OpenMP: GOMP_parallel is the entry GCC compiles `#pragma omp parallel` to.
struct Gomp {
  int (*pause_all)(int) = nullptr;
  int (*in_parallel)() = nullptr;
  int (*thread_num)() = nullptr;
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
};
const Gomp& gomp() {
  static const Gomp g = [] {
    Gomp r;
    void* h = dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (h == nullptr) return r;
    r.pause_all = reinterpret_cast<decltype(r.pause_all)>(dlsym(h, "omp_pause_resource_all"));
    r.in_parallel = reinterpret_cast<decltype(r.in_parallel)>(dlsym(h, "omp_in_parallel"));
    r.parallel = reinterpret_cast<decltype(r.parallel)>(dlsym(h, "GOMP_parallel"));
    r.thread_num = reinterpret_cast<decltype(r.thread_num)>(dlsym(h, "omp_get_thread_num"));
    return r;
  }();
  return g;
}

void shrink_omp_pool() {
  const Gomp& g = gomp();
  if (g.pause_all == nullptr || g.in_parallel == nullptr || g.in_parallel()) return;
  g.pause_all(1);  // omp_pause_soft: this thread's pool threads exit
}

// Runs an empty 2-thread parallel region on this thread, so libgomp keeps a pool with one helper for it.
void start_omp_pool() {
  if (gomp().parallel != nullptr) gomp().parallel([](void*) {}, nullptr, 2, 0);
}

// Places a new pool's helpers on CPUs other than the worker's. A helper thread libgomp has just created
// is, in about half of the pools, left where it slows every region of the pool's life: measured on 2 vCPUs
// (AMD EPYC), 300 back-to-back regions of `a + 1` on 1024^2 after each new pool: half the blocks at 80-90
// us a region instead of 50-56 (each thread's own chunk the same 45-55 us: the rest is the helper's late
// start in every region); the same with a plain C OpenMP loop on the host thread whose pool was ended and
// made again, never with a pool kept. Binding (OMP_PROC_BIND=spread) removed it; so does moving each helper
// once, right after the pool is made, to a CPU other than the worker's (its affinity set to that CPU, then
// given back: the thread stays where it was moved, and the scheduler is free to move it later): 29 of 30
// blocks fast, against 14 of 30. The region runs the pool's own thread count (the worker's ICV, torch's
// thread count), so the pool is the one the kernels use. Nothing is changed for a thread whose affinity
// allows one CPU (OMP_PROC_BIND, taskset) or a process with one thread.
struct SpreadArgs {
  int worker_cpu;
};
std::atomic<int> g_spread_last_worker_cpu{-1}, g_spread_last_helper_cpu{-1};  // the last placement, for tests
void spread_helper(void* p) {
  const Gomp& g = gomp();
  const int t = g.thread_num != nullptr ? g.thread_num() : 0;
  if (t == 0) return;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (pthread_getaffinity_np(pthread_self(), sizeof allowed, &allowed) != 0) return;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (cpus.size() < 2) return;
  // Thread t goes t CPUs after the worker's in the allowed list (as OMP_PROC_BIND=spread places a team):
  // with as many threads as CPUs, each on its own.
  const int worker_cpu = static_cast<SpreadArgs*>(p)->worker_cpu;
  const auto at = std::find(cpus.begin(), cpus.end(), worker_cpu);
  const size_t w = at == cpus.end() ? 0 : static_cast<size_t>(at - cpus.begin());
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpus[(w + static_cast<size_t>(t)) % cpus.size()], &one);
  if (pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0) {
    if (t == 1) g_spread_last_helper_cpu.store(sched_getcpu(), std::memory_order_relaxed);
    pthread_setaffinity_np(pthread_self(), sizeof allowed, &allowed);
  }
}
void spread_omp_pool() {
  const Gomp& g = gomp();
  if (g.parallel == nullptr || g.in_parallel == nullptr || g.in_parallel()) return;
  if (at::get_num_threads() < 2) return;
  SpreadArgs args{sched_getcpu()};
  g_spread_last_worker_cpu.store(args.worker_cpu, std::memory_order_relaxed);
  g.parallel(spread_helper, &args, 0, 0);  // 0: the thread's ICV, which torch's regions use too
}
std::atomic<uint64_t> g_pools_spread{0};
// A mode switch read from the environment at first use (`cache` < 0 until then): "off"/"0" -> 0, "on"/"1" ->
// `on`, anything else (unset included) -> `other`. A setter stores into `cache` directly.
int env_mode(std::atomic<int>& cache, const char* var, int on, int other) {
  int m = cache.load(std::memory_order_relaxed);
  if (m < 0) {
    const char* e = std::getenv(var);
    const std::string v = e == nullptr ? "" : e;
    m = (v == "off" || v == "0") ? 0 : (v == "on" || v == "1") ? on : other;
    cache.store(m);
  }
  return m;
}
// TORCHNEURON_LAB_SPREAD_POOL: off|0 turns the placement off.
std::atomic<int> g_spread_mode{-1};
bool pool_spread_on() { return env_mode(g_spread_mode, "TORCHNEURON_LAB_SPREAD_POOL", 1, 1) == 1; }

thread_local int64_t tls_pool_shrunk_ns = 0;  // a host thread's last shrink

// The spin throttle. Between parallel regions a worker's OpenMP helper waits for the next region by
// spinning (libgomp: up to GOMP_SPINCOUNT iterations, milliseconds) before it sleeps, unless the process's
// managed threads outnumber the CPUs, when it spins ~100 iterations and sleeps ("throttled"). libgomp does
// not count the host thread: with the host running Python, the worker and its helper, a device whose
// worker waits for the host (a host-bound step: many small kernels) has a helper spinning on the core the
// host needs (perf, a compiled qwen2 zoo step on 2 vCPUs: 48% of all samples). A worker starved (waited for
// launches more than kStarved of a kStarveWindowNs window) in kEngageAfter windows running asks for the
// throttle; one the host runs ahead of (kAheadDepth launches queued, the worker never waiting) while the
// host waits for it (blocked in syncs or on the full launch queue > kHostBlocked of the window: the spin
// takes no core the host uses) in kReleaseAfter windows running gives it back: back-to-back parallel
// kernels keep their spinning helper (a futex wake-up per region made `a + 1` on 1024^2 2x slower, GPT-2's
// step 1.3x). A queue merely deep did release it until 2026-12-05: a compiled step's host (guards, AOT
// wrappers, an eager optimizer) keeps a graph's kernels queued >= 128 deep without ever waiting, and the
// released helper's spin took its core back (qwen2 zoo step compiled 2.7-3.3 ms -> 2.1-2.4 ms, t5 6.1 ->
// 5.3 ms, nn_transformer 2.3 -> 1.9 ms, fresh processes alternating). Measured per 10 ms window
// on 2 vCPUs: host-bound zoo steps starve the worker in 40-80% of windows (queue 3-12 deep once throttled),
// GPT-2/MLP steps and big elementwise kernels in ~0 (queue 500+ deep, the host blocked in 80-100% of
// windows; a compiled qwen2 step's host in 17%). A worker idle 20 ms gives it back
// (with its own pool), so the host's CPU code after device work is not throttled.
// The throttle is one more managed thread: a thread of ours that ran a 2-thread region (GOMP_parallel) keeps
// its pool (one sleeping helper) while any worker wants it and ends it (omp_pause) when none does. Thread
// counts per region stay torch's, so results do not change. Mode: TORCHNEURON_LAB_SPIN_THROTTLE=auto
// (default) | on | off, or set_spin_throttle(); spin_throttle_stats() reports it.
constexpr int64_t kStarveWindowNs = 10'000'000;
constexpr double kStarved = 0.3;        // a window starved: the worker waited for launches > 30% of it
constexpr uint64_t kAheadDepth = 128;   // a window the host was ahead: >= 128 launches queued per take, and
constexpr double kBusy = 0.05;          //   the worker waited < 5% of it
constexpr int kEngageAfter = 2;         // consecutive starved windows that engage the throttle
constexpr int kReleaseAfter = 3;        // consecutive windows ahead, the host blocked, that release it
constexpr double kHostBlocked = 0.3;    // a window the host waited for the device > 30% of

struct SpinThrottle {
  std::mutex mu;
  std::condition_variable cv;
  int wants = 0;         // workers asking for it
  bool held = false;     // our pool exists
  bool started = false;  // the thread runs
  uint64_t engaged = 0, released = 0;
};
SpinThrottle& spin_throttle() {
  static auto* t = new SpinThrottle();  // leaked: its thread may outlive static destruction
  return *t;
}
std::atomic<uint64_t> g_windows{0}, g_windows_starved{0}, g_windows_ahead{0}, g_windows_host_blocked{0};
// Time host threads spent blocked in waits for the device (syncs, a full launch queue), all devices: a
// window in which the host waited is one whose core the helper's spin does not take from it.
// A wait is credited when it ends; the one in progress (its start in g_host_waiting_since, set by the first
// thread to wait) counts up to now, so a window inside a long wait (a full queue drains for ~100 ms) is
// blocked too.
std::atomic<int64_t> g_host_wait_ns{0};
std::atomic<int64_t> g_host_waiting_since{0};
int64_t host_wait_total(int64_t now) {
  const int64_t since = g_host_waiting_since.load(std::memory_order_relaxed);
  return g_host_wait_ns.load(std::memory_order_relaxed) + (since != 0 && now > since ? now - since : 0);
}

// 0 off, 1 auto, 2 on; -1: read the environment at first use.
std::atomic<int> g_throttle_mode{-1};
int throttle_mode() { return env_mode(g_throttle_mode, "TORCHNEURON_LAB_SPIN_THROTTLE", 2, 1); }

void throttle_main() {
  pthread_setname_np(pthread_self(), "neuron-throttle");
  SpinThrottle& t = spin_throttle();
  std::unique_lock<std::mutex> lock(t.mu);
  for (;;) {
    t.cv.wait(lock, [&] { return (t.wants > 0) != t.held; });
    const bool want = t.wants > 0;
    lock.unlock();
    if (want) {
      start_omp_pool();  // a pool: one helper, asleep
    } else {
      shrink_omp_pool();
    }
    lock.lock();
    t.held = want;
    (want ? t.engaged : t.released)++;
  }
}

void request_throttle(bool on) {
  SpinThrottle& t = spin_throttle();
  std::lock_guard<std::mutex> lock(t.mu);
  t.wants += on ? 1 : -1;
  if (!t.started) {
    t.started = true;
    std::thread(throttle_main).detach();
  }
  t.cv.notify_one();
}

// A worker's view of the current window: its start, the time the worker waited for launches in it, and
// the queue's depth at each take (what was queued: the host's lead).
struct StarveWindow {
  int64_t t0 = 0;
  int64_t idle_ns = 0;
  int64_t host_wait0 = 0;  // host_wait_total() at the window's start
  uint64_t depth_sum = 0, takes = 0;
  int streak = 0;  // consecutive windows that argue for a change
  bool throttling = false;

  void reset() { t0 = 0; idle_ns = 0; depth_sum = 0; takes = 0; streak = 0; }
  void release() {
    if (throttling) request_throttle(false);
    throttling = false;
    reset();
  }
  // The worker took work at `now`, after waiting `waited` ns for it, with `depth` launches queued.
  void took_work(int64_t now, int64_t waited, size_t depth) {
    if (t0 == 0) {
      t0 = now;
      host_wait0 = host_wait_total(now);
      return;
    }
    idle_ns += waited;
    depth_sum += depth;
    takes++;
    const int64_t span = now - t0;
    if (span < kStarveWindowNs) return;
    const bool starved = static_cast<double>(idle_ns) > kStarved * static_cast<double>(span);
    const bool ahead = depth_sum >= kAheadDepth * takes && static_cast<double>(idle_ns) < kBusy * static_cast<double>(span);
    const int64_t host_wait = host_wait_total(now);
    const bool host_blocked = static_cast<double>(host_wait - host_wait0) > kHostBlocked * static_cast<double>(span);
    host_wait0 = host_wait;
    g_windows.fetch_add(1, std::memory_order_relaxed);
    if (host_blocked) g_windows_host_blocked.fetch_add(1, std::memory_order_relaxed);
    if (starved) g_windows_starved.fetch_add(1, std::memory_order_relaxed);
    if (ahead) g_windows_ahead.fetch_add(1, std::memory_order_relaxed);
    const int mode = throttle_mode();
    bool want = mode == 2;
    if (mode == 1) {
      streak = (throttling ? ahead && host_blocked : starved) ? streak + 1 : 0;
      want = throttling ? streak < kReleaseAfter : streak >= kEngageAfter;
    }
    if (want != throttling) {
      request_throttle(want);
      streak = 0;
    }
    throttling = want;
    t0 = now;
    idle_ns = 0;
    depth_sum = 0;
    takes = 0;
  }
};

// The worker's side: called after each completion `c`; wakes the waiters when one of them needs `c`.
void notify_completed(StreamQueue& s, uint64_t c) {
  if (s.waiters.load() == 0 || c < s.wake_at.load()) return;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.wake_at.store(UINT64_MAX);
  }
  s.cv_done.notify_all();
}

void worker_main(StreamQueue* s) {
  // Named as a device engine, so top/perf/py-spy tell the emulated device's work from the host's.
  const std::string tname = "neuron" + std::to_string(s->device) + ":s" + std::to_string(s->id);
  pthread_setname_np(pthread_self(), tname.substr(0, 15).c_str());
  tls_worker_stream = s->id;
  set_current_device(s->device);
  tls_stream[s->device] = s->id;
  // A device runs kernels: autograd and version counting happened on the host when the op was called. Its
  // CPU kernels write CPU aliases made by the launching thread, which are inference tensors when that thread
  // was in torch.inference_mode(); through ADInplaceOrView on this thread (not in inference mode) every
  // in-place write raised "Inplace update to inference tensor outside InferenceMode" (addmm.out, copy_).
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  std::vector<Work> batch;
  batch.reserve(kWorkerBatch);
  std::vector<std::function<void(const Launch&)>> spent;  // handed to the host at the batch's end
  bool pool_used = false;  // kernels ran since this worker last shrank its OpenMP pool
  bool pool_spread = false;  // its pool was made and its helpers placed (spread_omp_pool) since then
  StarveWindow starve;
  for (;;) {
    const int64_t wait0 = now_ns();
    size_t depth = 0;
    // A host launching a burst of small kernels enqueues one every few microseconds: spin briefly before
    // sleeping, so each launch does not pay a futex sleep and wake-up of the worker (a device's queue is
    // polled by its own engine; the spin is bounded so an idle worker costs no CPU).
    for (int i = 0; i < kSpinRounds && !work_ready(*s); ++i) std::this_thread::yield();
    if (!work_ready(*s)) {
      std::unique_lock<std::mutex> lock(s->mu);
      s->sleeping.store(true, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with wake_worker's
      auto work = [&] { return work_ready(*s); };
      if (pool_used && !s->cv_work.wait_for(lock, std::chrono::milliseconds(kIdleReleaseMs), work)) {
        lock.unlock();
        shrink_omp_pool();  // idle: give the CPUs back to the host's CPU kernels
        pool_spread = false;
        starve.release();
        pool_used = false;
        lock.lock();
      }
      s->cv_work.wait(lock, work);
      s->sleeping.store(false, std::memory_order_relaxed);
    }
    pool_used = true;
    {
      // Take the published positions, in order, without a lock (the overflow under it).
      uint64_t t = s->taken.load(std::memory_order_relaxed);
      while (batch.size() < kWorkerBatch) {
        const uint64_t next = t + 1;
        StreamQueue::Slot& slot = s->ring[next % StreamQueue::kRing];
        if (slot.pos.load(std::memory_order_acquire) == next) {
          batch.push_back(std::move(slot.work));
          slot.work.run = nullptr;  // (a moved-from std::function is only "valid")
        } else if (!take_overflowed(*s, next, batch)) {
          break;
        }
        t = next;
        s->taken.store(t, std::memory_order_release);  // the producers may write its slot again
      }
      depth = batch.size() + (s->launched.load(std::memory_order_acquire) - t);
    }
    if (batch.empty()) continue;
    {
      const int64_t now = now_ns();
      starve.took_work(now, now - wait0, depth);
    }
    if (!pool_spread) {
      // The first work since this worker's pool ended (or ever): its pool is made here, its helpers placed.
      // The default stream's worker only: it runs a program's kernels. Other streams' workers (side streams,
      // collectives' communication streams) often run nothing parallel, and a pool made for each -- one more
      // thread per stream -- doubled a program's threads (64 streams: 128) and, outnumbering the CPUs, would
      // throttle every pool's spin (test_streams_come_from_a_pool_per_priority_as_cudas caught it).
      if (s->id == 0 && pool_spread_on()) {
        try {
          adopt_host_cpu_settings();  // the pool's size: torch's thread count, as the kernels' regions
          spread_omp_pool();
          g_pools_spread.fetch_add(1, std::memory_order_relaxed);
        } catch (...) {  // placement is an optimisation: the kernels run regardless
        }
      }
      pool_spread = true;
    }
    for (Work& w : batch) {
      // A launch whose thread was interrupted (Ctrl-C in one of its waits) since is dropped: it was queued,
      // not running. Other threads' launches run (they were not interrupted and will read their results).
      if (w.run && launch_dropped(w.launch)) {
        w.run = nullptr;
        g_dropped_launches.fetch_add(1, std::memory_order_relaxed);
      }
      tls_worker_pos = s->completed.load(std::memory_order_relaxed) + 1;
      try {
        adopt_host_cpu_settings();
        if (w.run) w.run(w.launch);  // dropped work (Ctrl-C) only advances the stream
      } catch (const c10::IndexError& e) {
        note_error(*s, w, e.what_without_backtrace(), ErrorClass::Index);
      } catch (const c10::ValueError& e) {
        note_error(*s, w, e.what_without_backtrace(), ErrorClass::Value);
      } catch (const c10::TypeError& e) {
        note_error(*s, w, e.what_without_backtrace(), ErrorClass::Type);
      } catch (const c10::NotImplementedError& e) {
        note_error(*s, w, e.what_without_backtrace(), ErrorClass::NotImplemented);
      } catch (const c10::OutOfMemoryError& e) {
        note_error(*s, w, e.what_without_backtrace(), ErrorClass::OutOfMemory);
      } catch (const c10::Error& e) {
        note_error(*s, w, e.what_without_backtrace());
      } catch (const std::exception& e) {
        note_error(*s, w, e.what());
      } catch (...) {
        note_error(*s, w, "unknown C++ exception");
      }
      if (w.run) spent.push_back(std::move(w.run));
      if (&w == &batch.back()) {
        // The batch's closures go to the host (it frees them at its next launch or wait) with the last
        // completion, so a host that waited for the batch finds them.
        uint64_t c;
        {
          std::lock_guard<std::mutex> lock(s->mu);
          for (auto& f : spent) s->spent.push_back(std::move(f));
          s->spent_n.store(s->spent.size(), std::memory_order_relaxed);
          c = s->completed.fetch_add(1) + 1;
        }
        spent.clear();
        notify_completed(*s, c);
        continue;
      }
      notify_completed(*s, s->completed.fetch_add(1) + 1);
    }
    batch.clear();
  }
}

void record_wait(int device, int stream, const char* what, int64_t t0, int64_t t1) {
  if (!recording()) return;
  EventRecord ev;
  ev.kind = EventKind::Sync;
  ev.engine = Engine::Host;
  ev.device = static_cast<int8_t>(device);
  ev.name_id = intern_string(what);
  ev.start_ns = t0;
  ev.end_ns = t1;
  ev.host_start_ns = t0;
  ev.host_end_ns = t1;
  ev.stream = stream;
  push_event(ev);
}

// Destroys the closures of finished kernels on this (host) thread. The vectors swap, so neither side's
// buffer is ever freed by the other thread.
void reap_locked(StreamQueue& s, std::vector<std::function<void(const Launch&)>>& out) {
  if (!s.spent.empty()) s.spent.swap(out);
  s.spent_n.store(0, std::memory_order_relaxed);
}
thread_local std::vector<std::function<void(const Launch&)>> tls_reaped;
void reap(StreamQueue& s) {
  if (tls_worker_stream >= 0) return;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    reap_locked(s, tls_reaped);
  }
  tls_reaped.clear();
}

// Sleeps on `s.cv_done` until `completed >= pos` or `until`; the caller holds `lock` on `s.mu`. The
// position is stored in `wake_at` before `completed` is read, and the worker adds to `completed` before it
// reads `wake_at` (all sequentially consistent): either the worker sees this position and notifies, or
// this read sees the completion. Woken waiters re-register (the worker reset `wake_at`).
bool wait_completed_locked(StreamQueue& s, std::unique_lock<std::mutex>& lock, uint64_t pos,
                           std::chrono::steady_clock::time_point until) {
  s.waiters.fetch_add(1);
  bool reached = false;
  for (;;) {
    if (pos < s.wake_at.load()) s.wake_at.store(pos);
    reached = s.completed.load() >= pos;
    if (reached || s.cv_done.wait_until(lock, until) == std::cv_status::timeout) break;
  }
  if (!reached) reached = s.completed.load() >= pos;
  s.waiters.fetch_sub(1);
  return reached;
}

thread_local int tls_keep_gil = 0;  // KeepGilInWaits

// Waits for `s` to reach `pos`; true if the host actually blocked. The GIL is released while waiting
// (a kernel may need it) and never re-taken while a queue lock is held. Bounded by
// TORCHNEURON_LAB_SYNC_TIMEOUT; on the main thread Ctrl-C is honoured: the thread's queued launches are
// dropped (the running ones finish), so the queues are drained, and KeyboardInterrupt is raised.
bool wait_on(StreamQueue& s, uint64_t pos, const char* what, bool interruptible = true) {
  bool reached;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    reached = s.completed >= pos;
    // A child forked while the parent had kernels queued inherits positions no worker will ever complete
    // (its workers are the parent's threads): every wait would last the whole sync timeout. CUDA's
    // synchronize and get_rng_state raise the bad-fork error at once there.
    if (!reached && in_bad_fork()) check_not_in_bad_fork();
    if (reached && tls_worker_stream < 0) reap_locked(s, tls_reaped);
  }
  if (reached) {
    tls_reaped.clear();
    // Not inside KeepGilInWaits (torch's generator mutex held): a clear's Py_DECREFs may run Python.
    if (tls_worker_stream < 0 && tls_keep_gil == 0) maybe_auto_clear_stacks(true);
    return false;
  }
  TORCH_CHECK(!(tls_worker_stream == s.id && current_device() == s.device), "neuron stream ", s.id,
              " cannot wait for itself");
  struct HostWaitClock {  // a host thread's blocked time, for the spin throttle's windows
    int64_t t0 = 0;
    bool first = false;  // this wait set g_host_waiting_since
    HostWaitClock() {
      if (tls_worker_stream >= 0) return;
      t0 = now_ns();
      int64_t none = 0;
      first = g_host_waiting_since.compare_exchange_strong(none, t0, std::memory_order_relaxed);
    }
    ~HostWaitClock() {
      if (t0 == 0) return;
      g_host_wait_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
      if (first) g_host_waiting_since.store(0, std::memory_order_relaxed);
    }
  } host_wait_clock;
  // The wait for the last kernel or two (a sync right after its launch) usually ends within microseconds:
  // poll for up to kWaitSpinNs, yielding the core, before sleeping. A sleep costs a futex sleep and wake-up
  // on both sides (~12 us per sync of `a + 1` on 1024x1024 here); the spin is bounded and yields, so a long
  // wait loses at most kWaitSpinNs of polling.
  for (const int64_t until = now_ns() + kWaitSpinNs; s.completed.load() < pos && now_ns() < until;)
    std::this_thread::yield();
  const bool python = Py_IsInitialized() && !_Py_IsFinalizing();
  PyThreadState* saved = (python && tls_keep_gil == 0 && PyGILState_Check()) ? PyEval_SaveThread() : nullptr;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(sync_timeout_s());
  bool done = false, interrupted = false;
  while (!done) {
    {
      std::unique_lock<std::mutex> lock(s.mu);
      done = wait_completed_locked(s, lock, pos, std::chrono::steady_clock::now() + std::chrono::milliseconds(50));
    }
    if (done || std::chrono::steady_clock::now() > deadline) break;
    if (interruptible && python && PyGILState_GetThisThreadState() != nullptr) {
      PyGILState_STATE g = PyGILState_Ensure();
      interrupted = PyErr_CheckSignals() != 0;  // the exception stays set on this thread
      PyGILState_Release(g);
      if (interrupted) break;
    }
  }
  uint64_t dropped0 = 0;
  if (interrupted) {
    dropped0 = g_dropped_launches.load();
    interrupts_of_this_thread().fetch_add(1);  // drops this thread's queued launches, on every stream
    uint64_t last;
    last = s.launched.load(std::memory_order_acquire);
    wait_on(s, last, what, /*interruptible=*/false);
  }
  if (saved != nullptr) PyEval_RestoreThread(saved);
  if (!interrupted) reap(s);
  // A sync is where a program's queues go idle: the launch-stack table can be emptied there (a program that
  // launches faster than its worker wakes up never finds them idle at a launch).
  if (!interrupted && tls_worker_stream < 0 && tls_keep_gil == 0) maybe_auto_clear_stacks(true);
  if (interrupted) {
    // The KeyboardInterrupt PyErr_CheckSignals set on this thread, saying what it cost: the launches dropped
    // leave their outputs as they were (CUDA's queued work would still run).
    const uint64_t dropped = g_dropped_launches.load() - dropped0;
    if (dropped > 0) {
      std::ostringstream m;
      m << "Ctrl-C in " << what << " on neuron:" << s.device << " stream " << s.id << ": " << dropped
        << " launch" << (dropped == 1 ? "" : "es") << " this thread had queued " << (dropped == 1 ? "was" : "were")
        << " dropped (never run), so the tensors they would have written keep their previous contents";
      PyGILState_STATE g = PyGILState_Ensure();
      PyErr_Clear();
      PyErr_SetString(PyExc_KeyboardInterrupt, m.str().c_str());
      PyGILState_Release(g);
    }
    python_error err;
    err.persist();
    throw err;
  }
  if (!done) {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.completed < pos)
      TORCH_CHECK(false, what, ": neuron:", s.device, " stream ", s.id, " did not reach position ", pos,
                  " (completed ", s.completed.load(), ", ", s.launched.load() - s.completed.load(), " pending) within ", sync_timeout_s(),
                  " s (TORCHNEURON_LAB_SYNC_TIMEOUT)");
  }
  return true;
}

std::mutex g_internal_mu;
std::vector<std::string> g_internal_dirs;  // added rarely (one per Inductor cache directory), read at errors

bool internal_file(const std::string& file) {
  if (file.find("/torch/") != std::string::npos || file.find("/torchneuron_lab/") != std::string::npos ||
      file.find("<frozen") != std::string::npos)
    return true;
  std::lock_guard<std::mutex> lock(g_internal_mu);
  for (const auto& d : g_internal_dirs)
    if (file.rfind(d, 0) == 0) return true;
  return false;
}

// The lab's mapper of a user frame to its source, e.g. a Jupyter cell's file to "cell [2], line 2"
// (recorder.set_source_mapper): a strong reference, never released (it may outlive the interpreter).
std::atomic<PyObject*> g_site_mapper{nullptr};

std::string format_site(const SiteFrame& f);

std::string launch_site(const std::vector<SiteFrame>& frames) {
  if (frames.empty()) return "";
  // The innermost frame outside torch, the lab and code they generated: the user's line that launched it.
  size_t pick = 0;
  while (pick < frames.size() && internal_file(frames[pick].file)) ++pick;
  if (pick == frames.size()) return format_site(frames.front());
  // A compiled function's kernels launch from Dynamo's code for it, which runs the graph at the function's
  // first line (its decorator): the line that launched them is its caller's.
  const SiteFrame& f = frames[pick];
  if (f.line == f.first_line) {
    for (size_t j = pick + 1; j < frames.size(); ++j)
      if (!internal_file(frames[j].file)) return format_site(frames[j]) + " (compiled " + f.name + ")";
  }
  return format_site(f);
}

std::string format_site(const SiteFrame& f) {
  const std::string& file = f.file;
  const int line = f.line;
  const std::string& name = f.name;
  if (g_site_mapper.load() != nullptr && Py_IsInitialized() && !_Py_IsFinalizing()) {
    PyGILState_STATE g = PyGILState_Ensure();
    // read and held under the GIL, which set_site_mapper holds to replace (and release) it
    PyObject* mapper = g_site_mapper.load();
    Py_XINCREF(mapper);
    std::string mapped;
    PyObject* r = mapper != nullptr ? PyObject_CallFunction(mapper, "si", file.c_str(), line) : nullptr;
    if (r != nullptr && PyUnicode_Check(r)) {
      const char* u = PyUnicode_AsUTF8(r);
      if (u != nullptr) mapped = u;
    }
    Py_XDECREF(r);
    Py_XDECREF(mapper);
    clear_python_error_keeping_interrupt();  // a failing mapper leaves the plain site
    PyGILState_Release(g);
    if (!mapped.empty()) return mapped;
  }
  return file + ":" + std::to_string(line) + " in " + name;
}

}  // namespace

KeepGilInWaits::KeepGilInWaits() { ++tls_keep_gil; }
KeepGilInWaits::~KeepGilInWaits() { --tls_keep_gil; }

void set_spin_throttle(const std::string& mode) {
  TORCH_CHECK_VALUE(mode == "auto" || mode == "on" || mode == "off",
                    "spin throttle mode must be 'auto', 'on' or 'off', got '", mode, "'");
  g_throttle_mode.store(mode == "off" ? 0 : mode == "on" ? 2 : 1);
}

SpinThrottleStats spin_throttle_stats() {
  SpinThrottle& t = spin_throttle();
  std::lock_guard<std::mutex> lock(t.mu);
  const int m = throttle_mode();
  return {m == 0 ? "off" : m == 2 ? "on" : "auto", t.wants, t.held, t.engaged, t.released,
          g_windows.load(), g_windows_starved.load(), g_windows_ahead.load(), g_windows_host_blocked.load(),
          g_pools_spread.load(), pool_spread_on(), g_spread_last_worker_cpu.load(), g_spread_last_helper_cpu.load()};
}

void set_pool_spread(bool on) { g_spread_mode.store(on ? 1 : 0); }

void spread_thread_pool() {
  // The calling (host) thread's pool, made now with its helpers placed as a worker's are; for a host thread
  // about to run CPU kernels after a launch ended its pool (the benchmarks' CPU blocks: a fair baseline).
  if (tls_worker_stream >= 0) return;
  spread_omp_pool();
}

void end_host_thread_pool() {
  // Not the process's main thread (the user's thread, whose CPU code keeps its pool) nor a worker: a thread
  // that runs kernels for the device on the host -- autograd's device threads (pt_autograd_N, backward)
  // above all. Such a thread may never launch again (backward ended), so the pool ends with the kernel.
  static thread_local int8_t helper = -1;
  if (helper < 0) helper = (tls_worker_stream < 0 && static_cast<pid_t>(syscall(SYS_gettid)) != getpid()) ? 1 : 0;
  if (helper == 1) shrink_omp_pool();
}

bool launch_blocking() {
  int v = g_launch_blocking.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("TORCHNEURON_LAB_LAUNCH_BLOCKING");
    v = (e != nullptr && e[0] == '1' && e[1] == '\0') ? 1 : 0;
    g_launch_blocking.store(v);
  }
  return v == 1;
}
void set_launch_blocking(bool on) { g_launch_blocking.store(on ? 1 : 0); }

int current_stream(int device) { return tls_stream[device]; }
void set_current_stream(int device, int stream) {
  check_stream(device, stream);
  tls_stream[device] = stream;
}
void check_stream(int device, int stream) { (void)stream_of(device, stream); }

int new_stream(int device, int priority) {
  check_not_in_bad_fork();
  DeviceQueues& d = queues_of(device);
  std::lock_guard<std::mutex> lock(d.mu);
  TORCH_CHECK(static_cast<int>(d.streams.size()) < kMaxStreamsPerDevice, "neuron:", device, " has ",
              kMaxStreamsPerDevice, " streams already (each has a worker thread); reuse streams");
  auto* s = new StreamQueue();
  s->device = device;
  s->id = static_cast<int>(d.streams.size());
  s->priority = priority < -1 ? -1 : (priority > 0 ? 0 : priority);
  d.by_id[d.streams.size()].store(s, std::memory_order_release);
  d.streams.push_back(s);
  return s->id;
}

int pool_stream(int device, bool high_priority) {
  check_not_in_bad_fork();
  constexpr int kPoolSize = 32;  // per priority, as CUDA's (each stream's worker thread starts at its first launch)
  DeviceQueues& d = queues_of(device);
  const int p = high_priority ? 1 : 0;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (static_cast<int>(d.pool[p].size()) == kPoolSize) {
      const int id = d.pool[p][d.pool_next[p]];
      d.pool_next[p] = (d.pool_next[p] + 1) % kPoolSize;
      return id;
    }
  }
  const int id = new_stream(device, high_priority ? -1 : 0);
  std::lock_guard<std::mutex> lock(d.mu);
  d.pool[p].push_back(id);
  return id;
}

int stream_priority(int device, int stream) { return stream_of(device, stream).priority; }

LaunchTag& launch_tag() { return tls_launch_tag; }

void add_internal_path(const std::string& dir) {
  std::lock_guard<std::mutex> lock(g_internal_mu);
  if (std::find(g_internal_dirs.begin(), g_internal_dirs.end(), dir) == g_internal_dirs.end())
    g_internal_dirs.push_back(dir);
}

void push_launched_event(EventRecord ev, int64_t start_ns, int64_t end_ns, int stream, const Launch& l) {
  ev.start_ns = start_ns;
  ev.end_ns = end_ns;
  ev.stream = stream;
  ev.host_start_ns = l.host_start_ns;
  ev.host_end_ns = l.host_end_ns;
  ev.correlation = l.id;
  push_event_from(ev, l.thread, with_stack_enabled() ? l.current_stack() : kNoStack, l.profiler_corr);
}

Launch begin_launch(int32_t name_id) {
  Launch l;
  l.id = g_next_launch.fetch_add(1, std::memory_order_relaxed);
  l.host_start_ns = now_ns();
  l.thread = thread_hash();
  stamp_launcher(l);
  if (g_recording_flags.load(std::memory_order_relaxed) & kKinetoBit) l.profiler_corr = kineto_correlation();
  l.name_id = name_id;
  l.stack = capture_stack(with_stack_enabled() ? SIZE_MAX : kLaunchSiteDepth);
  l.stack_gen = last_capture_generation();
  return l;
}

uint64_t enqueue(Work w) {
  StreamQueue& s = stream_of(w.device, w.stream);
  uint64_t pos;
  bool shrink = false;
  for (;;) {
    uint64_t need = 0;
    {
      std::lock_guard<std::mutex> lock(s.pmu);
      // A bounded launch queue, as a real device's: a host that runs ahead by kMaxQueued launches waits
      // (a recorded host stall: the region is device-bound) instead of queueing without limit.
      // It waits until half the queue has run, not for one slot: one wake-up per kMaxQueued / 2 kernels
      // instead of one per kernel (each would take a core from the kernels running on the worker).
      const uint64_t enqueued = s.launched.load(std::memory_order_relaxed);
      if (tls_worker_stream < 0 && enqueued >= kMaxQueued && s.completed < enqueued - kMaxQueued + 1) {
        need = enqueued - kMaxQueued / 2;
      } else {
        w.launch.host_end_ns = now_ns();
        if (tls_worker_stream < 0 && w.launch.host_end_ns - tls_pool_shrunk_ns > kHostReleaseNs) {
          tls_pool_shrunk_ns = w.launch.host_end_ns;
          shrink = true;
        }
        pos = push_locked(s, std::move(w));
      }
    }
    if (need == 0) break;
    const int64_t t0 = now_ns();
    wait_on(s, need, "sync: launch queue full");
    record_wait(s.device, s.id, "sync: launch queue full", t0, now_ns());
  }
  wake_worker(s);
  if (tls_worker_stream < 0 && s.spent_n.load(std::memory_order_relaxed) >= kReapAt) reap(s);
  if (shrink) shrink_omp_pool();  // this host thread's CPU kernels made a pool: the device's kernels run now
  if (launch_blocking() && tls_worker_stream < 0) {
    wait_on(s, pos, "launch blocking");
    raise_async_error(s.device);
  }
  return pos;
}

uint64_t stream_enqueued(int device, int stream) {
  // `launched` is stored under the producers' lock after the position was published: a thread sees at least its own launches.
  return stream_of(device, stream).launched.load(std::memory_order_acquire);
}
uint64_t stream_completed(int device, int stream) {
  StreamQueue& s = stream_of(device, stream);
  std::lock_guard<std::mutex> lock(s.mu);
  return s.completed;
}
uint64_t stream_overflowed(int device, int stream) {
  StreamQueue& s = stream_of(device, stream);
  std::lock_guard<std::mutex> lock(s.mu);
  return s.overflowed;
}
bool stream_idle(int device, int stream) {
  check_not_in_bad_fork();  // as torch.cuda: raised at once, before any queue lock
  StreamQueue& s = stream_of(device, stream);
  const uint64_t launched = s.launched.load(std::memory_order_acquire);
  return s.completed.load() == launched;
}

void raise_async_error(int device) {
  DeviceQueues& d = queues_of(device);
  std::optional<AsyncError> e;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (!d.error.has_value()) return;
    e = std::move(d.error);
    d.error.reset();
  }
  const std::string site = launch_site(e->frames.empty() ? stack_frames(e->stack) : e->frames);
  std::ostringstream o;
  const std::string op = string_of(e->name_id);
  o << "neuron:" << device << " (stream " << e->stream << "): asynchronous error in "
    << (op.empty() ? std::string("a kernel") : op) << " launched "
    << (site.empty() ? std::string("earlier") : "at " + site) << "\n"
    << e->message << "\n"
    << "Kernels run asynchronously, so this error is reported at a later synchronisation point than the "
       "launch; set TORCHNEURON_LAB_LAUNCH_BLOCKING=1 to raise it at the launch itself.";
  if (e->later > 0) o << " (" << e->later << " later kernel(s) on this device also failed)";
  // The kernel's own Python exception type (IndexError for an index out of range, ...), as on CPU.
  switch (e->cls) {
    case ErrorClass::Index: TORCH_CHECK_INDEX(false, o.str());
    case ErrorClass::Value: TORCH_CHECK_VALUE(false, o.str());
    case ErrorClass::Type: TORCH_CHECK_TYPE(false, o.str());
    case ErrorClass::NotImplemented: TORCH_CHECK_NOT_IMPLEMENTED(false, o.str());
    case ErrorClass::OutOfMemory: TORCH_CHECK_WITH(OutOfMemoryError, false, o.str());
    default: TORCH_CHECK(false, o.str());
  }
}

void set_site_mapper(void* callable) {  // GIL held
  PyObject* fn = static_cast<PyObject*>(callable);
  if (fn == Py_None) fn = nullptr;
  Py_XINCREF(fn);
  PyObject* old = g_site_mapper.exchange(fn);
  Py_XDECREF(old);
}

void resolve_pending_error_sites() {
  for (int dev = 0; dev < kMaxDevices; ++dev) {
    DeviceQueues* d = g_queues[dev];
    if (d == nullptr) continue;
    int32_t stack;
    {
      std::lock_guard<std::mutex> lock(d->mu);
      if (!d->error.has_value() || d->error->stack < 0 || !d->error->frames.empty()) continue;
      stack = d->error->stack;
    }
    auto frames = stack_frames(stack);  // takes the GIL: not under the device's lock
    std::lock_guard<std::mutex> lock(d->mu);
    if (d->error.has_value() && d->error->stack == stack && d->error->frames.empty()) d->error->frames = frames;
  }
}

void clear_python_error_keeping_interrupt() {
  if (PyErr_Occurred() == nullptr) return;
  const bool interrupt = PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) != 0;
  PyErr_Clear();
  if (interrupt) PyErr_SetInterrupt();
}

void rethrow_if_interrupt() {
  try {
    throw;
  } catch (const python_error& e) {
    bool interrupt = false;
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      PyGILState_STATE g = PyGILState_Ensure();
      if (e.type != nullptr) {  // persisted
        interrupt = PyErr_GivenExceptionMatches(e.type, PyExc_KeyboardInterrupt) != 0;
      } else if (PyErr_Occurred() != nullptr) {  // still the thread's error indicator (a Python kernel's throw)
        interrupt = PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) != 0;
        if (!interrupt) PyErr_Clear();  // taken as the kernel's refusal: not left set for unrelated code
      }
      PyGILState_Release(g);
    }
    if (interrupt) throw;
  } catch (pybind11::error_already_set& e) {  // a Python kernel's exception, as torch's Python dispatcher throws it
    bool interrupt = false;
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      PyGILState_STATE g = PyGILState_Ensure();
      interrupt = e.matches(PyExc_KeyboardInterrupt);
      PyGILState_Release(g);
    }
    if (interrupt) throw;
  } catch (...) {
  }
}

bool queues_look_idle() {
  // Lock-free and approximate (a stream made meanwhile may be missed): streams are published in id order.
  for (int dev = 0; dev < kMaxDevices; ++dev) {
    DeviceQueues* d = g_queues[dev];
    if (d == nullptr) continue;
    for (const auto& slot : d->by_id) {
      const StreamQueue* q = slot.load(std::memory_order_acquire);
      if (q == nullptr) break;
      if (q->completed.load(std::memory_order_relaxed) != q->launched.load(std::memory_order_relaxed)) return false;
    }
  }
  return true;
}

bool all_queues_idle() {
  for (int dev = 0; dev < kMaxDevices; ++dev) {
    DeviceQueues* d = g_queues[dev];
    if (d == nullptr) continue;
    std::lock_guard<std::mutex> lock(d->mu);
    for (StreamQueue* q : d->streams)
      if (q->completed.load() != q->launched.load()) return false;
  }
  return true;
}

void wait_position(int device, int stream, uint64_t pos, const char* what, bool record_always,
                   bool raise_errors) {
  check_not_in_bad_fork();  // as torch.cuda: raised at once, before any queue lock
  StreamQueue& s = stream_of(device, stream);
  const int64_t t0 = now_ns();
  bool unobserved;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    unobserved = s.observed < pos;
  }
  try {
    wait_on(s, pos, what);  // blocks only if unobserved (observed <= completed)
  } catch (const python_error&) {  // Ctrl-C: the wait it interrupted is a sync the program made, with its time
    record_wait(device, stream, (std::string(what) + " (interrupted by Ctrl-C)").c_str(), t0, now_ns());
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.observed < pos) s.observed = pos;
  }
  // A host wait for kernels launched since the last one is a dependency of the program, recorded whether
  // or not the worker happened to be done (so counts do not depend on timing); one with nothing new to
  // wait for is recorded only when asked (a sync point: .item() on an idle device is still a sync).
  if (record_always || unobserved) record_wait(device, stream, what, t0, now_ns());
  if (raise_errors) raise_async_error(device);
}

void wait_position_quiet(int device, int stream, uint64_t pos) {
  wait_on(stream_of(device, stream), pos, "a plan's first launch");  // Ctrl-C honoured, as every host wait
}

void synchronize_stream(int device, int stream, const char* what, bool record_always, bool raise_errors) {
  check_not_in_bad_fork();  // as torch.cuda: raised at once, before any queue lock
  StreamQueue& s = stream_of(device, stream);
  const uint64_t pos = s.launched.load(std::memory_order_acquire);
  wait_position(device, stream, pos, what, record_always, raise_errors);
}

std::atomic<int> g_sync_debug_mode{0};
int sync_debug_mode() { return g_sync_debug_mode.load(std::memory_order_relaxed); }
void set_sync_debug_mode(int mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "invalid value of debug_mode, expected one of `default`, `warn`, `error`");
  g_sync_debug_mode.store(mode, std::memory_order_relaxed);
}
void warn_or_error_on_sync(const char* what) {
  const int mode = g_sync_debug_mode.load(std::memory_order_relaxed);
  if (C10_LIKELY(mode == 0) || tls_worker_stream >= 0) return;
  std::string op = what;
  if (op.rfind("sync: ", 0) == 0) op = op.substr(6);
  const std::string msg = "called a synchronizing neuron operation (" + op + ")";
  TORCH_CHECK(mode != 2, msg);
  // no C++ file: torch's Python handler then issues the message alone, at the calling Python line (TORCH_WARN
  // appends this file's line to the message)
  c10::warn(c10::Warning(c10::UserWarning(), {__func__, nullptr, 0}, msg, false));
}

void synchronize_device(int device, const char* what) {
  check_not_in_bad_fork();  // as torch.cuda: raised at once, before any queue lock
  DeviceQueues& d = queues_of(device);
  std::vector<StreamQueue*> streams;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    streams = d.streams;
  }
  const int64_t t0 = now_ns();
  for (StreamQueue* s : streams) {
    const uint64_t pos = s->launched.load(std::memory_order_acquire);
    try {
      wait_on(*s, pos, what);
    } catch (const python_error&) {  // Ctrl-C: a recorded sync too
      record_wait(device, -1, (std::string(what) + " (interrupted by Ctrl-C)").c_str(), t0, now_ns());
      throw;
    }
  }
  record_wait(device, -1, what, t0, now_ns());
  raise_async_error(device);
}

void drain_all(bool raise_interrupt) {
  if (tls_worker_stream >= 0 || in_bad_fork()) return;  // a forked child's inherited queues never drain
  std::exception_ptr interrupt;  // a Ctrl-C in one of the waits (this thread's queued launches were dropped)
  for (int d = 0; d < kMaxDevices; ++d) {
    DeviceQueues* q = g_queues[d];
    if (q == nullptr) continue;
    std::vector<StreamQueue*> streams;
    {
      std::lock_guard<std::mutex> lock(q->mu);
      streams = q->streams;
    }
    for (StreamQueue* s : streams) {
      const uint64_t pos = s->launched.load(std::memory_order_acquire);
      try {
        wait_on(*s, pos, "drain");
      } catch (const python_error&) {
        if (!interrupt) interrupt = std::current_exception();
      } catch (...) {
      }
    }
  }
  // Swallowed, the interrupt left the kernels it dropped unsaid: `%neuron_watch`'s end-of-cell drain reported
  // a cell whose later results were never computed as a success.
  if (raise_interrupt && interrupt) std::rethrow_exception(interrupt);
}

void synchronize_all(const char* what) {
  for (int d = 0; d < device_count() && d < kMaxDevices; ++d)
    if (g_queues[d] != nullptr) synchronize_device(d, what);
}

void stamp_launcher(Launch& l) {
  l.interrupts = &interrupts_of_this_thread();
  l.interrupts_seen = l.interrupts->load(std::memory_order_relaxed);
}

int worker_stream() { return tls_worker_stream; }
uint64_t worker_position() { return tls_worker_pos; }

// ATen takes the process's intra-op thread count into a thread once, at its first parallel region (an
// OpenMP ICV and MKL's thread-local count), and flush-denormal is a register of the thread that set it:
// `torch.set_num_threads(1)` after a worker's first parallel kernel left the worker at 2 threads, so a
// reduction partitioned by thread count was no longer CPU's (found by the sixth hostile review). The
// Python wrappers record each setting here; a thread that runs kernels (a worker before each kernel, a
// host thread in the fallback) takes it when it changed: two relaxed loads when it did not.
std::atomic<int> g_cpu_threads{0};
std::atomic<int> g_cpu_flush_denormal{-1};
thread_local int tls_cpu_threads = 0;
thread_local int tls_cpu_flush_denormal = -1;

void set_host_cpu_settings(int threads, int flush_denormal) {
  if (threads > 0) g_cpu_threads.store(threads, std::memory_order_relaxed);
  if (flush_denormal >= 0) g_cpu_flush_denormal.store(flush_denormal ? 1 : 0, std::memory_order_relaxed);
}

void adopt_host_cpu_settings() {
  const int n = g_cpu_threads.load(std::memory_order_relaxed);
  const int fd = g_cpu_flush_denormal.load(std::memory_order_relaxed);
  if ((n == tls_cpu_threads && fd == tls_cpu_flush_denormal) || at::in_parallel_region()) return;
  if (n > 0 && n != tls_cpu_threads) {
    at::set_num_threads(n);
    tls_cpu_threads = n;
  }
  if (fd >= 0 && fd != tls_cpu_flush_denormal) {
    at::globalContext().setFlushDenormal(fd == 1);
    tls_cpu_flush_denormal = fd;
  }
}

namespace {
std::mutex g_events_mu;
std::unordered_set<const NeuronEvent*> g_live_events;
}  // namespace

NeuronEvent* new_event(bool timing) {
  auto* ev = new NeuronEvent();
  ev->timing = timing;
  std::lock_guard<std::mutex> lock(g_events_mu);
  g_live_events.insert(ev);
  return ev;
}

void destroy_event(NeuronEvent* ev) {
  if (ev == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_events_mu);
    g_live_events.erase(ev);
  }
  delete ev;  // its queued markers hold their own stamps
}

NeuronEvent* live_event(int64_t id) {
  auto* ev = reinterpret_cast<NeuronEvent*>(id);
  std::lock_guard<std::mutex> lock(g_events_mu);
  return g_live_events.count(ev) != 0 ? ev : nullptr;
}

double event_elapsed_ms(const NeuronEvent* a, const NeuronEvent* b) {
  TORCH_CHECK(a != nullptr && b != nullptr && a->pos != 0 && b->pos != 0,
              "Both events must be recorded before calculating elapsed time.");
  TORCH_CHECK(a->timing && b->timing, "Both events must be created with argument 'enable_timing=True'.");
  TORCH_CHECK(event_done(a) && event_done(b), "Both events must be completed before calculating elapsed time.");
  return static_cast<double>(b->stamp->load() - a->stamp->load()) / 1e6;
}

void record_event(NeuronEvent* ev, int device, int stream) {
  check_not_in_bad_fork();  // as torch.cuda: raised at once, before any queue lock
  StreamQueue& s = stream_of(device, stream);  // checks the stream before the event changes
  Work w;
  w.device = device;
  w.stream = stream;
  w.launch.id = g_next_launch.fetch_add(1, std::memory_order_relaxed);
  w.launch.host_start_ns = now_ns();
  w.launch.name_id = -1;
  // The marker stamps the device time at which everything before it on the stream has completed, in this
  // record's own cell (a later record of the event takes a new one).
  auto stamp = std::make_shared<std::atomic<int64_t>>(0);
  if (ev->timing) w.run = [stamp](const Launch&) { stamp->store(now_ns()); };
  else w.run = [](const Launch&) {};
  w.launch.host_end_ns = now_ns();
  {
    std::lock_guard<std::mutex> lock(s.pmu);
    ev->device = device;
    ev->stream = stream;
    ev->stamp = std::move(stamp);
    ev->pos = push_locked(s, std::move(w));
  }
  wake_worker(s);
}

bool event_done(const NeuronEvent* ev) {
  check_not_in_bad_fork();
  if (ev == nullptr || ev->pos == 0) return true;
  StreamQueue& s = stream_of(ev->device, ev->stream);
  std::lock_guard<std::mutex> lock(s.mu);
  return s.completed >= ev->pos;
}

void enqueue_stream_wait(int device, int stream, int other_device, int other_stream, uint64_t pos) {
  StreamQueue* other = &stream_of(other_device, other_stream);
  Work w;
  w.device = device;
  w.stream = stream;
  w.launch = Launch{};
  w.launch.id = g_next_launch.fetch_add(1, std::memory_order_relaxed);
  w.launch.host_start_ns = now_ns();
  // A device-side wait: this stream's worker blocks until the other stream passes `pos`. It gives up when
  // the thread that launched it is interrupted (Ctrl-C in one of its host waits: that host then waits for
  // the running work, which must not be this wait on another device's long queue) and after the sync timeout.
  stamp_launcher(w.launch);
  w.run = [other, pos](const Launch& l) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(sync_timeout_s()));
    std::unique_lock<std::mutex> lock(other->mu);
    for (;;) {
      const auto slice = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(20));
      if (wait_completed_locked(*other, lock, pos, slice)) return;
      if (launch_dropped(l)) return;
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "a neuron stream waited more than ",
                  sync_timeout_s(), " s for an event on neuron:", other->device, " stream ", other->id,
                  " (TORCHNEURON_LAB_SYNC_TIMEOUT)");
    }
  };
  enqueue(std::move(w));
}

void stream_wait_event(int device, int stream, const NeuronEvent* ev) {
  check_not_in_bad_fork();  // as torch.cuda: raised at once, before any queue lock
  if (ev == nullptr || ev->pos == 0) return;  // never recorded: nothing to wait for (as CUDA)
  if (ev->device == device && ev->stream == stream) return;  // stream order already guarantees it
  enqueue_stream_wait(device, stream, ev->device, ev->stream, ev->pos);
}

}  // namespace tnl
