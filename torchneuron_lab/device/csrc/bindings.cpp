// Python bindings of the runtime (the `_C` module). Every entry point converts C++ errors into
// Python exceptions through pybind11/torch's translation; none of them can abort the interpreter.
#include "neuron.h"

#include <torch/csrc/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <thread>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>

// From libtorch_python (torch/csrc/profiler/python/combined_traceback.h, whose header needs a JSON
// library torch does not ship): turns captured tracebacks into lists of {filename, line, name}.
namespace torch {
TORCH_API std::vector<pybind11::object> py_symbolize(std::vector<CapturedTraceback*>& to_symbolize);
TORCH_PYTHON_API void installCapturedTracebackPython();
}  // namespace torch

namespace tnl {

// defined in allocator.cpp / recorder.cpp (same translation unit)
py::dict stats_dict(int device);

namespace {

std::shared_ptr<c10::GatheredContext> gather_python_context() {
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
}

py::list symbolize_all(const std::vector<std::shared_ptr<c10::GatheredContext>>& ctxs) {
  std::vector<torch::CapturedTraceback*> tbs;
  std::vector<int> index(ctxs.size(), -1);
  for (size_t i = 0; i < ctxs.size(); ++i) {
    auto* tb = dynamic_cast<torch::CapturedTraceback*>(ctxs[i].get());
    if (tb != nullptr) {
      index[i] = static_cast<int>(tbs.size());
      tbs.push_back(tb);
    }
  }
  std::vector<py::object> frames;
  if (!tbs.empty()) {
    try {
      frames = torch::py_symbolize(tbs);
    } catch (const std::exception&) {
      // PyTorch's symbolizer refuses a whole batch when one frame's file or function name is not valid UTF-8
      // (a lone surrogate: a file name with undecodable bytes); torch.cuda's snapshot raises then. Here only
      // the stacks holding such a frame lose their frames, to one that says why.
      if (PyErr_Occurred()) PyErr_Clear();
      frames.clear();
      for (auto* tb : tbs) {
        std::vector<torch::CapturedTraceback*> one{tb};
        try {
          frames.push_back(torch::py_symbolize(one)[0]);
        } catch (const std::exception&) {
          if (PyErr_Occurred()) PyErr_Clear();
          py::dict fr;
          fr["filename"] = "<a frame's file or function name is not valid UTF-8: this stack cannot be shown>";
          fr["line"] = 0;
          fr["name"] = "?";
          py::list only;
          only.append(fr);
          frames.push_back(only);
        }
      }
    }
  }
  py::list out;
  for (size_t i = 0; i < ctxs.size(); ++i) {
    if (index[i] < 0) out.append(py::list());
    else out.append(frames[index[i]]);
  }
  return out;
}

const char* engine_name(Engine e) {
  switch (e) {
    case Engine::Tensor: return "tensor";
    case Engine::Vector: return "vector";
    case Engine::Scalar: return "scalar";
    case Engine::GpSimd: return "gpsimd";
    case Engine::Dma: return "dma";
    default: return "host";
  }
}
const char* kind_name(EventKind k) {
  switch (k) {
    case EventKind::Kernel: return "kernel";
    case EventKind::Dma: return "dma";
    case EventKind::Sync: return "sync";
    default: return "marker";
  }
}
const char* direction_name(Direction d) {
  switch (d) {
    case Direction::H2D: return "h2d";
    case Direction::D2H: return "d2h";
    case Direction::D2D: return "d2d";
    default: return "";
  }
}
Engine engine_from(const std::string& s) {
  if (s == "tensor") return Engine::Tensor;
  if (s == "vector") return Engine::Vector;
  if (s == "scalar") return Engine::Scalar;
  if (s == "gpsimd") return Engine::GpSimd;
  if (s == "dma") return Engine::Dma;
  if (s == "host") return Engine::Host;
  TORCH_CHECK_VALUE(false, "unknown engine '", s, "'; expected tensor, vector, scalar, gpsimd, dma or host");
}
EventKind kind_from(const std::string& s) {
  if (s == "kernel") return EventKind::Kernel;
  if (s == "dma") return EventKind::Dma;
  if (s == "sync") return EventKind::Sync;
  if (s == "marker") return EventKind::Marker;
  TORCH_CHECK_VALUE(false, "unknown event kind '", s, "'; expected kernel, dma, sync or marker");
}

// Line numbers of one code object's instructions. PyCode_Addr2Line scans the code's line table from its start
// on every call, so a large function (a generated FX forward of 10,000 lines) launching from many of its lines
// cost time quadratic in its size; from a code object's second distinct instruction on, its table is read once
// (co_lines(): (start, end, line) ranges of byte offsets, in order) and searched.
class LineTable {
 public:
  int line(PyCodeObject* code, int lasti) {
    if (lasti < 0 || (!built_ && ++lookups_ < 2)) return PyCode_Addr2Line(code, lasti);
    if (!built_) build(code);
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), lasti,
                               [](int x, const Range& r) { return x < r.start; });
    if (it != ranges_.begin() && lasti < (it - 1)->end) return (it - 1)->line;
    return PyCode_Addr2Line(code, lasti);  // outside every range (not expected): CPython's own answer
  }

