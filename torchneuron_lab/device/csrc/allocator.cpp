// Caching allocator of the emulated NeuronCore's HBM.
//
// Device memory is host memory obtained in large segments; segments are split into blocks that are
// cached and reused (small pool: requests <= 1 MiB carved from 2 MiB segments; large pool: 20 MiB
// segments for requests < 10 MiB, exact 2 MiB-rounded segments above). A per-device capacity (the
// device profile's HBM) is enforced on reserved memory; exceeding it raises torch.OutOfMemoryError
// after releasing cached segments once, and leaves every structure consistent.
#include "neuron.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <pthread.h>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>

namespace tnl {

namespace {

constexpr size_t kMinBlockSize = 512;
constexpr size_t kSmallSize = 1 << 20;
constexpr size_t kSmallBuffer = 2 << 20;
constexpr size_t kLargeBuffer = 20 << 20;
constexpr size_t kMinLargeAlloc = 10 << 20;
constexpr size_t kRoundLarge = 2 << 20;
constexpr size_t kSegmentAlign = 4096;

struct Stat {
  int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void update(int64_t amount) {
    current += amount;
    if (current > peak) peak = current;
    if (amount > 0) allocated += amount;
    if (amount < 0) freed += -amount;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = 0; freed = 0; }
};
enum PoolIdx { kAll = 0, kSmallPool = 1, kLargePool = 2 };
using StatArray = std::array<Stat, 3>;

void update_stat(StatArray& a, bool small, int64_t amount) {
  a[kAll].update(amount);
  a[small ? kSmallPool : kLargePool].update(amount);
}

struct DeviceStats {
  StatArray allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes, active_bytes,
      inactive_split_bytes, requested_bytes;
  int64_t num_alloc_retries = 0, num_ooms = 0, num_device_alloc = 0, num_device_free = 0;
  int64_t num_sync_all_streams = 0;
  Stat oversize_allocations, oversize_segments;
};

struct Block {
  int device;
  size_t size;
  size_t requested_size = 0;
  char* ptr;
  bool small;
  bool allocated = false;
  // Stream-ordered reuse: the stream the block's segment belongs to, the stream position launched last
  // when it was freed (work up to there may still use it), streams it was also used on (record_stream;
  // a stream of any device, as CUDA's) and, while a free waits for those, the positions they must complete.
  struct StreamPos {
    int device, stream;
    uint64_t pos;
  };
  int stream = 0;
  uint64_t free_pos = 0;
  std::vector<std::pair<int, int>> uses;  // (device, stream)
  std::vector<StreamPos> pending;
  Block* prev = nullptr;
  Block* next = nullptr;
  std::shared_ptr<c10::GatheredContext> context;
  Block(int d, size_t s, char* p, bool sm) : device(d), size(s), ptr(p), small(sm) {}
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

struct BlockLess {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return reinterpret_cast<uintptr_t>(a->ptr) < reinterpret_cast<uintptr_t>(b->ptr);
  }
};

struct TraceEntry {
  std::string action;
  uintptr_t addr;
  size_t size;
  int64_t time_us;
  std::shared_ptr<c10::GatheredContext> context;
};

struct OomInfo {
  bool valid = false;
  int64_t requested = 0, allocated = 0, reserved = 0, capacity = 0, largest_free_block = 0;
  // What the diagnosis needs to tell the causes apart (tracing/oom.py): the per-process limit, the pool and
  // stream of the request, and the largest cached free block it could not use, by reason.
  int64_t limit = 0, segment = 0;
  int stream = 0;
  bool small = false;
  int64_t largest_usable = 0;        // same pool, same stream (fits: the request was not that large)
  int64_t largest_other_stream = 0;  // same pool, another stream's block (reused only on its stream)
  int64_t largest_other_pool = 0;    // the other pool's (never serves this pool's requests)
  int64_t time_ns = 0;
  std::string message;
  std::shared_ptr<c10::GatheredContext> context;
};

std::atomic<bool> g_record_history{false};
std::atomic<bool> g_record_context{false};
std::atomic<size_t> g_max_entries{100000};
std::shared_ptr<c10::GatheredContext> (*g_context_fn)() = nullptr;

void neuron_block_free(void* ctx);

thread_local int tls_host_now = 0;  // HostNowGuards alive on this thread

class DeviceAllocator {
 public:
  DeviceAllocator(int device, int64_t capacity) : device_(device), capacity_(capacity), limit_(capacity) {}

  // torch.neuron.set_per_process_memory_fraction: this process may reserve at most fraction * capacity
  // (as CUDA's: exceeding it raises OutOfMemoryError; memory already reserved stays).
  void set_memory_fraction(double fraction) {
    std::lock_guard<std::mutex> lock(mu_);
    fraction_ = fraction;
    limit_ = static_cast<int64_t>(fraction * static_cast<double>(capacity_));
  }
  double memory_fraction() {
    std::lock_guard<std::mutex> lock(mu_);
    return fraction_;
  }

