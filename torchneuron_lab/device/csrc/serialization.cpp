// Backend tensor metadata (torch._C._set_tensor_metadata / _get_tensor_metadata): flags a user or a
// library attaches to a neuron tensor travel with it through shallow copies and torch.save/torch.load,
// as PyTorch's serialization hooks for PrivateUse1 backends provide (torch_openreg registers the same).
#include "neuron.h"

#include <c10/core/TensorImpl.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>

#include <map>

namespace tnl {

namespace {

struct NeuronBackendMeta final : public c10::BackendMeta {
  std::map<std::string, bool> flags;
  c10::intrusive_ptr<c10::BackendMeta> clone(const c10::intrusive_ptr<c10::BackendMeta>& /*ptr*/) const override {
    auto copy = c10::make_intrusive<NeuronBackendMeta>();
    copy->flags = flags;
    return copy;
  }
};

void get_backend_meta(const at::Tensor& t, std::unordered_map<std::string, bool>& out) {
  auto* meta = dynamic_cast<NeuronBackendMeta*>(t.unsafeGetTensorImpl()->get_backend_meta());
  if (meta == nullptr) return;
  for (const auto& [k, v] : meta->flags) out[k] = v;
}

void set_backend_meta(const at::Tensor& t, std::unordered_map<std::string, bool>& in) {
  if (in.empty()) return;
  auto meta = c10::make_intrusive<NeuronBackendMeta>();
  if (auto* old = dynamic_cast<NeuronBackendMeta*>(t.unsafeGetTensorImpl()->get_backend_meta())) meta->flags = old->flags;
  for (const auto& [k, v] : in) meta->flags[k] = v;
  t.unsafeGetTensorImpl()->set_backend_meta(meta);
}

}  // namespace

void install_backend_meta_serialization() {
  static std::once_flag once;
  std::call_once(once, [] { torch::jit::TensorBackendMetaRegistry(kNeuron, &get_backend_meta, &set_backend_meta); });
}

}  // namespace tnl