 private:
  struct Range {
    int start, end, line;
  };
  void build(PyCodeObject* code) {
    built_ = true;
    try {
      py::object lines = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(code)).attr("co_lines")();
      for (py::handle item : lines) {
        auto t = py::reinterpret_borrow<py::tuple>(item);
        const int start = t[0].cast<int>(), end = t[1].cast<int>();
        const int line = t[2].is_none() ? -1 : t[2].cast<int>();
        if (end > start) ranges_.push_back({start, end, line});
      }
    } catch (const std::exception&) {  // no co_lines: every lookup is CPython's
      if (PyErr_Occurred()) PyErr_Clear();
      ranges_.clear();
    }
  }
  std::vector<Range> ranges_;
  int lookups_ = 0;
  bool built_ = false;
};

// Interned stacks symbolized once each: list by stack id of [(filename, line, name), ...] innermost last.
// Frames shared by several stacks are built once.
py::list recorder_stacks_py() {
  std::vector<std::vector<StackFrameRef>> all = stacks_snapshot();
  std::unordered_map<const void*, std::unordered_map<int, py::object>> frames;
  std::unordered_map<const void*, LineTable> tables;
  py::list out;
  for (const auto& st : all) {
    py::list fl(st.size());
    for (size_t i = 0; i < st.size(); ++i) {
      const StackFrameRef& fr = st[i];
      py::object& slot = frames[fr.code][fr.lasti];
      if (!slot) {
        auto* code = reinterpret_cast<PyCodeObject*>(fr.code);
        const int line = tables[fr.code].line(code, fr.lasti);
        slot = py::make_tuple(py::reinterpret_borrow<py::object>(code->co_filename), line,
                              py::reinterpret_borrow<py::object>(code->co_name));
      }
      fl[st.size() - 1 - i] = slot;  // innermost last
    }
    out.append(fl);
  }
  release_stacks(all);
  return out;
}

template <typename T, typename F>
py::bytes column(const std::vector<RecorderSlot>& slots, F get) {
  PyObject* o = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(slots.size() * sizeof(T)));
  if (o == nullptr) throw py::error_already_set();
  T* p = reinterpret_cast<T*>(PyBytes_AS_STRING(o));
  for (size_t i = 0; i < slots.size(); ++i) p[i] = static_cast<T>(get(slots[i]));
  return py::reinterpret_steal<py::bytes>(o);
}

// The recorder's contents as columns of packed little-endian arrays (bytes; numpy.frombuffer reads them
// without a copy) plus the tables their ids index: `strings` (name/shapes/dtypes ids), `stacks` (stack
// ids, -1: none), `kinds`, `engines`, `directions`. Nothing is materialised per event here.
py::dict recorder_read_columns_py() {
  std::vector<RecorderSlot> slots = recorder_copy();
  py::dict d;
  d["n"] = slots.size();
  d["seq"] = column<int64_t>(slots, [](const RecorderSlot& s) { return s.seq; });
  d["kind"] = column<uint8_t>(slots, [](const RecorderSlot& s) { return s.ev.kind; });
  d["engine"] = column<uint8_t>(slots, [](const RecorderSlot& s) { return s.ev.engine; });
  d["direction"] = column<uint8_t>(slots, [](const RecorderSlot& s) { return s.ev.direction; });
  d["new_signature"] = column<uint8_t>(slots, [](const RecorderSlot& s) { return s.ev.new_signature; });
  d["device"] = column<int8_t>(slots, [](const RecorderSlot& s) { return s.ev.device; });
  d["name"] = column<int32_t>(slots, [](const RecorderSlot& s) { return s.ev.name_id; });
  d["shapes"] = column<int32_t>(slots, [](const RecorderSlot& s) { return s.ev.shapes_id; });
  d["dtypes"] = column<int32_t>(slots, [](const RecorderSlot& s) { return s.ev.dtypes_id; });
  d["subgraph"] = column<int32_t>(slots, [](const RecorderSlot& s) { return s.ev.subgraph; });
  d["start_ns"] = column<int64_t>(slots, [](const RecorderSlot& s) { return s.ev.start_ns; });
  d["end_ns"] = column<int64_t>(slots, [](const RecorderSlot& s) { return s.ev.end_ns; });
  d["bytes_read"] = column<int64_t>(slots, [](const RecorderSlot& s) { return s.ev.bytes_read; });
  d["bytes_written"] = column<int64_t>(slots, [](const RecorderSlot& s) { return s.ev.bytes_written; });
  d["flops"] = column<int64_t>(slots, [](const RecorderSlot& s) { return s.ev.flops; });
  d["thread"] = column<int64_t>(slots, [](const RecorderSlot& s) { return s.thread; });
  d["stack"] = column<int32_t>(slots, [](const RecorderSlot& s) { return s.stack; });
  d["stream"] = column<int32_t>(slots, [](const RecorderSlot& s) { return s.ev.stream; });
  d["host_start_ns"] = column<int64_t>(slots, [](const RecorderSlot& s) { return s.ev.host_start_ns; });
  d["host_end_ns"] = column<int64_t>(slots, [](const RecorderSlot& s) { return s.ev.host_end_ns; });
  d["correlation"] = column<int64_t>(slots, [](const RecorderSlot& s) { return s.ev.correlation; });
  d["strings"] = strings_snapshot();
  d["stacks"] = recorder_stacks_py();
  py::list kinds, engines, directions;
  for (int k = 0; k <= static_cast<int>(EventKind::Marker); ++k) kinds.append(kind_name(static_cast<EventKind>(k)));
  for (int e = 0; e <= static_cast<int>(Engine::Host); ++e) engines.append(engine_name(static_cast<Engine>(e)));
  for (int x = 0; x <= static_cast<int>(Direction::D2D); ++x)
    directions.append(direction_name(static_cast<Direction>(x)));
  d["kinds"] = kinds; d["engines"] = engines; d["directions"] = directions;
  const auto window = recorder_dropped_window();
  d["dropped"] = recorder_dropped();
  d["dropped_first_ns"] = window.first;
  d["dropped_last_ns"] = window.second;
  return d;
}