  c10::DataPtr allocate(size_t n) {
    if (n == 0) {
      return c10::DataPtr(nullptr, nullptr, nullptr, c10::Device(kNeuron, device_));
    }
    std::shared_ptr<c10::GatheredContext> ctx;
    if (g_record_context.load(std::memory_order_relaxed) && g_context_fn) ctx = g_context_fn();
    // The stream this allocation is ordered on, and the reuse limit: the host launches later than every
    // free, so any cached block of its stream is safe; a kernel running at position P (a workspace or an
    // output allocated on the stream's worker) may reuse a block only if it was freed before P launched.
    int stream = 0;
    uint64_t limit = UINT64_MAX;
    if (worker_stream() >= 0) {
      stream = worker_stream();
      limit = worker_position();
    } else {
      stream = current_stream(device_);
      // A host allocation is used by kernels launched after it, so any cached block of its stream is safe
      // (they run after the kernels launched before its free). Memory a host-path kernel writes *now* is
      // not ordered: while it runs, another thread may have launched kernels that still use blocks it
      // freed since. It takes only blocks whose last launched use has completed (HostNowGuard).
      if (tls_host_now > 0) limit = stream_completed(device_, stream) + 1;
    }
    std::unique_lock<std::mutex> lock(mu_);
    process_pending();
    // Every size enters here: a request beyond the capacity can never be met (and would overflow the
    // rounding below, e.g. a size_t made from a negative or overflowed byte count): out of memory. The
    // per-process fraction is not checked here: as CUDA's, it bounds what is reserved, where a new segment
    // is needed (new_segment); a cached block serves a request above it.
    if (n > static_cast<size_t>(capacity_)) raise_oom(n, n, ctx, lock, n <= kSmallSize, stream);
    const size_t size = round_size(n);
    const bool small = size <= kSmallSize;
    Block* block = find_free(small, size, stream, limit);
    if (block == nullptr) {
      block = new_segment(small, size, n, ctx, lock, stream);  // throws OutOfMemoryError (lock released)
    } else if (block->is_split()) {
      update_stat(stats_.inactive_split, block->small, -1);
      update_stat(stats_.inactive_split_bytes, block->small, -static_cast<int64_t>(block->size));
    }
    maybe_split(block, size);
    block->allocated = true;
    block->uses.clear();
    block->requested_size = n;
    block->context = ctx;
    active_[block->ptr] = block;
    update_stat(stats_.allocation, block->small, 1);
    update_stat(stats_.allocated_bytes, block->small, block->size);
    update_stat(stats_.active, block->small, 1);
    update_stat(stats_.active_bytes, block->small, block->size);
    update_stat(stats_.requested_bytes, block->small, n);
    if (g_record_history.load(std::memory_order_relaxed)) trace("alloc", block->ptr, block->size, ctx);
    report_to_profiler(block->ptr, static_cast<int64_t>(block->size));
    // context == data pointer, so raw_allocate()/raw_deallocate() (used by CPU kernels for scratch
    // space while a neuron kernel runs) work on these blocks too.
    return c10::DataPtr(block->ptr, block->ptr, &neuron_block_free, c10::Device(kNeuron, device_));
  }

  // Frees the block starting at p; false if p is not a live block of this device.
  bool free_ptr(void* p) {
    std::shared_ptr<c10::GatheredContext> ctx;
    if (g_record_history.load(std::memory_order_relaxed) && g_record_context.load() && g_context_fn)
      ctx = g_context_fn();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = active_.find(static_cast<char*>(p));
    if (it == active_.end()) return false;
    Block* block = it->second;
    if (g_record_history.load(std::memory_order_relaxed)) {
      trace("free_requested", block->ptr, block->size, ctx);
      trace("free_completed", block->ptr, block->size, ctx);
    }
    active_.erase(block->ptr);
    block->allocated = false;
    update_stat(stats_.allocation, block->small, -1);
    update_stat(stats_.allocated_bytes, block->small, -static_cast<int64_t>(block->size));
    update_stat(stats_.requested_bytes, block->small, -static_cast<int64_t>(block->requested_size));
    report_to_profiler(block->ptr, -static_cast<int64_t>(block->size));
    block->requested_size = 0;
    block->context.reset();
    block->free_pos = stream_enqueued(device_, block->stream);
    if (!block->uses.empty()) {
      // Used on other streams (record_stream): cached only once the work they had launched by now is done.
      for (const auto& [d, s] : block->uses) block->pending.push_back({d, s, stream_enqueued(d, s)});
      block->uses.clear();
      pending_.push_back(block);
      process_pending();
      return true;
    }
    release_to_pool(block);
    return true;
  }

  // record_stream: the live block at p is also used by work on `stream` of `device` (checked by the caller).
  void record_use(void* p, int device, int stream) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = active_.find(static_cast<char*>(p));
    if (it == active_.end()) return;
    Block* b = it->second;
    if (device == device_ && stream == b->stream) return;
    const std::pair<int, int> use(device, stream);
    if (std::find(b->uses.begin(), b->uses.end(), use) == b->uses.end()) b->uses.push_back(use);
  }

  // Frees whose other-stream work has completed join the cache.
  void process_pending() {
    if (pending_.empty()) return;
    for (auto it = pending_.begin(); it != pending_.end();) {
      Block* b = *it;
      bool done = true;
      for (const auto& u : b->pending) done = done && stream_completed(u.device, u.stream) >= u.pos;
      if (done) {
        b->pending.clear();
        it = pending_.erase(it);
        release_to_pool(b);
      } else {
        ++it;
      }
    }
  }

  // Caller holds mu_. Moves a freed block (stats: no longer active) into its stream's pool, merged.
  void release_to_pool(Block* block) {
    update_stat(stats_.active, block->small, -1);
    update_stat(stats_.active_bytes, block->small, -static_cast<int64_t>(block->size));
    for (Block* nb : {block->prev, block->next}) {
      if (nb != nullptr && !nb->allocated && nb->pending.empty()) {
        update_stat(stats_.inactive_split, nb->small, -1);
        update_stat(stats_.inactive_split_bytes, nb->small, -static_cast<int64_t>(nb->size));
      }
    }
    merge(block, block->prev);
    merge(block, block->next);
    if (block->is_split()) {
      update_stat(stats_.inactive_split, block->small, 1);
      update_stat(stats_.inactive_split_bytes, block->small, block->size);
    }
    pool(block->small).insert(block);
  }

