// Kernel recorder: a bounded ring of device events (kernels, DMA, syncs, markers), the per-device cache of
// eager op signatures and the table of interned host stacks. Recording off costs one relaxed atomic load
// per op.
//
// Memory is bounded as a whole and paid as it is used:
// - events live in fixed-size chunks allocated on first write: starting the recorder allocates nothing,
//   so the first kernel of a recording pays for one chunk, not for zeroing the whole capacity (which
//   cost 80-300 ms per recording with the 1M-event default);
// - the capacity is checked against the memory available when recording starts (ValueError), and a
//   chunk that still cannot be allocated drops the event (counted): recording never fails an op;
// - an event stores a 4-byte stack id: identical Python stacks (same code objects and instruction
//   offsets) share one entry of the stack table, so stacks cost memory per distinct call path, and
//   reading symbolizes each distinct stack once (bindings.cpp).
// Ring policy: the first `keep_first` events are pinned (never overwritten); the rest of the capacity
// is a ring of the newest events. A long run keeps its start (first-seen signatures, warm-up) and its
// end; the events overwritten between them are counted with the time window they covered.
#include "neuron.h"

#include <Python.h>

#include <unistd.h>

#include <array>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

namespace tnl {

std::atomic<uint32_t> g_recording_flags{0};
std::atomic<uint64_t> g_sig_generation{1};

namespace {

constexpr size_t kChunk = 4096;          // events per chunk
constexpr size_t kKeptChunks = 16;       // chunks kept across clear() (64k events)
constexpr size_t kMaxStackDepth = 128;   // innermost frames kept per stack
constexpr size_t kMaxStacks = 1 << 20;   // distinct stacks; beyond, events get kStackTableFull
// Every launch interns its Python stack (the launch line of an asynchronous error), and the table holds the
// stacks' code objects: a session that ran new code again and again (a notebook cell re-run, exec, FX's
// generated forwards) kept every such code object alive, recording or not (1.3 MB per 1,000 re-run cells of
// 50 lines), until the table filled at kMaxStacks and launches lost their lines. Once the table has
// kAutoClearStacks stacks, a host wait or a launch that finds nothing referencing it -- nothing recording, no
// recorded event kept, every queue idle -- empties it (clear_stacks); when a recording or kept events do, that
// side tries again kAutoClearRetry stacks later (a long recording costs a try per 1,024 new stacks, not one per
// sync); busy queues only pass the try to the next launch or wait.
constexpr size_t kAutoClearStacks = 16384;
constexpr size_t kAutoClearRetry = 1024;

struct Chunk {
  RecorderSlot slots[kChunk];
};

struct Recorder {
  std::mutex mu;
  std::vector<std::unique_ptr<Chunk>> chunks;
  size_t capacity = 1 << 20;
  size_t keep_first = 0;  // pinned head
  size_t size = 0;        // valid entries
  size_t ring_pos = 0;    // next overwrite position inside the ring part, once full
  uint64_t seq = 0;
  uint64_t dropped = 0;
  int64_t dropped_first_ns = 0;  // time window of the dropped events (valid when dropped > 0)
  int64_t dropped_last_ns = 0;
  bool record_shapes = true;
  bool with_stack = false;

