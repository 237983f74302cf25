// Compiled graphs launched like kernels (README.md, "Compiled graphs on the queue").
//
// Inductor's generated host code for a graph (its `call`) runs on the host thread with neuron tensors, as a
// CUDA graph's wrapper runs on the host: its buffers are stream-ordered device allocations, the ATen ops it
// calls (extern kernels, fallbacks) are ordinary eager launches, and each of its fused C++ kernels is a
// HostKernel launch: the kernel's entry point, a C function taking pointers and integers that Inductor
// built into a shared object, is called by the stream's worker in stream order. The host returns as soon
// as the graph's last kernel is enqueued, so host Python after a compiled graph overlaps its kernels.
#include "neuron.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <array>
#include <utility>

namespace tnl {
namespace {

// Every argument of an Inductor C++ kernel is a pointer or an integer: both are passed in integer
// registers (then 8-byte stack slots) by the x86-64 System V and AArch64 calling conventions, so an entry
// point of N such parameters is called through a function type of N machine words.
using Word = uintptr_t;
constexpr size_t kMaxKernelArgs = 64;

template <size_t... I>
void call_words(void* fn, const Word* a, std::index_sequence<I...> /*unused*/) {
  using Fn = void (*)(decltype((void)I, Word{})...);
  reinterpret_cast<Fn>(fn)(a[I]...);
}
template <size_t N>
void call_n(void* fn, const Word* a) {
  call_words(fn, a, std::make_index_sequence<N>{});
}
template <size_t... N>
constexpr std::array<void (*)(void*, const Word*), sizeof...(N)> call_table(std::index_sequence<N...> /*unused*/) {
  return {&call_n<N>...};
}
const std::array<void (*)(void*, const Word*), kMaxKernelArgs + 1> kCallWords =
    call_table(std::make_index_sequence<kMaxKernelArgs + 1>{});

enum class ArgKind : uint8_t { In, Out, Int };

ArgKind kind_of(const std::string& type, const std::string& kernel) {
  if (type.find('*') != std::string::npos) return type.rfind("const ", 0) == 0 ? ArgKind::In : ArgKind::Out;
  std::string t = type.rfind("const ", 0) == 0 ? type.substr(6) : type;
  static const char* ints[] = {"int64_t", "int32_t", "int", "long", "uint64_t", "uint32_t", "bool", "int8_t",
                               "uint8_t", "int16_t"};
  for (const char* i : ints)
    if (t == i) return ArgKind::Int;
  TORCH_CHECK_NOT_IMPLEMENTED(false, kernel, ": a compiled kernel argument of type '", type,
                              "' cannot be launched on the queue (only pointers and integers)");
}

struct HostKernel {
  HostKernel(uintptr_t entry, const std::vector<std::string>& types, const std::string& name,
             const std::string& engine, int device)
      : entry(reinterpret_cast<void*>(entry)), name(name), device(device) {
    TORCH_CHECK_VALUE(entry != 0, name, ": no entry point");
    TORCH_CHECK_NOT_IMPLEMENTED(types.size() <= kMaxKernelArgs, name, " takes ", types.size(),
                                " arguments; at most ", kMaxKernelArgs, " can be launched on the queue");
    check_device_index(device);
    for (const auto& t : types) kinds.push_back(kind_of(t, name));
    name_id = intern_string(name);
    this->engine = engine_from(engine);
  }

  void call(const py::args& args) {
    const size_t n = args.size();
    TORCH_CHECK_TYPE(n == kinds.size(), name, " takes ", kinds.size(), " arguments (", n, " given)");
    std::array<Word, kMaxKernelArgs> words{};
    // Device memory is stream-ordered: a buffer the graph's code frees (`del buf0`) after this launch is
    // reused only by later launches of this stream, as CUDA's caching allocator does, so the closure holds
    // no reference to it (memory stats change at the host's free). Host memory (a graph constant) is kept.
    c10::SmallVector<c10::Storage, 2> keep;
    int64_t read = 0, written = 0;
    const bool rec = recording();
    for (size_t i = 0; i < n; ++i) {
      PyObject* o = args[i].ptr();
      if (kinds[i] == ArgKind::Int) {
        const long long v = PyLong_AsLongLong(o);
        if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
        words[i] = static_cast<Word>(v);
        continue;
      }
      TORCH_CHECK_TYPE(THPVariable_Check(o), name, ": argument ", i, " must be a tensor");
      const at::Tensor& t = THPVariable_Unpack(o);
      // host memory (a graph constant) is readable by the device's worker as it is by host kernels
      TORCH_CHECK(t.is_cpu() || (t.device().type() == kNeuron && t.device().index() == device), name,
                  ": argument ", i, " is on ", t.device(), "; the graph runs on neuron:", device);
      words[i] = reinterpret_cast<Word>(t.data_ptr());
      if (t.is_cpu()) keep.push_back(t.storage());
      if (rec) (kinds[i] == ArgKind::In ? read : written) += static_cast<int64_t>(t.numel()) * t.element_size();
    }
    Work w;
    w.device = device;
    w.stream = current_stream(device);
    w.launch = begin_launch(name_id);
    const int32_t subgraph = launch_tag().subgraph;
    void (*call)(void*, const Word*) = kCallWords[n];
    w.run = [fn = entry, call, words, keep = std::move(keep), rec, read, written, subgraph, dev = device,
             eng = engine, nid = name_id, stream = w.stream](const Launch& l) {
      const int64_t t0 = now_ns();
      {
        RedirectGuard host(-1);  // a kernel's scratch memory is the emulator's, not the device's
        call(fn, words.data());
      }
      const int64_t t1 = now_ns();
      if (rec && recording()) {
        EventRecord e;
        e.kind = EventKind::Kernel;
        e.engine = eng;
        e.device = static_cast<int8_t>(dev);
        e.name_id = nid;
        e.subgraph = subgraph;
        e.bytes_read = read;
        e.bytes_written = written;
        push_launched_event(e, t0, t1, stream, l);
      }
    };
    py::gil_scoped_release no_gil;  // a full queue makes the host wait
    enqueue(std::move(w));
  }

  void* entry;
  std::vector<ArgKind> kinds;
  std::string name;
  int32_t name_id = -1;
  Engine engine = Engine::Vector;
  int device;
};

}  // namespace

void init_graph_bindings(py::module& m) {
  py::class_<HostKernel>(m, "HostKernel")
      .def(py::init<uintptr_t, const std::vector<std::string>&, const std::string&, const std::string&, int>(),
           py::arg("entry"), py::arg("arg_types"), py::arg("name"), py::arg("engine"), py::arg("device"))
      .def("__call__", &HostKernel::call)
      .def_readonly("name", &HostKernel::name)
      .def_readonly("device", &HostKernel::device);
  // Returns the previous value, to be restored.
  m.def("set_launch_subgraph", [](int32_t id) { return std::exchange(launch_tag().subgraph, id); });
  m.def("set_launch_name", [](int32_t id) { return std::exchange(launch_tag().name_id, id); });
  m.def("add_internal_path", &add_internal_path, py::arg("dir"));
  m.def("intern_string", [](const std::string& s) { return intern_string(s); });
}

}  // namespace tnl