  // Returns cached, wholly free segments to the host. Caller holds no lock. As CUDA's, it synchronises
  // the device first (queued kernels may still read blocks the host has freed).
  void empty_cache() {
    if (worker_stream() < 0) synchronize_device(device_, "sync: torch.neuron.empty_cache()");
    std::lock_guard<std::mutex> lock(mu_);
    stats_.num_sync_all_streams++;
    process_pending();
    release_cached();
  }

  void stats_into(DeviceStats& out) {
    std::lock_guard<std::mutex> lock(mu_);
    out = stats_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    for (StatArray* a : all_arrays()) for (auto& s : *a) s.reset_peak();
    stats_.oversize_allocations.reset_peak();
    stats_.oversize_segments.reset_peak();
  }
  void reset_accumulated() {
    std::lock_guard<std::mutex> lock(mu_);
    for (StatArray* a : all_arrays()) for (auto& s : *a) s.reset_accumulated();
    stats_.oversize_allocations.reset_accumulated();
    stats_.oversize_segments.reset_accumulated();
    stats_.num_alloc_retries = 0;
    stats_.num_sync_all_streams = 0;
    stats_.num_ooms = 0;
    stats_.num_device_alloc = 0;
    stats_.num_device_free = 0;
  }
  int64_t reserved() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_.reserved_bytes[kAll].current;
  }
  int64_t capacity() const { return capacity_; }
  bool owns(const void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = segments_.upper_bound(reinterpret_cast<uintptr_t>(p));
    if (it == segments_.begin()) return false;
    --it;
    return reinterpret_cast<uintptr_t>(p) < it->first + it->second.size_total;
  }