// The same contents as Python lists per column (notes/api.md), stacks as lists of {filename, line, name}.
py::dict recorder_read_py() {
  std::vector<RecorderSlot> slots = recorder_copy();
  const std::vector<std::string> names = strings_snapshot();
  auto str = [&](int32_t id) -> const std::string& {
    static const std::string empty;
    return id >= 0 && id < static_cast<int32_t>(names.size()) ? names[id] : empty;
  };
  py::list stack_table = recorder_stacks_py();
  std::vector<py::list> stack_dicts;
  for (py::handle fl : stack_table) {
    py::list frames;
    for (py::handle fr : fl) {
      py::tuple t = py::reinterpret_borrow<py::tuple>(fr);
      py::dict f;
      f["filename"] = t[0]; f["line"] = t[1]; f["name"] = t[2];
      frames.append(f);
    }
    stack_dicts.push_back(frames);
  }
  py::list seq, kind, name, device, engine, start, end, br, bw, flops, newsig, shapes, dtypes, direction, subgraph,
      thread, stack, stream, host_start, host_end, correlation;
  for (const RecorderSlot& s : slots) {
    stream.append(s.ev.stream);
    host_start.append(s.ev.host_start_ns);
    host_end.append(s.ev.host_end_ns);
    correlation.append(s.ev.correlation);
    seq.append(s.seq);
    kind.append(kind_name(s.ev.kind));
    name.append(str(s.ev.name_id));
    device.append(static_cast<int>(s.ev.device));
    engine.append(engine_name(s.ev.engine));
    start.append(s.ev.start_ns);
    end.append(s.ev.end_ns);
    br.append(s.ev.bytes_read);
    bw.append(s.ev.bytes_written);
    flops.append(s.ev.flops);
    newsig.append(s.ev.new_signature);
    shapes.append(str(s.ev.shapes_id));
    dtypes.append(str(s.ev.dtypes_id));
    direction.append(direction_name(s.ev.direction));
    subgraph.append(s.ev.subgraph);
    thread.append(s.thread);
    if (s.stack >= 0 && s.stack < static_cast<int32_t>(stack_dicts.size()))
      stack.append(py::reinterpret_steal<py::list>(PySequence_List(stack_dicts[s.stack].ptr())));
    else
      stack.append(py::list());
  }
  py::dict d;
  d["seq"] = seq; d["kind"] = kind; d["name"] = name; d["device"] = device; d["engine"] = engine;
  d["start_ns"] = start; d["end_ns"] = end; d["bytes_read"] = br; d["bytes_written"] = bw; d["flops"] = flops;
  d["new_signature"] = newsig; d["shapes"] = shapes; d["dtypes"] = dtypes; d["direction"] = direction;
  d["subgraph"] = subgraph; d["thread"] = thread; d["stack"] = stack;
  d["stream"] = stream; d["host_start_ns"] = host_start; d["host_end_ns"] = host_end;
  d["correlation"] = correlation;
  return d;
}

