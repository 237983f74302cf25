// Layouts the emulated device does not hold: sparse compressed (CSR/CSC/BSR/BSC) and quantized tensors raise one
// NotImplementedError where one would be made on neuron (README.md "What stays unsupported"). Sparse COO tensors
// are held (kernels.cpp, "Sparse COO tensors"): a neuron tensor's conversion to one runs on the host here.
//
// Why a backend fallback is not enough. kernels.cpp registers an error fallback for SparseCsrPrivateUse1 and
// QuantizedPrivateUse1 (any op on such a tensor raises), but the dispatcher prefers an
// operator's own composite kernel (CompositeExplicitAutograd[NonFunctional]) to any backend fallback.
// Conversions and factories carry their target device through BackendSelect, so `csr.to("neuron")` dispatches
// aten::_to_copy with the key SparseCsrPrivateUse1 (the CPU tensor's SparseCsr functionality, the target's
// PrivateUse1 backend) and lands in ATen's composite _to_copy, which copies the member tensors to neuron (dense
// copies the device accepts) and wraps them in a compressed tensor with no further dispatch on a sparse key.
// torch.sparse_csr_tensor(..., device="neuron") (aten::sparse_compressed_tensor), torch.zeros(...,
// layout=torch.sparse_csr, device="neuron"), _sparse_compressed_tensor_with_dims and the implicit-composite
// constructors (torch.ops.aten.sparse_csr_tensor, _sparse_compressed_tensor_unsafe ...) take the same road.
//
// The class closed here: at load, every aten operator with a composite kernel and no kernel of its own for
// SparseCsrPrivateUse1 gets the error kernel there (a direct registration outranks the composite one; details at
// CompositeOverrides). An op only reaches that key when one of its tensors, or the tensor it is asked to make,
// is sparse compressed and on neuron, so nothing that works on the device changes. Dense-to-sparse conversions
// of a neuron tensor (_to_sparse*) raise before the host computes the conversion.
//
// Left open (README.md): torch.empty_like(cpu_sparse_compressed, device="neuron") dispatches on the CPU tensor
// alone (SparseCsrCPU, no BackendSelect), and overriding a CPU kernel makes PyTorch warn at every import.
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_nested_tensor_size_native.h>
#include <ATen/ops/_nested_tensor_storage_offsets_native.h>
#include <ATen/ops/_nested_tensor_strides_native.h>
#include <torch/library.h>

#include <string>

namespace tnl {

void unsupported_layout_named(const std::string& what, const std::string& op) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "neuron tensors must be dense and strided (torch.strided, not quantized): ",
                              op, " would make a ", what, " tensor on the emulated neuron device, which ",
                              "has no kernels for it. Keep it on the CPU, or convert it first (.to_dense() for ",
                              "sparse layouts, .dequantize() for quantized tensors, .to_padded_tensor() or ",
                              ".unbind() for nested tensors), then move it to neuron.",
                              op == "aten::_nested_tensor_from_mask"
                                  ? " nn.TransformerEncoder makes one in its eval fast path from a "
                                    "src_key_padding_mask: build it with enable_nested_tensor=False."
                                  : "");
}

namespace {

constexpr const char* kWhatSparse = "sparse";
constexpr const char* kWhatCompressed = "sparse compressed (CSR/CSC/BSR/BSC)";

// The error kernels.cpp's fallback raises, named after the op.
[[noreturn]] void layout_error(const char* what, const c10::OperatorHandle& op) {
  const auto& s = op.schema();
  unsupported_layout_named(what, s.overload_name().empty() ? s.name() : s.name() + "." + s.overload_name());
}

void compressed_error(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack*) {
  layout_error(kWhatCompressed, op);
}

// Dense -> sparse conversions of a neuron tensor: the layout made is the op's (or its `layout` argument's).
void to_sparse_error(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& s = op.schema();
  if (s.name() == "aten::_to_sparse" && s.overload_name() == "sparse_dim")
    return sparse_host_fallback(op, c10::DispatchKeySet(), stack);
  if (s.name() != "aten::_to_sparse") layout_error(kWhatCompressed, op);
  const auto idx = s.argumentIndexWithName("layout");
  const size_t nargs = s.arguments().size();
  const c10::IValue& v = (*stack)[stack->size() - nargs + idx.value()];
  const bool coo = v.isNone() || v.toLayout() == c10::kSparse;
  if (coo) return sparse_host_fallback(op, c10::DispatchKeySet(), stack);  // COO tensors are supported
  layout_error(kWhatCompressed, op);
}

// A strided nested tensor made from neuron tensors (torch.nested.as_nested_tensor, nested_tensor, the math
// path of SDPA on jagged tensors): raised where it would be made. The op is a composite that wraps its inputs'
// buffer without dispatching on a nested key, and autograd then read the new tensor's metadata through
// _nested_tensor_size (below), which raised inside a constructor that may not throw: std::terminate (rc 134).
void nested_from_list_error(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack*) {
  layout_error("nested (torch.strided layout)", op);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"_to_sparse", "_to_sparse.sparse_dim", "_to_sparse_csr", "_to_sparse_csc",
                           "_to_sparse_bsr", "_to_sparse_bsc"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&to_sparse_error>());
  m.impl("_nested_tensor_from_tensor_list", torch::CppFunction::makeFromBoxedFunction<&nested_from_list_error>());
}