  // Snapshot support (read under lock, symbolized by the caller).
  struct SegView {
    uintptr_t address;
    size_t total;
    bool small;
    int stream;
    struct BlockView {
      uintptr_t address;
      size_t size, requested;
      bool allocated;
      bool pending_free;  // freed, not reusable until the other streams it was used on pass its free
      std::shared_ptr<c10::GatheredContext> ctx;
    };
    std::vector<BlockView> blocks;
  };
  std::vector<SegView> segments_view() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<SegView> out;
    for (auto& kv : segments_) {
      SegView s{kv.first, kv.second.size_total, kv.second.head->small, kv.second.head->stream, {}};
      for (Block* b = kv.second.head; b != nullptr; b = b->next)
        s.blocks.push_back({reinterpret_cast<uintptr_t>(b->ptr), b->size, b->requested_size, b->allocated,
                            !b->allocated && !b->pending.empty(), b->context});
      out.push_back(std::move(s));
    }
    return out;
  }
  std::vector<TraceEntry> trace_view() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<TraceEntry> out;
    const size_t n = trace_.size();
    for (size_t i = 0; i < n; ++i) out.push_back(trace_[(trace_next_ + i) % n]);
    return out;
  }
  void clear_trace() {
    std::lock_guard<std::mutex> lock(mu_);
    trace_.clear();
    trace_next_ = 0;
  }
  // pthread_atfork: the forking thread holds every allocator lock across fork(), so the child inherits
  // consistent structures and unlocked mutexes (no other thread can be half-way through them).
  void fork_lock() { mu_.lock(); }
  void fork_unlock() { mu_.unlock(); }
  OomInfo last_oom() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_oom_;
  }

 private:
  struct Segment {
    Block* head;
    size_t size_total;
  };

  bool all_idle() {
    // Every stream this device's blocks belong to has completed its work (stream ids are dense).
    for (int s = 0; s < kMaxStreamsPerDevice; ++s) {
      uint64_t e, c;
      try {
        e = stream_enqueued(device_, s);
        c = stream_completed(device_, s);
      } catch (const c10::Error&) {
        break;  // past the last stream
      }
      if (e != c) return false;
    }
    return true;
  }

  static size_t round_size(size_t n) {
    if (n < kMinBlockSize) return kMinBlockSize;
    return kMinBlockSize * ((n + kMinBlockSize - 1) / kMinBlockSize);
  }
  static size_t segment_size(size_t size) {
    if (size <= kSmallSize) return kSmallBuffer;
    if (size < kMinLargeAlloc) return kLargeBuffer;
    return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
  }
  std::set<Block*, BlockLess>& pool(bool small) { return small ? small_free_ : large_free_; }
  std::vector<StatArray*> all_arrays() {
    return {&stats_.allocation, &stats_.segment, &stats_.active, &stats_.inactive_split,
            &stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.active_bytes,
            &stats_.inactive_split_bytes, &stats_.requested_bytes};
  }

  Block* find_free(bool small, size_t size, int stream, uint64_t limit) {
    auto& p = pool(small);
    Block key(device_, size, nullptr, small);
    key.stream = stream;
    for (auto it = p.lower_bound(&key); it != p.end() && (*it)->stream == stream; ++it) {
      Block* b = *it;
      if (limit != UINT64_MAX && b->free_pos >= limit) continue;  // a later launch may still use it
      p.erase(it);
      return b;
    }
    return nullptr;
  }

  void maybe_split(Block* block, size_t size) {
    const size_t remaining = block->size - size;
    const bool should = block->small ? remaining >= kMinBlockSize : remaining > kSmallSize;
    if (!should) return;
    auto* rest = new Block(device_, remaining, block->ptr + size, block->small);
    rest->stream = block->stream;
    rest->free_pos = block->free_pos;
    rest->prev = block;
    rest->next = block->next;
    if (rest->next) rest->next->prev = rest;
    block->next = rest;
    block->size = size;
    pool(block->small).insert(rest);
    update_stat(stats_.inactive_split, rest->small, 1);
    update_stat(stats_.inactive_split_bytes, rest->small, rest->size);
  }

  void merge(Block* dst, Block* src) {
    if (src == nullptr || src->allocated || !src->pending.empty()) return;
    pool(src->small).erase(src);
    if (dst->prev == src) {
      dst->ptr = src->ptr;
      dst->prev = src->prev;
      if (dst->prev) dst->prev->next = dst;
      auto it = segments_.find(reinterpret_cast<uintptr_t>(src->ptr));
      if (it != segments_.end()) it->second.head = dst;
    } else {
      dst->next = src->next;
      if (dst->next) dst->next->prev = dst;
    }
    dst->size += src->size;
    dst->free_pos = std::max(dst->free_pos, src->free_pos);
    delete src;
  }

  void release_cached() {
    for (auto it = segments_.begin(); it != segments_.end();) {
      Block* head = it->second.head;
      if (!head->allocated && head->next == nullptr && head->pending.empty() &&
          stream_completed(device_, head->stream) >= head->free_pos) {
        pool(head->small).erase(head);
        const size_t sz = it->second.size_total;
        update_stat(stats_.segment, head->small, -1);
        update_stat(stats_.reserved_bytes, head->small, -static_cast<int64_t>(sz));
        stats_.num_device_free++;
        if (g_record_history.load(std::memory_order_relaxed)) trace("segment_free", head->ptr, sz, nullptr);
        std::free(head->ptr);
        delete head;
        it = segments_.erase(it);
      } else {
        ++it;
      }
    }
  }

  Block* new_segment(bool small, size_t size, size_t requested, std::shared_ptr<c10::GatheredContext> ctx,
                     std::unique_lock<std::mutex>& lock, int stream) {
    const size_t seg = segment_size(size);
    if (stats_.reserved_bytes[kAll].current + static_cast<int64_t>(seg) > limit_) {
      // CUDA's retry: release the cache (its synchronize_and_free_events counts a sync of all streams), try again
      stats_.num_alloc_retries++;
      stats_.num_sync_all_streams++;
      release_cached();
      if (stats_.reserved_bytes[kAll].current + static_cast<int64_t>(seg) > limit_ && worker_stream() < 0 &&
          !all_idle()) {
        // Cached segments may still be in use by queued kernels: wait for the device (not under our
        // lock: kernels allocate too), then release what became free.
        lock.unlock();
        synchronize_device(device_, "sync: out-of-memory retry");
        lock.lock();
        process_pending();
        release_cached();
      }
    }
    char* ptr = nullptr;
    if (stats_.reserved_bytes[kAll].current + static_cast<int64_t>(seg) <= limit_) {
      ptr = static_cast<char*>(std::aligned_alloc(kSegmentAlign, seg));
    }
    if (ptr == nullptr) {
      raise_oom(requested, seg, ctx, lock, small, stream);
    }
    auto* b = new Block(device_, seg, ptr, small);
    b->stream = stream;
    segments_[reinterpret_cast<uintptr_t>(ptr)] = Segment{b, seg};
    update_stat(stats_.segment, small, 1);
    update_stat(stats_.reserved_bytes, small, seg);
    stats_.num_device_alloc++;
    if (g_record_history.load(std::memory_order_relaxed)) trace("segment_alloc", ptr, seg, ctx);
    return b;
  }

  // torch.profiler.profile(profile_memory=True): each allocation and free, with the totals after it, as
  // CUDA's caching allocator reports them (a no-op unless the calling thread is being profiled).
  void report_to_profiler(void* ptr, int64_t delta) {
    if (!c10::memoryProfilingEnabled()) return;
    c10::reportMemoryUsageToProfiler(ptr, delta, static_cast<size_t>(stats_.allocated_bytes[kAll].current),
                                     static_cast<size_t>(stats_.reserved_bytes[kAll].current),
                                     c10::Device(kNeuron, static_cast<c10::DeviceIndex>(device_)));
  }

  [[noreturn]] void raise_oom(uint64_t requested, uint64_t seg, std::shared_ptr<c10::GatheredContext> ctx,
                              std::unique_lock<std::mutex>& lock, bool small, int stream) {
    stats_.num_ooms++;
    const int64_t allocated = stats_.allocated_bytes[kAll].current;
    const int64_t reserved = stats_.reserved_bytes[kAll].current;
    if (c10::memoryProfilingEnabled())
      c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(requested), static_cast<size_t>(allocated),
                                       static_cast<size_t>(reserved),
                                       c10::Device(kNeuron, static_cast<c10::DeviceIndex>(device_)));
    const int64_t free_dev = capacity_ - reserved;
    int64_t largest = 0;
    for (Block* b : large_free_) largest = std::max<int64_t>(largest, b->size);
    for (Block* b : small_free_) largest = std::max<int64_t>(largest, b->size);
    std::ostringstream m;
    m << "Neuron out of memory. Tried to allocate " << fmt(requested) << " (needs a new " << fmt(seg)
      << " segment). neuron:" << device_ << " has a total capacity of " << fmt(capacity_) << " of which "
      << fmt(std::max<int64_t>(free_dev, 0)) << " is free. Of the reserved memory " << fmt(allocated)
      << " is allocated by PyTorch, and " << fmt(reserved - allocated)
      << " is reserved by PyTorch but unallocated (largest cached free block " << fmt(largest)
      << ")" << (limit_ < capacity_ ? "; this process may reserve at most " + fmt(limit_) +
                                          " (torch.neuron.set_per_process_memory_fraction(" +
                                          std::to_string(fraction_) + "))"
                                    : std::string())
      << ". If reserved but unallocated memory is large, call torch.neuron.empty_cache(); otherwise "
         "reduce the batch size or free tensors (see %neuron_memory). The emulated capacity is set by "
         "TORCHNEURON_LAB_HBM_BYTES.";
    last_oom_.valid = true;
    last_oom_.requested = static_cast<int64_t>(std::min<uint64_t>(requested, INT64_MAX));
    last_oom_.allocated = allocated;
    last_oom_.reserved = reserved;
    last_oom_.capacity = capacity_;
    last_oom_.largest_free_block = largest;
    last_oom_.limit = limit_;
    last_oom_.segment = static_cast<int64_t>(std::min<uint64_t>(seg, INT64_MAX));
    last_oom_.stream = stream;
    last_oom_.small = small;
    last_oom_.largest_usable = last_oom_.largest_other_stream = last_oom_.largest_other_pool = 0;
    for (Block* b : pool(small)) {
      int64_t& slot = b->stream == stream ? last_oom_.largest_usable : last_oom_.largest_other_stream;
      slot = std::max<int64_t>(slot, b->size);
    }
    for (Block* b : pool(!small)) last_oom_.largest_other_pool = std::max<int64_t>(last_oom_.largest_other_pool, b->size);
    last_oom_.time_ns = now_ns();
    last_oom_.message = m.str();
    last_oom_.context = ctx;
    if (g_record_history.load(std::memory_order_relaxed))
      trace("oom", reinterpret_cast<char*>(static_cast<uintptr_t>(std::max<int64_t>(free_dev, 0))),
            static_cast<size_t>(requested), ctx);
    lock.unlock();
    TORCH_CHECK_WITH(OutOfMemoryError, false, m.str());
  }

  static std::string fmt(uint64_t bytes) {
    char buf[64];
    const double b = static_cast<double>(bytes);
    if (bytes >= (1ULL << 40)) snprintf(buf, sizeof buf, "%.2f TiB", b / (1ULL << 40));
    else if (bytes >= (1LL << 30)) snprintf(buf, sizeof buf, "%.2f GiB", b / (1LL << 30));
    else if (bytes >= (1LL << 20)) snprintf(buf, sizeof buf, "%.2f MiB", b / (1LL << 20));
    else if (bytes >= 1024) snprintf(buf, sizeof buf, "%.2f KiB", b / 1024);
    else snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(bytes));
    return buf;
  }

  void trace(const char* action, char* ptr, size_t size, std::shared_ptr<c10::GatheredContext> ctx) {
    const size_t cap = g_max_entries.load();
    TraceEntry e{action, reinterpret_cast<uintptr_t>(ptr), size, now_ns() / 1000, std::move(ctx)};
    if (cap == 0) return;
    if (trace_.size() < cap) {
      trace_.push_back(std::move(e));
    } else {
      trace_[trace_next_] = std::move(e);
      trace_next_ = (trace_next_ + 1) % cap;
    }
  }

  int device_;
  int64_t capacity_;
  int64_t limit_;           // reserved bytes allowed: capacity_ * fraction_ (under mu_)
  double fraction_ = 1.0;
  std::mutex mu_;
  std::set<Block*, BlockLess> small_free_, large_free_;
  std::unordered_map<char*, Block*> active_;
  std::vector<Block*> pending_;  // freed, waiting for the streams they were recorded on
  std::map<uintptr_t, Segment> segments_;
  DeviceStats stats_;
  std::vector<TraceEntry> trace_;
  size_t trace_next_ = 0;
  OomInfo last_oom_;
};