py::dict snapshot_py() {
  py::list segments;
  py::list traces;
  for (int d = 0; d < device_count(); ++d) {
    DeviceAllocator* a = peek_device(d);
    py::list trace_list;
    if (a == nullptr) {
      traces.append(trace_list);
      continue;
    }
    auto segs = a->segments_view();
    std::vector<std::shared_ptr<c10::GatheredContext>> ctxs;
    for (auto& s : segs) for (auto& b : s.blocks) ctxs.push_back(b.ctx);
    py::list frames = symbolize_all(ctxs);
    size_t k = 0;
    for (auto& s : segs) {
      py::dict seg;
      int64_t allocated = 0, active = 0, requested = 0;
      py::list blocks;
      for (auto& b : s.blocks) {
        py::dict bd;
        bd["address"] = b.address;
        bd["size"] = b.size;
        bd["requested_size"] = b.allocated ? b.requested : 0;
        // torch.cuda's states: a freed block still used by another stream's queued work is pending free
        bd["state"] = b.allocated ? "active_allocated" : b.pending_free ? "active_pending_free" : "inactive";
        bd["frames"] = frames[k++];
        blocks.append(bd);
        if (b.allocated) {
          allocated += b.size;
          requested += b.requested;
        }
        if (b.allocated || b.pending_free) active += b.size;
      }
      seg["device"] = d;
      seg["address"] = s.address;
      seg["total_size"] = s.total;
      seg["allocated_size"] = allocated;
      seg["active_size"] = active;
      seg["requested_size"] = requested;
      seg["stream"] = s.stream;
      seg["segment_type"] = s.small ? "small" : "large";
      seg["segment_pool_id"] = py::make_tuple(0, 0);
      seg["is_expandable"] = false;
      seg["frames"] = py::list();
      seg["blocks"] = blocks;
      segments.append(seg);
    }
    auto entries = a->trace_view();
    std::vector<std::shared_ptr<c10::GatheredContext>> tctx;
    for (auto& e : entries) tctx.push_back(e.context);
    py::list tframes = symbolize_all(tctx);
    for (size_t i = 0; i < entries.size(); ++i) {
      py::dict e;
      e["action"] = entries[i].action;
      if (entries[i].action == "oom") e["device_free"] = entries[i].addr;  // torch.cuda's field for OOMs
      else e["addr"] = entries[i].addr;
      e["size"] = entries[i].size;
      e["stream"] = 0;
      e["time_us"] = entries[i].time_us;
      e["frames"] = tframes[i];
      trace_list.append(e);
    }
    traces.append(trace_list);
  }
  py::dict out;
  out["segments"] = segments;
  out["device_traces"] = traces;
  py::dict settings;
  settings["PYTORCH_NEURON_ALLOC_CONF"] = "";
  settings["max_split_size"] = -1;
  settings["garbage_collection_threshold"] = 0.0;
  settings["expandable_segments"] = false;
  settings["pinned_num_register_threads"] = 1;
  settings["release_lock_on_malloc"] = false;
  settings["pinned_use_host_register"] = false;
  settings["roundup_power2_divisions"] = py::dict();
  out["allocator_settings"] = settings;
  return out;
}

py::object last_oom_py(int device) {
  DeviceAllocator* a = peek_device(device);
  if (a == nullptr) return py::none();
  OomInfo o = a->last_oom();
  if (!o.valid) return py::none();
  py::dict d;
  d["device"] = device;
  d["requested"] = o.requested;
  d["allocated"] = o.allocated;
  d["reserved"] = o.reserved;
  d["capacity"] = o.capacity;
  d["largest_free_block"] = o.largest_free_block;
  d["limit"] = o.limit;
  d["segment"] = o.segment;
  d["stream"] = o.stream;
  d["pool"] = o.small ? "small" : "large";
  d["largest_usable"] = o.largest_usable;
  d["largest_other_stream"] = o.largest_other_stream;
  d["largest_other_pool"] = o.largest_other_pool;
  d["time_ns"] = o.time_ns;
  d["message"] = o.message;
  d["frames"] = symbolize_all({o.context})[0];
  return d;
}

}  // namespace

template <typename S>  // the allocator's Stat and c10's (pinned memory)
py::dict stat_py(const S& s) {
  py::dict d;
  d["current"] = s.current;
  d["peak"] = s.peak;
  d["allocated"] = s.allocated;
  d["freed"] = s.freed;
  return d;
}