// A nested tensor's metadata (sizes, strides, offsets of its members: CPU tensors the NestedTensorImpl holds)
// needs no device kernel: answered as CPU and CUDA answer it, so code that only reads it (autograd recording a
// nested output's shape) never meets the layout error in a place that cannot throw.
TORCH_LIBRARY_IMPL(aten, NestedTensorPrivateUse1, m) {
  m.impl("_nested_tensor_size", TORCH_FN(at::native::_nested_tensor_size));
  m.impl("_nested_tensor_strides", TORCH_FN(at::native::_nested_tensor_strides));
  m.impl("_nested_tensor_storage_offsets", TORCH_FN(at::native::_nested_tensor_storage_offsets));
}

bool is_compressed_constructor(const std::string& name) {  // name without "aten::"
  for (const char* op : {"sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor",
                         "_sparse_csr_tensor_unsafe", "_sparse_csc_tensor_unsafe", "_sparse_bsr_tensor_unsafe",
                         "_sparse_bsc_tensor_unsafe", "_sparse_compressed_tensor_unsafe"})
    if (name == op) return true;
  return false;
}

// SparseCsrPrivateUse1 gets the error kernel for every aten op with an explicit composite kernel, and for the
// implicit composites reached through BackendSelect (the sparse constructors, to.dtype_layout): about 1,500 ops,
// ~3 ms at load. The compressed constructors that are implicit composites (torch.ops.aten.sparse_csr_tensor,
// _sparse_compressed_tensor_unsafe ...) assemble the tensor without dispatching again, and run at the Autograd
// key before BackendSelect, or (without `layout`, under inference_mode) at the dense key BackendSelect computes:
// they also get it for AutogradPrivateUse1 and PrivateUse1 (reached when a member or the target is neuron).
// QuantizedPrivateUse1 needs no such list: making a quantized tensor always ends in a backend op for its key
// (empty_quantized ...), which reaches kernels.cpp's fallback. (SparsePrivateUse1 runs COO ops: kernels.cpp.)
struct CompositeOverrides {
  torch::Library sparse_csr{torch::Library::IMPL, "aten", c10::DispatchKey::SparseCsrPrivateUse1, __FILE__,
                            __LINE__};
  torch::Library autograd{torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1, __FILE__,
                          __LINE__};
  torch::Library dense{torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__};

  static void add(torch::Library& lib, const std::string& qualified) {
    try {
      lib.impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&compressed_error>());
    } catch (const c10::Error&) {  // an op the dispatcher refuses to override keeps its composite kernel
    }
  }

  CompositeOverrides() {
    using K = c10::DispatchKey;
    auto& d = c10::Dispatcher::singleton();
    for (const auto& name : d.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) continue;
      auto op = d.findOp(name);
      if (!op) continue;
      const bool explicit_composite = op->hasKernelForDispatchKey(K::CompositeExplicitAutograd) ||
                                      op->hasKernelForDispatchKey(K::CompositeExplicitAutogradNonFunctional);
      const bool implicit_factory = op->hasKernelForDispatchKey(K::CompositeImplicitAutograd) &&
                                    op->hasKernelForDispatchKey(K::BackendSelect);
      if (!explicit_composite && !implicit_factory) continue;
      const std::string base = name.name.substr(6);
      const std::string qualified = base + (name.overload_name.empty() ? "" : "." + name.overload_name);
      if (!op->hasKernelForDispatchKey(K::SparseCsrPrivateUse1)) add(sparse_csr, qualified);
      if (implicit_factory && is_compressed_constructor(base)) {
        if (!op->hasKernelForDispatchKey(K::AutogradPrivateUse1)) add(autograd, qualified);
        if (!op->hasKernelForDispatchKey(K::PrivateUse1)) add(dense, qualified);
      }
    }
  }
};

CompositeOverrides& composite_overrides() {
  static CompositeOverrides* o = new CompositeOverrides();  // lives as long as the process (like the dispatcher)
  return *o;
}

const bool kCompositeOverridesRegistered = (composite_overrides(), true);

}  // namespace
}  // namespace tnl