  RecorderSlot* slot(size_t i) {
    const size_t c = i / kChunk;
    if (c >= chunks.size()) chunks.resize(c + 1);
    if (!chunks[c]) {
      chunks[c].reset(new (std::nothrow) Chunk());
      if (!chunks[c]) return nullptr;
    }
    return &chunks[c]->slots[i % kChunk];
  }
  const RecorderSlot& at(size_t i) const { return chunks[i / kChunk]->slots[i % kChunk]; }
  void note_dropped(const EventRecord& ev) {
    if (dropped == 0 || ev.start_ns < dropped_first_ns) dropped_first_ns = ev.start_ns;
    if (dropped == 0 || ev.end_ns > dropped_last_ns) dropped_last_ns = ev.end_ns;
    dropped++;
  }
  void reset_events() {
    size = 0;
    ring_pos = 0;
    dropped = 0;
    dropped_first_ns = dropped_last_ns = 0;
  }
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

// Interned Python stacks. Entries hold a strong reference to their code objects (taken with the GIL
// held), so an address in the table is never reused by another code object while the entry lives.
struct StackHash {
  size_t operator()(const std::vector<StackFrameRef>& v) const {
    uint64_t h = 1469598103934665603ULL;
    for (const auto& f : v) {
      h = (h ^ reinterpret_cast<uintptr_t>(f.code)) * 1099511628211ULL;
      h = (h ^ static_cast<uint64_t>(static_cast<uint32_t>(f.lasti))) * 1099511628211ULL;
    }
    return h;
  }
};
struct StackEq {
  bool operator()(const std::vector<StackFrameRef>& a, const std::vector<StackFrameRef>& b) const {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].code != b[i].code || a[i].lasti != b[i].lasti) return false;
    return true;
  }
};
struct Stacks {
  std::atomic<size_t> count{0};  // by_id.size(), read without the lock
  std::atomic<size_t> next_auto_clear[2] = {kAutoClearStacks, kAutoClearStacks};  // [at a launch, at a sync]
  std::atomic<uint64_t> auto_clears{0}, auto_clear_tries{0};
  std::mutex mu;
  std::unordered_map<std::vector<StackFrameRef>, int32_t, StackHash, StackEq> ids;
  std::vector<const std::vector<StackFrameRef>*> by_id;  // points at the keys of `ids`
  std::atomic<uint64_t> generation{0};  // bumped by clear_stacks (ids are reused after a clear)
};
Stacks& stacks() {
  static Stacks s;
  return s;
}

uint32_t this_thread_hash() {
  static thread_local uint32_t h =
      static_cast<uint32_t>(std::hash<std::thread::id>()(std::this_thread::get_id()) & 0xffffffff);
  return h;
}

// Signatures first seen on this thread whose kernel event is not pushed yet ("name(dtype[shape], ...)").
thread_local std::vector<std::string> tls_pending_signatures;

// "aten::mm(float32[4, 4], float32[4])" -> shapes "[4, 4], [4]", dtypes "float32, float32".
void split_signature(const std::string& desc, std::string& shapes, std::string& dtypes) {
  const size_t open = desc.find('(');
  if (open == std::string::npos) return;
  int depth = 0;
  std::string dtype;
  for (size_t i = open + 1; i < desc.size(); ++i) {
    const char ch = desc[i];
    if (depth == 0) {
      if (ch == '[') {
        depth = 1;
        if (!dtypes.empty()) dtypes += ", ";
        dtypes += dtype;
        if (!shapes.empty()) shapes += ", ";
        shapes += '[';
        dtype.clear();
      } else if (ch != ',' && ch != ' ' && ch != ')') {
        dtype += ch;
      }
    } else {
      shapes += ch;
      if (ch == '[') depth++;
      else if (ch == ']') depth--;
    }
  }
}

int64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (f >> key >> value) {
    std::getline(f, unit);
    if (key == "MemAvailable:") return value * 1024;
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : -1;
}

std::string gib(double bytes) {
  std::ostringstream o;
  o.precision(1);
  o << std::fixed << bytes / (1024.0 * 1024.0 * 1024.0) << " GiB";
  return o.str();
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

std::vector<std::string> strings_snapshot() {
  Strings& st = strings();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.names;
}

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// The calling thread's Python stack as an id of the stack table. Kernels run with the GIL released
// (torch drops it before dispatch); a thread without a Python thread state (a pure C++ thread) or without
// Python frames (the autograd engine's device threads) gets kNoStack.
//
// A launch captures its site at every op, so the common case -- a stack this thread captured before -- is
// answered from a small per-thread cache without the GIL or the table's lock: a thread's own frames change
// only when it runs Python, and it runs none while it is in this call (it is inside an op, or holds the
// GIL), so it reads them unlocked (python_frames_without_gil). An entry is valid while the table's
// generation is unchanged: the table holds references to its keys' code objects until a clear bumps the
// generation, so a cached code address cannot have been reused by another code object. A miss takes the
// GIL (a new key's code objects get references), as torch's own CapturedTraceback does.
// (perf, 64x64 add chain on 2 cores: per launch, one GIL take and release plus the table's lock and hash
// lookup -- four mutex operations of the host thread's 25 per op -- before this cache.)
namespace {
constexpr size_t kStackCacheSlots = 64;  // a power of two: a model's forward launches from more lines than this
struct CachedStack {
  uint64_t gen = ~uint64_t{0};
  int32_t id = kNoStack;
  std::vector<StackFrameRef> key;
};
thread_local std::array<CachedStack, kStackCacheSlots> tls_stack_cache;
thread_local uint64_t tls_capture_gen = 0;  // the table's generation the last capture's id belongs to

CachedStack& cache_slot(const std::vector<StackFrameRef>& key) {
  return tls_stack_cache[StackHash{}(key) & (kStackCacheSlots - 1)];
}
}  // namespace

int32_t capture_stack_locked(const std::vector<StackFrameRef>& key);
int32_t capture_stack(size_t max_depth) {
  if (!Py_IsInitialized() || python_finalizing()) return kNoStack;
  PyThreadState* ts = PyGILState_GetThisThreadState();
  if (ts == nullptr) return kNoStack;
  // Before this capture fills its thread-local key: a clear's Py_DECREFs may run Python that launches too.
  // (It takes the GIL itself when it clears.)
  maybe_auto_clear_stacks(/*at_sync=*/false);
  static thread_local std::vector<StackFrameRef> key;
  key.resize(std::min(max_depth, kMaxStackDepth));
  const bool unlocked = python_frames_without_gil() || PyGILState_Check();
  CachedStack* c = nullptr;
  if (unlocked) {
    key.resize(python_frames(ts, key.data(), key.size()));
    if (key.empty()) return kNoStack;
    const uint64_t gen = stacks().generation.load(std::memory_order_acquire);
    c = &cache_slot(key);
    if (c->gen == gen && c->id >= 0 && StackEq{}(key, c->key)) {
      tls_capture_gen = gen;
      return c->id;
    }
  }
  PyGILState_STATE g = PyGILState_Ensure();
  if (!unlocked) key.resize(python_frames(ts, key.data(), key.size()));
  const int32_t id = key.empty() ? kNoStack : capture_stack_locked(key);
  PyGILState_Release(g);
  if (id >= 0) {
    if (c == nullptr) c = &cache_slot(key);
    c->gen = tls_capture_gen;
    c->id = id;
    c->key = key;
  }
  return id;
}
// The table's id of `key` (the thread's frames, read), added if new; the caller holds the GIL.
int32_t capture_stack_locked(const std::vector<StackFrameRef>& key) {
  Stacks& st = stacks();
  std::lock_guard<std::mutex> lock(st.mu);
  tls_capture_gen = st.generation.load(std::memory_order_relaxed);  // clears bump it under this lock
  auto it = st.ids.find(key);
  int32_t id;
  if (it != st.ids.end()) {
    id = it->second;
  } else {
    if (st.by_id.size() >= kMaxStacks) return kStackTableFull;
    for (const auto& fr : key) Py_INCREF(reinterpret_cast<PyObject*>(fr.code));
    id = static_cast<int32_t>(st.by_id.size());
    auto ins = st.ids.emplace(key, id);
    st.by_id.push_back(&ins.first->first);
    st.count.store(st.by_id.size(), std::memory_order_relaxed);
  }
  return id;
}

// The caller holds the GIL; the snapshot holds its own references (release_stacks drops them), so a
// concurrent clear_stacks() cannot free a code object it still reads.
std::vector<std::vector<StackFrameRef>> stacks_snapshot() {
  Stacks& st = stacks();
  std::lock_guard<std::mutex> lock(st.mu);
  std::vector<std::vector<StackFrameRef>> out;
  out.reserve(st.by_id.size());
  for (const auto* k : st.by_id) {
    out.push_back(*k);
    for (const auto& fr : *k) Py_INCREF(reinterpret_cast<PyObject*>(fr.code));
  }
  return out;
}
void release_stacks(std::vector<std::vector<StackFrameRef>>& snap) {
  for (const auto& v : snap)
    for (const auto& fr : v) Py_DECREF(reinterpret_cast<PyObject*>(fr.code));
  snap.clear();
}

// Drops every interned stack (and its code references). Needs the GIL; events still in the ring would
// point at nothing, so it is only called with the ring empty.
bool clear_stacks() {
  // Ids are reused after a clear: a launch still queued would run (and record its event, or fail) with an id
  // naming another stack. The table then stays (a later clear empties it); a pending asynchronous error keeps
  // its frames.
  if (!all_queues_idle()) return false;
  resolve_pending_error_sites();
  Stacks& st = stacks();
  std::vector<std::vector<StackFrameRef>> old;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    for (const auto* k : st.by_id) old.push_back(*k);
    st.by_id.clear();
    st.ids.clear();
    st.count.store(0, std::memory_order_relaxed);
    st.generation.fetch_add(1, std::memory_order_acq_rel);
  }
  if (old.empty() || !Py_IsInitialized() || python_finalizing()) return true;
  PyGILState_STATE g = PyGILState_Ensure();
  for (const auto& v : old)
    for (const auto& fr : v) Py_DECREF(reinterpret_cast<PyObject*>(fr.code));
  PyGILState_Release(g);
  return true;
}

bool take_pending_signature(int32_t name_id, int32_t* shapes_id, int32_t* dtypes_id) {
  if (tls_pending_signatures.empty()) return false;
  const std::string prefix = string_of(name_id) + "(";
  for (size_t i = tls_pending_signatures.size(); i-- > 0;) {
    const std::string& desc = tls_pending_signatures[i];
    if (desc.compare(0, prefix.size(), prefix) != 0) continue;
    std::string shapes, dtypes;
    split_signature(desc, shapes, dtypes);
    *shapes_id = intern_string(shapes);
    *dtypes_id = intern_string(dtypes);
    tls_pending_signatures.erase(tls_pending_signatures.begin() + static_cast<std::ptrdiff_t>(i));
    return true;
  }
  return false;
}

uint32_t thread_hash() { return this_thread_hash(); }

void push_event(EventRecord ev) {
  if (ev.new_signature && !tls_pending_signatures.empty()) {
    // The signature's shapes and dtypes, even without record_shapes: a signature *is* op + shapes + dtypes.
    int32_t sh = -1, dt = -1;
    if (take_pending_signature(ev.name_id, &sh, &dt) && ev.shapes_id < 0 && ev.dtypes_id < 0) {
      ev.shapes_id = sh;
      ev.dtypes_id = dt;
    }
  }
  const uint32_t flags = g_recording_flags.load(std::memory_order_relaxed);
  if (!(flags & kRecorderBit)) {
    if (flags & kKinetoBit) kineto_capture(ev, kineto_correlation());
    return;
  }
  push_event_from(ev, this_thread_hash(), rec().with_stack ? capture_stack() : kNoStack,
                  (flags & kKinetoBit) ? kineto_correlation() : 0);
}

void push_event_from(EventRecord ev, uint32_t thread, int32_t stack, uint64_t kineto_corr) {
  const uint32_t flags = g_recording_flags.load(std::memory_order_relaxed);
  if (flags & kKinetoBit) kineto_capture(ev, kineto_corr);
  if (!(flags & kRecorderBit)) return;
  Recorder& r = rec();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!(g_recording_flags.load(std::memory_order_relaxed) & kRecorderBit)) return;
  size_t idx;
  if (r.size < r.capacity) {
    idx = r.size;
  } else if (r.capacity > r.keep_first) {
    idx = r.keep_first + r.ring_pos;
    r.note_dropped(r.at(idx).ev);
  } else {  // everything pinned: the new event is the one dropped
    r.note_dropped(ev);
    r.seq++;
    return;
  }
  RecorderSlot* s = nullptr;
  try {
    s = r.slot(idx);
  } catch (const std::bad_alloc&) {
    s = nullptr;
  }
  if (s == nullptr) {  // out of memory for a new chunk: drop this event, never fail the op
    r.note_dropped(ev);
    r.seq++;
    return;
  }
  s->ev = ev;
  s->seq = r.seq++;
  s->thread = thread;
  s->stack = stack;
  if (r.size < r.capacity) {
    r.size++;
  } else {
    r.ring_pos = (r.ring_pos + 1) % (r.capacity - r.keep_first);
  }
}

