// Kernel recorder: a bounded ring buffer of device events (kernels, DMA, syncs, markers) plus the
// per-device cache of eager op signatures. Recording off costs one relaxed atomic load per op.
#include "neuron.h"

#include <torch/csrc/profiler/combined_traceback.h>

#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

namespace tnl {

std::atomic<uint32_t> g_recording_flags{0};
std::atomic<uint64_t> g_sig_generation{1};

namespace {

struct Slot {
  EventRecord ev;
  uint64_t seq = 0;
  uint64_t thread = 0;
  std::shared_ptr<torch::CapturedTraceback> stack;
};

struct Recorder {
  std::mutex mu;
  std::vector<Slot> ring;
  size_t capacity = 1 << 20;
  size_t next = 0;    // write position
  size_t size = 0;    // valid entries
  uint64_t seq = 0;
  uint64_t dropped = 0;
  bool record_shapes = true;
  bool with_stack = false;
};

Recorder& rec() {
  static Recorder r;
  return r;
}

struct Strings {
  std::mutex mu;
  std::unordered_map<std::string, int32_t> ids;
  std::vector<std::string> names;
};
Strings& strings() {
  static Strings s;
  return s;
}

struct Signatures {
  std::mutex mu;
  std::vector<std::unordered_set<uint64_t>> seen;
  std::vector<std::vector<std::string>> described;
};
Signatures& sigs() {
  static Signatures s;
  return s;
}

uint64_t thread_hash() {
  static thread_local uint64_t h = std::hash<std::thread::id>()(std::this_thread::get_id()) & 0xffffffff;
  return h;
}

}  // namespace

bool record_shapes_enabled() { return rec().record_shapes; }
bool with_stack_enabled() { return rec().with_stack; }

int32_t intern_string(const std::string& s) {
  Strings& st = strings();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.ids.find(s);
  if (it != st.ids.end()) return it->second;
  const auto id = static_cast<int32_t>(st.names.size());
  st.names.push_back(s);
  st.ids.emplace(s, id);
  return id;
}

std::string string_of(int32_t id) {
  if (id < 0) return "";
  Strings& st = strings();
  std::lock_guard<std::mutex> lock(st.mu);
  return id < static_cast<int32_t>(st.names.size()) ? st.names[id] : "";
}

void push_event(EventRecord ev) {
  const uint32_t flags = g_recording_flags.load(std::memory_order_relaxed);
  if (flags & kKinetoBit) kineto_capture(ev);
  if (!(flags & kRecorderBit)) return;
  std::shared_ptr<torch::CapturedTraceback> stack;
  Recorder& r = rec();
  if (r.with_stack) stack = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
  std::lock_guard<std::mutex> lock(r.mu);
  if (!(g_recording_flags.load(std::memory_order_relaxed) & kRecorderBit)) return;
  if (r.ring.size() != r.capacity) r.ring.resize(r.capacity);
  Slot& s = r.ring[r.next];
  s.ev = ev;
  s.seq = r.seq++;
  s.thread = thread_hash();
  s.stack = std::move(stack);
  r.next = (r.next + 1) % r.capacity;
  if (r.size < r.capacity) r.size++;
  else r.dropped++;
}

bool note_signature(int device, uint64_t hash, const std::function<std::string()>& describe) {
  // Per-thread memo of signatures already known to be seen (they never become unseen, except by
  // clear_signatures(), which bumps the generation).
  static thread_local std::unordered_set<uint64_t> known;
  static thread_local uint64_t known_gen = 0;
  const uint64_t key = hash * 31 + static_cast<uint64_t>(device);
  if (known_gen != g_sig_generation.load(std::memory_order_relaxed)) {
    known.clear();
    known_gen = g_sig_generation.load();
  }
  if (known.count(key)) return false;
  if (known.size() > 65536) known.clear();
  known.insert(key);
  Signatures& s = sigs();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.seen.size() <= static_cast<size_t>(device)) {
    s.seen.resize(device + 1);
    s.described.resize(device + 1);
  }
  if (!s.seen[device].insert(hash).second) return false;
  s.described[device].push_back(describe());
  return true;
}

// ---- control, used by bindings.cpp ----
void recorder_start(size_t capacity, bool record_shapes, bool with_stack) {
  TORCH_CHECK_VALUE(capacity >= 1, "recorder capacity must be >= 1, got ", capacity);
  Recorder& r = rec();
  std::lock_guard<std::mutex> lock(r.mu);
  if (capacity != r.capacity) {
    r.ring.clear();
    r.ring.shrink_to_fit();
    r.capacity = capacity;
    r.next = 0;
    r.size = 0;
  }
  r.record_shapes = record_shapes;
  r.with_stack = with_stack;
  g_recording_flags.fetch_or(kRecorderBit);
}
void recorder_stop() { g_recording_flags.fetch_and(~kRecorderBit); }
void recorder_clear() {
  Recorder& r = rec();
  std::lock_guard<std::mutex> lock(r.mu);
  r.next = 0;
  r.size = 0;
  r.dropped = 0;
  for (auto& s : r.ring) s.stack.reset();
}
uint64_t recorder_dropped() { return rec().dropped; }

// Copies the buffer in order (oldest first).
std::vector<Slot> recorder_copy() {
  Recorder& r = rec();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<Slot> out;
  out.reserve(r.size);
  const size_t start = (r.next + r.capacity - r.size) % r.capacity;
  for (size_t i = 0; i < r.size; ++i) out.push_back(r.ring[(start + i) % r.capacity]);
  return out;
}

std::vector<std::string> signatures_of(int device) {
  Signatures& s = sigs();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.described.size() <= static_cast<size_t>(device)) return {};
  return s.described[device];
}
void clear_signatures() {
  g_sig_generation.fetch_add(1);
  Signatures& s = sigs();
  std::lock_guard<std::mutex> lock(s.mu);
  s.seen.clear();
  s.described.clear();
}

}  // namespace tnl