py::dict stats_dict(int device) {
  check_device_index(device);
  DeviceStats st;
  if (DeviceAllocator* a = peek_device(device)) a->stats_into(st);
  auto arr = [](const StatArray& a) {
    py::dict d;
    d["all"] = stat_py(a[kAll]);
    d["small_pool"] = stat_py(a[kSmallPool]);
    d["large_pool"] = stat_py(a[kLargePool]);
    return d;
  };
  py::dict r;
  r["allocation"] = arr(st.allocation);
  r["segment"] = arr(st.segment);
  r["active"] = arr(st.active);
  r["inactive_split"] = arr(st.inactive_split);
  r["allocated_bytes"] = arr(st.allocated_bytes);
  r["reserved_bytes"] = arr(st.reserved_bytes);
  r["active_bytes"] = arr(st.active_bytes);
  r["inactive_split_bytes"] = arr(st.inactive_split_bytes);
  r["requested_bytes"] = arr(st.requested_bytes);
  r["num_alloc_retries"] = st.num_alloc_retries;
  r["num_ooms"] = st.num_ooms;
  r["num_sync_all_streams"] = st.num_sync_all_streams;
  r["num_device_alloc"] = st.num_device_alloc;
  r["num_device_free"] = st.num_device_free;
  r["max_split_size"] = -1;
  r["oversize_allocations"] = stat_py(st.oversize_allocations);
  r["oversize_segments"] = stat_py(st.oversize_segments);
  return r;
}

// Converts the result of host code (a tensor, or a list/tuple of them) back to neuron tensors.
py::object results_back(HostCall& call, const py::object& result) {
  auto convert = [&](py::handle h) -> py::object {
    if (THPVariable_Check(h.ptr())) return py::cast(call.out(THPVariable_Unpack(h.ptr())));
    return py::reinterpret_borrow<py::object>(h);
  };
  if (py::isinstance<py::list>(result) || py::isinstance<py::tuple>(result)) {
    py::list out(py::len(result));
    size_t i = 0;
    for (py::handle h : result) out[i++] = convert(h);
    return py::object(out);
  }
  return convert(result);
}

struct HostPlan {
  explicit HostPlan(int device) : device(device) { check_device_index(device); }
  int device;
  // per argument position, the two most recent CPU aliases (Python tensors), newest first: a training
  // loop's `loss = step()` keeps the previous step's saved tensors alive while the next forward runs,
  // so activations alternate between two blocks of the caching allocator
  std::vector<std::array<py::object, 2>> aliases;
  int64_t reused = 0, made = 0;

  // an alias nothing but this plan references (not kept by the graph from an earlier call)
  static at::Tensor unheld(const py::object& o) {
    if (!o || Py_REFCNT(o.ptr()) != 1) return at::Tensor();
    at::Tensor a = THPVariable_Unpack(o.ptr());
    return a.use_count() == 2 ? a : at::Tensor();  // the Python object's reference and this one
  }

  py::object run(py::function fn, py::list args) {
    HostCall call(device);
    const size_t n = py::len(args);
    if (aliases.size() < n) aliases.resize(n);
    py::list cpu_args(n);
    for (size_t i = 0; i < n; ++i) {
      py::handle h = args[i];
      if (!THPVariable_Check(h.ptr()) || THPVariable_Unpack(h.ptr()).device().type() != kNeuron) {
        cpu_args[i] = h;
        continue;
      }
      const at::Tensor& t = THPVariable_Unpack(h.ptr());
      auto& slot = aliases[i];
      at::Tensor prev;
      size_t hit = 2;
      for (size_t k = 0; k < 2 && hit == 2; ++k) {
        at::Tensor cand = unheld(slot[k]);
        if (alias_matches(t, cand)) {
          prev = std::move(cand);
          hit = k;
        }
      }
      at::Tensor a = call.in_reusing(t, prev);
      if (hit < 2) {
        ++reused;
        if (hit == 1) std::swap(slot[0], slot[1]);
      } else {
        ++made;
        slot[1] = std::move(slot[0]);
        slot[0] = py::cast(a);
      }
      cpu_args[i] = slot[0];
    }
    py::object result;
    {
      RedirectGuard redirect(device);
      result = fn(cpu_args);
    }
    return results_back(call, result);
  }
};

void init_graph_bindings(py::module& m);  // graphs.cpp
void init_collective_bindings(py::module& m);  // collectives.cpp