std::mutex g_devices_mu;
std::array<std::atomic<DeviceAllocator*>, 64> g_devices{};

// Never creates state: returns nullptr for a device that was never used.
DeviceAllocator* peek_device(int d) {
  if (d < 0 || d >= 64) return nullptr;
  return g_devices[d].load(std::memory_order_acquire);
}

DeviceAllocator* get_device(int d) {
  check_not_in_bad_fork();
  DeviceAllocator* a = peek_device(d);
  if (a != nullptr) return a;
  check_device_index(d);
  std::lock_guard<std::mutex> lock(g_devices_mu);
  a = g_devices[d].load();
  if (a == nullptr) {
    mark_runtime_started();
    a = new DeviceAllocator(d, config().hbm_bytes);
    g_devices[d].store(a, std::memory_order_release);
  }
  return a;
}

DeviceAllocator* peek_device(int d);

bool free_neuron_ptr(void* ptr) {
  for (int d = 0; d < 64; ++d) {
    DeviceAllocator* a = peek_device(d);
    if (a == nullptr) {
      if (d >= device_count()) break;
      continue;
    }
    if (a->free_ptr(ptr)) return true;
  }
  return false;
}

// Deleters run inside destructors: they must never throw (that would terminate the interpreter).
void neuron_block_free(void* ptr) {
  if (ptr == nullptr) return;
  if (!free_neuron_ptr(ptr)) {
    std::fprintf(stderr, "torchneuron_lab: neuron allocator asked to free unknown pointer %p (ignored)\n", ptr);
  }
}