std::vector<SiteFrame> stack_frames(int32_t id) {
  std::vector<SiteFrame> out;
  if (id < 0 || !Py_IsInitialized() || python_finalizing()) return out;
  PyGILState_STATE g = PyGILState_Ensure();
  {
    Stacks& st = stacks();
    std::lock_guard<std::mutex> lock(st.mu);
    if (id < static_cast<int32_t>(st.by_id.size())) {
      for (const StackFrameRef& fr : *st.by_id[id]) {
        auto* code = reinterpret_cast<PyCodeObject*>(fr.code);
        const char* file = PyUnicode_AsUTF8(code->co_filename);
        const char* name = PyUnicode_AsUTF8(code->co_name);
        out.push_back({file ? file : "?", PyCode_Addr2Line(code, fr.lasti), name ? name : "?", code->co_firstlineno});
      }
    }
  }
  if (PyErr_Occurred()) PyErr_Clear();
  PyGILState_Release(g);
  return out;
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
  std::string desc;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.seen.size() <= static_cast<size_t>(device)) {
      s.seen.resize(device + 1);
      s.described.resize(device + 1);
    }
    if (!s.seen[device].insert(hash).second) return false;
    desc = describe();
    s.described[device].push_back(desc);
  }
  if (recording()) {  // push_event attaches its shapes/dtypes to the kernel event
    if (tls_pending_signatures.size() >= 8) tls_pending_signatures.erase(tls_pending_signatures.begin());
    tls_pending_signatures.push_back(std::move(desc));
  }
  return true;
}