void init_module(py::module& m) {
  init_graph_bindings(m);
  init_collective_bindings(m);
  torch::installCapturedTracebackPython();
  install_hooks();
  install_redirect_cpu_allocator();
  install_profiler_stubs();
  install_backend_meta_serialization();
  // Before any op's metadata is built (routing below builds it): which ops CUDA registers with a device check.
  try {
    const std::string yaml = py::str(py::module_::import("torchneuron_lab.device._backend").attr("_native_functions_yaml")());
    if (!yaml.empty()) set_native_functions_yaml(yaml);
  } catch (const std::exception& e) {
    PyErr_Clear();
  }
  const int routed = route_composites_to_fallback();
  m.attr("routed_composite_ops") = routed;
  m.attr("foreach_launch_ops") = route_foreach_to_launch();
  // At exit (neuron_module._release_autograd_device_threads): a backward on `device` from C++ tensors (no
  // Python objects anywhere in its graph task), twice. Autograd's device thread is one thread: the task it was
  // running when a backward failed (holding that graph task) ends before this one's runs. Tasks of the failed
  // graph still queued have older sequence numbers, so they run (are skipped) after these; the pause lets the
  // thread drain them while Python can still take the GIL. Grad mode on, inference mode off: a script that
  // turned grad off globally would give `x * 1` no graph.
  m.def("release_autograd_device_thread", [](int device) {
    check_device_index(device);
    py::gil_scoped_release no_gil;
    at::AutoGradMode grad(true);
    c10::InferenceMode no_inference(false);
    for (int i = 0; i < 2; ++i) {
      at::Tensor x = at::zeros({}, at::TensorOptions().device(c10::Device(kNeuron, device))).requires_grad_(true);
      torch::autograd::backward({x.mul(1)});
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  m.def("plan_check_waits", [] {
    const auto [n, ns] = plan_check_waits();
    return py::make_tuple(n, ns);
  });
  m.def("launch_path_counts", [] {
    py::dict d;
    for (const auto& [k, v] : launch_path_counts()) d[py::str(k)] = v;
    return d;
  });

  m.def("set_spin_throttle", &set_spin_throttle, py::arg("mode"));
  m.def("spin_throttle_stats", [] {
    const SpinThrottleStats st = spin_throttle_stats();
    py::dict d;
    d["mode"] = st.mode;
    d["wants"] = st.wants;
    d["held"] = st.held;
    d["engaged"] = st.engaged;
    d["released"] = st.released;
    d["windows"] = st.windows;
    d["windows_starved"] = st.windows_starved;
    d["windows_ahead"] = st.windows_ahead;
    d["windows_host_blocked"] = st.windows_host_blocked;
    d["pools_spread"] = st.pools_spread;
    d["spread"] = st.spread;
    d["spread_last"] = py::make_tuple(st.spread_worker_cpu, st.spread_helper_cpu);
    return d;
  });
  m.def("set_pool_spread", &set_pool_spread, py::arg("on"));
  m.def("spread_thread_pool", &spread_thread_pool, py::call_guard<py::gil_scoped_release>());

  m.def("configure", &configure, py::arg("num_devices"), py::arg("hbm_bytes"));
  m.def("runtime_started", &runtime_started);
  m.def("init", &init_devices);
  m.def("in_bad_fork", &in_bad_fork);
  m.def("device_count", &device_count);
  m.def("current_device", &current_device);
  m.def("set_device", [](int d) { set_current_device(d); });
  // Asynchronous execution (queue.cpp). Waits release the GIL themselves.
  m.def("synchronize", [](int d) {
    check_device_index(d);
    synchronize_device(d, "sync: torch.neuron.synchronize()");
  });
  m.def("synchronize_stream", [](int d, int s) {
    warn_or_error_on_sync("sync: Stream.synchronize()");
    synchronize_stream(d, s, "sync: Stream.synchronize()");
  });
  m.def("sync_debug_mode", &sync_debug_mode);
  m.def("set_sync_debug_mode", &set_sync_debug_mode);
  m.def("launch_blocking", &launch_blocking);
  m.def("set_launch_blocking", &set_launch_blocking);
  m.def("set_host_cpu_settings", &set_host_cpu_settings, py::arg("threads"), py::arg("flush_denormal"));
  m.def("current_stream", [](int d) {
    check_device_index(d);
    return current_stream(d);
  });
  m.def("set_stream", [](int d, int s) { set_current_stream(d, s); });
  m.def("stream_priority", &stream_priority);
  m.def("stream_query", &stream_idle);
  m.def("stream_overflowed", &stream_overflowed);
  m.def("stream_counts", [](int d, int s) { return py::make_tuple(stream_enqueued(d, s), stream_completed(d, s)); });
  // torch.cuda._sleep's counterpart for tests: a kernel that keeps the stream busy for `ms` milliseconds
  // (it ends early when the thread that launched it is interrupted by Ctrl-C in a wait).
  m.def("sleep", [](int d, double ms) {
    check_device_index(d);
    Work w;
    w.device = d;
    w.stream = current_stream(d);
    static const int32_t name = intern_string("neuron::_sleep");
    w.launch = begin_launch(name);
    const bool rec = recording();
    w.run = [ms, d, rec, stream = w.stream](const Launch& l) {
      const int64_t t0 = now_ns();
      const int64_t until = t0 + static_cast<int64_t>(ms * 1e6);
      while (now_ns() < until && !launch_dropped(l)) std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (rec && recording()) {
        EventRecord ev;
        ev.kind = EventKind::Kernel;
        ev.engine = Engine::Scalar;
        ev.device = static_cast<int8_t>(d);
        ev.name_id = l.name_id;
        push_launched_event(ev, t0, now_ns(), stream, l);
      }
    };
    py::gil_scoped_release nogil;
    enqueue(std::move(w));
  }, py::arg("device"), py::arg("ms"));
  m.def("drain", []() {
    py::gil_scoped_release nogil;
    drain_all(/*raise_interrupt=*/true);
  });
  // Event.elapsed_time for torch.neuron.Event (torch.Event's own method accepts only exact torch.Event
  // objects): the events by their event_id (the address of their NeuronEvent), which must be live events.
  m.def("event_elapsed_ms", [](int64_t a_id, int64_t b_id) {
    NeuronEvent* a = a_id == 0 ? nullptr : live_event(a_id);
    NeuronEvent* b = b_id == 0 ? nullptr : live_event(b_id);
    TORCH_CHECK_TYPE((a_id == 0 || a != nullptr) && (b_id == 0 || b != nullptr),
                     "elapsed_time: expected neuron Events (an event_id names no live neuron event)");
    return event_elapsed_ms(a, b);
  });
  m.def("raise_async_error", [](int d) {
    check_device_index(d);
    raise_async_error(d);
  });
  m.def("now_ns", &now_ns);

  m.def("memory_stats", &stats_dict);
  // the same entry points torch.accelerator reaches (allocator.cpp, NeuronAllocator: c10::DeviceAllocator)
  m.def("reset_peak_stats", [](int d) { g_neuron_allocator.resetPeakStats(static_cast<c10::DeviceIndex>(d)); });
  m.def("reset_accumulated_stats",
        [](int d) { g_neuron_allocator.resetAccumulatedStats(static_cast<c10::DeviceIndex>(d)); });
  m.def("empty_cache", []() { g_neuron_allocator.emptyCache({0, 0}); });
  m.def("capacity", [](int d) {
    check_device_index(d);
    return config().hbm_bytes;
  });
  m.def("mem_get_info", [](int d) {
    const auto [free, total] = g_neuron_allocator.getMemoryInfo(static_cast<c10::DeviceIndex>(d));
    return py::make_tuple(static_cast<int64_t>(free), static_cast<int64_t>(total));
  });
  m.def("set_memory_fraction", [](double fraction, int d) {
    check_device_index(d);
    get_device(d)->set_memory_fraction(fraction);
  });
  m.def("memory_fraction", [](int d) {
    check_device_index(d);
    DeviceAllocator* a = peek_device(d);
    return a != nullptr ? a->memory_fraction() : 1.0;
  });
  m.def("raw_alloc", &raw_alloc, py::arg("nbytes"), py::arg("device"), py::arg("stream"));
  m.def("raw_delete", &raw_delete, py::arg("ptr"));
  m.def("host_memory_stats", [] {
    const at::HostStats st = g_pinned_allocator.get_stats();
    auto duration = [](const c10::CachingAllocator::DurationStat& s) {
      py::dict d;
      d["total"] = s.total;
      d["max"] = s.max;
      d["min"] = s.min;
      d["count"] = s.count;
      d["avg"] = s.count == 0 ? 0 : s.total / s.count;
      return d;
    };
    py::dict r;
    r["active_requests"] = stat_py(st.active_requests);
    r["active_bytes"] = stat_py(st.active_bytes);
    r["allocations"] = stat_py(st.allocations);
    r["allocated_bytes"] = stat_py(st.allocated_bytes);
    r["host_alloc_time"] = duration(st.host_alloc_time);
    r["host_free_time"] = duration(st.host_free_time);
    r["num_host_alloc"] = st.num_host_alloc;
    r["num_host_free"] = st.num_host_free;
    return r;
  });
  m.def("reset_host_accumulated_stats", [] { g_pinned_allocator.reset_accumulated_stats(); });
  m.def("reset_host_peak_stats", [] { g_pinned_allocator.reset_peak_stats(); });
  m.def("snapshot", &snapshot_py);
  m.def("record_memory_history", [](bool enabled, bool record_context, size_t max_entries) {
    g_context_fn = &gather_python_context;
    g_max_entries.store(max_entries);
    g_record_context.store(enabled && record_context);
    g_record_history.store(enabled);
    if (!enabled) {
      for (int d = 0; d < device_count(); ++d)
        if (auto* a = peek_device(d)) a->clear_trace();
    }
  }, py::arg("enabled"), py::arg("record_context") = true, py::arg("max_entries") = 100000);
  m.def("last_oom", &last_oom_py);

  m.def("recorder_start", &recorder_start, py::arg("capacity") = 1 << 20, py::arg("record_shapes") = true,
        py::arg("with_stack") = false, py::arg("keep_first") = 0);
  m.def("recorder_slot_bytes", &recorder_slot_bytes);
  m.def("recorder_read_columns", &recorder_read_columns_py);
  m.def("recorder_stop", []() {
    {
      py::gil_scoped_release nogil;
      drain_all();  // queued kernels record their events first
    }
    recorder_stop();
  });
  m.def("recorder_clear", []() {
    {
      py::gil_scoped_release nogil;
      drain_all();
    }
    recorder_clear();
  });
  m.def("stack_table_stats", [] {
    const StackTableStats st = stack_table_stats();
    py::dict d;
    d["stacks"] = st.stacks;
    d["auto_clears"] = st.auto_clears;
    d["tries"] = st.tries;
    return d;
  });
  m.def("release_stacks_if_unreferenced", []() {
    {
      py::gil_scoped_release nogil;
      drain_all();  // a queued launch's stack names its site in an asynchronous error
    }
    return release_stacks_if_unreferenced();
  });
  m.def("set_site_mapper", [](py::object fn) { set_site_mapper(fn.ptr()); }, py::arg("fn"),
        "The callable (filename, line) -> str | None that names an asynchronous error's launch site "
        "(None: file:line in function)");
  m.def("recorder_enabled", []() { return (g_recording_flags.load() & kRecorderBit) != 0; });
  m.def("recorder_dropped", &recorder_dropped);
  m.def("recorder_read", &recorder_read_py);
  m.def("recorder_push", [](const std::string& kind, const std::string& name, int device, const std::string& engine,
                            int64_t start_ns, int64_t end_ns, int64_t bytes_read, int64_t bytes_written,
                            int64_t flops, int subgraph, const std::string& shapes) {
    if (!(g_recording_flags.load() & kRecorderBit)) return false;
    EventRecord ev;
    ev.kind = kind_from(kind);
    ev.engine = engine_from(engine);
    ev.device = static_cast<int8_t>(device);
    ev.name_id = intern_string(name);
    ev.start_ns = start_ns;
    ev.end_ns = end_ns;
    ev.bytes_read = bytes_read;
    ev.bytes_written = bytes_written;
    ev.flops = flops;
    ev.subgraph = subgraph;
    if (!shapes.empty()) ev.shapes_id = intern_string(shapes);
    push_event(ev);
    return true;
  }, py::arg("kind"), py::arg("name"), py::arg("device"), py::arg("engine"), py::arg("start_ns"),
     py::arg("end_ns"), py::arg("bytes_read") = 0, py::arg("bytes_written") = 0, py::arg("flops") = 0,
     py::arg("subgraph") = -1, py::arg("shapes") = "");
  m.def("signature_count", [](int d) {
    check_device_index(d);
    return signatures_of(d).size();
  });
  m.def("signatures", [](int d) {
    check_device_index(d);
    return signatures_of(d);
  });
  m.def("clear_signatures", &clear_signatures);

  // Runs fn(list) with neuron tensors replaced by zero-copy CPU aliases and this thread's CPU
  // allocations diverted to neuron:device; tensors in the returned list/tuple come back as neuron
  // tensors (views keep sharing storage; new memory is adopted without a copy).
  m.def("run_on_host", [](py::function fn, py::list args, int device) {
    HostCall call(device);
    py::list cpu_args;
    for (py::handle h : args) {
      if (THPVariable_Check(h.ptr())) cpu_args.append(py::cast(call.in(THPVariable_Unpack(h.ptr()))));
      else cpu_args.append(h);
    }
    py::object result;
    {
      RedirectGuard redirect(device);
      result = fn(cpu_args);
    }
    auto convert = [&](py::handle h) -> py::object {
      if (THPVariable_Check(h.ptr())) return py::cast(call.out(THPVariable_Unpack(h.ptr())));
      return py::reinterpret_borrow<py::object>(h);
    };
    if (py::isinstance<py::list>(result) || py::isinstance<py::tuple>(result)) {
      py::list out;
      for (py::handle h : result) out.append(convert(h));
      return py::object(out);
    }
    return convert(result);
  }, py::arg("fn"), py::arg("args"), py::arg("device"));
  // run_on_host for one compiled graph called many times: the CPU aliases of its inputs are kept
  // between calls, per argument position, and reused while they view the same bytes with the same
  // layout and nothing else holds them (an alias costs two allocations and a Python object).
  py::class_<HostPlan>(m, "HostPlan")
      .def(py::init<int>(), py::arg("device"))
      .def("run", &HostPlan::run, py::arg("fn"), py::arg("args"))
      .def_readonly("device", &HostPlan::device)
      .def_readonly("reused", &HostPlan::reused)
      .def_readonly("made", &HostPlan::made);
  m.def("cpu_alias", [](const at::Tensor& t) {
    HostCall call(t.device().type() == kNeuron ? t.device().index() : current_device());
    return call.in(t);
  });

  // The CPU engine (mt19937) that neuron:d's default generator draws from, as a CPU torch.Generator
  // sharing its state: host code (compiled graphs) passes it to CPU kernels to draw from neuron's stream.
  m.def("generator_engine", [](int d) {
    return py::reinterpret_steal<py::object>(THPGenerator_Wrap(cpu_engine_of(default_generator(d))));
  });
  m.def("default_generator", [](int d) {
    return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(default_generator(d)));
  });
}

}  // namespace tnl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { tnl::init_module(m); }