// The device allocator torch sees (c10::GetAllocator(kPrivateUse1)). A c10::DeviceAllocator, as CUDA's: the
// generic accelerator API (torch.accelerator.memory_stats, empty_cache, get_memory_info, ...; Inductor's
// and torch's test harness call them) reaches the caching allocator through this interface, and raised
// "INTERNAL ASSERT FAILED ... Allocator for neuron is not a DeviceAllocator" while it was a plain Allocator.
class NeuronAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override { return get_device(current_device())->allocate(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &neuron_block_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  // Some device has been used (torch.accelerator's functions do nothing, or return nothing, before).
  bool initialized() override {
    if (in_bad_fork()) return false;  // as torch.cuda.is_initialized() in a forked child
    for (int d = 0; d < device_count(); ++d)
      if (peek_device(d) != nullptr) return true;
    return false;
  }
  void emptyCache(c10::MempoolId_t mempool_id) override {
    TORCH_CHECK_NOT_IMPLEMENTED(mempool_id.first == 0 && mempool_id.second == 0,
                                "neuron has no private memory pools (MemPool); got pool id (", mempool_id.first,
                                ", ", mempool_id.second, ")");
    for (int d = 0; d < device_count(); ++d)
      if (auto* a = peek_device(d)) a->empty_cache();
  }
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    TORCH_CHECK(stream.device_type() == kNeuron, "recordStream: expected a neuron stream, got ", stream);
    if (ptr.get() != nullptr) record_block_stream(ptr.get(), stream.device_index(), static_cast<int>(stream.id()));
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device_index(device);
    DeviceStats st;
    if (auto* a = peek_device(device)) a->stats_into(st);
    c10::CachingDeviceAllocator::DeviceStats out;
    auto arr = [](c10::CachingDeviceAllocator::StatArray& to, const StatArray& from) {
      static_assert(kAll == static_cast<int>(c10::CachingDeviceAllocator::StatType::AGGREGATE) &&
                    kSmallPool == static_cast<int>(c10::CachingDeviceAllocator::StatType::SMALL_POOL) &&
                    kLargePool == static_cast<int>(c10::CachingDeviceAllocator::StatType::LARGE_POOL));
      for (size_t i = 0; i < from.size(); ++i) copy_stat(to[i], from[i]);
    };
    arr(out.allocation, st.allocation);
    arr(out.segment, st.segment);
    arr(out.active, st.active);
    arr(out.inactive_split, st.inactive_split);
    arr(out.allocated_bytes, st.allocated_bytes);
    arr(out.reserved_bytes, st.reserved_bytes);
    arr(out.active_bytes, st.active_bytes);
    arr(out.inactive_split_bytes, st.inactive_split_bytes);
    arr(out.requested_bytes, st.requested_bytes);
    out.num_alloc_retries = st.num_alloc_retries;
    out.num_sync_all_streams = st.num_sync_all_streams;
    out.num_ooms = st.num_ooms;
    copy_stat(out.oversize_allocations, st.oversize_allocations);
    copy_stat(out.oversize_segments, st.oversize_segments);
    out.num_device_alloc = st.num_device_alloc;
    out.num_device_free = st.num_device_free;
    out.max_split_size = -1;  // no limit: -1, as memory_stats() and CUDA report it
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device_index(device);
    if (auto* a = peek_device(device)) a->reset_accumulated();
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    check_device_index(device);
    if (auto* a = peek_device(device)) a->reset_peak();
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_device_index(device);
    auto* a = peek_device(device);
    const int64_t total = config().hbm_bytes;
    const int64_t reserved = a != nullptr ? a->reserved() : 0;
    return {static_cast<size_t>(std::max<int64_t>(total - reserved, 0)), static_cast<size_t>(total)};
  }

 private:
  static void copy_stat(c10::CachingAllocator::Stat& to, const Stat& from) {
    to.current = from.current;
    to.peak = from.peak;
    to.allocated = from.allocated;
    to.freed = from.freed;
  }
};

thread_local int tls_redirect_device = -1;
thread_local PlacementGuard* tls_placement = nullptr;
c10::DeleterFnPtr g_base_raw_deleter = nullptr;

void placed_free(void*) {}  // the memory is an output's device block, owned by its neuron tensor

bool is_placed(void* ptr) {
  for (PlacementGuard* g = tls_placement; g != nullptr; g = g->prev_)
    for (size_t i = 0; i < g->n_; ++i)
      if (g->slots_[i].ptr == ptr) return true;
  return false;
}

// raw_deallocate() through the CPU allocator: the pointer may be a neuron block (allocated while a
// kernel ran), an output's block handed out by a PlacementGuard, or ordinary host memory.
void redirect_raw_free(void* ptr) {
  if (ptr == nullptr) return;
  if (is_placed(ptr)) return;
  if (free_neuron_ptr(ptr)) return;
  if (g_base_raw_deleter != nullptr) g_base_raw_deleter(ptr);
  else std::free(ptr);
}

class RedirectCpuAllocator final : public c10::Allocator {
 public:
  explicit RedirectCpuAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    const int d = tls_redirect_device;
    if (d < 0) {
      if (PlacementGuard* g = tls_placement; g != nullptr && n > 0) {
        for (size_t i = 0; i < g->n_; ++i) {
          PlacementGuard::Slot& s = g->slots_[i];
          if (!s.used && s.nbytes == n) {
            s.used = true;
            return c10::DataPtr(s.ptr, s.ptr, &placed_free, c10::Device(c10::kCPU));
          }
        }
      }
      return base_->allocate(n);
    }
    HostNowGuard now;  // host code (a host-path op, a compiled graph) writes what it allocates at once
    c10::DataPtr p = get_device(d)->allocate(n);
    p.unsafe_set_device(c10::Device(c10::kCPU));
    return p;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &redirect_raw_free; }
  c10::Allocator* base() const { return base_; }

 private:
  c10::Allocator* base_;
};