// ---- control, used by bindings.cpp ----
size_t recorder_slot_bytes() { return sizeof(RecorderSlot); }

void recorder_start(size_t capacity, bool record_shapes, bool with_stack, size_t keep_first) {
  TORCH_CHECK_VALUE(capacity >= 1, "recorder capacity must be >= 1, got ", capacity);
  TORCH_CHECK_VALUE(keep_first <= capacity, "recorder keep_first must be between 0 and the capacity (",
                    capacity, "), got ", keep_first);
  // Half of the memory available now, at most: the rest is the program's.
  const int64_t avail = available_memory_bytes();
  if (avail > 0) {
    const size_t max_events = static_cast<size_t>(avail / 2) / sizeof(RecorderSlot);
    TORCH_CHECK_VALUE(capacity <= max_events, "recorder capacity ", capacity, " events would need ",
                      gib(static_cast<double>(capacity) * sizeof(RecorderSlot)), " (",
                      sizeof(RecorderSlot), " bytes per event) but ", gib(static_cast<double>(avail)),
                      " of memory is available; allowed range: 1 to ", max_events,
                      " events (half the available memory)");
  }
  Recorder& r = rec();
  bool emptied = false;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (capacity != r.capacity || keep_first != r.keep_first) {
      r.chunks.clear();
      r.chunks.shrink_to_fit();
      r.capacity = capacity;
      r.keep_first = keep_first;
      r.reset_events();
      emptied = true;
    }
    emptied = emptied || r.size == 0;
    r.record_shapes = record_shapes;
    r.with_stack = with_stack;
  }
  if (emptied) clear_stacks();
  g_recording_flags.fetch_or(kRecorderBit);
}
void recorder_stop() { g_recording_flags.fetch_and(~kRecorderBit); }
void recorder_clear() {
  Recorder& r = rec();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    r.reset_events();
    if (r.chunks.size() > kKeptChunks) {
      r.chunks.resize(kKeptChunks);
      r.chunks.shrink_to_fit();
    }
  }
  clear_stacks();
}
// The interned stacks hold their code objects (a key's pointers stay valid), and the code Dynamo runs for a
// compiled frame holds the compiled function: after torch._dynamo.reset(), a graph whose kernels had launched
// stayed alive through its frame's stack (0.24 MB and ~380 Python objects per compile and reset). Called after
// a reset (the queues drained): with no recorded event left, none points at a stack, and the table empties.
bool release_stacks_if_unreferenced() {
  {
    Recorder& r = rec();
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.size != 0) return false;
  }
  return clear_stacks();
}
void maybe_auto_clear_stacks(bool at_sync) {
  Stacks& st = stacks();
  std::atomic<size_t>& next = st.next_auto_clear[at_sync ? 1 : 0];
  const size_t n = st.count.load(std::memory_order_relaxed);
  if (n < next.load(std::memory_order_relaxed)) return;
  // Busy queues are the usual refusal at a launch (the previous launch still queued) and pass: the next launch
  // looks again (a lock-free look). A back-off here would make a program that launches twice per step try
  // only at its second launch, every time, and never clear.
  if (!queues_look_idle()) return;
  st.auto_clear_tries.fetch_add(1, std::memory_order_relaxed);
  bool cleared = false;
  // The other refusals, without the GIL; a sync inside an op runs without it (torch drops it before
  // dispatch): taken for the clear only, as capture_stack does.
  // (clear_stacks checks the queues under their locks)
  if (g_recording_flags.load() == 0 && Py_IsInitialized() && !python_finalizing() &&
      PyGILState_GetThisThreadState() != nullptr) {
    struct Gil {
      PyGILState_STATE g = PyGILState_Ensure();
      ~Gil() { PyGILState_Release(g); }
    } gil;
    cleared = g_recording_flags.load() == 0 && release_stacks_if_unreferenced();
  }
  if (cleared) {
    for (auto& a : st.next_auto_clear) a.store(kAutoClearStacks, std::memory_order_relaxed);
    st.auto_clears.fetch_add(1, std::memory_order_relaxed);
  } else {
    next.store(n + kAutoClearRetry, std::memory_order_relaxed);
  }
}
uint64_t stack_generation() { return stacks().generation.load(std::memory_order_acquire); }
uint64_t last_capture_generation() { return tls_capture_gen; }
StackTableStats stack_table_stats() {
  Stacks& st = stacks();
  return {st.count.load(), st.auto_clears.load(), st.auto_clear_tries.load()};
}
uint64_t recorder_dropped() { return rec().dropped; }
std::pair<int64_t, int64_t> recorder_dropped_window() {
  Recorder& r = rec();
  std::lock_guard<std::mutex> lock(r.mu);
  return {r.dropped_first_ns, r.dropped_last_ns};
}
size_t recorder_keep_first() { return rec().keep_first; }

// Copies the buffer in order (oldest first: the pinned head, then the ring from its oldest entry).
std::vector<RecorderSlot> recorder_copy() {
  drain_all();  // kernels still queued push their events when they run
  Recorder& r = rec();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<RecorderSlot> out;
  out.reserve(r.size);
  const size_t head = std::min(r.size, r.keep_first);
  for (size_t i = 0; i < head; ++i) out.push_back(r.at(i));
  if (r.size < r.capacity) {
    for (size_t i = head; i < r.size; ++i) out.push_back(r.at(i));
  } else {
    for (size_t i = r.keep_first + r.ring_pos; i < r.capacity; ++i) out.push_back(r.at(i));
    for (size_t i = r.keep_first; i < r.keep_first + r.ring_pos; ++i) out.push_back(r.at(i));
  }
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