NeuronAllocator g_neuron_allocator;
RedirectCpuAllocator* g_redirect = nullptr;

// Pinned host memory for neuron (tensor.pin_memory("neuron")): page-aligned host allocations the
// device's DMA could use directly; isPinnedPtr() answers for any address inside one of them.
std::mutex g_pinned_mu;
// A block's memory goes back to the system when it is freed and no queued copy uses it. A copy queued on a
// pinned tensor (non_blocking) holds a use of the block (pinned_use), not the tensor's storage: a storage can
// swap its memory under its users (`p.untyped_storage().resize_(0)` after `x.copy_(p, non_blocking=True)` freed
// the block the copy was about to read: a segfault), as CUDA's host allocator keeps a block with pending
// copies (its recorded events) until they are done.
struct PinnedBlock {
  size_t bytes = 0;
  int uses = 0;        // queued copies holding it
  bool freed = false;  // freed by its storage while used: released by the last use
};
std::map<uintptr_t, PinnedBlock> g_pinned;  // start -> block
struct PinnedStats {  // under g_pinned_mu
  c10::CachingAllocator::Stat active_requests, active_bytes, allocations, allocated_bytes;
  int64_t num_host_alloc = 0, num_host_free = 0;
} g_pinned_stats;

void pinned_free(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    auto it = g_pinned.find(reinterpret_cast<uintptr_t>(ptr));
    if (it != g_pinned.end()) {
      g_pinned_stats.active_requests.decrease(1);
      g_pinned_stats.active_bytes.decrease(it->second.bytes);
      g_pinned_stats.allocations.decrease(1);
      g_pinned_stats.allocated_bytes.decrease(it->second.bytes);
      g_pinned_stats.num_host_free++;
      if (it->second.uses > 0) {
        it->second.freed = true;  // the last queued copy using it releases it
        return;
      }
      g_pinned.erase(it);
    }
  }
  std::free(ptr);
}

void pinned_unuse(void* ctx) {
  const auto start = reinterpret_cast<uintptr_t>(ctx);
  {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    auto it = g_pinned.find(start);
    if (it == g_pinned.end() || --it->second.uses > 0 || !it->second.freed) return;
    g_pinned.erase(it);
  }
  std::free(ctx);
}

// The host allocator torch sees for neuron (at::getHostAllocator(kPrivateUse1)): torch.accelerator's
// empty_host_cache() called through a null one (a segfault once a neuron tensor existed). Pinned memory is
// not cached here: it goes back to the system when freed, or when the last queued copy using it has run (a
// copy holds a use of the block, pinned_use, so nothing needs a stream record); empty_cache has nothing to
// release and the stats count the allocations their storages hold.
class PinnedHostAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return c10::DataPtr(nullptr, nullptr, &pinned_free, c10::Device(c10::kCPU));
    TORCH_CHECK_WITH(OutOfMemoryError, n <= (static_cast<size_t>(1) << 62),
                     "neuron pinned host memory: can't allocate ", n, " bytes");
    const size_t rounded = (n + kSegmentAlign - 1) / kSegmentAlign * kSegmentAlign;
    void* p = std::aligned_alloc(kSegmentAlign, rounded);
    TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr, "neuron pinned host memory: can't allocate ", n, " bytes");
    {
      std::lock_guard<std::mutex> lock(g_pinned_mu);
      g_pinned[reinterpret_cast<uintptr_t>(p)] = PinnedBlock{n};
      g_pinned_stats.active_requests.increase(1);
      g_pinned_stats.active_bytes.increase(n);
      g_pinned_stats.allocations.increase(1);
      g_pinned_stats.allocated_bytes.increase(n);
      g_pinned_stats.num_host_alloc++;
    }
    return c10::DataPtr(p, p, &pinned_free, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool record_event(void* /*ptr*/, void* /*ctx*/, c10::Stream /*stream*/) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    at::HostStats st;
    st.active_requests = g_pinned_stats.active_requests;
    st.active_bytes = g_pinned_stats.active_bytes;
    st.allocations = g_pinned_stats.allocations;
    st.allocated_bytes = g_pinned_stats.allocated_bytes;
    st.num_host_alloc = g_pinned_stats.num_host_alloc;
    st.num_host_free = g_pinned_stats.num_host_free;
    return st;
  }
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    for (c10::CachingAllocator::Stat* s : {&g_pinned_stats.active_requests, &g_pinned_stats.active_bytes, &g_pinned_stats.allocations,
                         &g_pinned_stats.allocated_bytes})
      s->reset_accumulated();
    g_pinned_stats.num_host_alloc = 0;
    g_pinned_stats.num_host_free = 0;
  }
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    for (c10::CachingAllocator::Stat* s : {&g_pinned_stats.active_requests, &g_pinned_stats.active_bytes, &g_pinned_stats.allocations,
                         &g_pinned_stats.allocated_bytes})
      s->reset_peak();
  }
};
PinnedHostAllocator g_pinned_allocator;

std::atomic<bool> g_bad_fork{false};

std::mutex g_raw_mu;  // after the allocators' locks in the fork handlers (never held while taking them)
// leaked: blocks never deleted must not be freed by a static destructor after the interpreter has gone
auto& g_raw_blocks = *new std::unordered_map<uintptr_t, c10::DataPtr>();

void fork_prepare() {
  g_devices_mu.lock();
  for (int d = 0; d < 64; ++d)
    if (DeviceAllocator* a = peek_device(d)) a->fork_lock();
  g_pinned_mu.lock();
  g_raw_mu.lock();
}
void fork_parent() {
  g_raw_mu.unlock();
  g_pinned_mu.unlock();
  for (int d = 63; d >= 0; --d)
    if (DeviceAllocator* a = peek_device(d)) a->fork_unlock();
  g_devices_mu.unlock();
}
void fork_child() {
  // As CUDA: a child forked after the device was initialised may not use it (its memory is a
  // copy-on-write snapshot, the parent's other threads are gone); freeing inherited tensors stays safe.
  if (runtime_started()) g_bad_fork.store(true);
  fork_parent();
  reset_queue_locks_after_fork();
}

}  // namespace

c10::Allocator* pinned_host_allocator() { return &g_pinned_allocator; }
bool is_pinned_host_ptr(const void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(g_pinned_mu);
  auto it = g_pinned.upper_bound(p);
  if (it == g_pinned.begin()) return false;
  --it;
  return !it->second.freed && p < it->first + std::max<size_t>(it->second.bytes, 1);
}

c10::DataPtr pinned_use(void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(g_pinned_mu);
  auto it = g_pinned.upper_bound(p);
  if (it == g_pinned.begin()) return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
  --it;
  if (it->second.freed || p >= it->first + std::max<size_t>(it->second.bytes, 1))
    return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
  ++it->second.uses;
  return c10::DataPtr(ptr, reinterpret_cast<void*>(it->first), &pinned_unuse, c10::Device(c10::kCPU));
}

bool in_bad_fork() { return g_bad_fork.load(); }
void check_not_in_bad_fork() {
  TORCH_CHECK(!g_bad_fork.load(std::memory_order_relaxed),
              "Cannot re-initialize neuron in forked subprocess. To use neuron with multiprocessing, you must "
              "use the 'spawn' start method (the emulated device's memory and threads belong to the parent "
              "process; move tensors to the CPU before handing them to a forked worker).");
}
void install_fork_handlers() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(&fork_prepare, &fork_parent, &fork_child); });
}
void init_devices() {
  for (int d = 0; d < device_count(); ++d) get_device(d);
}

c10::Allocator* neuron_allocator() { return &g_neuron_allocator; }
c10::DataPtr allocate_on(int device, size_t nbytes) { return get_device(device)->allocate(nbytes); }

// torch.neuron.caching_allocator_alloc / caching_allocator_delete (torch.cuda's raw allocation API): a
// block of the caching allocator handed out as an address, ordered on `stream`, held here until deleted.
uintptr_t raw_alloc(size_t nbytes, int device, int stream) {
  check_device_index(device);
  check_stream(device, stream);
  const int prev = current_stream(device);
  set_current_stream(device, stream);
  c10::DataPtr p;
  try {
    p = get_device(device)->allocate(nbytes);
  } catch (...) {
    set_current_stream(device, prev);
    throw;
  }
  set_current_stream(device, prev);
  const auto addr = reinterpret_cast<uintptr_t>(p.get());
  if (addr == 0) return 0;  // a 0-byte request, as CUDA's: nothing to delete
  std::lock_guard<std::mutex> lock(g_raw_mu);
  g_raw_blocks.emplace(addr, std::move(p));
  return addr;
}
void raw_delete(uintptr_t addr) {
  c10::DataPtr p;
  {
    std::lock_guard<std::mutex> lock(g_raw_mu);
    auto it = g_raw_blocks.find(addr);
    TORCH_CHECK(it != g_raw_blocks.end(), "invalid device pointer: 0x", std::hex, addr,
                " (not allocated by torch.neuron.caching_allocator_alloc, or already deleted)");
    p = std::move(it->second);
    g_raw_blocks.erase(it);
  }
  // p's destructor frees the block (outside the lock), stream-ordered as any tensor's
}
void record_block_stream(void* ptr, int device, int stream) {
  check_stream(device, stream);
  for (int d = 0; d < 64; ++d) {
    DeviceAllocator* a = peek_device(d);
    if (a != nullptr && a->owns(ptr)) {
      a->record_use(ptr, device, stream);
      return;
    }
  }
}
bool is_neuron_data_ptr(const c10::DataPtr& p) { return p.get_deleter() == &neuron_block_free; }

int device_of_ptr(const void* ptr) {
  for (int d = 0; d < device_count(); ++d) {
    DeviceAllocator* a = peek_device(d);
    if (a != nullptr && a->owns(ptr)) return d;
  }
  return -1;
}

RedirectGuard::RedirectGuard(int device) : prev_(tls_redirect_device) { tls_redirect_device = device; }
RedirectGuard::~RedirectGuard() { tls_redirect_device = prev_; }

HostNowGuard::HostNowGuard() { ++tls_host_now; }
HostNowGuard::~HostNowGuard() { --tls_host_now; }

PlacementGuard::PlacementGuard(Slot* slots, size_t n) : slots_(slots), n_(n), prev_(tls_placement) {
  tls_placement = this;
}
PlacementGuard::~PlacementGuard() { tls_placement = prev_; }

c10::Allocator* redirect_cpu_allocator() { return g_redirect; }

void install_redirect_cpu_allocator() {
  if (g_redirect != nullptr) return;
  // Wrap whatever CPU allocator is active; outside a neuron kernel every call is forwarded to it.
  c10::Allocator* base = c10::GetCPUAllocator();
  g_base_raw_deleter = base->raw_deleter();
  g_redirect = new RedirectCpuAllocator(base);
  c10::SetCPUAllocator(g_redirect, /*priority=*/100);
}

REGISTER_ALLOCATOR(kNeuron, &g_neuron_allocator);
REGISTER_HOST_ALLOCATOR(kNeuron, &g_pinned_allocator);

}  // namespace tnl
