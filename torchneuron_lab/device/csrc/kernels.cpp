// Kernel execution on the emulated NeuronCore.
//
// Device memory is host memory, so a neuron tensor's bytes can be handed to ATen's CPU kernels
// directly. The boxed fallback below runs every ATen op that has no native neuron kernel:
//   1. each neuron tensor argument becomes a CPU tensor that *aliases* the same bytes (no copy);
//      device-mismatched arguments raise the same error CUDA raises;
//   2. the CPU kernel runs while this thread's CPU allocations are diverted to the neuron caching
//      allocator, so outputs (and kernel workspaces) are born in device memory;
//   3. outputs are re-wrapped as neuron tensors: views of an input keep sharing its neuron storage,
//      fresh outputs adopt the device block they were allocated in (again no copy); in-place and out=
//      arguments get their (possibly resized) storage and metadata written back;
//   4. when recording, one kernel event is emitted with engine class, bytes, FLOPs and signature.
// Native kernels cover allocation, views, copies (DMA), item() (sync), resize_ and set_.
#include "neuron.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/SparseTensorImpl.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/Resize.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/_efficientzerotensor_native.h>
#include <ATen/ops/clone_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/copy_sparse_to_sparse_native.h>
#include <ATen/ops/zero_native.h>
#include <ATen/ops/empty_native.h>
#include <ATen/ops/sparse_resize_and_clear_native.h>
#include <ATen/ops/sparse_resize_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_coalesced_native.h>
#include <ATen/ops/values_native.h>
#include <ATen/ops/indices_native.h>
#include <ATen/ops/_values_native.h>
#include <ATen/ops/_indices_native.h>
#include <ATen/ops/is_coalesced_native.h>
#include <ATen/ops/dense_dim_native.h>
#include <ATen/ops/sparse_dim_native.h>
#include <ATen/ops/_nnz_native.h>
#include <ATen/ops/add_cpu_dispatch.h>
#include <ATen/ops/div_cpu_dispatch.h>
#include <ATen/ops/mul_cpu_dispatch.h>
#include <ATen/ops/sub_cpu_dispatch.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_native.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/_to_copy_native.h>
#include <ATen/ops/alias_native.h>
#include <ATen/ops/convolution_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/library.h>

#include <Python.h>

#include <fstream>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

// ATen's sparse stub (aten/src/ATen/native/sparse/SparseStubs.h, not among the installed headers), declared as
// ATen declares it: the symbol is exported by libtorch_cpu.
namespace at::native {
using flatten_indices_fn = at::Tensor (*)(const at::Tensor& indices, at::IntArrayRef size);
DECLARE_DISPATCH(flatten_indices_fn, flatten_indices_stub)
}  // namespace at::native

namespace tnl {
void upcast_or_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);  // cuda_parity.cpp
namespace {

// How launches went (launch_path_counts(): a diagnostic of where host time goes): the general path queued,
// the fast path, one foreach launch, a plan's first launch checked on the host (waits for the stream,
// unrecorded), any other host-path run that waits for the stream, a host run on memory no kernel uses, and
// (counted among the queued too) a new key launched unchecked because its structure is trusted.
enum LaunchPath { kQueued, kFast, kForeach, kPlanCheck, kHostWait, kHostNow, kTrusted, kNumPaths };
std::array<std::atomic<uint64_t>, kNumPaths> g_paths{};
std::atomic<int64_t> g_plan_check_wait_ns{0};  // host time in plan checks' waits for the stream (all devices)
inline void count_path(LaunchPath p) { g_paths[p].fetch_add(1, std::memory_order_relaxed); }

// ------------------------------------------------------------------------------------------------
// Op metadata (computed once per operator schema)

enum class Flops : uint8_t { None, Mm, Addmm, Bmm, Baddbmm, Mv, Dot, Conv, ConvBackward };

struct OpMeta {
  std::string name;
  int32_t name_id = -1;
  Engine engine = Engine::Scalar;
  Flops flops = Flops::None;
  std::vector<int> gen_args;
  std::vector<int> device_args;
  std::vector<bool> write_args;  // per argument: tensor(s) written in place
  bool any_write = false;
  bool view_only = false;  // every return aliases an input and nothing is written: no kernel runs
  bool sync = false;       // output shape depends on device data: the host waits
  bool allow_cpu_tensors = false;
  // CUDA's registration checks that every positional tensor argument is on one device (native_functions.yaml
  // without `device_check: NoCheck`): a 0-dim CPU tensor is refused too (c10::impl::check_and_update_common_device).
  bool exact_device = false;
  int mask_arg = -1;  // masked_fill's mask: CUDA's kernel checks its device itself (any dim)
  // bernoulli_'s `p`: CUDA's kernel copies it to the device itself, so a CPU tensor of any shape is taken
  // (copied at the call: the user may change it before the queued kernel runs)
  int copied_cpu_arg = -1;
  // The op's Meta kernel accepts inputs its CPU kernel refuses (shape checks the CPU kernel makes at run time:
  // index_put_'s value, multinomial's sample count): a new shape is never launched on a trusted structure's
  // Meta plan, whose error would come at the next sync instead of the call.
  bool meta_lenient = false;
  // index_add / index_reduce: the same, but a mixture of experts launches index_add_ at a new shape every step,
  // so the one check the Meta kernel skips (check_index_source) is made here instead.
  bool index_source_check = false;
  // Arguments of schema type Scalar, Scalar? or Scalar[] (bit i: argument i): a plan is keyed by their
  // types, not their values (an optimizer's step size changes at every call; see LaunchPlan).
  uint64_t number_args = 0;
  bool rng_without_generator = false;  // seeded-random op with no Generator argument (e.g. native_dropout)
  // Asynchronous launch (queue.cpp): every return is a Tensor, Tensor[] or Tensor? (a value return needs
  // the data: the host waits); `out_op` is the op's out= variant whose CPU kernel writes straight into
  // outputs the host allocated (zero copy), when one exists.
  bool async_ok = false;
  bool pointwise = false;  // ATen's `pointwise` tag: an output may be exactly an input (full overlap)
  // A seeded-random op without a Generator whose `dropout_p` is 0.0 at a call draws nothing (the attention
  // kernels in eval): that call launches asynchronously like any other op. (native_dropout has its own
  // kernel: it draws even at p == 0, as CPU's does.)
  bool async_ok_without_rng = false;
  int rng_p_arg = -1;
  std::optional<c10::OperatorHandle> out_op;

  // Whether this call draws no random numbers from a lent generator.
  bool draws_rng(const torch::jit::Stack& stack, size_t base) const {
    if (!rng_without_generator) return false;
    if (rng_p_arg < 0) return true;
    const c10::IValue& v = stack[base + rng_p_arg];
    return !(v.isDouble() && v.toDouble() == 0.0);
  }
};

// The out= overload of a functional op: the same leading arguments (names and types) followed by one
// written Tensor per return, with a CPU kernel. Found once per operator.
std::optional<c10::OperatorHandle> find_out_variant(const c10::OperatorHandle& op) {
  static const std::unordered_map<std::string, std::vector<c10::OperatorName>> by_name = [] {
    std::unordered_map<std::string, std::vector<c10::OperatorName>> m;
    for (const auto& n : c10::Dispatcher::singleton().getAllOpNames()) m[n.name].push_back(n);
    return m;
  }();
  const c10::FunctionSchema& f = op.schema();
  const auto& fr = f.returns();
  if (fr.empty()) return std::nullopt;
  for (const auto& r : fr)
    if (r.type()->kind() != c10::TypeKind::TensorType || r.alias_info()) return std::nullopt;
  for (const auto& a : f.arguments())
    if (a.alias_info() && a.alias_info()->isWrite()) return std::nullopt;
  auto it = by_name.find(f.name());
  if (it == by_name.end()) return std::nullopt;
  const auto& fa = f.arguments();
  for (const auto& name : it->second) {
    if (name.overload_name == f.overload_name()) continue;
    auto h = c10::Dispatcher::singleton().findSchema(name);
    if (!h.has_value()) continue;
    const auto& oa = h->schema().arguments();
    if (oa.size() != fa.size() + fr.size()) continue;
    bool ok = true;
    for (size_t i = 0; i < fa.size() && ok; ++i)
      ok = oa[i].name() == fa[i].name() && oa[i].type()->str() == fa[i].type()->str();
    for (size_t i = fa.size(); i < oa.size() && ok; ++i)
      ok = oa[i].kwarg_only() && oa[i].type()->kind() == c10::TypeKind::TensorType && oa[i].alias_info() &&
           oa[i].alias_info()->isWrite();
    if (ok && h->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return h;
  }
  return std::nullopt;
}

const std::unordered_set<std::string>& names_in(const char* which) {
  static const std::unordered_map<std::string, std::unordered_set<std::string>> sets = {
      {"tensor",
       {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "matmul", "linear",
        "convolution", "_convolution", "convolution_backward", "_int_mm", "addr", "ger", "outer",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
        "cudnn_convolution", "mkldnn_convolution", "_slow_conv2d_forward", "_slow_conv2d_backward",
        "slow_conv3d_forward", "_linalg_solve_ex", "linalg_lu_factor_ex", "_linalg_eigh", "linalg_cholesky_ex",
        "_linalg_svd", "linalg_qr", "_linalg_det", "linalg_inv_ex", "triangular_solve", "linalg_solve_triangular",
        "cholesky_solve", "_cholesky_solve_helper", "geqrf", "ormqr", "linalg_householder_product",
        "_linalg_slogdet", "linalg_ldl_factor_ex", "linalg_ldl_solve", "linalg_lu_solve", "linalg_lstsq",
        "linalg_eig", "_fft_r2c", "_fft_c2r", "_fft_c2c", "baddbmm_", "addmm_"}},
      {"vector",
       {"sum", "mean", "prod", "nansum", "amax", "amin", "max", "min", "aminmax", "var", "std", "var_mean",
        "std_mean", "norm", "linalg_vector_norm", "_softmax", "_log_softmax", "_softmax_backward_data",
        "_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward", "native_batch_norm",
        "native_batch_norm_backward", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
        "native_group_norm", "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
        "logsumexp", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "_logcumsumexp", "argmax",
        "argmin", "any", "all", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
        "nll_loss2d_backward", "mse_loss", "mse_loss_backward", "l1_loss", "smooth_l1_loss",
        "smooth_l1_loss_backward", "huber_loss", "huber_loss_backward", "binary_cross_entropy",
        "binary_cross_entropy_backward", "binary_cross_entropy_with_logits", "kl_div", "count_nonzero",
        "mode", "median", "nanmedian", "histc", "bincount", "_batch_norm_with_update",
        "batch_norm_backward", "renorm", "trace", "_cdist_forward", "_cdist_backward", "_pdist_forward",
        "cross", "linalg_cross", "_euclidean_dist", "_weight_norm_interface", "logit_backward",
        "_adaptive_avg_pool2d", "adaptive_max_pool2d", "avg_pool2d", "max_pool2d_with_indices",
        "avg_pool2d_backward", "max_pool2d_with_indices_backward", "_adaptive_avg_pool2d_backward",
        "avg_pool3d", "max_pool3d_with_indices", "_adaptive_avg_pool3d", "adaptive_max_pool3d", "std_var"}},
      {"gpsimd",
       {"index", "index_put_", "_index_put_impl_", "gather", "scatter", "scatter_", "scatter_add",
        "scatter_add_", "scatter_reduce", "scatter_reduce_", "index_select", "index_add", "index_add_",
        "index_copy", "index_copy_", "index_fill", "index_fill_", "index_reduce", "index_reduce_",
        "masked_select", "masked_scatter", "masked_scatter_", "nonzero", "nonzero_static", "sort", "argsort",
        "topk", "kthvalue", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
        "embedding", "embedding_dense_backward", "_embedding_bag", "_embedding_bag_forward_only",
        "_embedding_bag_backward", "take", "put", "put_", "searchsorted", "bucketize", "multinomial", "randperm",
        "gather_backward", "_gather_sparse_backward", "repeat_interleave", "embedding_renorm_", "histogram",
        "_histogramdd_from_bin_cts", "_histogramdd_from_bin_tensors", "_histogramdd_bin_edges", "msort"}},
      {"dma",
       {"copy_", "_copy_from", "_copy_from_and_resize", "clone", "cat", "_cat", "stack", "_stack",
        "_to_copy", "repeat", "flip", "roll", "narrow_copy", "constant_pad_nd", "reflection_pad1d",
        "reflection_pad2d", "replication_pad1d", "replication_pad2d", "_unsafe_view", "contiguous",
        "as_strided_copy", "expand_copy", "permute_copy", "t_copy", "transpose_copy", "view_copy",
        "slice_copy", "select_copy", "unsqueeze_copy", "squeeze_copy", "detach_copy", "alias_copy",
        "diagonal_copy", "unbind_copy", "split_copy", "split_with_sizes_copy", "unfold_copy", "col2im",
        "im2col", "tril_indices", "triu_indices", "slice_scatter", "select_scatter", "diagonal_scatter",
        "as_strided_scatter", "_reshape_copy", "lift_fresh_copy", "_fused_moving_avg_obs_fq_helper"}},
      {"sync",
       {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
        "unique_dim_consecutive", "repeat_interleave", "bincount", "equal", "_local_scalar_dense", "histc",
        "_assert_async", "histogram", "nanmedian"}},
      {"cpu_ok", {"index", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put", "equal"}},
      {"meta_lenient", {"index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put", "multinomial"}},
      {"index_source", {"index_add", "index_add_", "index_reduce", "index_reduce_"}},
  };
  return sets.at(which);
}

Flops flops_kind(const std::string& base) {
  if (base == "mm" || base == "_int_mm") return Flops::Mm;
  if (base == "addmm" || base == "addmm_") return Flops::Addmm;
  if (base == "bmm") return Flops::Bmm;
  if (base == "baddbmm" || base == "baddbmm_") return Flops::Baddbmm;
  if (base == "mv" || base == "addmv") return Flops::Mv;
  if (base == "dot" || base == "vdot") return Flops::Dot;
  if (base == "convolution" || base == "_convolution") return Flops::Conv;
  if (base == "convolution_backward") return Flops::ConvBackward;
  return Flops::None;
}

// The operators (as "aten::name.overload") CUDA registers with a device check of every tensor argument: the
// entries of torch's native_functions.yaml without `device_check: NoCheck` (TensorIterator ops and a few
// others are NoCheck: they take 0-dim CPU tensors as scalars). Read once from the file torch ships
// (set_native_functions_yaml, by the module's init before any op's metadata is built); without it every op
// takes 0-dim CPU tensors (the older behaviour).
std::mutex g_exact_device_mu;
std::shared_ptr<const std::unordered_set<std::string>> g_exact_device_ops;
std::shared_ptr<const std::unordered_set<std::string>> exact_device_ops() {
  std::lock_guard<std::mutex> lock(g_exact_device_mu);
  return g_exact_device_ops;
}

OpMeta build_meta(const c10::OperatorHandle& op) {
  OpMeta m;
  const c10::FunctionSchema& s = op.schema();
  const std::string& base = s.name();
  std::string plain = base.rfind("aten::", 0) == 0 ? base.substr(6) : base;
  if (!plain.empty() && plain.back() == '_' && plain.find("_copy_from") == std::string::npos &&
      names_in("gpsimd").count(plain) == 0 && names_in("dma").count(plain) == 0) {
    // in-place variant: classify like its functional op
    std::string f = plain.substr(0, plain.size() - 1);
    if (names_in("tensor").count(f) || names_in("vector").count(f) || names_in("gpsimd").count(f)) plain = f;
  }
  m.name = s.overload_name().empty() ? base : base + "." + s.overload_name();
  m.name_id = intern_string(m.name);
  if (names_in("tensor").count(plain)) m.engine = Engine::Tensor;
  else if (names_in("vector").count(plain)) m.engine = Engine::Vector;
  else if (names_in("gpsimd").count(plain)) m.engine = Engine::GpSimd;
  else if (names_in("dma").count(plain)) m.engine = Engine::Dma;
  else m.engine = Engine::Scalar;
  m.flops = flops_kind(plain);
  m.sync = names_in("sync").count(plain) > 0;
  m.allow_cpu_tensors = names_in("cpu_ok").count(plain) > 0;
  if (auto ops = exact_device_ops()) m.exact_device = ops->count(m.name) > 0;
  const auto& args = s.arguments();
  if (plain == "masked_fill" || plain == "masked_fill_")
    for (size_t i = 0; i < args.size(); ++i)
      if (args[i].name() == "mask") m.mask_arg = static_cast<int>(i);
  if (plain == "bernoulli" || plain == "bernoulli_")
    for (size_t i = 1; i < args.size(); ++i)
      if (args[i].name() == "p" && args[i].type()->kind() == c10::TypeKind::TensorType)
        m.copied_cpu_arg = static_cast<int>(i);
  m.meta_lenient = names_in("meta_lenient").count(plain) > 0;
  m.index_source_check = names_in("index_source").count(plain) > 0;
  m.write_args.assign(args.size(), false);
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& t = args[i].type();
    const auto kind = t->kind();
    if (kind == c10::TypeKind::DeviceObjType ||
        (kind == c10::TypeKind::OptionalType &&
         t->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::DeviceObjType))
      m.device_args.push_back(static_cast<int>(i));
    if (kind == c10::TypeKind::GeneratorType ||
        (kind == c10::TypeKind::OptionalType &&
         t->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType))
      m.gen_args.push_back(static_cast<int>(i));
    c10::TypePtr elem = t;
    if (kind == c10::TypeKind::OptionalType) elem = t->castRaw<c10::OptionalType>()->getElementType();
    else if (kind == c10::TypeKind::ListType) elem = t->castRaw<c10::ListType>()->getElementType();
    if (elem->kind() == c10::TypeKind::NumberType && i < 64) m.number_args |= uint64_t{1} << i;
    if (args[i].alias_info() && args[i].alias_info()->isWrite()) {
      m.write_args[i] = true;
      m.any_write = true;
    }
  }
  bool all_alias = !s.returns().empty();
  for (const auto& r : s.returns()) {
    if (!r.alias_info() || r.alias_info()->isWrite()) all_alias = false;
  }
  m.view_only = all_alias && !m.any_write;
  m.rng_without_generator = m.gen_args.empty() && op.hasTag(at::Tag::nondeterministic_seeded);
  m.pointwise = op.hasTag(at::Tag::pointwise);
  if (!m.pointwise) {
    // ATen tags many out= overloads of pointwise ops without `pointwise` (where.self_out, relu.out,
    // gelu.out, clone.out, ...): such an overload is pointwise when its functional overload is
    // (`self_out` -> `self`, `Scalar_out` -> `Scalar`, `out` -> the default one).
    const std::string& ov = s.overload_name();
    std::optional<std::string> fun;
    if (ov == "out") fun = "";
    else if (ov.size() > 4 && ov.compare(ov.size() - 4, 4, "_out") == 0) fun = ov.substr(0, ov.size() - 4);
    if (fun.has_value()) {
      auto f = c10::Dispatcher::singleton().findOp({base, *fun});
      m.pointwise = f.has_value() && f->hasTag(at::Tag::pointwise);
    }
  }
  m.async_ok = !m.sync && !m.view_only;
  if (m.rng_without_generator)
    for (size_t i = 0; i < args.size(); ++i)
      if (args[i].name() == "dropout_p" && args[i].type()->kind() == c10::TypeKind::FloatType)
        m.rng_p_arg = static_cast<int>(i);
  for (const auto& r : s.returns()) {
    const auto k = r.type()->kind();
    const bool tensor_like =
        k == c10::TypeKind::TensorType ||
        (k == c10::TypeKind::ListType &&
         r.type()->castRaw<c10::ListType>()->getElementType()->kind() == c10::TypeKind::TensorType) ||
        (k == c10::TypeKind::OptionalType &&
         r.type()->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType);
    if (!tensor_like) m.async_ok = false;
  }
  m.async_ok_without_rng = m.async_ok;
  if (m.rng_without_generator) m.async_ok = false;
  // The out= overload only where it is the same code as the functional op (pointwise ops and the
  // matmul family are structured kernels); other out= kernels may assume more of their output (e.g. a
  // zeroed buffer) than an uninitialised device block.
  if (m.async_ok && (op.hasTag(at::Tag::pointwise) || m.flops == Flops::Mm || m.flops == Flops::Addmm ||
                     m.flops == Flops::Bmm || m.flops == Flops::Baddbmm))
    m.out_op = find_out_variant(op);
  return m;
}

const OpMeta& op_meta_slow(const c10::OperatorHandle& op);

// Hot path: most eager loops repeat the same few ops; a tiny per-thread cache skips the shared lock.
const OpMeta& op_meta(const c10::OperatorHandle& op) {
  static thread_local const c10::FunctionSchema* keys[4] = {nullptr, nullptr, nullptr, nullptr};
  static thread_local const OpMeta* vals[4] = {nullptr, nullptr, nullptr, nullptr};
  static thread_local unsigned next = 0;
  const c10::FunctionSchema* key = &op.schema();
  for (int i = 0; i < 4; ++i)
    if (keys[i] == key) return *vals[i];
  const OpMeta& m = op_meta_slow(op);
  keys[next & 3] = key;
  vals[next & 3] = &m;
  ++next;
  return m;
}

const OpMeta& op_meta_slow(const c10::OperatorHandle& op) {
  static std::shared_mutex mu;
  static std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<OpMeta>> cache;
  const c10::FunctionSchema* key = &op.schema();
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return *it->second;
  }
  auto m = std::make_unique<OpMeta>(build_meta(op));
  std::unique_lock<std::shared_mutex> lock(mu);
  auto it = cache.emplace(key, std::move(m)).first;
  return *it->second;
}

// ------------------------------------------------------------------------------------------------
// Aliasing between neuron tensors and CPU views of the same bytes

// A kernel reads and writes a tensor's memory through its storage: a storage shrunk after the tensor was
// made (`t.untyped_storage().resize_(0)`, a smaller `resize_` of a shared storage) would have the kernel read
// or write outside the device's block (a segfault, or another tensor's memory). Raised at the launch instead.
void check_storage_holds(const at::Tensor& t) {
  // (fake tensors with symbolic sizes reach alias_in through _fused_sdp_choice while Dynamo traces: nothing
  // is read through them, and their sizes cannot be computed)
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return;
  const c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  if (st == nullptr || t.numel() == 0) return;
  const size_t need = at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.dtype().itemsize(),
                                                       static_cast<size_t>(t.storage_offset()));
  if (need <= st->nbytes()) return;
  TORCH_CHECK(false, "a neuron tensor with sizes ", t.sizes(), ", strides ", t.strides(), ", storage offset ",
              t.storage_offset(), " and itemsize ", t.dtype().itemsize(), " requires a storage size of ", need,
              " bytes, but its storage holds ", st->nbytes(), " bytes (was the storage resized after the tensor "
              "was made?)");
}

at::Tensor cpu_alias(const at::Tensor& t) {
  check_storage_holds(t);
  c10::StorageImpl* ns = t.storage().unsafeGetStorageImpl();
  auto st = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), ns->nbytes(),
                                                  c10::DataPtr(ns->data_ptr().get(), c10::Device(c10::kCPU)),
                                                  redirect_cpu_allocator(), ns->resizable());
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(std::move(st)),
                                                   c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) impl->_set_conj(true);
  if (t.is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

// A host tensor as a queued copy holds it: a new TensorImpl on the same storage (kept alive) with the
// launch's sizes, strides and offset. Holding the user's own TensorImpl, a copy read or wrote whatever the
// tensor was when it ran: `p.t_()` after `x.copy_(p, non_blocking=True)` transposed what arrived, and
// `h.set_(other)` after a device-to-host copy into `h` made it write into `other`'s memory.
// A pinned tensor's alias holds a use of its pinned block instead (a storage of its own on the same memory): the
// user's storage may swap its memory before the copy runs (`resize_`), which freed the block under the copy.
at::Tensor host_alias(const at::Tensor& t) {
  c10::Storage storage(t.storage());
  if (storage.nbytes() > 0) {
    c10::DataPtr use = pinned_use(storage.mutable_data());
    if (use.get() != nullptr)
      storage = c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), storage.nbytes(),
                                                                  std::move(use), /*allocator=*/nullptr,
                                                                  /*resizable=*/false));
  }
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                   t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) impl->_set_conj(true);
  if (t.is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

at::Tensor wrap_neuron(const at::Tensor& cpu, c10::Storage storage) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage),
                                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), cpu.dtype());
  impl->set_sizes_and_strides(cpu.sizes(), cpu.strides(), cpu.storage_offset());
  if (cpu.is_conj()) impl->_set_conj(true);
  if (cpu.is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

// Moves a device block allocated through the CPU redirect into a neuron storage (zero copy); copies
// anything else (memory the CPU kernel got elsewhere) into a fresh device block.
c10::Storage adopt_storage(c10::StorageImpl* cs, int device) {
  const size_t nbytes = cs->nbytes();
  c10::DataPtr dp;
  if (is_neuron_data_ptr(cs->data_ptr())) {
    // The storage already holds a device block: re-label it in place (no new StorageImpl, no copy).
    cs->mutable_data_ptr().unsafe_set_device(c10::Device(kNeuron, device));
    cs->set_allocator(neuron_allocator());
    return c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(cs));
  } else {
    HostNowGuard now;
    dp = allocate_on(device, nbytes);
    if (nbytes > 0) std::memcpy(dp.get(), cs->data_ptr().get(), nbytes);
  }
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                            std::move(dp), neuron_allocator(), true));
}

struct AliasIn {
  at::Tensor original;
  at::Tensor alias;
  c10::StorageImpl* alias_storage;
  const void* data;
  size_t nbytes;
  bool writable;
};

struct CallState {
  c10::SmallVector<AliasIn, 6> ins;
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 4> adopted;
  int device = -1;
  bool cpu_outputs = false;
  at::Generator rng;  // the neuron generator the call draws from (undefined: none)
};

// A CPU view with t's geometry on an existing CPU alias storage.
at::Tensor cpu_view_on(const at::Tensor& t, const c10::Storage& cpu_storage) {
  check_storage_holds(t);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(cpu_storage),
                                                   c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) impl->_set_conj(true);
  if (t.is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

// Replaces a neuron tensor by a zero-copy CPU alias and remembers the pair for map_back(). Arguments
// that share a neuron storage get CPU aliases sharing ONE CPU storage, so ATen's internal/partial
// overlap checks (which compare storages) see the aliasing exactly as they would on CPU.
at::Tensor alias_in(CallState& cs, const at::Tensor& t, bool writable) {
  c10::StorageImpl* ns = t.storage().unsafeGetStorageImpl();
  // The same tensor in two argument slots (`torch.sum(t, 0, out=t)`, `v.scatter_add_(0, i, v)`) is one CPU
  // tensor, as on CPU, where kernels compare TensorImpls: with two aliases, an out= that is also an input was
  // resized without the input changing (CPU's "output with shape [] doesn't match the broadcast shape" missing,
  // wrong sums), and a strided view passed as both self and src escaped CPU's overlap error.
  // (Each slot keeps its entry, so what walks the arguments -- recorded shapes, plan keys -- sees every slot;
  // the first entry is writable when any slot writes, as the Meta twin and the write-back look at it.)
  for (auto& in : cs.ins) {
    if (in.original.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
      in.writable = in.writable || writable;
      AliasIn same = in;  // (push_back may move the entries)
      cs.ins.push_back(std::move(same));
      return cs.ins.back().alias;
    }
  }
  for (auto& in : cs.ins) {
    if (in.original.storage().unsafeGetStorageImpl() == ns) {
      at::Tensor a = cpu_view_on(t, in.alias.storage());
      cs.ins.push_back({t, a, in.alias_storage, in.data, in.nbytes, writable});
      return a;
    }
  }
  at::Tensor a = cpu_alias(t);
  cs.ins.push_back({t, a, a.storage().unsafeGetStorageImpl(), t.storage().data_ptr().get(), t.storage().nbytes(),
                    writable});
  return a;
}

// Maps a CPU result of host code back to a neuron tensor: an input's alias returns that input itself
// (*is_input = true), a view of an input keeps the input's neuron storage, and memory allocated while
// the code ran (a device block) is adopted in place; results sharing new storage share it afterwards.
at::Tensor map_back(CallState& cs, const at::Tensor& t, bool* is_input = nullptr) {
  for (const auto& in : cs.ins)
    if (in.alias.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
      if (is_input != nullptr) *is_input = true;
      return in.original;
    }
  c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  for (const auto& in : cs.ins)
    if (in.alias_storage == st) return wrap_neuron(t, in.original.storage());
  for (const auto& ad : cs.adopted)
    if (ad.first == st) return wrap_neuron(t, ad.second);
  c10::Storage ns = adopt_storage(st, cs.device);
  cs.adopted.emplace_back(st, ns);
  return wrap_neuron(t, std::move(ns));
}

std::string dtype_name(c10::ScalarType t) {
  std::string s = c10::toString(t);
  static const std::unordered_map<std::string, std::string> pretty = {
      {"Float", "float32"}, {"Double", "float64"}, {"Half", "float16"}, {"BFloat16", "bfloat16"},
      {"Long", "int64"},    {"Int", "int32"},      {"Short", "int16"},  {"Char", "int8"},
      {"Byte", "uint8"},    {"Bool", "bool"},      {"ComplexFloat", "complex64"},
      {"ComplexDouble", "complex128"}};
  auto it = pretty.find(s);
  return it == pretty.end() ? s : it->second;
}

std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

[[noreturn]] void device_mismatch(const std::string& a, const std::string& b, const std::string& arg,
                                  const std::string& op) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", a,
              " and ", b, "! (when checking argument for argument ", arg, " in method ", op, ")");
}

inline uint64_t mix(uint64_t h, uint64_t v) {
  return h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
}

struct SigBuilder {
  uint64_t hash;
  c10::SmallVector<const at::Tensor*, 8> tensors;
};

void note_tensor_sig(SigBuilder& sb, const at::Tensor& t) {
  sb.hash = mix(sb.hash, static_cast<uint64_t>(t.scalar_type()) * 131 + t.dim());
  for (int64_t s : t.sizes()) sb.hash = mix(sb.hash, static_cast<uint64_t>(s));
}

int64_t nbytes_of(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size()) : 0;
}

int64_t compute_flops(Flops f, const std::vector<at::Tensor>& in, const at::Tensor& out0) {
  auto sz = [&](size_t i, int d) -> int64_t { return i < in.size() && in[i].defined() && in[i].dim() > d ? in[i].size(d) : 0; };
  switch (f) {
    case Flops::Mm:  // a[M,K] @ b[K,N]
      return 2 * sz(0, 0) * sz(0, 1) * sz(1, 1);
    case Flops::Addmm:  // bias, a[M,K], b[K,N]
      return 2 * sz(1, 0) * sz(1, 1) * sz(2, 1) + (out0.defined() ? out0.numel() : 0);
    case Flops::Bmm:
      return 2 * sz(0, 0) * sz(0, 1) * sz(0, 2) * sz(1, 2);
    case Flops::Baddbmm:
      return 2 * sz(1, 0) * sz(1, 1) * sz(1, 2) * sz(2, 2);
    case Flops::Mv:
      return in.size() >= 2 && in[0].dim() == 2 ? 2 * in[0].numel() : (in.size() >= 2 ? 2 * in[1].numel() : 0);
    case Flops::Dot:
      return 2 * (in.empty() ? 0 : in[0].numel());
    case Flops::Conv: {  // input, weight[Cout, Cin/g, k...]
      if (in.size() < 2 || !out0.defined() || in[1].dim() < 1 || in[1].size(0) == 0) return 0;
      return 2 * out0.numel() * (in[1].numel() / in[1].size(0));
    }
    case Flops::ConvBackward: {  // grad_out, input, weight: ~2x forward
      if (in.size() < 3 || in[2].dim() < 1 || in[2].size(0) == 0) return 0;
      return 4 * in[0].numel() * (in[2].numel() / in[2].size(0));
    }
    default:
      return 0;
  }
}

// ------------------------------------------------------------------------------------------------
// Layouts the device does not hold: one error, at the boundary (see README.md "What stays unsupported")

std::string layout_label(const at::Tensor& t) {
  if (t.is_quantized()) return "quantized";
  if (t.is_nested()) return "nested (torch.strided layout)";
  std::ostringstream o;
  o << t.layout();
  std::string s = o.str();
  return s.rfind("torch.", 0) == 0 ? s.substr(6) : s;
}

[[noreturn]] void unsupported_layout(const at::Tensor& t, const std::string& op) {
  unsupported_layout_named(layout_label(t), op);
}

// ------------------------------------------------------------------------------------------------
// The fallback

// ------------------------------------------------------------------------------------------------
// Asynchronous launch (queue.cpp; README.md "Asynchronous execution")
//
// The host computes the outputs' metadata with the op's Meta kernel on meta twins of the arguments
// (twins of arguments sharing a storage share one meta storage with the same address, so ATen's overlap
// checks and shape errors are raised at the launch, as on CPU and CUDA), allocates the outputs on the
// current stream, and enqueues the CPU kernel on CPU aliases. Ops whose results cannot be known without
// the data (no Meta kernel, data-dependent shapes, value returns, out= tensors to resize, outputs that
// alias inputs) return false: the host then waits for the stream and runs them itself.

at::Tensor meta_twin(const at::Tensor& a, std::vector<std::pair<c10::StorageImpl*, c10::Storage>>& storages) {
  c10::StorageImpl* st = a.storage().unsafeGetStorageImpl();
  c10::Storage ms;
  for (auto& p : storages)
    if (p.first == st) ms = p.second;
  if (!ms) {
    // The address is the real one (never dereferenced: meta kernels read no data) so overlap checks hold.
    ms = c10::Storage(c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), st->nbytes(),
        c10::DataPtr(const_cast<void*>(st->data_ptr().get()), c10::Device(c10::kMeta)),
        c10::GetAllocator(c10::kMeta), st->resizable()));
    storages.emplace_back(st, ms);
  }
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(ms), c10::DispatchKeySet(c10::DispatchKey::Meta),
                                                   a.dtype());
  impl->set_sizes_and_strides(a.sizes(), a.strides(), a.storage_offset());
  if (a.is_conj()) impl->_set_conj(true);
  if (a.is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

bool same_geometry(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes().equals(b.sizes()) && a.strides().equals(b.strides()) &&
         a.storage_offset() == b.storage_offset() && a.storage().nbytes() == b.storage().nbytes();
}

// The shapes and dtypes of a call's device arguments, interned into the event (record_shapes).
void record_arg_shapes(const CallState& cs, EventRecord& ev) {
  std::ostringstream sh, dt;
  bool first = true;
  for (const auto& in : cs.ins) {
    sh << (first ? "" : ", ") << shape_str(in.original.sizes());
    dt << (first ? "" : ", ") << dtype_name(in.original.scalar_type());
    first = false;
  }
  ev.shapes_id = intern_string(sh.str());
  ev.dtypes_id = intern_string(dt.str());
}

// What a launch of an op with given argument metadata produces, found by its Meta kernel once and
// cached: the Meta kernels of many ops are Python (torch._meta_registrations, ~100 us a call), and
// output metadata depends only on the arguments' metadata and values of non-tensor arguments, which
// make the key (with the aliasing pattern of the arguments).
//
// Scalar arguments (schema type Scalar) are keyed by type, not value: their values change output metadata
// only where they decide a size (arange's end), and an optimizer passes a new step size at every call
// (`p.addcdiv_(m, d, value=-step_size)`, the foreach form's list of step sizes), which would make every
// call a new key, checked on the host with a wait. A plan remembers the values it was made with (`vals`);
// a call with other values runs the Meta kernel again (it raises a value's error at once, e.g. an integer
// to a negative power, and finds a size a value decides) but is not checked against the CPU kernel again
// once its structure was (`confirmed`): that check is about the op and its arguments' metadata. An
// elementwise op that writes only its arguments keeps its launched plan as it is (`in_place_only`).
struct LaunchPlan {
  static constexpr int kNone = -2, kSingle = -1;
  bool host_path = false;        // results need the data (or the Meta kernel failed): run on the host
  bool meta_failed = false;      // host_path because the Meta kernel failed for `vals` (another may not)
  bool confirmed = false;        // a plan of this key matched the CPU kernel's results
  bool cpu_strides = false;      // outs took the CPU kernel's strides (plan_with_cpu_strides)
  bool in_place_only = false;    // launched, and every return is an argument written in place (or none)
  std::vector<int64_t> vals;     // the Scalar arguments' values (bits) this plan was made with
  std::vector<int> ret_sizes;    // per return: kNone, kSingle, or the length of a Tensor[]
  struct Out {
    enum Kind : uint8_t { Undefined, Input, New } kind = Undefined;
    int input = -1;              // Input: index into the call's aliased arguments
    std::vector<int64_t> sizes, strides;
    at::ScalarType dtype = at::kFloat;
  };
  std::vector<Out> outs;         // flattened returns
  // Written arguments that hold no bytes and the kernel sizes (an out= tensor from `at::empty({0})`: ATen's
  // functional ops run through their out= variant, `where`, `arange`): sized on the host at the launch
  struct Resize {
    int input;                   // index into the call's aliased arguments
    std::vector<int64_t> sizes, strides;
    bool operator==(const Resize& o) const { return input == o.input && sizes == o.sizes && strides == o.strides; }
  };
  std::vector<Resize> resizes;
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};
std::mutex g_plans_mu;
std::unordered_map<std::vector<int64_t>, std::shared_ptr<const LaunchPlan>, KeyHash> g_plans;
constexpr size_t kMaxPlans = 1 << 16;

std::shared_ptr<const LaunchPlan> find_plan(const std::vector<int64_t>& key) {
  std::lock_guard<std::mutex> lock(g_plans_mu);
  auto it = g_plans.find(key);
  return it == g_plans.end() ? nullptr : it->second;
}
void store_plan(std::vector<int64_t> key, std::shared_ptr<const LaunchPlan> plan) {
  std::lock_guard<std::mutex> lock(g_plans_mu);
  if (g_plans.size() >= kMaxPlans) g_plans.clear();  // a bound, not an LRU: plans are cheap to remake
  g_plans.insert_or_assign(std::move(key), std::move(plan));
}

// A plan's *structure*: its key with each tensor's sizes and strides abstracted (plan_key(abstract=true)).
// Every plan key is checked against the CPU kernel at its first launch, on the host after a wait for the
// stream; code whose shapes change at every step (a mixture of experts routes a different number of tokens
// to each expert) paid that wait at every new shape, ~10 times a Mixtral step. Once kTrustAfter keys of a
// structure matched the CPU kernel and none of it ever differed (in strides or anything else), a new key of
// that structure is launched with its Meta plan at once; one that differs marks the structure for good.
struct StructureRecord {
  int confirmed = 0;
  bool differed = false;
};
constexpr int kTrustAfter = 3;
std::unordered_map<std::vector<int64_t>, StructureRecord, KeyHash> g_structures;  // under g_plans_mu

bool structure_trusted(const std::vector<int64_t>& skey) {
  std::lock_guard<std::mutex> lock(g_plans_mu);
  auto it = g_structures.find(skey);
  return it != g_structures.end() && !it->second.differed && it->second.confirmed >= kTrustAfter;
}
void note_structure(const std::vector<int64_t>& skey, bool matched) {
  if (skey.empty()) return;
  std::lock_guard<std::mutex> lock(g_plans_mu);
  if (g_structures.size() >= kMaxPlans) g_structures.clear();
  StructureRecord& r = g_structures[skey];
  if (matched) ++r.confirmed;
  else r.differed = true;
}

// The value of a 0-dim integer (or bool) CPU tensor argument -- a Python int as a wrapped number (`x // 0`),
// `torch.tensor(0)` -- which a plan key keeps, as it keeps integer Scalars' values (key_number): CPU kernels
// check such values at run time where Meta kernels do not (integer division by zero), and the check runs at
// a key's first launch, on the host, raising at the call. Keyed by type only, `x // 0` after `x // 2` reused
// the plan, was queued, and raised at the next sync. Raw bits, zero-extended: distinct values, distinct keys.
std::optional<int64_t> cpu_integer_value(const at::Tensor& t) {
  if (!t.is_cpu() || t.dim() != 0 || t.layout() != at::kStrided || t._is_zerotensor() ||
      !c10::isIntegralType(t.scalar_type(), /*includeBool=*/true) || t.element_size() > 8)
    return std::nullopt;
  int64_t v = 0;
  std::memcpy(&v, t.const_data_ptr(), t.element_size());
  return v;
}

// A size in a plan's structure: empty / one / more.
int64_t size_class(int64_t v) { return v == 0 ? 0 : v == 1 ? 1 : 2; }

void key_tensor(const at::Tensor& t, const CallState& cs, std::vector<int64_t>& k, bool abstract = false) {
  if (!t.defined()) {
    k.push_back(-1);
    return;
  }
  int group = -1;  // arguments sharing a storage: the first aliased argument with that storage
  if (t.device().type() == c10::kCPU) {
    for (size_t i = 0; i < cs.ins.size(); ++i)
      if (cs.ins[i].alias.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
        for (size_t j = 0; j <= i; ++j)
          if (cs.ins[j].alias_storage == cs.ins[i].alias_storage) {
            group = static_cast<int>(j);
            break;
          }
        break;
      }
  }
  k.push_back(group == -1 ? (t.is_cpu() ? -3 : -4) : group);
  k.push_back(static_cast<int64_t>(t.scalar_type()));
  k.push_back(t.dim());
  if (abstract) {
    // A plan's structure (see StructureRecord): each size as empty / one / more, the layout as the order of
    // the strides of dims larger than one (zero strides marked), and where each size-1 dim's stride falls
    // in the order of all strides (kernels read it: a (2, 16, 1, 1) tensor of strides (16, 1, 16, 16) is
    // channels-last to suggest_memory_format, one of (16, 1, 1, 1) is not), an offset or not, whether the
    // storage holds exactly this tensor; the same flags.
    for (int64_t v : t.sizes()) k.push_back(size_class(v));
    const int64_t d = t.dim();
    for (int64_t i = 0; i < d; ++i) {
      int64_t rank = 0;
      const int64_t si = t.stride(i);
      if (t.size(i) > 1 && si == 0) rank = -1;
      else
        for (int64_t j = 0; j < d; ++j)
          if (j != i && (t.size(j) > 1 || t.size(i) == 1) && (t.stride(j) > si || (t.stride(j) == si && j < i)))
            ++rank;
      k.push_back(t.size(i) > 1 ? rank : -2 - rank);
    }
    k.push_back(t.storage_offset() != 0);
    k.push_back((t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0) | (t._is_zerotensor() ? 4 : 0) |
                (t.unsafeGetTensorImpl()->is_wrapped_number() ? 8 : 0));
    if (group >= 0)
      k.push_back(static_cast<int64_t>(cs.ins[group].nbytes) == t.numel() * static_cast<int64_t>(t.element_size()));
    // an integer value whose low byte is zero may be a zero divisor in the op's dtype: never trusted from
    // structures confirmed with other values (see cpu_integer_value)
    if (const auto v = cpu_integer_value(t)) k.push_back((*v & 0xFF) == 0 ? 1 : 0);
    return;
  }
  for (int64_t v : t.sizes()) k.push_back(v);
  for (int64_t v : t.strides()) k.push_back(v);
  k.push_back(t.storage_offset());
  k.push_back((t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0) | (t._is_zerotensor() ? 4 : 0) |
              (t.unsafeGetTensorImpl()->is_wrapped_number() ? 8 : 0));
  if (group >= 0) k.push_back(static_cast<int64_t>(cs.ins[group].nbytes));
  if (const auto v = cpu_integer_value(t)) k.push_back(*v);
}

// A Scalar argument in a plan key: its type goes to the key `k`; the value's bits go to `vals` when the value
// cannot meet a check only the CPU kernel makes (`floats`: every tensor argument is floating or complex,
// and the value is a float no floating dtype overflows on), else to the key as before. Integers keep their
// values in the key: CPU kernels check them at run time where Meta kernels do not (an integer tensor to a
// negative power, a fill that overflows int8), and those errors are raised at the call, as CPU's are.
// False for complex or symbolic values (not cached).
bool key_number(const c10::IValue& x, bool floats, std::vector<int64_t>& k, std::vector<int64_t>& vals) {
  if (x.isNone()) {
    k.push_back(0);
  } else if (x.isDouble()) {
    const double d = x.toDouble();
    int64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    const bool free_value = floats && (!std::isfinite(d) || std::abs(d) <= 65504.0);  // float16's largest
    k.push_back(free_value ? 2 : 4);
    (free_value ? vals : k).push_back(bits);
  } else if (x.isInt()) {
    k.push_back(1);
    k.push_back(x.toInt());
  } else if (x.isBool()) {
    k.push_back(3);
    k.push_back(x.toBool() ? 1 : 0);
  } else {
    return false;
  }
  return true;
}

bool floating_tensor(const at::Tensor& t) {
  if (!t.defined()) return true;
  switch (t.scalar_type()) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kComplexFloat: case at::kComplexDouble: case at::kComplexHalf:
      return true;
    default:
      return false;  // integers, bool, float8 (448 overflows e4m3fn)
  }
}

// The cache key of a launch (`vals`: the Scalar values it leaves out, see LaunchPlan), or false for
// arguments it does not describe (then no cache).
bool plan_key(const c10::FunctionSchema& schema, const OpMeta& meta, const torch::jit::Stack& stack, size_t base,
              size_t nargs, const CallState& cs, std::vector<int64_t>& k, std::vector<int64_t>& vals,
              bool abstract = false) {
  k.reserve(32);
  k.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&schema)));
  bool floats = true;  // every tensor argument floating or complex (see key_number)
  if (meta.number_args)
    for (size_t i = 0; i < nargs && floats; ++i) {
      const c10::IValue& v = stack[base + i];
      if (v.isTensor()) {
        floats = floating_tensor(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) floats = floats && floating_tensor(t);
      } else if (v.isOptionalTensorList()) {
        for (const std::optional<at::Tensor>& t : v.toOptionalTensorList())
          floats = floats && (!t.has_value() || floating_tensor(*t));
      }
    }
  for (size_t i = 0; i < nargs; ++i) {
    const c10::IValue& v = stack[base + i];
    if (i < 64 && (meta.number_args >> i & 1) && !v.isTensor()) {
      k.push_back(-116);
      if (v.isList()) {  // Scalar[]: every typed list is a list here
        const auto l = v.toListRef();
        k.push_back(static_cast<int64_t>(l.size()));
        for (const c10::IValue& x : l)
          if (!key_number(x, floats, k, vals)) return false;
      } else if (!key_number(v, floats, k, vals)) {
        return false;
      }
      continue;
    }
    if (v.isTensor()) {
      k.push_back(-101);
      key_tensor(v.toTensor(), cs, k, abstract);
    } else if (v.isTensorList()) {
      k.push_back(-102);
      auto l = v.toTensorList();
      k.push_back(static_cast<int64_t>(l.size()));
      for (const at::Tensor& t : l) key_tensor(t, cs, k, abstract);
    } else if (v.isOptionalTensorList()) {
      k.push_back(-103);
      auto l = v.toOptionalTensorList();
      k.push_back(static_cast<int64_t>(l.size()));
      for (const std::optional<at::Tensor>& t : l) key_tensor(t.has_value() ? *t : at::Tensor(), cs, k, abstract);
    } else if (v.isNone()) {
      k.push_back(-104);
    } else if (v.isInt()) {
      k.push_back(-105);
      k.push_back(v.toInt());
    } else if (v.isBool()) {
      k.push_back(-106);
      k.push_back(v.toBool() ? 1 : 0);
    } else if (v.isDouble()) {
      k.push_back(-107);
      const double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      k.push_back(bits);
    } else if (v.isIntList()) {
      k.push_back(-108);
      auto l = v.toIntList();
      k.push_back(static_cast<int64_t>(l.size()));
      for (int64_t x : l) k.push_back(x);
    } else if (v.isScalar()) {
      k.push_back(-109);
      const c10::Scalar sc = v.toScalar();
      k.push_back(static_cast<int64_t>(sc.type()));
      if (sc.isIntegral(false)) k.push_back(sc.toLong());
      else if (sc.isBoolean()) k.push_back(sc.toBool());
      else if (sc.isFloatingPoint()) {
        const double d = sc.toDouble();
        int64_t bits;
        std::memcpy(&bits, &d, sizeof bits);
        k.push_back(bits);
      } else {
        return false;  // complex / symbolic scalars: not cached
      }
    } else if (v.isDevice()) {
      k.push_back(-110);
      k.push_back(static_cast<int64_t>(v.toDevice().type()) * 1000 + v.toDevice().index());
    } else if (v.isGenerator()) {
      k.push_back(-111);
    } else if (v.isString()) {
      k.push_back(-112);
      k.push_back(static_cast<int64_t>(std::hash<std::string_view>()(v.toStringView())));
      k.push_back(static_cast<int64_t>(v.toStringView().size()));
    } else if (v.isDoubleList()) {
      k.push_back(-113);
      auto l = v.toDoubleList();
      k.push_back(static_cast<int64_t>(l.size()));
      for (double d : l) {
        int64_t bits;
        std::memcpy(&bits, &d, sizeof bits);
        k.push_back(bits);
      }
    } else if (v.isBoolList()) {
      k.push_back(-114);
      auto l = v.toBoolList();
      k.push_back(static_cast<int64_t>(l.size()));
      for (bool b : l) k.push_back(b ? 1 : 0);
    } else {
      return false;
    }
  }
  (void)schema;
  return true;
}

// Runs the op's Meta kernel on meta twins of the arguments and records what the launch produces.
// Warnings of a plan's Meta kernel. The plan runs the op's Meta kernel before the CPU kernel runs the call, and
// both warn about the same call (an out= tensor of the wrong shape: "An output with one or more elements was
// resized ..." twice, once from a Python meta kernel in torch/_prims_common with a garbled message): the Meta
// kernel's C++ warnings go to a handler that drops them, its Python ones to an "ignore" filter for its duration.
struct QuietWarnings {
  struct Drop final : c10::WarningHandler {
    void process(const c10::Warning& /*warning*/) override {}
  };
  Drop drop;
  c10::WarningUtils::WarningHandlerGuard guard{&drop};
  PyObject* ctx = nullptr;  // a warnings.catch_warnings() entered, with simplefilter("ignore")
  QuietWarnings() {
    if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *et, *ev, *etb;  // an exception already set on this thread stays set
    PyErr_Fetch(&et, &ev, &etb);
    // Each call runs Python, where a pending Ctrl-C is raised: its error is cleared before the next call (no
    // Python is called with an error set) and the Ctrl-C made pending again at the end.
    bool interrupt = false;
    auto settle_error = [&interrupt]() {
      if (PyErr_Occurred() == nullptr) return;
      interrupt = interrupt || PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) != 0;
      PyErr_Clear();
    };
    PyObject* warnings = PyImport_ImportModule("warnings");
    settle_error();
    if (warnings != nullptr) {
      ctx = PyObject_CallMethod(warnings, "catch_warnings", nullptr);
      settle_error();
      PyObject* entered = ctx != nullptr ? PyObject_CallMethod(ctx, "__enter__", nullptr) : nullptr;
      settle_error();
      PyObject* filtered = entered != nullptr ? PyObject_CallMethod(warnings, "simplefilter", "s", "ignore") : nullptr;
      settle_error();
      if (filtered == nullptr && ctx != nullptr && entered != nullptr) {
        Py_XDECREF(PyObject_CallMethod(ctx, "__exit__", "OOO", Py_None, Py_None, Py_None));
        settle_error();
      }
      if (entered == nullptr || filtered == nullptr) Py_CLEAR(ctx);
      Py_XDECREF(entered);
      Py_XDECREF(filtered);
      Py_DECREF(warnings);
    }
    if (interrupt) PyErr_SetInterrupt();
    PyErr_Restore(et, ev, etb);
    PyGILState_Release(g);
  }

  ~QuietWarnings() {
    if (ctx == nullptr || !Py_IsInitialized() || _Py_IsFinalizing()) return;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyObject* r = PyObject_CallMethod(ctx, "__exit__", "OOO", Py_None, Py_None, Py_None);
    Py_XDECREF(r);
    Py_DECREF(ctx);
    clear_python_error_keeping_interrupt();  // these calls run Python: a Ctrl-C may be raised there
    PyErr_Restore(et, ev, etb);
    PyGILState_Release(g);
  }
  QuietWarnings(const QuietWarnings&) = delete;
  QuietWarnings& operator=(const QuietWarnings&) = delete;
};

std::shared_ptr<LaunchPlan> make_plan(const c10::OperatorHandle& op, const OpMeta& meta,
                                      const torch::jit::Stack& stack, size_t base, size_t nargs,
                                      const CallState& cs, const std::vector<int64_t>& vals) {
  auto plan = std::make_shared<LaunchPlan>();
  plan->host_path = true;
  plan->meta_failed = true;  // until the Meta kernel's results are understood
  plan->vals = vals;
  std::vector<std::pair<c10::StorageImpl*, c10::Storage>> mstorages;
  c10::SmallVector<std::pair<at::Tensor, size_t>, 6> twins;  // meta twin, index into cs.ins
  auto twin_of = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined()) return t;
    for (size_t k = 0; k < cs.ins.size(); ++k)
      if (cs.ins[k].alias.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
        for (const auto& [m, j] : twins)
          if (j == k) return m;  // one tensor in two slots: one twin, as one alias (alias_in)
        at::Tensor m = meta_twin(t, mstorages);
        twins.emplace_back(m, k);
        return m;
      }
    return t;  // a CPU tensor read as a scalar, or an allowed CPU argument
  };
  torch::jit::Stack mstack;
  mstack.reserve(nargs);
  for (size_t i = 0; i < nargs; ++i) {
    const c10::IValue& v = stack[base + i];
    if (v.isTensor()) {
      mstack.emplace_back(twin_of(v.toTensor()));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> l;
      for (const at::Tensor& t : v.toTensorList()) l.push_back(twin_of(t));
      mstack.emplace_back(std::move(l));
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> l;
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
        if (t.has_value() && t->defined()) l.push_back(twin_of(*t));
        else l.push_back(std::nullopt);
      }
      mstack.emplace_back(std::move(l));
    } else if (v.isDevice() && std::find(meta.device_args.begin(), meta.device_args.end(), static_cast<int>(i)) !=
                                   meta.device_args.end()) {
      mstack.emplace_back(c10::Device(c10::kMeta));
    } else {
      mstack.push_back(v);
    }
  }
  try {
    QuietWarnings quiet;  // the CPU kernel gives the call's warnings
    at::RecordFunctionGuard no_op_events(false);  // a Python Meta kernel's ATen calls are not the program's ops
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &mstack);
  } catch (...) {
    // No Meta kernel, a data-dependent shape, or a real error of the arguments (shapes, dtypes): the
    // host path runs the CPU kernel, which raises its own error at once. A Ctrl-C in a Python Meta kernel
    // is the user's: raised (it was lost, and a loop of such launches could not be interrupted).
    rethrow_if_interrupt();
    return plan;
  }
  // Written arguments must keep their geometry (an out= tensor to resize: the host path does it).
  for (const auto& [m, k] : twins)
    if (cs.ins[k].writable && !same_geometry(m, cs.ins[k].alias)) {
      // An empty out= tensor the kernel sizes (nothing to keep): sized at the launch, as an output is
      // allocated. Another argument on its storage, or a layout the plan cannot give it: the host path.
      const AliasIn& in = cs.ins[k];
      bool shared = false;
      for (size_t j = 0; j < cs.ins.size(); ++j)
        shared = shared || (j != k && cs.ins[j].alias_storage == in.alias_storage);
      if (shared || in.nbytes != 0 || in.original.storage_offset() != 0 || !in.original.storage().resizable() ||
          m.storage_offset() != 0 || !m.is_non_overlapping_and_dense() || m.scalar_type() != in.original.scalar_type())
        return plan;
      for (const auto& r : plan->resizes)
        if (r.input == static_cast<int>(k)) return plan;
      bool direct = false;  // a Tensor argument of its own (the launch swaps its alias on the stack)
      for (size_t i = 0; i < nargs; ++i)
        direct = direct || (stack[base + i].isTensor() &&
                            stack[base + i].toTensor().unsafeGetTensorImpl() == in.alias.unsafeGetTensorImpl());
      if (!direct) return plan;
      plan->resizes.push_back({static_cast<int>(k), m.sizes().vec(), m.strides().vec()});
    }
  const size_t nret = op.schema().returns().size();
  if (mstack.size() != nret) return plan;
  std::vector<c10::StorageImpl*> out_storages;
  auto add = [&](const at::Tensor& m) -> bool {
    LaunchPlan::Out o;
    if (!m.defined()) {
      plan->outs.push_back(o);
      return true;
    }
    for (const auto& [tw, k] : twins)
      if (tw.unsafeGetTensorImpl() == m.unsafeGetTensorImpl()) {
        o.kind = LaunchPlan::Out::Input;
        o.input = static_cast<int>(k);
        plan->outs.push_back(o);
        return true;
      }
    // layout first: a sparse output (EmbeddingBag(sparse=True)'s grad) has no storage to ask for
    if (m.layout() != at::kStrided || m.is_quantized()) return false;
    c10::StorageImpl* ms = m.storage().unsafeGetStorageImpl();
    for (const auto& p : mstorages)
      if (p.second.unsafeGetStorageImpl() == ms) return false;  // a view of an input
    if (std::find(out_storages.begin(), out_storages.end(), ms) != out_storages.end()) return false;
    if (m.storage_offset() != 0) return false;
    out_storages.push_back(ms);
    o.kind = LaunchPlan::Out::New;
    o.sizes = m.sizes().vec();
    o.strides = m.strides().vec();
    o.dtype = m.scalar_type();
    plan->outs.push_back(std::move(o));
    return true;
  };
  for (size_t r = 0; r < nret; ++r) {
    const c10::IValue& mv = mstack[r];
    if (mv.isTensor()) {
      if (!add(mv.toTensor())) return plan;
      plan->ret_sizes.push_back(LaunchPlan::kSingle);
    } else if (mv.isTensorList()) {
      auto l = mv.toTensorList();
      for (const at::Tensor& m : l)
        if (!add(m)) return plan;
      plan->ret_sizes.push_back(static_cast<int>(l.size()));
    } else if (mv.isNone()) {
      plan->ret_sizes.push_back(LaunchPlan::kNone);
    } else {
      return plan;
    }
  }
  plan->host_path = false;
  plan->meta_failed = false;
  plan->in_place_only = std::none_of(plan->outs.begin(), plan->outs.end(),
                                     [](const LaunchPlan::Out& o) { return o.kind == LaunchPlan::Out::New; });
  return plan;
}

// A plan made by the Meta kernel is checked once against the CPU kernel before it is trusted: the first
// launch of each key runs on the host path and its results' sizes, strides and dtypes (and which are
// arguments returned) must be the plan's; a Meta kernel that disagrees with the CPU's (native_batch_norm's
// saved statistics in eval mode, embedding_bag's offsets) keeps its key on the host path for good.
struct PendingPlan {
  std::shared_ptr<LaunchPlan> plan;
  std::vector<int64_t> key;
  std::vector<int64_t> skey;  // its structure (empty: not counted)
};

// Walks a launch's results (the returns on the stack from `rbase`) against the plan's returns: `each(t, out)`
// for every tensor with its planned output; false at the first difference in the returns' structure or
// when `each` says no.
template <typename Each>
bool walk_results(const LaunchPlan& plan, const torch::jit::Stack& stack, size_t rbase, size_t nret, Each&& each) {
  if (plan.ret_sizes.size() != nret) return false;
  size_t next = 0;
  auto one = [&](const at::Tensor& t) -> bool {
    if (next >= plan.outs.size()) return false;
    const LaunchPlan::Out& o = plan.outs[next];
    return each(t, next++, o);
  };
  for (size_t r = 0; r < nret; ++r) {
    const c10::IValue& v = stack[rbase + r];
    const int n = plan.ret_sizes[r];
    if (n == LaunchPlan::kNone) {
      if (!v.isNone()) return false;
    } else if (n == LaunchPlan::kSingle) {
      if (!v.isTensor() || !one(v.toTensor())) return false;
    } else {
      if (!v.isTensorList()) return false;
      auto l = v.toTensorList();
      if (static_cast<int>(l.size()) != n) return false;
      for (const at::Tensor& t : l)
        if (!one(t)) return false;
    }
  }
  return next == plan.outs.size();
}

// What every result must share with its planned output: undefined-ness, the argument returned in place,
// or a neuron tensor of the planned sizes and dtype at offset 0 (strides are compared by the callers).
bool same_kind(const at::Tensor& t, const LaunchPlan::Out& o, const CallState& cs) {
  if (o.kind == LaunchPlan::Out::Undefined) return !t.defined();
  if (!t.defined()) return false;
  if (o.kind == LaunchPlan::Out::Input) return t.unsafeGetTensorImpl() == cs.ins[o.input].original.unsafeGetTensorImpl();
  return t.device().type() == kNeuron && t.sizes().equals(o.sizes) && t.scalar_type() == o.dtype &&
         t.storage_offset() == 0;
}

// Every stride counts, those of size-1 dims too: kernels choose their path by them (a tensor's suggested
// memory format), so CPU's (16, 1, 16, 16) where a Meta kernel says (16, 1, 1, 1) gave a later
// native_batch_norm_backward other bits than CPU's.
bool same_layout(const at::Tensor& t, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  return t.sizes().equals(sizes) && t.strides().equals(strides);
}

// The written arguments the plan sizes at the launch (resizes) must get the CPU kernel's geometry too: an
// empty out= tensor CPU's TensorIterator sizes like its input (`torch.neg(x.t(), out=empty(0))`: strides
// (1, n)) where the Meta kernel makes it contiguous. Unchecked, such a key was confirmed, its structure
// trusted, and a new shape of it got the Meta layout (`o.view(-1)` worked where CPU's raises).
bool resizes_match(const LaunchPlan& plan, const CallState& cs) {
  for (const auto& r : plan.resizes)
    if (!same_layout(cs.ins[r.input].original, r.sizes, r.strides)) return false;
  return true;
}

bool plan_matches(const LaunchPlan& plan, const torch::jit::Stack& stack, size_t rbase, size_t nret,
                  const CallState& cs) {
  return walk_results(plan, stack, rbase, nret, [&](const at::Tensor& t, size_t, const LaunchPlan::Out& o) {
    if (!same_kind(t, o, cs)) return false;
    if (o.kind != LaunchPlan::Out::New) return true;
    return same_layout(t, o.sizes, o.strides);
  }) && resizes_match(plan, cs);
}

// A Meta kernel may pick another layout than the CPU kernel for the same arguments (a channels-last
// convolution: Meta says contiguous, mkldnn returns channels-last, as the compiled graphs Inductor makes
// for CPU expect). When the first launch's results differ from the plan only in strides (same returns,
// sizes, dtypes, aliasing, distinct fresh dense storages at offset 0), the plan takes the CPU kernel's
// strides: a kernel's layout choice depends on its arguments' metadata, which the plan key holds.
std::shared_ptr<LaunchPlan> plan_with_cpu_strides(const LaunchPlan& plan, const torch::jit::Stack& stack,
                                                        size_t rbase, size_t nret, const CallState& cs) {
  auto fixed = std::make_shared<LaunchPlan>(plan);
  fixed->cpu_strides = true;
  std::vector<const c10::StorageImpl*> seen;
  const bool ok = walk_results(plan, stack, rbase, nret, [&](const at::Tensor& t, size_t i, const LaunchPlan::Out& o) {
    if (!same_kind(t, o, cs)) return false;
    if (o.kind != LaunchPlan::Out::New) return true;
    if (!t.is_non_overlapping_and_dense()) return false;
    const c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
    if (std::find(seen.begin(), seen.end(), st) != seen.end()) return false;
    for (const auto& in : cs.ins)
      if (in.original.storage().unsafeGetStorageImpl() == st) return false;
    seen.push_back(st);
    fixed->outs[i].strides = t.strides().vec();
    return true;
  });
  if (!ok) return nullptr;
  for (auto& r : fixed->resizes) {  // a sized out= argument: the CPU kernel's layout, when it is a dense one
    const at::Tensor& t = cs.ins[r.input].original;
    if (!t.sizes().equals(r.sizes) || !t.is_non_overlapping_and_dense() || t.storage_offset() != 0) return nullptr;
    r.strides = t.strides().vec();
  }
  return fixed;
}

// After a functional kernel ran on the worker: its results (the stack, returns flattened in order) land in
// the outputs the host allocated (`targets`; undefined where an argument is returned in place). A result
// the kernel allocated in its own output block (PlacementGuard) with the output's geometry is already
// there; one that sits in another output's block (or a different view of its own) is first copied out,
// so no copy reads memory an earlier copy wrote.
void land_results(torch::jit::Stack& st, const std::vector<at::Tensor>& targets,
                  c10::ArrayRef<PlacementGuard::Slot> slots) {
  c10::SmallVector<std::pair<const at::Tensor*, at::Tensor>, 4> pairs;
  size_t k = 0;
  auto add = [&](const at::Tensor& t) {
    if (k < targets.size() && targets[k].defined() && t.defined()) pairs.emplace_back(&targets[k], t);
    ++k;
  };
  for (const c10::IValue& v : st) {
    if (v.isTensor()) add(v.toTensor());
    else if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList()) add(t);
    else ++k;
  }
  auto in_place = [](const at::Tensor& dst, const at::Tensor& t) {
    return dst.data_ptr() == t.data_ptr() && dst.sizes().equals(t.sizes()) && dst.strides().equals(t.strides());
  };
  auto in_slots = [&](const at::Tensor& t) {
    const char* p = static_cast<const char*>(t.storage().data());
    for (const auto& sl : slots)
      if (p >= static_cast<const char*>(sl.ptr) && p < static_cast<const char*>(sl.ptr) + sl.nbytes) return true;
    return false;
  };
  for (auto& [dst, t] : pairs)
    if (!in_place(*dst, t) && in_slots(t)) t = t.clone();
  for (auto& [dst, t] : pairs)
    if (!in_place(*dst, t)) dst->copy_(t);
}

// The fields every kernel event has, queued or run on the host: the op (or the name a compiled graph's code
// gives it), its graph, the bytes read and written.
void fill_kernel_fields(EventRecord& ev, const OpMeta& meta, int device, bool new_sig, int64_t bytes_read,
                        int64_t bytes_written) {
  ev.kind = EventKind::Kernel;
  ev.engine = meta.engine;
  ev.device = static_cast<int8_t>(device);
  ev.name_id = meta.name_id;
  const LaunchTag& tag = launch_tag();
  ev.subgraph = tag.subgraph;
  if (tag.name_id >= 0) ev.name_id = tag.name_id;
  ev.bytes_read = bytes_read;
  ev.bytes_written = bytes_written;
  ev.new_signature = new_sig;
}

// A queued kernel's event as every launch path records it: those fields and the signature taken if it is new.
// Not recording: a new signature's pending description is dropped, and the event stays empty.
EventRecord kernel_event(const OpMeta& meta, int device, bool rec, bool new_sig, int64_t bytes_read,
                         int64_t bytes_written) {
  EventRecord ev;
  if (!rec) {
    if (new_sig) {
      int32_t a, b;
      take_pending_signature(meta.name_id, &a, &b);
    }
    return ev;
  }
  fill_kernel_fields(ev, meta, device, new_sig, bytes_read, bytes_written);
  if (new_sig) take_pending_signature(meta.name_id, &ev.shapes_id, &ev.dtypes_id);
  return ev;
}

// Names the launch an error of a queued kernel came from (raised later, at a synchronisation point).
void add_kernel_context(c10::Error& e, const OpMeta& meta, int device, int stream) {
  e.add_context("while running " + meta.name + " on neuron:" + std::to_string(device) + " (stream " +
                std::to_string(stream) + ", emulated NeuronCore, host kernels)");
}

// index_add / index_reduce (self, dim, index, source, ...): the check of source's shape that CPU's kernel makes
// (with its message) and the Meta kernel torch registers does not.
void check_index_source(const torch::jit::Stack& stack, size_t base) {
  const at::Tensor& self = stack[base].toTensor();
  const at::Tensor& source = stack[base + 3].toTensor();
  std::vector<int64_t> a = self.sizes().vec(), b = source.sizes().vec();
  if (source.dim() != 0 && self.dim() != 0) {
    const int64_t dim = c10::maybe_wrap_dim(stack[base + 1].toInt(), self.dim());
    if (dim < static_cast<int64_t>(a.size())) a.erase(a.begin() + dim);
    if (dim < static_cast<int64_t>(b.size())) b.erase(b.begin() + dim);
  }
  TORCH_CHECK(a == b, "source tensor shape must match self tensor shape, excluding the specified dimension. Got "
              "self.shape = ", self.sizes(), " source.shape = ", source.sizes());
}

bool launch_async(const c10::OperatorHandle& op, const OpMeta& meta, torch::jit::Stack* stack, size_t base,
                  size_t nargs, CallState& cs, bool new_sig, bool rec, int64_t bytes_read,
                  const std::vector<at::Tensor>& in_for_flops, PendingPlan* pending) {
  const auto& schema = op.schema();
  // A written argument that shares memory with another argument, or overlaps itself: the CPU kernel's
  // own overlap checks decide, at once, on the host path (Meta kernels do not all make them).
  // A pointwise op whose output is exactly one of its inputs (`torch.mul(x, 2, out=x)`, the foreach
  // kernels' in-place loops) is fine for the CPU kernel (full overlap) and is launched like the rest.
  auto same_view = [](const at::Tensor& a, const at::Tensor& b) {
    return a.data_ptr() == b.data_ptr() && a.scalar_type() == b.scalar_type() && a.sizes().equals(b.sizes()) &&
           a.strides().equals(b.strides());
  };
  for (size_t k = 0; k < cs.ins.size(); ++k) {
    if (!cs.ins[k].writable) continue;
    if (at::has_internal_overlap(cs.ins[k].alias) == at::MemOverlap::Yes) return false;
    for (size_t j = 0; j < cs.ins.size(); ++j) {
      if (j == k || cs.ins[j].alias_storage != cs.ins[k].alias_storage) continue;
      // the same tensor in two slots (alias_in gives them one alias), or an unwritten exact view of it
      const bool same_tensor = cs.ins[j].alias.unsafeGetTensorImpl() == cs.ins[k].alias.unsafeGetTensorImpl();
      if (meta.pointwise && (same_tensor || (!cs.ins[j].writable && same_view(cs.ins[j].original, cs.ins[k].original))))
        continue;
      return false;
    }
  }
  auto alias_index = [&](const at::Tensor& t) -> int {
    for (size_t k = 0; k < cs.ins.size(); ++k)
      if (cs.ins[k].alias.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return static_cast<int>(k);
    return -1;
  };
  static thread_local std::vector<int64_t> key, vals;  // reused: no allocation per launch
  key.clear();
  vals.clear();
  const bool keyed = plan_key(schema, meta, *stack, base, nargs, cs, key, vals);
  std::shared_ptr<const LaunchPlan> plan = keyed ? find_plan(key) : nullptr;
  if (!plan) {
    auto made = make_plan(op, meta, *stack, base, nargs, cs, vals);
    if (!keyed) return false;  // nothing to remember it by: the host path, always
    if (made->host_path) {
      store_plan(key, std::move(made));
      return false;
    }
    std::vector<int64_t> skey, svals;
    if (!plan_key(schema, meta, *stack, base, nargs, cs, skey, svals, /*abstract=*/true)) skey.clear();
    if (!skey.empty()) {
      // the planned outputs' sizes as empty / one / more: which of their dims have size 1 (a convolution to a
      // 1x1 output, a decode step's query of length 1) decides strides a Meta kernel may not give as CPU's,
      // so such keys make their own structure
      skey.push_back(-120);
      for (const auto& o : made->outs)
        if (o.kind == LaunchPlan::Out::New) {
          skey.push_back(static_cast<int64_t>(o.sizes.size()));
          for (int64_t v : o.sizes) skey.push_back(size_class(v));
        }
    }
    if (skey.empty() || meta.meta_lenient || !structure_trusted(skey)) {
      pending->plan = std::move(made);  // checked against the CPU kernel by this (host path) launch
      pending->key = key;
      pending->skey = std::move(skey);
      return false;
    }
    if (meta.index_source_check) check_index_source(*stack, base);
    made->confirmed = true;  // a new shape of a structure the CPU kernel confirmed (StructureRecord)
    store_plan(key, made);
    plan = std::move(made);
    count_path(kTrusted);
  }
  if (plan->vals != vals && plan->in_place_only && meta.pointwise) {
    // An elementwise op that writes only its arguments, launched before, with other float Scalar values
    // (an optimizer's update: `p.addcdiv_(m, d, value=-step_size)`, the foreach ops' per-tensor loops on
    // this device, a bias correction's `div_`): the plan holds as it is. Values decide no size (the written arguments
    // keep theirs) and no dtype (a Scalar's type is in the key); the values reach the kernel through the
    // launch's arguments. The Meta kernels of these ops check no float value, and several are Python
    // (addcdiv_'s: ~35 us a call, every tensor of every step).
  } else if (plan->vals != vals && (plan->meta_failed || !plan->host_path)) {
    // Other Scalar values: the Meta kernel sees them (a value's error is raised at once, on the host path,
    // by the CPU kernel; a size a value decides is found), the CPU check of the structure holds.
    auto made = make_plan(op, meta, *stack, base, nargs, cs, vals);
    if (made->host_path) {
      // the host path raises the value's error (a checked plan stays: the next valid value uses it)
      if (plan->host_path) store_plan(key, std::move(made));
      return false;
    }
    made->confirmed = plan->confirmed;
    auto same_but_strides = [](const LaunchPlan& a, const LaunchPlan& b) {
      if (a.ret_sizes != b.ret_sizes || a.outs.size() != b.outs.size() || !(a.resizes == b.resizes)) return false;
      for (size_t i = 0; i < a.outs.size(); ++i)
        if (a.outs[i].kind != b.outs[i].kind || a.outs[i].input != b.outs[i].input ||
            a.outs[i].sizes != b.outs[i].sizes || a.outs[i].dtype != b.outs[i].dtype)
          return false;
      return true;
    };
    if (!plan->host_path && same_but_strides(*made, *plan)) {
      auto again = std::make_shared<LaunchPlan>(*plan);  // the checked outs (CPU strides kept), new values
      again->vals = vals;
      store_plan(key, again);
      plan = std::move(again);
    } else if (made->confirmed && !plan->cpu_strides) {
      store_plan(key, made);
      plan = std::move(made);
    } else {
      pending->plan = std::move(made);
      pending->key = key;
      return false;
    }
  }
  if (plan->host_path) return false;

  const size_t nret = schema.returns().size();
  struct NewOut {
    at::Tensor neuron;
    at::Tensor alias;
  };
  c10::SmallVector<NewOut, 2> outs;
  std::vector<c10::IValue> results(nret);
  std::vector<at::Tensor> copy_targets;  // per returned tensor, flattened: where its data must land
  c10::DeviceGuard guard(c10::Device(kNeuron, cs.device));
  // Size the empty out= tensors the plan names: a fresh device block in their (shared) storage, as CPU's
  // resize does, and a new CPU alias in the kernel's arguments.
  for (const auto& r : plan->resizes) {
    AliasIn& in = cs.ins[r.input];
    const at::Tensor& t = in.original;
    const size_t nbytes = at::detail::computeStorageNbytes(r.sizes, r.strides, t.dtype().itemsize());
    c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
    st->set_data_ptr_noswap(neuron_allocator()->allocate(nbytes));
    st->set_nbytes(nbytes);
    t.unsafeGetTensorImpl()->set_sizes_and_strides(r.sizes, r.strides, 0);
    at::Tensor a = cpu_alias(t);
    for (size_t i = base; i < stack->size(); ++i) {
      c10::IValue& v = (*stack)[i];
      if (v.isTensor() && v.toTensor().unsafeGetTensorImpl() == in.alias.unsafeGetTensorImpl()) v = a;
    }
    in.alias = a;
    in.alias_storage = a.storage().unsafeGetStorageImpl();
    in.data = st->data_ptr().get();
    in.nbytes = nbytes;
  }
  size_t next = 0;
  auto output = [&]() -> at::Tensor {
    const LaunchPlan::Out& o = plan->outs[next++];
    if (o.kind == LaunchPlan::Out::Undefined) {
      copy_targets.emplace_back();
      return at::Tensor();
    }
    if (o.kind == LaunchPlan::Out::Input) {
      copy_targets.emplace_back();
      return cs.ins[o.input].original;  // in-place / out=: the argument itself
    }
    at::Tensor t = at::detail::empty_strided_generic(o.sizes, o.strides, neuron_allocator(),
                                                     c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), o.dtype);
    outs.push_back({t, cpu_alias(t)});
    copy_targets.push_back(outs.back().alias);
    return t;
  };
  for (size_t r = 0; r < nret; ++r) {
    const int n = plan->ret_sizes[r];
    if (n == LaunchPlan::kNone) {
      results[r] = c10::IValue();
      copy_targets.emplace_back();
    } else if (n == LaunchPlan::kSingle) {
      results[r] = output();
    } else {
      c10::List<at::Tensor> l;
      for (int i = 0; i < n; ++i) l.push_back(output());
      results[r] = std::move(l);
    }
  }

  // The kernel's arguments: CPU aliases; CPU tensors (scalars) are copied now, as a launch copies its
  // arguments, so the host may change them afterwards.
  // That holds for CPU tensors inside list arguments too: `x[i]`, `x[mask] = v` and `index_put_` take
  // their CPU indices and masks as a `Tensor?[]`.
  std::vector<c10::IValue> args(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  auto host_owned = [&](const at::Tensor& t) {
    // (a wrapped Python number is the binding's own temporary: nobody else can change it)
    return t.defined() && t.is_cpu() && alias_index(t) < 0 && !t._is_zerotensor() &&
           !t.unsafeGetTensorImpl()->is_wrapped_number();
  };
  for (c10::IValue& v : args) {
    if (v.isTensor()) {
      if (host_owned(v.toTensor())) v = v.toTensor().clone();
    } else if (v.isTensorList()) {
      const c10::List<at::Tensor> l = v.toTensorList();
      if (std::none_of(l.begin(), l.end(), [&](const at::Tensor& t) { return host_owned(t); })) continue;
      c10::List<at::Tensor> copy;
      copy.reserve(l.size());
      for (const at::Tensor& t : l) copy.push_back(host_owned(t) ? t.clone() : t);
      v = std::move(copy);
    } else if (v.isOptionalTensorList()) {
      const c10::List<std::optional<at::Tensor>> l = v.toOptionalTensorList();
      bool any = false;
      for (const std::optional<at::Tensor>& t : l) any = any || (t.has_value() && host_owned(*t));
      if (!any) continue;
      c10::List<std::optional<at::Tensor>> copy;
      copy.reserve(l.size());
      for (const std::optional<at::Tensor>& t : l)
        copy.push_back(t.has_value() && host_owned(*t) ? std::optional<at::Tensor>(t->clone()) : t);
      v = std::move(copy);
    }
  }
  const bool use_out = meta.out_op.has_value() && outs.size() == nret;
  std::vector<at::Tensor> out_aliases;
  out_aliases.reserve(outs.size());
  for (const auto& o : outs) out_aliases.push_back(o.alias);

  int64_t bytes_written = 0;
  if (rec) {
    for (const auto& o : outs) bytes_written += nbytes_of(o.neuron);
    for (const auto& in : cs.ins)
      if (in.writable) bytes_written += nbytes_of(in.original);
  }
  EventRecord ev = kernel_event(meta, cs.device, rec, new_sig, bytes_read, bytes_written);
  if (rec) {
    at::Tensor out0 = results.empty() || !results[0].isTensor() ? at::Tensor() : results[0].toTensor();
    if (meta.flops != Flops::None && out0.defined()) ev.flops = compute_flops(meta.flops, in_for_flops, out0);
    if (record_shapes_enabled() && ev.shapes_id < 0) record_arg_shapes(cs, ev);
  }

  Work w;
  w.device = cs.device;
  w.stream = current_stream(cs.device);
  w.launch = begin_launch(meta.name_id);
  const int device = cs.device;
  const OpMeta* m = &meta;  // OpMeta entries live as long as the process
  c10::OperatorHandle kernel = use_out ? *meta.out_op : op;
  w.run = [kernel, args = std::move(args), out_aliases = std::move(out_aliases), use_out, rec, ev, device,
           m, stream = w.stream, copy_targets = std::move(copy_targets)](const Launch& l) mutable {
    torch::jit::Stack st(args.begin(), args.end());
    if (use_out)
      for (const at::Tensor& a : out_aliases) st.emplace_back(a);
    const int64_t t0 = now_ns();
    try {
      // The host kernel's scratch memory is the emulator's, not the device's (a device kernel's temporaries
      // live in its registers/SBUF): only the outputs the host allocated at the launch are device memory.
      RedirectGuard host(-1);
      if (use_out) {
        kernel.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st);
      } else {
        c10::SmallVector<PlacementGuard::Slot, 2> slots;
        for (const at::Tensor& d : copy_targets)
          if (d.defined() && d.storage().nbytes() > 0)
            slots.push_back({d.storage().mutable_data(), d.storage().nbytes(), false});
        {
          PlacementGuard place(slots.data(), slots.size());
          kernel.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st);
        }
        land_results(st, copy_targets, slots);
      }
    } catch (c10::Error& e) {
      add_kernel_context(e, *m, device, stream);
      throw;
    }
    const int64_t t1 = now_ns();
    if (rec && recording()) push_launched_event(ev, t0, t1, stream, l);
  };
  const int launch_stream = w.stream;
  const uint64_t pos = enqueue(std::move(w));
  if (cs.rng.defined()) note_random_launch(cs.rng, device, launch_stream, pos);
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  for (auto& r : results) stack->push_back(std::move(r));
  return true;
}

// Whether every device tensor argument of a call holds no bytes (an empty out= tensor a factory sizes):
// the call reads and writes nothing a queued kernel may still use.
bool touches_no_device_bytes(const CallState& cs) {
  for (const auto& in : cs.ins)
    if (in.nbytes != 0) return false;
  return true;
}

// Replaces each tensor an argument or return holds (a Tensor, a Tensor[], a Tensor?[]'s defined ones) by fn(it);
// false, and nothing changed, for any other value.
template <typename F>
bool map_tensors(c10::IValue& v, F&& fn) {
  if (v.isTensor()) {
    v = fn(v.toTensor());
  } else if (v.isTensorList()) {
    auto list = v.toTensorList();
    c10::List<at::Tensor> out;
    out.reserve(list.size());
    for (const at::Tensor& t : list) out.push_back(fn(t));
    v = std::move(out);
  } else if (v.isOptionalTensorList()) {
    auto list = v.toOptionalTensorList();
    c10::List<std::optional<at::Tensor>> out;
    out.reserve(list.size());
    for (const std::optional<at::Tensor>& t : list)
      out.push_back(t.has_value() && t->defined() ? std::optional<at::Tensor>(fn(*t)) : std::nullopt);
    v = std::move(out);
  } else {
    return false;
  }
  return true;
}

// Writes back in-place / out= arguments whose storage or geometry a host kernel changed (on their CPU aliases).
void write_back_writable(CallState& cs) {
  c10::SmallVector<c10::StorageImpl*, 4> storages_done;  // aliases may share one CPU storage
  for (auto& in : cs.ins) {
    if (!in.writable) continue;
    c10::TensorImpl* a = in.alias.unsafeGetTensorImpl();
    c10::TensorImpl* o = in.original.unsafeGetTensorImpl();
    c10::StorageImpl* as = a->storage().unsafeGetStorageImpl();
    const bool done = std::find(storages_done.begin(), storages_done.end(), as) != storages_done.end();
    if (as == in.alias_storage && !done &&
        (as->data_ptr().get() != in.data || as->nbytes() != in.nbytes)) {
      storages_done.push_back(as);
      c10::StorageImpl* ns = o->storage().unsafeGetStorageImpl();
      if (is_neuron_data_ptr(as->data_ptr())) {
        c10::DataPtr dp = as->set_data_ptr(c10::DataPtr());
        dp.unsafe_set_device(c10::Device(kNeuron, cs.device));
        ns->set_data_ptr_noswap(std::move(dp));
      } else if (as->nbytes() == 0) {
        ns->set_data_ptr_noswap(c10::DataPtr(nullptr, c10::Device(kNeuron, cs.device)));
      }
      ns->set_nbytes(as->nbytes());
    } else if (as != in.alias_storage) {
      for (auto& other : cs.ins) {
        if (other.alias_storage == as) {
          o->set_storage_keep_dtype(other.original.storage());
          break;
        }
      }
    }
    if (a->sizes() != o->sizes() || a->strides() != o->strides() ||
        a->storage_offset() != o->storage_offset())
      o->set_sizes_and_strides(a->sizes(), a->strides(), a->storage_offset());
  }
}

// ------------------------------------------------------------------------------------------------
// Sparse COO tensors (README.md "Sparse COO tensors")
//
// A sparse COO neuron tensor is a SparseTensorImpl (key SparsePrivateUse1) whose indices and values are dense
// neuron tensors, as a CUDA one holds CUDA tensors. Its metadata, constructors, resizes, zero_, copies and
// clones are ATen's device-generic kernels, registered for SparsePrivateUse1 below (they only move member
// tensors, whose ops are ordinary neuron launches). Every other op on it (coalesce, to_dense, arithmetic,
// sparse matmuls, reductions, the sparse gradients of embeddings) runs on the host as CPU runs it: after a wait
// for the current stream, the op's CPU kernel runs on SparseCPU twins whose indices and values are zero-copy
// CPU aliases of the neuron members; a sparse result becomes a sparse neuron tensor over the memory the kernel
// allocated (device blocks, through the redirect), and a sparse argument the op changed in place (add_, mul_,
// resize, an out=) gets the twin's new members, sizes and coalesced flag.

at::SparseTensorImpl* sparse_impl(const at::Tensor& t) {
  return static_cast<at::SparseTensorImpl*>(t.unsafeGetTensorImpl());
}

// A sparse COO tensor with `key` over the given members (no copy, no checks: they come from a COO tensor).
at::Tensor assemble_coo(c10::DispatchKey key, int64_t sparse_dim, int64_t dense_dim, c10::IntArrayRef sizes,
                        const at::Tensor& indices, const at::Tensor& values, bool coalesced) {
  std::optional<c10::DeviceGuard> guard;
  if (values.device().type() == kNeuron && current_device() != values.device().index())
    guard.emplace(values.device());
  at::Tensor t = at::detail::make_tensor<at::SparseTensorImpl>(c10::DispatchKeySet(key), values.dtype());
  at::SparseTensorImpl* impl = sparse_impl(t);
  impl->raw_resize_(sparse_dim, dense_dim, sizes);
  impl->set_indices_and_values_unsafe(indices, values);
  impl->set_coalesced(coalesced);
  return t;
}

struct SparseTwin {
  at::Tensor original;  // the neuron tensor
  at::Tensor host;      // its SparseCPU twin
  c10::TensorImpl* indices;  // the twin's members as made
  c10::TensorImpl* values;
};

at::Tensor coo_to_host(CallState& cs, std::vector<SparseTwin>& twins, const at::Tensor& t) {
  for (const auto& tw : twins)
    if (tw.original.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return tw.host;
  at::SparseTensorImpl* impl = sparse_impl(t);
  at::Tensor idx = alias_in(cs, impl->indices(), /*writable=*/true);
  at::Tensor val = alias_in(cs, impl->values(), /*writable=*/true);
  at::Tensor host = assemble_coo(c10::DispatchKey::SparseCPU, impl->sparse_dim(), impl->dense_dim(), t.sizes(), idx,
                                 val, impl->coalesced());
  twins.push_back({t, host, idx.unsafeGetTensorImpl(), val.unsafeGetTensorImpl()});
  return host;
}

// A SparseCPU result of a host kernel as a sparse neuron tensor: an argument's twin returns the argument, with
// what the kernel changed written back; a new one gets neuron members (an argument member's alias maps back to
// that member, memory the kernel allocated is adopted).
at::Tensor coo_from_host(CallState& cs, std::vector<SparseTwin>& twins, const at::Tensor& r) {
  at::SparseTensorImpl* ri = sparse_impl(r);
  for (auto& tw : twins) {
    if (tw.host.unsafeGetTensorImpl() != r.unsafeGetTensorImpl()) continue;
    at::SparseTensorImpl* oi = sparse_impl(tw.original);
    if (ri->indices().unsafeGetTensorImpl() != tw.indices || ri->values().unsafeGetTensorImpl() != tw.values ||
        ri->sizes() != oi->sizes() || ri->sparse_dim() != oi->sparse_dim() || ri->dense_dim() != oi->dense_dim()) {
      at::Tensor idx = map_back(cs, ri->indices());
      at::Tensor val = map_back(cs, ri->values());
      std::optional<c10::DeviceGuard> guard;
      if (current_device() != cs.device) guard.emplace(c10::Device(kNeuron, cs.device));
      oi->raw_resize_(ri->sparse_dim(), ri->dense_dim(), ri->sizes());
      oi->set_indices_and_values_unsafe(idx, val);
      tw.indices = ri->indices().unsafeGetTensorImpl();  // written back once, if returned twice
      tw.values = ri->values().unsafeGetTensorImpl();
    }
    oi->set_coalesced(ri->coalesced());
    return tw.original;
  }
  return assemble_coo(c10::DispatchKey::SparsePrivateUse1, ri->sparse_dim(), ri->dense_dim(), r.sizes(),
                      map_back(cs, ri->indices()), map_back(cs, ri->values()), ri->coalesced());
}

void coo_twins_written_back(CallState& cs, std::vector<SparseTwin>& twins) {
  for (auto& tw : twins) (void)coo_from_host(cs, twins, tw.host);
}

}  // namespace

// Runs an op whose arguments hold sparse COO neuron tensors (or that makes one from dense neuron tensors:
// `_to_sparse`) on the host, as CPU runs it (above).
void sparse_host_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet /*ks*/, torch::jit::Stack* stack) {
  check_not_in_bad_fork();
  adopt_host_cpu_settings();
  const OpMeta& meta = op_meta(op);
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  const bool rec = recording();
  CallState cs;
  std::vector<SparseTwin> twins;
  std::string foreign_dev, foreign_arg;  // a tensor on another device (CPU scalars aside): CUDA's error
  auto convert = [&](const at::Tensor& t, size_t argi) -> at::Tensor {
    if (!t.defined()) return t;
    if (t.device().type() != kNeuron) {
      if (foreign_dev.empty() && !(t.is_cpu() && t.dim() == 0 && t.layout() == c10::kStrided)) {
        foreign_dev = t.device().str();
        foreign_arg = schema.arguments()[argi].name();
      }
      return t;
    }
    const int d = t.device().index();
    if (cs.device < 0) cs.device = d;
    else if (d != cs.device)
      device_mismatch("neuron:" + std::to_string(cs.device), "neuron:" + std::to_string(d),
                      schema.arguments()[argi].name(), meta.name);
    if (t.layout() == c10::kSparse) return coo_to_host(cs, twins, t);
    if (t.layout() != c10::kStrided || t.is_quantized() || t.is_nested()) unsupported_layout(t, meta.name);
    return alias_in(cs, t, /*writable=*/true);
  };
  for (size_t i = 0; i < nargs; ++i) {
    c10::IValue& v = (*stack)[base + i];
    if (map_tensors(v, [&](const at::Tensor& t) { return convert(t, i); })) continue;
    if (v.isDevice() && v.toDevice().type() == kNeuron) {
      if (cs.device < 0) cs.device = v.toDevice().has_index() ? v.toDevice().index() : current_device();
      v = c10::IValue(c10::Device(c10::kCPU));
    } else if (v.isGenerator() && v.toGenerator().device().type() == kNeuron) {
      TORCH_CHECK_NOT_IMPLEMENTED(false, meta.name, " on sparse neuron tensors does not take a neuron Generator "
                                  "(its kernel runs on the host with the CPU generator)");
    }
  }
  if (!foreign_dev.empty() && (!cs.ins.empty() || !twins.empty()))
    device_mismatch("neuron:" + std::to_string(cs.device), foreign_dev, foreign_arg, meta.name);
  if (cs.device < 0) cs.device = current_device();
  check_device_index(cs.device);
  // the host reads and writes the members: what the current stream launched before must have run
  synchronize_stream(cs.device, current_stream(cs.device), ("sync: " + meta.name).c_str(), /*record_always=*/false,
                     /*raise_errors=*/false);
  const int64_t t0 = rec ? now_ns() : 0;
  try {
    std::optional<c10::DeviceGuard> guard;
    if (current_device() != cs.device) guard.emplace(c10::Device(kNeuron, cs.device));
    RedirectGuard redirect(cs.device);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    at::RecordFunctionGuard no_op_events(false);
    op.callBoxed(stack);  // CPU's kernels (SparseCPU, CPU, BackendSelect for a factory's layout)
  } catch (c10::Error& e) {
    end_host_thread_pool();
    e.add_context("while running " + meta.name + " on sparse neuron tensors (emulated NeuronCore, host kernels)");
    throw;
  }
  const int64_t t1 = rec ? now_ns() : 0;
  end_host_thread_pool();
  write_back_writable(cs);
  coo_twins_written_back(cs, twins);
  auto back = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || !t.is_cpu()) return t;
    if (t.layout() == c10::kSparse) return coo_from_host(cs, twins, t);
    if (t.layout() != c10::kStrided || t.is_quantized() || t.is_nested()) unsupported_layout(t, meta.name);
    return map_back(cs, t);
  };
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  for (size_t i = 0; i < nret; ++i) map_tensors((*stack)[rbase + i], back);
  if (rec) {
    EventRecord ev;
    fill_kernel_fields(ev, meta, cs.device, false, 0, 0);
    ev.start_ns = t0;
    ev.end_ns = t1;
    ev.stream = current_stream(cs.device);
    push_event(ev);
  }
}

namespace {

void neuron_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet /*ks*/, torch::jit::Stack* stack) {
  check_not_in_bad_fork();
  adopt_host_cpu_settings();  // a kernel this thread runs on the host (an autograd thread's too)
  const OpMeta& meta = op_meta(op);
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  const bool rec = recording();
  CallState cs;
  SigBuilder sig{reinterpret_cast<uint64_t>(&schema), {}};
  std::vector<at::Tensor> in_for_flops;
  int64_t bytes_read = 0;
  std::string foreign_dev, foreign_arg;

  auto convert = [&](const at::Tensor& t, size_t argi) -> at::Tensor {
    if (!t.defined()) return t;
    note_tensor_sig(sig, t);
    if (rec) {
      if (!schema.arguments()[argi].is_out()) bytes_read += nbytes_of(t);  // an out= tensor is only written
      if (meta.flops != Flops::None) in_for_flops.push_back(t);
    }
    if (t.device().type() == kNeuron) {
      const int d = t.device().index();
      if (cs.device < 0) cs.device = d;
      else if (d != cs.device)
        device_mismatch("neuron:" + std::to_string(cs.device), "neuron:" + std::to_string(d),
                        schema.arguments()[argi].name(), meta.name);
      if (t._is_zerotensor()) {
        // A ZeroTensor has no memory behind it (ATen's ZeroTensor kernels handle the ops that know
        // it); any other op reads it as the zeros it stands for, as ATen's ZeroTensor fallback does.
        TORCH_CHECK(!meta.write_args[argi], "ZeroTensors are immutable. Please materialize the tensor using "
                    "`.clone()`, if you want a mutable zero tensor.");
        return at::zeros(t.sizes(), t.options().device(c10::kCPU));
      }
      return alias_in(cs, t, meta.write_args[argi]);
    }
    if (t.is_cpu()) {
      // A 0-dim CPU tensor may be read as a scalar where CUDA allows it (ops without a device check, and an
      // op's keyword-only inputs, which CUDA's check skips); written (out=/in-place) never.
      TORCH_CHECK(static_cast<int>(argi) != meta.mask_arg || meta.allow_cpu_tensors,
                  "expected self and mask to be on the same device, but got mask on cpu and self on neuron:",
                  cs.device < 0 ? current_device() : cs.device);
      if (static_cast<int>(argi) == meta.copied_cpu_arg) return t.clone();
      const bool scalar_ok = t.dim() == 0 && !meta.write_args[argi] &&
                             (!meta.exact_device || schema.arguments()[argi].kwarg_only());
      if (!scalar_ok && !meta.allow_cpu_tensors && foreign_dev.empty()) {
        foreign_dev = "cpu";
        foreign_arg = schema.arguments()[argi].name();
      }
      return t;
    }
    if (foreign_dev.empty()) {
      foreign_dev = t.device().str();
      foreign_arg = schema.arguments()[argi].name();
    }
    return t;
  };

  for (size_t i = 0; i < nargs; ++i)
    map_tensors((*stack)[base + i], [&](const at::Tensor& t) { return convert(t, i); });
  for (int i : meta.device_args) {
    c10::IValue& v = (*stack)[base + i];
    if (!v.isDevice()) continue;
    const c10::Device d = v.toDevice();
    if (d.type() == kNeuron) {
      if (cs.device < 0) cs.device = d.has_index() ? d.index() : current_device();
      v = c10::IValue(c10::Device(c10::kCPU));
    } else if (d.is_cpu()) {
      cs.cpu_outputs = true;
    }
  }
  if (cs.device < 0) {
    // No neuron tensor and no neuron device: only a neuron Generator brought the call here (a CPU tensor's
    // `uniform_(generator=g)`, `torch.rand(n, generator=g)`). CPU's check: the generator must be a CPU one
    // (the kernel would otherwise write CPU tensors through clones, or make neuron outputs).
    for (int i : meta.gen_args) {
      const c10::IValue& v = (*stack)[base + i];
      if (v.isGenerator())
        TORCH_CHECK(v.toGenerator().device().type() != kNeuron,
                    "Expected a 'cpu' device type for generator but found 'neuron'");
    }
    cs.device = current_device();
  }
  if (!foreign_dev.empty() && !cs.ins.empty())
    device_mismatch("neuron:" + std::to_string(cs.device), foreign_dev, foreign_arg, meta.name);
  check_device_index(cs.device);
  for (int i : meta.gen_args) {
    c10::IValue& v = (*stack)[base + i];
    if (v.isNone()) {
      cs.rng = default_generator(cs.device);
      v = c10::IValue(cpu_engine_of(cs.rng));
    } else if (v.isGenerator()) {
      cs.rng = v.toGenerator();
      v = c10::IValue(cpu_engine_of(cs.rng));
    }
  }

  bool new_sig = false;
  if (!meta.view_only) {
    new_sig = note_signature(cs.device, sig.hash, [&]() {
      std::ostringstream o;
      o << meta.name << "(";
      bool first = true;
      for (const auto& in : cs.ins) {
        o << (first ? "" : ", ") << dtype_name(in.original.scalar_type()) << shape_str(in.original.sizes());
        first = false;
      }
      o << ")";
      return o.str();
    });
  }

  // Asynchronous launch; otherwise (a view, a sync op, results that need the data, the first launch of
  // a plan) the host runs the op itself, after waiting for its stream unless the op only makes a view or
  // touches no device bytes.
  PendingPlan pending;
  std::optional<HostNowGuard> host_now;
  const bool draws_rng = meta.draws_rng(*stack, base);
  const bool async_ok = meta.async_ok || (meta.async_ok_without_rng && !draws_rng);
  if (draws_rng) cs.rng = default_generator(cs.device);
  if (worker_stream() < 0) {
    // draws in launch order: behind the generator's last random launch on another stream (the host path
    // below waits for this stream, so for that launch too)
    if (cs.rng.defined()) order_random_launch(cs.rng, cs.device, current_stream(cs.device));
    // TORCHNEURON_LAB_LAUNCH_BLOCKING=1: every kernel runs on the host at its launch (errors raised there)
    if (async_ok && !cs.cpu_outputs && !launch_blocking() &&
        launch_async(op, meta, stack, base, nargs, cs, new_sig, rec, bytes_read, in_for_flops, &pending)) {
      count_path(kQueued);
      return;
    }
    // A sync op (data-dependent shape, a value) is a synchronisation point: always recorded. Any other
    // op on the host path (no Meta kernel, the first launch of a plan) is recorded only if it waited.
    // The first launch of a plan waits too, unrecorded: it is the emulator's own check of the plan (like a
    // signature's compile on the device), not a synchronisation point of the program.
    if (!meta.view_only && !meta.sync && !cs.rng.defined() && touches_no_device_bytes(cs)) {
      // Every device tensor argument holds no bytes (`torch.arange(n, device=...)`: its out= tensor is
      // empty until the kernel sizes it): nothing a queued kernel writes is read, so the host runs it now
      // (a plan's first launch too), on memory no queued kernel uses, instead of waiting for the stream.
      host_now.emplace();
      count_path(kHostNow);
    } else if (!meta.view_only && pending.plan) {
      count_path(kPlanCheck);
      const int st = current_stream(cs.device);
      const int64_t w0 = now_ns();
      wait_position_quiet(cs.device, st, stream_enqueued(cs.device, st));
      // not an event (not a sync of the program), but time the host lost: the lab reports it apart
      g_plan_check_wait_ns.fetch_add(now_ns() - w0, std::memory_order_relaxed);
      // an error a queued kernel raised stays pending: this wait is the emulator's, not a sync of the program
    } else if (!meta.view_only) {
      count_path(kHostWait);
      // only a sync op (a data-dependent shape, a value) is a synchronisation point that reports a queued
      // kernel's error; the others wait because the emulator runs them on the host (CUDA does not sync there)
      // (_assert_async is on the emulator's host path, but CUDA's does not synchronise)
      if (meta.sync && meta.name.rfind("aten::_assert_async", 0) != 0) warn_or_error_on_sync(("sync: " + meta.name).c_str());
      synchronize_stream(cs.device, current_stream(cs.device), ("sync: " + meta.name).c_str(),
                         /*record_always=*/meta.sync || !async_ok, /*raise_errors=*/meta.sync);
    }
  }

  // Random ops without a Generator argument draw from the CPU default generator inside host kernels:
  // lend it the device generator's state for the call, then hand the advanced state back.
  std::optional<at::Tensor> saved_cpu_rng;
  at::Generator engine;
  if (draws_rng) {
    engine = cpu_engine_of(default_generator(cs.device));
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    saved_cpu_rng = cpu.get_state();
    std::lock_guard<std::mutex> lock2(engine.mutex());
    cpu.set_state(engine.get_state());
  }
  struct RngRestore {
    std::optional<at::Tensor>& saved;
    at::Generator& engine;
    ~RngRestore() {
      if (!saved.has_value()) return;
      at::Generator cpu = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(cpu.mutex());
      {
        std::lock_guard<std::mutex> lock2(engine.mutex());
        engine.set_state(cpu.get_state());
      }
      cpu.set_state(*saved);
    }
  } rng_restore{saved_cpu_rng, engine};

  const int64_t t0 = rec ? now_ns() : 0;
  try {
    std::optional<c10::DeviceGuard> guard;
    if (current_device() != cs.device) guard.emplace(c10::Device(kNeuron, cs.device));
    RedirectGuard redirect(cs.cpu_outputs ? -1 : cs.device);
    // The CPU kernel's own ATen calls run on CPU aliases: the caller's torch.autocast("cpu") must not reach them
    // (a device kernel never sees CPU autocast; on a worker the thread's autocast is off). MHA's fast path ran in
    // bf16 on neuron under CPU autocast.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    // Nor the profiler's op callbacks: its inner ATen calls are the emulator's (a device kernel's work), not
    // ops of the program (a first call's host check listed le, where, empty_permuted... under relu)
    at::RecordFunctionGuard no_op_events(false);
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  } catch (c10::Error& e) {
    end_host_thread_pool();
    e.add_context("while running " + meta.name + " on neuron:" + std::to_string(cs.device) +
                  " (emulated NeuronCore, host kernels)");
    throw;
  }
  const int64_t t1 = rec ? now_ns() : 0;
  end_host_thread_pool();
  if (cs.rng.defined() && worker_stream() < 0) {
    // drew on the host, after this stream's queued work: a later random launch on another stream waits
    // for this stream's position
    const int st = current_stream(cs.device);
    note_random_launch(cs.rng, cs.device, st, stream_enqueued(cs.device, st));
  }

  // write back in-place / out= arguments whose storage or geometry the kernel changed
  if (meta.any_write) write_back_writable(cs);

  int64_t bytes_written = 0;
  at::Tensor out0;
  auto back = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || cs.cpu_outputs || !t.is_cpu()) return t;
    // a nested tensor reports the strided layout: a CPU kernel that makes one from dense neuron tensors
    // (nn.TransformerEncoder's eval fast path: _nested_tensor_from_mask) raised c10's internal error
    if (t.layout() == c10::kSparse) {  // a sparse gradient (embedding_bag's): members adopted as device tensors
      std::vector<SparseTwin> none;
      return coo_from_host(cs, none, t);
    }
    if (t.layout() != at::kStrided || t.is_quantized() || t.is_nested()) unsupported_layout(t, meta.name);
    bool is_input = false;
    at::Tensor r = map_back(cs, t, &is_input);
    if (rec && (is_input || !meta.view_only)) bytes_written += nbytes_of(t);
    return r;
  };
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  for (size_t i = 0; i < nret; ++i) {
    c10::IValue& v = (*stack)[rbase + i];
    map_tensors(v, back);
    if (i == 0 && v.isTensor()) out0 = v.toTensor();
  }
  if (pending.plan) {
    const bool matched = plan_matches(*pending.plan, *stack, rbase, nret, cs);
    note_structure(pending.skey, matched);
    if (matched) {
      pending.plan->confirmed = true;
      store_plan(std::move(pending.key), pending.plan);
    } else if (auto cpu_layout = plan_with_cpu_strides(*pending.plan, *stack, rbase, nret, cs)) {
      cpu_layout->confirmed = true;
      store_plan(std::move(pending.key), std::move(cpu_layout));
    } else {
      auto host = std::make_shared<LaunchPlan>();
      host->host_path = true;
      store_plan(std::move(pending.key), host);
    }
  }

  if (rec && !meta.view_only) {
    EventRecord ev;
    fill_kernel_fields(ev, meta, cs.device, new_sig, bytes_read, bytes_written);
    ev.start_ns = t0;
    ev.end_ns = t1;
    if (meta.flops != Flops::None) ev.flops = compute_flops(meta.flops, in_for_flops, out0);
    if (record_shapes_enabled()) {
      record_arg_shapes(cs, ev);
    }
    ev.stream = current_stream(cs.device);
    push_event(ev);
  }
}

// ------------------------------------------------------------------------------------------------
// Native kernels

// torch.use_deterministic_algorithms(True): uninitialised memory is filled (NaN, or the integer maximum),
// as CPU and CUDA do, unless torch.utils.deterministic.fill_uninitialized_memory is False.
void fill_if_deterministic(at::Tensor& t) {
  if (at::globalContext().deterministicAlgorithms() && at::globalContext().deterministicFillUninitializedMemory()) {
    // the fill goes through the fallback: launched on the stream like any kernel
    at::native::fill_empty_deterministic_(t);
  }
}

int device_index_of(std::optional<c10::Device> d) {
  if (!d.has_value() || !d->has_index()) return current_device();
  return d->index();
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned");  // as CUDA's empty
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided, "neuron tensors support only the strided layout, got ",
              *layout);
  const int d = device_index_of(device);
  check_device_index(d);
  c10::DeviceGuard guard(c10::Device(kNeuron, d));
  at::Tensor t = at::detail::empty_generic(size, neuron_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype), memory_format);
  fill_if_deterministic(t);
  return t;
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned");  // as CUDA's empty
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided, "neuron tensors support only the strided layout, got ",
              *layout);
  const int d = device_index_of(device);
  check_device_index(d);
  c10::DeviceGuard guard(c10::Device(kNeuron, d));
  at::Tensor t = at::detail::empty_strided_generic(size, stride, neuron_allocator(),
                                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                   c10::dtype_or_default(dtype));
  fill_if_deterministic(t);
  return t;
}

// native_dropout draws with the device generator passed explicitly (the CPU kernel would draw from the
// process-wide CPU generator, which other threads use concurrently). Same steps as ATen's CPU kernel, so
// a seeded neuron dropout equals a CPU dropout from the same generator state.
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0) return std::make_tuple(input, at::empty_like(input, input.options()));
  if (train.has_value() && !*train) {
    return std::make_tuple(input.clone(), at::ones_like(input, input.options().dtype(at::kBool)));
  }
  const double keep = 1. - p;
  const double scale = keep == 0 ? 0. : 1. / keep;
  at::Tensor mask = at::empty_like(input, input.options().dtype(at::kBool));
  mask.bernoulli_(keep, default_generator(input.device().index()));
  at::Tensor output = input.mul(mask).mul_(scale);
  return std::make_tuple(output, mask);
}

// torch._efficientzerotensor on neuron: a tensor with no memory behind it, as on CPU and CUDA (forward-mode
// AD makes these for the tangents of constants). ATen's ZeroTensor kernels run above the backend.
at::Tensor efficientzerotensor(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> /*pin_memory*/) {
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided, "neuron tensors support only the strided layout, got ",
              *layout);
  const int d = device_index_of(device);
  check_device_index(d);
  // the storage keeps a pointer to its allocator: one per device, alive for the process
  static std::array<std::unique_ptr<at::native::ZeroTensorAllocator>, 64> zeros;
  static std::once_flag once;
  std::call_once(once, [] {
    for (int i = 0; i < 64; ++i) zeros[i] = std::make_unique<at::native::ZeroTensorAllocator>(c10::Device(kNeuron, i));
  });
  const auto ks = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1) | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);
  return at::detail::empty_generic(size, zeros[d].get(), ks, c10::dtype_or_default(dtype), std::nullopt);
}

EventRecord dma_event(const char* name, Direction dir, int device, int64_t t0, int64_t t1, int64_t bytes) {
  EventRecord ev;
  ev.kind = EventKind::Dma;
  ev.engine = Engine::Dma;
  ev.direction = dir;
  ev.device = static_cast<int8_t>(device);
  static const int32_t h2d = intern_string("dma: host→device");
  static const int32_t d2h = intern_string("dma: device→host");
  static const int32_t d2d = intern_string("dma: device→device");
  static const int32_t copy = intern_string("aten::copy_");
  ev.name_id = dir == Direction::H2D ? h2d : dir == Direction::D2H ? d2h : (std::strcmp(name, "copy") == 0 ? copy : d2d);
  ev.start_ns = t0;
  ev.end_ns = t1;
  ev.bytes_read = bytes;
  ev.bytes_written = bytes;
  return ev;
}

void record_dma(const char* name, Direction dir, int device, int64_t t0, int64_t t1, int64_t bytes) {
  push_event(dma_event(name, dir, device, t0, t1, bytes));
}


// Copies follow PyTorch's CUDA copy: device-to-device copies are launched on the destination's current
// stream (between devices with a barrier each way on the source's current stream, as CUDA's); a host<->device
// copy with non_blocking=False waits for the stream (the copy runs after the work launched before it, and the
// host gets the data); with non_blocking=True it is launched too (a pageable
// host source is staged, copied at the launch, as cudaMemcpyAsync does; a pinned one is read by the DMA).
bool is_sub_byte(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::UInt1: case c10::ScalarType::UInt2: case c10::ScalarType::UInt3:
    case c10::ScalarType::UInt4: case c10::ScalarType::UInt5: case c10::ScalarType::UInt6:
    case c10::ScalarType::UInt7: case c10::ScalarType::Int1: case c10::ScalarType::Int2:
    case c10::ScalarType::Int3: case c10::ScalarType::Int4: case c10::ScalarType::Int5:
    case c10::ScalarType::Int6: case c10::ScalarType::Int7:
      return true;
    default:
      return false;
  }
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  check_not_in_bad_fork();
  const bool src_n = self.device().type() == kNeuron;
  const bool dst_n = dst.device().type() == kNeuron;
  TORCH_CHECK(src_n || self.is_cpu(), "copy from ", self.device(), " to ", dst.device(), " is not supported");
  TORCH_CHECK(dst_n || dst.is_cpu(), "copy from ", self.device(), " to ", dst.device(), " is not supported");
  // Sub-byte dtypes (uint1..7, int1..7: one element per byte, no CPU copy kernel) are copied as bytes where
  // CUDA copies them with a memcpy: same dtype, same shape, both contiguous; otherwise the CPU's error.
  if (self.scalar_type() == dst.scalar_type() && is_sub_byte(dst.scalar_type()) && self.sizes() == dst.sizes() &&
      self.is_contiguous() && dst.is_contiguous()) {
    copy_from(self.view(at::kByte), dst.view(at::kByte), non_blocking);
    return dst;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!is_sub_byte(self.scalar_type()) && !is_sub_byte(dst.scalar_type()),
                              "\"copy_kernel\" not implemented for '",
                              is_sub_byte(dst.scalar_type()) ? dst.scalar_type() : self.scalar_type(), "'");
  const int dev = dst_n ? dst.device().index() : self.device().index();
  const Direction dir = src_n && dst_n ? Direction::D2D : dst_n ? Direction::H2D : Direction::D2H;
  const char* dname = src_n && dst_n ? (self.device() == dst.device() ? "copy" : "d2d") : dst_n ? "h2d" : "d2h";
  if (dst.numel() == 0) {
    // Nothing to move (`torch.tensor([], device=...)`): the copy's checks (shapes, dtypes) on meta twins,
    // no wait for the stream and no DMA.
    at::empty_strided(dst.sizes(), dst.strides(), dst.options().device(c10::kMeta))
        .copy_(at::empty_strided(self.sizes(), self.strides(), self.options().device(c10::kMeta)));
    return dst;
  }
  at::Tensor s = src_n ? cpu_alias(self) : self;
  // src and dst sharing a neuron storage share one CPU storage, so the copy's overlap checks hold
  at::Tensor d = !dst_n ? dst
                 : (src_n && self.storage().unsafeGetStorageImpl() == dst.storage().unsafeGetStorageImpl())
                     ? cpu_view_on(dst, s.storage())
                     : cpu_alias(dst);
  // a copy between overlapping memory is checked by the CPU copy itself, on the host path
  const bool overlapping = src_n && dst_n && self.storage().unsafeGetStorageImpl() == dst.storage().unsafeGetStorageImpl();
  const bool cross = src_n && dst_n && self.device() != dst.device();
  const int src_dev = cross ? self.device().index() : -1;
  // A device-to-host copy into pageable memory is synchronous even with non_blocking=True, as CUDA's
  // cudaMemcpyAsync to pageable memory returns once the copy is done: the caller may read it at once.
  const bool async = worker_stream() < 0 && !launch_blocking() && !overlapping &&
                     ((src_n && dst_n) || (non_blocking && (dst_n || is_pinned_host_ptr(dst.data_ptr()))));
  if (cross && !async)
    synchronize_stream(src_dev, current_stream(src_dev), "sync: device→device copy");
  if (async) {
    // the same checks the copy makes, at the launch (shapes, overlap), on meta twins
    {
      std::vector<std::pair<c10::StorageImpl*, c10::Storage>> ms;
      at::Tensor md = dst_n ? meta_twin(d, ms) : at::empty_strided(dst.sizes(), dst.strides(), dst.options().device(c10::kMeta));
      at::Tensor msrc = src_n ? meta_twin(s, ms) : at::empty_strided(self.sizes(), self.strides(), self.options().device(c10::kMeta));
      md.copy_(msrc);
    }
    // and what meta twins cannot see: a destination whose elements share memory (`expand(...).copy_`),
    // CPU's error at the call
    at::assert_no_internal_overlap(d);
    if (!src_n) s = is_pinned_host_ptr(self.data_ptr()) ? host_alias(self) : self.clone();  // pinned: read by the DMA; else staged now
    if (!dst_n) d = host_alias(dst);  // pinned (else not async): written by the DMA
    const bool rec = recording();
    const int64_t bytes = nbytes_of(dst);
    Work w;
    w.device = dev;
    w.stream = current_stream(dev);
    static const int32_t copy_id = intern_string("aten::copy_");
    w.launch = begin_launch(copy_id);
    // Between devices, CUDA's two-way barrier, without blocking the host: the copy (on the destination's
    // stream) waits for the work launched on the source's current stream so far, and that stream's later
    // work (a kernel writing the source, a launch reusing its freed block) waits for the copy.
    const int src_stream = cross ? current_stream(src_dev) : -1;
    if (cross) enqueue_stream_wait(dev, w.stream, src_dev, src_stream, stream_enqueued(src_dev, src_stream));
    w.run = [s, d, dir, dname, dev, bytes, rec, stream = w.stream](const Launch& l) {
      const int64_t t0 = now_ns();
      {
        RedirectGuard redirect(-1);
        d.copy_(s);
      }
      if (rec && recording()) {
        const int64_t t1 = now_ns();
        push_launched_event(dma_event(dname, dir, dev, t0, t1, bytes), t0, t1, stream, l);
      }
    };
    const int dst_stream = w.stream;
    const uint64_t pos = enqueue(std::move(w));
    if (cross) enqueue_stream_wait(src_dev, src_stream, dev, dst_stream, pos);
    return dst;
  }
  // CUDA's copies between host and device with non_blocking=False (memcpy_and_sync) are its sync debug mode's
  // too; a copy synchronous here only under launch blocking or into pageable memory, or between devices, is not
  if (worker_stream() < 0 && (dir == Direction::D2H || dir == Direction::H2D) && !non_blocking)
    warn_or_error_on_sync(dir == Direction::D2H ? "sync: device→host copy" : "sync: host→device copy");
  if (worker_stream() < 0)
    synchronize_stream(dev, current_stream(dev), dir == Direction::D2H ? "sync: device→host copy" : dir == Direction::H2D
                                                                            ? "sync: host→device copy"
                                                                            : "sync: device→device copy");
  const bool rec = recording();
  const int64_t t0 = rec ? now_ns() : 0;
  {
    RedirectGuard redirect(-1);
    d.copy_(s);
  }
  if (rec) {
    EventRecord ev = dma_event(dname, dir, dev, t0, now_ns(), nbytes_of(dst));
    ev.stream = current_stream(dev);
    push_event(ev);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// Storages of neuron tensors allocate through the neuron allocator on their own device, so ATen's CPU
// resize/set_ code (size and overflow checks, bounds checks, deterministic fill) runs unchanged on them.
void prepare_storage_for_resize(const at::Tensor& self) {
  c10::StorageImpl* st = self.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  if (st != nullptr && st->allocator() != neuron_allocator()) st->set_allocator(neuron_allocator());
}

// ATen's CPU resize_/set_ set the new sizes before checking and allocating; when that fails (overflow,
// out of memory) the CPU tensor is left claiming more elements than its storage holds, and the next op
// reads or writes out of bounds. On neuron a failed resize_/set_ leaves the tensor exactly as it was.
struct GeometryRestore {
  explicit GeometryRestore(const at::Tensor& t)
      : impl(t.unsafeGetTensorImpl()), storage(impl->storage()), sizes(impl->sizes().vec()),
        strides(impl->strides().vec()), offset(impl->storage_offset()) {}
  void restore() {
    if (impl->storage().unsafeGetStorageImpl() != storage.unsafeGetStorageImpl()) impl->set_storage_keep_dtype(storage);
    impl->set_sizes_and_strides(sizes, strides, offset);
  }
  c10::TensorImpl* impl;
  c10::Storage storage;
  std::vector<int64_t> sizes, strides;
  int64_t offset;
};

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(self.device());
  prepare_storage_for_resize(self);
  // Growing the storage copies its bytes on the host: queued kernels writing them must finish first.
  uint64_t need = self.dtype().itemsize();
  bool overflow = false;
  for (int64_t v : size) overflow |= v < 0 || c10::mul_overflows(need, static_cast<uint64_t>(v), &need);
  overflow |= c10::add_overflows(need, static_cast<uint64_t>(self.storage_offset()) * self.dtype().itemsize(), &need);
  if (self.has_storage() && (overflow || need > self.storage().nbytes()) && worker_stream() < 0)
    synchronize_stream(self.device().index(), current_stream(self.device().index()), "sync: resize_");
  GeometryRestore before(self);
  HostNowGuard now;  // a grown storage is copied on the host now
  try {
    return at::native::resize_(self, size, memory_format);
  } catch (...) {
    before.restore();
    throw;
  }
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kNeuron,
              "Attempted to set the storage of a tensor on device \"", self.device(),
              "\" to a storage on different device \"", source.device(), "\".  This is no longer allowed; the "
              "devices must match.");
  c10::DeviceGuard guard(source.device().has_index() ? source.device() : self.device());
  // A geometry past the storage's end grows it, copying its bytes on the host, as resize_ does: queued kernels
  // writing them must finish first (else the copy took the bytes before them and their writes went to the
  // old block: a lost result).
  if (worker_stream() < 0 && source.nbytes() > 0) {
    size_t need = 0;
    try {
      need = stride.empty() ? at::detail::computeStorageNbytesContiguous(size, self.dtype().itemsize(), offset)
                            : at::detail::computeStorageNbytes(size, stride, self.dtype().itemsize(), offset);
    } catch (const std::exception&) {
      need = 0;  // set_storage_cpu_ raises its own error for this geometry
    }
    if (need > source.nbytes()) {
      const int d = source.device().has_index() ? source.device().index() : current_device();
      synchronize_stream(d, current_stream(d), "sync: set_ (storage grown)");
    }
  }
  GeometryRestore before(self);
  try {
    HostNowGuard now;  // a grown storage is copied on the host now
    at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
  } catch (...) {
    before.restore();
    throw;
  }
  prepare_storage_for_resize(self);
  return self;
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage source, c10::SymInt offset,
                                      c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return set_storage(self, std::move(source), offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
                     C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes() / self.element_size());
  return set_storage(self, std::move(source), 0, {n}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& src) {
  if (self.unsafeGetTensorImpl() == src.unsafeGetTensorImpl()) return self;
  return set_storage(self, src.storage(), src.storage_offset(), src.sizes(), src.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, neuron_allocator(), true);
  st.unsafeGetStorageImpl()->set_data_ptr_noswap(c10::DataPtr(nullptr, self.device()));
  return set_storage(self, std::move(st), 0, {0}, {});
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  check_not_in_bad_fork();
  const int d = self.device().index();
  if (worker_stream() < 0) {
    warn_or_error_on_sync("sync: item()");
    synchronize_stream(d, current_stream(d), "sync: item()");
  }
  const bool rec = recording();
  const int64_t t0 = rec ? now_ns() : 0;
  at::Scalar r = at::_local_scalar_dense(cpu_alias(self));
  if (rec) record_dma("d2h", Direction::D2H, d, t0, now_ns(), self.element_size());
  return r;
}

// Tensor.record_stream(s): the tensor's block is used by work on `s` too; when freed, it is reused only
// after the work launched on `s` until then has completed (the caching allocator's rule, as torch.cuda).
void record_stream(at::Tensor& self, c10::Stream s) {
  TORCH_CHECK(s.device_type() == kNeuron, "record_stream: expected a neuron stream, got ", s);
  if (!self.has_storage() || self.storage().data_ptr().get() == nullptr) return;
  record_block_stream(self.storage().data_ptr().get(), s.device_index(), static_cast<int>(s.id()));
}

// nn.Module.to("neuron") moves parameters in place (param.data = moved) when this says yes, as for CUDA.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto plain = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && (t.is_cpu() || t.device().type() == kNeuron) && !t.is_quantized();
  };
  if (self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set())) return true;
  return plain(self) && plain(from);
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}

// ------------------------------------------------------------------------------------------------
// Launch fast path for the hottest eager ops: add/sub/mul/div (Tensor overloads, functional and in place)
// of dense same-shape floating tensors, or a tensor and a Python number. The general path above (plan
// cache, CPU aliases built on the host, a boxed closure) costs ~3 us per launch, twice a CPU op of 64x64;
// here the host checks the arguments, allocates the output, notes the signature and enqueues a closure
// holding raw device pointers (the stream-ordered allocator keeps freed blocks until stream order makes
// reuse safe, as for the general path's aliases); the worker builds flat CPU views and runs ATen's CPU
// structured kernel. Anything else (recording, other dtypes, broadcasting, strides, mixed devices,
// overlap) takes the general path, whose behaviour this must equal (tests/test_fast_launch.py).

enum class FastOp : uint8_t { Add, Sub, Mul, Div };

struct FastEntry {
  const c10::FunctionSchema* schema;
  FastOp op;
  bool in_place;
};
std::array<FastEntry, 8> g_fast{};
std::atomic<int> g_fast_n{0};

const FastEntry* fast_entry(const c10::OperatorHandle& op) {
  const c10::FunctionSchema* sch = &op.schema();
  const int n = g_fast_n.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (g_fast[i].schema == sch) return &g_fast[i];
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  const int m = g_fast_n.load(std::memory_order_relaxed);
  for (int i = 0; i < m; ++i)
    if (g_fast[i].schema == sch) return &g_fast[i];
  const std::string& name = sch->name();
  FastEntry e{sch, FastOp::Add, false};
  std::string base = name.rfind("aten::", 0) == 0 ? name.substr(6) : name;
  if (!base.empty() && base.back() == '_') {
    e.in_place = true;
    base.pop_back();
  }
  if (base == "add") e.op = FastOp::Add;
  else if (base == "sub") e.op = FastOp::Sub;
  else if (base == "mul") e.op = FastOp::Mul;
  else if (base == "div") e.op = FastOp::Div;
  else return nullptr;
  if (m >= static_cast<int>(g_fast.size())) return nullptr;
  g_fast[m] = e;
  g_fast_n.store(m + 1, std::memory_order_release);
  return &g_fast[m];
}

bool fast_dense(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kNeuron || t._is_zerotensor() || t.is_neg() || t.is_conj()) return false;
  // contiguous with the canonical strides (not only is_contiguous()): a size-1 dim's stride decides the layout
  // TensorIterator gives the output (CPU's x + 1 keeps x's (16, 1, 16, 16)), which the flat output here would not
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.stride(d) != expected) return false;
    expected *= std::max<int64_t>(t.size(d), 1);
  }
  const at::ScalarType st = t.scalar_type();
  if (!(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16)) return false;
  // its storage still holds it (else the general path raises: check_storage_holds)
  return static_cast<size_t>(t.storage_offset() + t.numel()) * t.dtype().itemsize() <= t.storage().nbytes();
}

at::Tensor flat_cpu(void* ptr, int64_t numel, at::ScalarType dtype) {
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto st = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                  c10::DataPtr(ptr, c10::Device(c10::kCPU)), nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(std::move(st)),
                                                   c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_contiguous({numel});
  return at::Tensor(std::move(impl));
}

bool scalar_fits(const c10::Scalar& s, at::ScalarType dtype) {
  if (s.isComplex() || s.isSymbolic() || s.isBoolean()) return false;
  try {  // CPU's conversion of the value to the tensor's dtype raises on overflow: leave that to it, at once
    switch (dtype) {
      case at::kHalf: (void)s.to<at::Half>(); break;
      case at::kBFloat16: (void)s.to<at::BFloat16>(); break;
      case at::kFloat: (void)s.to<float>(); break;
      default: (void)s.to<double>(); break;
    }
  } catch (const std::exception&) {  // (c10's overflow report is a std::runtime_error)
    return false;
  }
  return true;
}

bool try_fast_launch(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (worker_stream() >= 0 || launch_blocking()) return false;
  const FastEntry* fe = fast_entry(op);
  if (fe == nullptr) return false;
  const size_t nargs = op.schema().arguments().size();
  const size_t base = stack->size() - nargs;
  if (nargs < 2 || nargs > 3) return false;
  const c10::IValue& sv = (*stack)[base];
  const c10::IValue& ov = (*stack)[base + 1];
  if (!sv.isTensor() || !ov.isTensor()) return false;
  const at::Tensor& self = sv.toTensor();
  const at::Tensor& other = ov.toTensor();
  if (!fast_dense(self)) return false;
  c10::Scalar alpha(1);
  if (nargs == 3) {
    const c10::IValue& av = (*stack)[base + 2];
    if (!av.isScalar()) return false;
    alpha = av.toScalar();
    // CPU's checks, at once: a complex or bool alpha, one that overflows the dtype (`half.add_(h, alpha=1e6)`)
    if (!scalar_fits(alpha, self.scalar_type())) return false;
  }
  const int device = self.device().index();
  const bool number = other.is_cpu() && other.unsafeGetTensorImpl()->is_wrapped_number();
  if (number) {
    // a Python number: a floating tensor keeps its dtype (bool/int/float numbers do not promote it);
    // subtracting a bool is an error CPU raises at once (the general path raises it here too)
    if (c10::isComplexType(other.scalar_type())) return false;
    if (fe->op == FastOp::Sub && other.scalar_type() == at::kBool) return false;
  } else {
    if (!fast_dense(other) || other.device().index() != device || other.scalar_type() != self.scalar_type() ||
        !other.sizes().equals(self.sizes()))
      return false;
    // in place: the other operand may be self itself (full overlap), not another view of its memory
    if (fe->in_place && other.storage().unsafeGetStorageImpl() == self.storage().unsafeGetStorageImpl() &&
        other.data_ptr() != self.data_ptr())
      return false;
  }
  check_not_in_bad_fork();

  const OpMeta& meta = op_meta(op);
  SigBuilder sig{reinterpret_cast<uint64_t>(&op.schema()), {}};
  note_tensor_sig(sig, self);
  note_tensor_sig(sig, other);
  const bool new_sig = note_signature(device, sig.hash, [&]() {
    std::ostringstream o;
    o << meta.name << "(" << dtype_name(self.scalar_type()) << shape_str(self.sizes());
    if (!number) o << ", " << dtype_name(other.scalar_type()) << shape_str(other.sizes());
    o << ")";
    return o.str();
  });
  // The kernel event, as the general path records it (bytes of every tensor argument read, the output
  // or the written argument written, the launch tag of a compiled graph, shapes when asked).
  const bool rec = recording();
  EventRecord ev = kernel_event(meta, device, rec, new_sig, nbytes_of(self) + nbytes_of(other), nbytes_of(self));
  if (rec && record_shapes_enabled() && ev.shapes_id < 0) {
    std::string sh = shape_str(self.sizes()), dt = dtype_name(self.scalar_type());
    if (!number) {
      sh += ", " + shape_str(other.sizes());
      dt += ", " + dtype_name(other.scalar_type());
    }
    ev.shapes_id = intern_string(sh);
    ev.dtypes_id = intern_string(dt);
  }

  at::Tensor out;
  if (fe->in_place) {
    out = self;
  } else {
    std::optional<c10::DeviceGuard> guard;
    if (current_device() != device) guard.emplace(c10::Device(kNeuron, device));
    out = at::detail::empty_generic(self.sizes(), neuron_allocator(),
                                    c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), self.scalar_type(),
                                    c10::MemoryFormat::Contiguous);
  }
  Work w;
  w.device = device;
  w.stream = current_stream(device);
  w.launch = begin_launch(meta.name_id);
  const at::ScalarType dtype = self.scalar_type();
  const int64_t numel = self.numel();
  void* po = out.numel() ? out.data_ptr() : nullptr;
  void* ps = self.numel() ? self.data_ptr() : nullptr;
  void* pt = number ? nullptr : (other.numel() ? other.data_ptr() : nullptr);
  at::Tensor num = number ? other : at::Tensor();  // the binding's own temporary: nobody else changes it
  const OpMeta* m = &meta;
  w.run = [fop = fe->op, po, ps, pt, num, numel, dtype, alpha, device, m, rec, ev,
           stream = w.stream](const Launch& l) {
    const int64_t t0 = now_ns();
    try {
      RedirectGuard host(-1);
      at::Tensor o = flat_cpu(po, numel, dtype);
      at::Tensor a = ps == po ? o : flat_cpu(ps, numel, dtype);
      at::Tensor b = num.defined() ? num : pt == ps ? a : pt == po ? o : flat_cpu(pt, numel, dtype);
      switch (fop) {
        case FastOp::Add: at::cpu::add_out(o, a, b, alpha); break;
        case FastOp::Sub: at::cpu::sub_out(o, a, b, alpha); break;
        case FastOp::Mul: at::cpu::mul_out(o, a, b); break;
        case FastOp::Div: at::cpu::div_out(o, a, b); break;
      }
    } catch (c10::Error& e) {
      add_kernel_context(e, *m, device, stream);
      throw;
    }
    if (rec && recording()) push_launched_event(ev, t0, now_ns(), stream, l);
  };
  enqueue(std::move(w));
  count_path(kFast);
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  stack->emplace_back(std::move(out));
  return true;
}

void fast_or_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!try_fast_launch(op, stack)) neuron_fallback(op, ks, stack);
}

// torch.from_file(..., device="neuron"): the file's bytes, copied to the device (the CPU kernel, then a copy).
// With shared=True the CPU tensor maps the file, so writes go to it both ways; a device copy cannot keep that
// promise, so it is refused (it silently became a private copy; CUDA refuses from_file on the device at all).
void from_file_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::IValue& shared = (*stack)[stack->size() - op.schema().arguments().size() + 1];
  TORCH_CHECK(!(shared.isBool() && shared.toBool()),
              "torch.from_file(shared=True) maps the file into host memory; neuron memory cannot map a file. Map it "
              "on the CPU (torch.from_file(..., shared=True)) and copy to neuron, or use shared=False");
  neuron_fallback(op, ks, stack);
}

// div_: its complex32 (CUDA has it, the CPU kernel not) is upcast as div's
void fast_or_upcast(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!try_fast_launch(op, stack)) upcast_or_fallback(op, ks, stack);
}

// ------------------------------------------------------------------------------------------------
// One launch per foreach op. `_foreach_*` ops have no CPU kernel: their CompositeExplicitAutograd kernel
// loops over the lists calling the per-tensor op, which on neuron made one launch per tensor (an AdamW
// step of a 27-parameter model: ~190 launches, each the general path's host cost). CUDA runs a foreach op
// as one multi-tensor kernel; here the host checks the lists, allocates a functional op's outputs and
// enqueues one closure, and the worker runs the same composite loop on CPU views of the device memory:
// the same per-tensor CPU kernels in the same order, so the results are CPU's bit for bit. Anything the
// per-tensor path might reject (broadcasting, mixed dtypes or devices, non-dense tensors, partial overlap
// with a written tensor, a scalar that does not fit the dtype, other argument types) takes the composite
// loop on the host as before, which raises CPU's errors at once.

struct ForeachKind {
  bool eligible = false;
  bool in_place = false;  // returns (), writes argument 0 (a Tensor[]); else returns one Tensor[]
};

const ForeachKind& foreach_kind(const c10::OperatorHandle& op) {
  static std::mutex mu;
  static std::unordered_map<const c10::FunctionSchema*, ForeachKind> cache;
  const c10::FunctionSchema* sch = &op.schema();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(sch);
  if (it != cache.end()) return it->second;
  ForeachKind k;
  const auto& args = sch->arguments();
  const auto& rets = sch->returns();
  bool ok = !args.empty() && args[0].type()->kind() == c10::TypeKind::ListType &&
            args[0].type()->containedType(0)->kind() == c10::TypeKind::TensorType;
  for (size_t i = 1; ok && i < args.size(); ++i) {
    const auto& a = args[i];
    if (a.alias_info() && a.alias_info()->isWrite()) ok = false;  // only argument 0 may be written
  }
  if (ok && rets.empty() && args[0].alias_info() && args[0].alias_info()->isWrite()) {
    k.in_place = true;
  } else if (ok && rets.size() == 1 && rets[0].type()->kind() == c10::TypeKind::ListType &&
             !(args[0].alias_info() && args[0].alias_info()->isWrite())) {
    // functional: elementwise only if its in-place twin exists (`_foreach_sqrt` / `_foreach_sqrt_`);
    // reductions (`_foreach_norm`, `_foreach_max`) have none
    auto twin = c10::Dispatcher::singleton().findOp({sch->name() + "_", sch->overload_name()});
    ok = twin.has_value();
  } else {
    ok = false;
  }
  k.eligible = ok;
  return cache.emplace(sch, k).first->second;
}

struct DenseRef {
  void* ptr;
  c10::SmallVector<int64_t, 4> sizes;
  at::ScalarType dtype;
};

at::Tensor dense_cpu(const DenseRef& r) {
  int64_t numel = 1;
  for (int64_t s : r.sizes) numel *= s;
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(r.dtype);
  auto st = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                  c10::DataPtr(numel ? r.ptr : nullptr, c10::Device(c10::kCPU)),
                                                  nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(std::move(st)),
                                                   c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                   c10::scalarTypeToTypeMeta(r.dtype));
  impl->set_sizes_contiguous(r.sizes);
  return at::Tensor(std::move(impl));
}

DenseRef dense_ref(const at::Tensor& t) {
  return {t.numel() ? t.data_ptr() : nullptr, c10::SmallVector<int64_t, 4>(t.sizes().begin(), t.sizes().end()),
          t.scalar_type()};
}

bool try_foreach_launch(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (worker_stream() >= 0 || launch_blocking()) return false;
  const ForeachKind& kind = foreach_kind(op);
  if (!kind.eligible) return false;
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  const c10::IValue& v0 = (*stack)[base];
  if (!v0.isTensorList()) return false;
  const c10::List<at::Tensor> self = v0.toTensorList();
  const size_t n = self.size();
  if (n == 0) return false;
  int device = -1;
  auto on_device = [&](const at::Tensor& t) {
    if (!fast_dense(t)) return false;
    if (device < 0) device = t.device().index();
    return t.device().index() == device;
  };
  c10::SmallVector<at::ScalarType, 32> dtypes;
  c10::SmallVector<c10::IntArrayRef, 32> sizes;
  for (size_t j = 0; j < n; ++j) {
    const at::Tensor& t = self.get(j);
    if (!on_device(t)) return false;
    dtypes.push_back(t.scalar_type());
  }
  for (size_t j = 0; j < n; ++j) sizes.push_back(self.get(j).sizes());  // (self holds the tensors)

  // Arguments as the worker rebuilds them: lists and 0-d tensors by raw pointer, the rest as they are.
  struct Arg {
    enum Kind : uint8_t { List, Tensor, Value } kind;
    std::vector<DenseRef> refs;
    c10::IValue value;
  };
  std::vector<Arg> args(nargs);
  std::unordered_map<const c10::StorageImpl*, size_t> written;  // storage -> index in self (in place)
  if (kind.in_place) {
    written.reserve(n);
    for (size_t j = 0; j < n; ++j)
      if (!written.emplace(self.get(j).storage().unsafeGetStorageImpl(), j).second) return false;
  }
  // A tensor read next to the written list may share memory with a written tensor only as that very tensor
  // (same index, same view: the per-tensor op's full overlap); anything else is CPU's overlap error.
  auto read_ok = [&](const at::Tensor& t, size_t j) {
    if (written.empty()) return true;
    auto it = written.find(t.storage().unsafeGetStorageImpl());
    if (it == written.end()) return true;
    const at::Tensor& w = self.get(it->second);
    return it->second == j && w.data_ptr() == t.data_ptr() && w.sizes().equals(t.sizes());
  };
  int64_t bytes_read = 0;
  for (size_t j = 0; j < n; ++j) bytes_read += nbytes_of(self.get(j));
  args[0].kind = Arg::List;
  args[0].refs.reserve(n);
  for (size_t j = 0; j < n; ++j) args[0].refs.push_back(dense_ref(self.get(j)));
  for (size_t i = 1; i < nargs; ++i) {
    const c10::IValue& v = (*stack)[base + i];
    Arg& a = args[i];
    if (v.isTensorList()) {
      const c10::List<at::Tensor> l = v.toTensorList();
      if (l.size() != n) return false;
      a.kind = Arg::List;
      a.refs.reserve(n);
      for (size_t j = 0; j < n; ++j) {
        const at::Tensor& t = l.get(j);
        if (!on_device(t) || t.scalar_type() != dtypes[j] || !t.sizes().equals(sizes[j]) || !read_ok(t, j))
          return false;
        a.refs.push_back(dense_ref(t));
        bytes_read += nbytes_of(t);
      }
    } else if (v.isTensor()) {  // a 0-d device tensor read as a scalar (`_foreach_mul_.Tensor`, a tensor lr)
      const at::Tensor& t = v.toTensor();
      if (!on_device(t) || t.dim() != 0 || !read_ok(t, SIZE_MAX)) return false;
      for (at::ScalarType d : dtypes)
        if (d != t.scalar_type()) return false;
      a.kind = Arg::Tensor;
      a.refs.push_back(dense_ref(t));
      bytes_read += nbytes_of(t);
    } else if (v.isScalar()) {
      const c10::Scalar sc = v.toScalar();
      for (at::ScalarType d : dtypes)
        if (!scalar_fits(sc, d)) return false;
      a.kind = Arg::Value;
      a.value = v;
    } else if (v.isList()) {  // Scalar[]: one per tensor
      const auto l = v.toListRef();
      if (l.size() != n) return false;
      for (size_t j = 0; j < n; ++j)
        if (!l[j].isScalar() || !scalar_fits(l[j].toScalar(), dtypes[j])) return false;
      a.kind = Arg::Value;
      a.value = v;
    } else {
      return false;
    }
  }
  check_not_in_bad_fork();

  const OpMeta& meta = op_meta(op);
  SigBuilder sig{reinterpret_cast<uint64_t>(&schema), {}};
  for (size_t j = 0; j < n; ++j) note_tensor_sig(sig, self.get(j));
  auto describe = [&]() {
    std::ostringstream o;
    o << meta.name << "(" << n << " x ";
    for (size_t j = 0; j < n && j < 4; ++j) o << (j ? ", " : "") << dtype_name(dtypes[j]) << shape_str(sizes[j]);
    o << (n > 4 ? ", ...)" : ")");
    return o.str();
  };
  const bool new_sig = note_signature(device, sig.hash, describe);
  const bool rec = recording();
  c10::List<at::Tensor> outs;
  std::vector<DenseRef> out_refs;
  if (!kind.in_place) {
    std::optional<c10::DeviceGuard> guard;
    if (current_device() != device) guard.emplace(c10::Device(kNeuron, device));
    outs.reserve(n);
    out_refs.reserve(n);
    for (size_t j = 0; j < n; ++j) {
      outs.push_back(at::detail::empty_generic(sizes[j], neuron_allocator(),
                                               c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtypes[j],
                                               c10::MemoryFormat::Contiguous));
      out_refs.push_back(dense_ref(outs.get(j)));
    }
  }
  int64_t bytes_written = 0;
  for (size_t j = 0; rec && j < n; ++j) bytes_written += nbytes_of(kind.in_place ? self.get(j) : outs.get(j));
  EventRecord ev = kernel_event(meta, device, rec, new_sig, bytes_read, bytes_written);
  if (rec && record_shapes_enabled() && ev.shapes_id < 0) {
    std::string d = describe();
    ev.shapes_id = intern_string(d.substr(d.find('(')));
    ev.dtypes_id = intern_string(dtype_name(dtypes[0]));
  }

  Work w;
  w.device = device;
  w.stream = current_stream(device);
  w.launch = begin_launch(meta.name_id);
  const OpMeta* m = &meta;
  w.run = [op, args = std::move(args), out_refs = std::move(out_refs), in_place = kind.in_place, device, m, rec,
           ev, stream = w.stream](const Launch& l) {
    const int64_t t0 = now_ns();
    try {
      RedirectGuard host(-1);
      at::AutoDispatchBelowADInplaceOrView below;  // CPU views of device memory: no autograd to track
      torch::jit::Stack st;
      st.reserve(args.size());
      for (const Arg& a : args) {
        if (a.kind == Arg::List) {
          c10::List<at::Tensor> l;
          l.reserve(a.refs.size());
          for (const DenseRef& r : a.refs) l.push_back(dense_cpu(r));
          st.emplace_back(std::move(l));
        } else if (a.kind == Arg::Tensor) {
          st.emplace_back(dense_cpu(a.refs[0]));
        } else {
          st.push_back(a.value);
        }
      }
      if (in_place) {
        op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st);
      } else {
        std::vector<at::Tensor> targets;
        targets.reserve(out_refs.size());
        c10::SmallVector<PlacementGuard::Slot, 32> slots;
        for (const DenseRef& r : out_refs) {
          targets.push_back(dense_cpu(r));
          if (targets.back().storage().nbytes() > 0)
            slots.push_back({targets.back().storage().mutable_data(), targets.back().storage().nbytes(), false});
        }
        {
          PlacementGuard place(slots.data(), slots.size());
          op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st);
        }
        land_results(st, targets, slots);
      }
    } catch (c10::Error& e) {
      add_kernel_context(e, *m, device, stream);
      throw;
    }
    if (rec && recording()) push_launched_event(ev, t0, now_ns(), stream, l);
  };
  enqueue(std::move(w));
  count_path(kForeach);
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  if (!kind.in_place) stack->emplace_back(std::move(outs));
  return true;
}

// Not launched as one: the composite loop (the kernel in the CPU slot of the dispatch table), whose
// per-tensor ops dispatch on neuron as before.
void foreach_launch_or_loop(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  if (!try_foreach_launch(op, stack)) op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

}  // namespace

// The emulator's kernels are ATen's: an operator of another library (a user's torch.library op with a CPU
// kernel only, quantized::, mkldnn::, onednn:: ...) gets the dispatcher's error, as on CUDA, rather than its
// CPU kernel run on a CPU alias of device memory (which showed the kernel a CPU tensor, and an alias it
// kept outlived the device block: memory shared with the next allocation).
void neuron_backend_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const std::string& name = op.schema().name();
  if (name.compare(0, 6, "aten::") != 0) {
    std::string full = op.schema().overload_name().empty() ? name : name + "." + op.schema().overload_name();
    std::string avail;
    for (auto k : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::HIP, c10::DispatchKey::XLA,
                   c10::DispatchKey::MPS, c10::DispatchKey::XPU, c10::DispatchKey::HPU, c10::DispatchKey::MTIA,
                   c10::DispatchKey::Meta})
      if (op.hasKernelForDispatchKey(k)) avail += (avail.empty() ? "" : ", ") + std::string(c10::toString(k));
    TORCH_CHECK_NOT_IMPLEMENTED(false, "Could not run '", full,
                                "' with arguments from the 'PrivateUse1' backend (the neuron device). It is not an "
                                "ATen operator and has no kernel for neuron (the emulator runs ATen's CPU kernels as "
                                "the device's, not another library's CPU kernel; CUDA does not run one either): "
                                "register one with torch.library.custom_op(..., device_types=\"neuron\") or "
                                "Library.impl(name, fn, \"PrivateUse1\"). '", full,
                                "' is only available for these backends: [", avail, "].");
  }
  neuron_fallback(op, ks, stack);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&neuron_backend_fallback>());
}

// Sparse, sparse-compressed, quantized and nested tensors on neuron: any op that would make or use one raises
// the same NotImplementedError naming the limitation (torch.sparse_coo_tensor(..., device="neuron"),
// torch.empty(..., layout=torch.sparse_csr, device="neuron"), quantized.to("neuron") ...).
void unsupported_layout_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack*) {
  const char* what = ks.has(c10::DispatchKey::QuantizedPrivateUse1) ? "quantized"
                     : ks.has(c10::DispatchKey::SparseCsrPrivateUse1) ? "sparse compressed (CSR/CSC/BSR/BSC)"
                     : ks.has(c10::DispatchKey::NestedTensorPrivateUse1) ? "nested (torch.strided layout)"
                                                                        : "sparse";
  const auto& s = op.schema();
  unsupported_layout_named(what, s.overload_name().empty() ? s.name() : s.name() + "." + s.overload_name());
}
// Sparse COO (see "Sparse COO tensors" above): ATen's device-generic kernels for the metadata, constructors and
// member moves; every other op on the host through sparse_host_fallback, including (registered op by op, at
// load) each op with a SparseCPU kernel that also has a composite one, which would outrank a backend fallback.
TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_host_fallback>());
}
TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  m.impl("_nnz", TORCH_FN(at::native::_nnz_sparse));
  m.impl("sparse_dim", TORCH_FN(at::native::sparse_dim_sparse));
  m.impl("dense_dim", TORCH_FN(at::native::dense_dim_sparse));
  m.impl("is_coalesced", TORCH_FN(at::native::is_coalesced_sparse));
  m.impl("_indices", TORCH_FN(at::native::_indices_sparse));
  m.impl("_values", TORCH_FN(at::native::_values_sparse));
  m.impl("indices", TORCH_FN(at::native::indices_sparse));
  m.impl("values", TORCH_FN(at::native::values_sparse));
  m.impl("_coalesced_", TORCH_FN(at::native::_coalesced_sparse_));
  m.impl("_sparse_coo_tensor_with_dims_and_tensors", TORCH_FN(at::native::new_with_dims_and_tensor_sparse_symint));
  m.impl("_sparse_coo_tensor_with_dims", TORCH_FN(at::native::new_with_dims_sparse));
  m.impl("sparse_resize_", TORCH_FN(at::native::sparse_resize_));
  m.impl("sparse_resize_and_clear_", TORCH_FN(at::native::sparse_resize_and_clear_));
  m.impl("empty.memory_format", TORCH_FN(at::native::empty_sparse_symint));
  m.impl("zero_", TORCH_FN(at::native::zero_sparse_));
  m.impl("copy_sparse_to_sparse_", TORCH_FN(at::native::copy_sparse_));
  m.impl("copy_", TORCH_FN(at::native::copy_sparse_wrapper_));
  m.impl("clone", TORCH_FN(at::native::clone_sparse));
}
struct SparseCpuOpsOnNeuron {
  torch::Library lib{torch::Library::IMPL, "aten", c10::DispatchKey::SparsePrivateUse1, __FILE__, __LINE__};
  SparseCpuOpsOnNeuron() {
    using K = c10::DispatchKey;
    auto& d = c10::Dispatcher::singleton();
    for (const auto& name : d.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) continue;
      auto op = d.findOp(name);
      if (!op || !op->hasKernelForDispatchKey(K::SparseCPU) || op->hasKernelForDispatchKey(K::SparsePrivateUse1))
        continue;
      const bool composite = op->hasKernelForDispatchKey(K::CompositeExplicitAutograd) ||
                             op->hasKernelForDispatchKey(K::CompositeExplicitAutogradNonFunctional) ||
                             op->hasKernelForDispatchKey(K::CompositeImplicitAutograd);
      if (!composite) continue;  // the backend fallback reaches it
      const std::string q = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
      try {
        lib.impl(q.c_str(), torch::CppFunction::makeFromBoxedFunction<&sparse_host_fallback>());
      } catch (const c10::Error&) {
      }
    }
  }
};
const bool kSparseCpuOpsOnNeuron = (new SparseCpuOpsOnNeuron(), true);  // lives as long as the dispatcher
TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&unsupported_layout_fallback>());
}
TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&unsupported_layout_fallback>());
}
// Nested tensors of the strided layout (torch.nested.nested_tensor): their ops are kernels registered per
// backend (NestedTensorCPU/CUDA), none for neuron; jagged ones (layout=torch.jagged) are a Python subclass
// over dense tensors and run on neuron.
TORCH_LIBRARY_IMPL(_, NestedTensorPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&unsupported_layout_fallback>());
}


// Copies handle the conjugate/negative bits themselves (the CPU copy on aliases resolves them), so the
// math-bit fallbacks must not try to materialise first: that materialisation is itself a copy on the
// device and would recurse forever.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

// torch.autocast("neuron"): PyTorch registers no AutocastPrivateUse1 kernels, so ops fall through unless
// listed here; the lists are ATen's own (the same policies CUDA uses).
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

// binary_cross_entropy is banned under autocast, as on CUDA (its fp16 inputs come from a sigmoid that
// saturates; a mixed fp16/fp32 call raised an unrelated dtype error, an fp16 one ran in fp16).
at::Tensor autocast_binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&,
                                                const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
              "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
              "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
              "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
              "safe to autocast.");
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TNL_LOW(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TNL_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TNL_FP32_OPT(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TNL_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(TNL_LOW)
  AT_FORALL_FP32(TNL_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TNL_FP32_OPT)
  AT_FORALL_PROMOTE(TNL_PROMOTE)
  // norm.Scalar / norm.ScalarOpt_dim: run in fp32 through the overload taking a dtype (CUDA's list too)
  using at::IntArrayRef;
  using at::Scalar;
  using at::ScalarType;
  using at::Tensor;
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(autocast_binary_cross_entropy_banned));
#undef TNL_LOW
#undef TNL_FP32
#undef TNL_FP32_OPT
#undef TNL_PROMOTE
}

// conj_physical_ has only a composite kernel, which calls the device's DispatchStub (none for neuron: an
// internal assert for complex tensors); the out= form is a plain kernel, and in place is out= self.
at::Tensor& conj_physical_inplace(at::Tensor& self) {
  if (!self.is_complex()) return self;
  return at::conj_physical_out(self, self);
}

// kaiser_window (every overload, out= too) has only composite kernels, which call the device's DispatchStub (none
// for neuron: "DispatchStub: missing kernel for neuron", an internal assert, also under
// torch.set_default_device("neuron")). The window is made by the CPU kernel and copied to the device, as a
// factory's host data is (CUDA computes it there; the values are CPU's either way).
at::Device window_device(std::optional<at::Device> device) {
  return device.has_value() && device->has_index() ? *device : at::Device(kNeuron, current_device());
}
at::Tensor kaiser_beta(int64_t n, bool periodic, double beta, std::optional<at::ScalarType> dtype,
                       std::optional<at::Layout> layout, std::optional<at::Device> device, std::optional<bool> pin) {
  const at::Device target = window_device(device);
  const auto options = at::TensorOptions().dtype(dtype).layout(layout).device(target).pinned_memory(pin);
  // the dtype check first, naming the device as on CUDA
  TORCH_CHECK(at::isFloatingType(at::typeMetaToScalarType(options.dtype())),
              "kaiser_window expects floating point dtypes, got: ", options);
  return at::kaiser_window(n, periodic, beta, dtype, layout, at::kCPU, false).to(target);
}
at::Tensor kaiser_periodic(int64_t n, bool periodic, std::optional<at::ScalarType> dtype,
                           std::optional<at::Layout> layout, std::optional<at::Device> device, std::optional<bool> pin) {
  return kaiser_beta(n, periodic, 12.0, dtype, layout, device, pin);
}
at::Tensor kaiser_plain(int64_t n, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                        std::optional<at::Device> device, std::optional<bool> pin) {
  return kaiser_beta(n, true, 12.0, dtype, layout, device, pin);
}
at::Tensor& kaiser_beta_out(int64_t n, bool periodic, double beta, at::Tensor& out) {
  const at::Tensor w = at::kaiser_window(n, periodic, beta, out.scalar_type(), std::nullopt, at::kCPU, false);
  at::native::resize_output(out, w.sizes());
  out.copy_(w);
  return out;
}
at::Tensor& kaiser_periodic_out(int64_t n, bool periodic, at::Tensor& out) {
  return kaiser_beta_out(n, periodic, 12.0, out);
}
at::Tensor& kaiser_plain_out(int64_t n, at::Tensor& out) { return kaiser_beta_out(n, true, 12.0, out); }

// mode(..., out=(values, indices)): its only kernel is a composite that refuses every device but CPU, CUDA and
// XPU ("mode only supports CPU, CUDA and XPU device type, got: neuron"; the functional form works). Here the
// composite's other checks, in its order and words, then the functional result copied into the outputs.
std::tuple<at::Tensor&, at::Tensor&> mode_values(const at::Tensor& self, int64_t dim, bool keepdim,
                                                 at::Tensor& values, at::Tensor& indices) {
  TORCH_CHECK(self.layout() == at::Layout::Strided, "mode only supports strided layout, got: ", self.layout());
  TORCH_CHECK(self.device() == values.device(), "expected device '", self.device(), "' but got '",
              values.device(), "' for values output");
  TORCH_CHECK(self.device() == indices.device(), "expected device '", self.device(), "' but got '",
              indices.device(), "' for indices output");
  TORCH_CHECK(self.scalar_type() == values.scalar_type(), "expected scalar type '", self.scalar_type(),
              "' but got '", values.scalar_type(), "' for values output");
  TORCH_CHECK(indices.scalar_type() == at::ScalarType::Long, "expected scalar type '", at::ScalarType::Long,
              "' but got '", indices.scalar_type(), "' for indices output");
  auto [v, i] = at::mode(self, dim, keepdim);
  at::native::resize_output(values, v.sizes());
  at::native::resize_output(indices, i.sizes());
  values.copy_(v);
  indices.copy_(i);
  return std::forward_as_tuple(values, indices);
}

// flatten_indices_stub: called on the indices' device by sparse COO argument checks
// (torch.sparse_coo_tensor(..., is_coalesced=True, check_invariants=True), _validate_sparse_coo_tensor_args),
// from code that calls the stub directly, not through the dispatcher: "DispatchStub: missing kernel for neuron".
// Composed on the device from ATen ops as the CPU kernel computes it (row-major linear index of each column of
// `indices` in `size`, int64; ATen's stub is not callable from outside libtorch); the check then goes on, and a
// sparse tensor on neuron is refused as every other way of making one.
at::Tensor flatten_indices_neuron(const at::Tensor& indices, at::IntArrayRef size) {
  TORCH_CHECK(indices.dim() > 1 && static_cast<size_t>(indices.size(0)) == size.size(),
              "flatten_indices(): the dimensionality of sparse `indices` and the length of `size` must match. ",
              "Got `indices.size(0) == ", indices.size(0), "` != `size.size() == ", size.size(), "`.");
  const auto strides = c10::contiguous_strides(size);
  const at::Tensor coeffs = at::tensor(std::vector<int64_t>(strides.begin(), strides.end()), at::kLong)
                                .to(indices.device())
                                .unsqueeze(1);
  return (indices.to(at::kLong) * coeffs).sum(0);
}

// aten::convolution. Under torch.jit.trace, as ATen's composite kernel does on CUDA: a call of
// aten::_convolution through the dispatcher, which the tracer records (it records no aten::convolution node),
// so a traced convolution is part of the graph (else its output had no value in the trace: "Cannot insert a
// Tensor that requires grad as a constant"). Otherwise the CPU kernel on the device's memory, as every op.
void convolution_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!torch::jit::tracer::isTracing()) {
    neuron_fallback(op, ks, stack);
    return;
  }
  auto args = torch::jit::pop(*stack, 9);
  at::Tensor out = at::native::convolution(args[0].toTensor(), args[1].toTensor(), args[2].toOptional<at::Tensor>(),
                                           args[3].toIntVector(), args[4].toIntVector(), args[5].toIntVector(),
                                           args[6].toBool(), args[7].toIntVector(), args[8].toInt());
  torch::jit::push(*stack, std::move(out));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("mode.values", mode_values);
  m.impl("kaiser_window", kaiser_plain);
  m.impl("kaiser_window.periodic", kaiser_periodic);
  m.impl("kaiser_window.beta", kaiser_beta);
  m.impl("kaiser_window.out", kaiser_plain_out);
  m.impl("kaiser_window.periodic_out", kaiser_periodic_out);
  m.impl("kaiser_window.beta_out", kaiser_beta_out);
  m.impl("conj_physical_", conj_physical_inplace);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_efficientzerotensor", efficientzerotensor);
  m.impl("native_dropout", native_dropout);
  m.impl("as_strided", as_strided);
  m.impl("view", at::native::view);
  m.impl("view.dtype", at::native::view_dtype);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("alias", at::native::alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("_to_copy", at::native::_to_copy);
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("record_stream", record_stream);
  // (div.Tensor keeps cuda_parity.cpp's complex32 kernel; its fast path is the in-place div_, whose other calls
  // go to that kernel too)
  for (const char* name : {"add.Tensor", "add_.Tensor", "sub.Tensor", "sub_.Tensor", "mul.Tensor", "mul_.Tensor"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fast_or_fallback>());
  m.impl("div_.Tensor", torch::CppFunction::makeFromBoxedFunction<&fast_or_upcast>());
  m.impl("from_file", torch::CppFunction::makeFromBoxedFunction<&from_file_kernel>());
  // CompositeExplicitAutograd kernels that pick a backend by device type: run them on the CPU side.
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&convolution_kernel>());
  for (const char* name : {"_convolution", "convolution_backward", "convolution_overrideable",
                           "convolution_backward_overrideable"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>());
  }
}

void set_native_functions_yaml(const std::string& path) {
  auto out = std::make_shared<std::unordered_set<std::string>>();
  std::ifstream f(path);
  TORCH_CHECK(f.good(), "cannot read ", path);
  std::string line, cur;
  bool nocheck = false;
  auto close = [&] {
    if (!cur.empty() && !nocheck) out->insert("aten::" + cur);
    cur.clear();
    nocheck = false;
  };
  while (std::getline(f, line)) {
    if (line.rfind("- func:", 0) == 0) {
      close();
      const size_t b = line.find_first_not_of(' ', 7);
      const size_t e = b == std::string::npos ? b : line.find('(', b);
      if (e != std::string::npos) cur = line.substr(b, e - b);
    } else if (!cur.empty() && line.find("device_check: NoCheck") != std::string::npos) {
      nocheck = true;
    }
  }
  close();
  std::lock_guard<std::mutex> lock(g_exact_device_mu);
  g_exact_device_ops = std::move(out);
}

}  // namespace tnl

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(flatten_indices_stub, &tnl::flatten_indices_neuron)
}  // namespace at::native

namespace tnl {

// Ops whose PrivateUse1 dispatch would otherwise land on a generic composite kernel (typically the
// structured "functional = allocate + out=" wrapper) but that have a CPU kernel: route them straight
// to the fallback, so the CPU kernel allocates its own output in device memory (one dispatch instead
// of three). Returns the number of operators routed.
// Registers `kernel` as the PrivateUse1 kernel of every aten operator whose name starts with `prefix` and
// that `want` accepts (once per process: -1 on a second call). Returns the number registered.
template <typename Want>
int register_for_ops(std::unique_ptr<torch::Library>& lib, const char* prefix, Want&& want,
                     torch::CppFunction (*kernel)()) {
  if (lib) return -1;
  lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                         __LINE__);
  int n = 0;
  auto& disp = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : disp.getAllOpNames()) {
    if (name.name.rfind(prefix, 0) != 0) continue;
    auto op = disp.findOp(name);
    if (!op.has_value() || !op->hasSchema()) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;  // native or already routed
    if (!want(*op, name.name.substr(6))) continue;
    const std::string full = name.overload_name.empty() ? name.name.substr(6)
                                                        : name.name.substr(6) + "." + name.overload_name;
    lib->impl(full.c_str(), kernel());
    ++n;
  }
  return n;
}

int route_composites_to_fallback() {
  static std::unique_ptr<torch::Library> lib;
  return register_for_ops(
      lib, "aten::",
      [](const c10::OperatorHandle& op, const std::string& base) {
        if (!op.hasKernelForDispatchKey(c10::DispatchKey::CPU)) return false;
        if (!op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) &&
            !op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd))
          return false;
        if (op_meta(op).view_only) return false;  // views keep their composite (as_strided based) kernels
        static const std::unordered_set<std::string> keep = {"copy_", "_to_copy", "clone", "lift_fresh",
                                                             "_copy_from", "resize_", "set_", "empty_like",
                                                             "new_empty", "new_empty_strided", "to",
                                                             "contiguous", "detach", "_reshape_copy"};
        return keep.count(base) == 0;
      },
      [] { return torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>(); });
}


std::pair<uint64_t, int64_t> plan_check_waits() {
  return {g_paths[kPlanCheck].load(std::memory_order_relaxed), g_plan_check_wait_ns.load(std::memory_order_relaxed)};
}

std::vector<std::pair<std::string, uint64_t>> launch_path_counts() {
  static const char* names[kNumPaths] = {"queued",    "fast",     "foreach", "plan_check",
                                         "host_wait", "host_now", "trusted_new_shape"};
  std::vector<std::pair<std::string, uint64_t>> out;
  for (int i = 0; i < kNumPaths; ++i) out.emplace_back(names[i], g_paths[i].load(std::memory_order_relaxed));
  return out;
}

// Every `_foreach_*` op that only has its composite loop (no CPU or PrivateUse1 kernel of its own) and that
// one launch can run (foreach_kind) gets foreach_launch_or_loop on neuron.
int route_foreach_to_launch() {
  static std::unique_ptr<torch::Library> lib;
  return register_for_ops(
      lib, "aten::_foreach_",
      [](const c10::OperatorHandle& op, const std::string&) {
        return !op.hasKernelForDispatchKey(c10::DispatchKey::CPU) &&
               op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) && foreach_kind(op).eligible;
      },
      [] { return torch::CppFunction::makeFromBoxedFunction<&foreach_launch_or_loop>(); });
}

}  // namespace tnl

namespace tnl {

struct HostCall::Impl {
  CallState cs;
};

HostCall::HostCall(int device, bool wait) : impl_(new Impl()), device_(device) {
  adopt_host_cpu_settings();
  check_not_in_bad_fork();
  check_device_index(device);
  // Host code runs after the kernels launched before it (recorded only if the host had to wait).
  if (wait && worker_stream() < 0)
    synchronize_stream(device, current_stream(device), "sync: host code (compiled graph)", /*record_always=*/false);
  impl_->cs.device = device;
}
HostCall::~HostCall() {
  delete impl_;
  end_host_thread_pool();  // host code on autograd's device thread (a composed backward)
}

at::Tensor HostCall::in(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kNeuron) return t;
  TORCH_CHECK(t.device().index() == device_, "compiled graph for neuron:", device_, " got an input on ", t.device());
  return alias_in(impl_->cs, t, /*writable=*/true);
}

bool alias_matches(const at::Tensor& t, const at::Tensor& alias) {
  if (!alias.defined() || !t.defined()) return false;
  const c10::StorageImpl* ns = t.storage().unsafeGetStorageImpl();
  const c10::TensorImpl* p = alias.unsafeGetTensorImpl();
  const c10::StorageImpl* ps = alias.storage().unsafeGetStorageImpl();
  // Same bytes, same dtype and geometry: the alias is exactly the one cpu_alias would build now.
  return ps->data_ptr().get() == ns->data_ptr().get() && ps->nbytes() == ns->nbytes() &&
         ps->resizable() == ns->resizable() && p->dtype() == t.dtype() && p->storage_offset() == t.storage_offset() &&
         p->sizes().equals(t.sizes()) && p->strides().equals(t.strides()) && p->is_conj() == t.is_conj() &&
         p->is_neg() == t.is_neg();
}

at::Tensor HostCall::in_reusing(const at::Tensor& t, at::Tensor& prev) {
  if (!t.defined() || t.device().type() != kNeuron) return t;
  TORCH_CHECK(t.device().index() == device_, "compiled graph for neuron:", device_, " got an input on ", t.device());
  if (alias_matches(t, prev)) {
    impl_->cs.ins.push_back({t, prev, prev.storage().unsafeGetStorageImpl(), t.storage().data_ptr().get(),
                             t.storage().nbytes(), /*writable=*/true});
    return prev;
  }
  prev = alias_in(impl_->cs, t, /*writable=*/true);
  return prev;
}

at::Tensor HostCall::out(const at::Tensor& t) {
  if (!t.defined() || !t.is_cpu()) return t;
  return map_back(impl_->cs, t);
}

}  // namespace tnl

namespace tnl {
namespace {
// scaled_dot_product_attention asks a per-device stub which fused kernel to use (math otherwise). The
// neuron device runs host kernels, so it makes the CPU's choice (flash attention for CPU when the
// inputs allow it); the chosen kernel then runs through the fallback on device memory.
int64_t neuron_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double dropout, bool causal,
                          std::optional<double> scale, bool gqa) {
  // Tensors that cannot be aliased take CPU's rules directly: the choice reads only metadata (sizes, strides,
  // dtypes, requires_grad), which they carry. Those are symbolic shapes (Dynamo tracing with dynamic shapes:
  // fake tensors whose storage size is symbolic; an alias raised "Expected !size_bytes_is_heap_allocated_")
  // and tensors without storage: torch.func's batched tensors and grad wrappers, which reach this stub because
  // scaled_dot_product_attention is CompositeImplicit ("Cannot access storage of BatchedTensorImpl": attention
  // under vmap, grad, jvp or jacfwd failed).
  auto metadata_only = [](const at::Tensor& t) {
    return t.defined() && (!t.has_storage() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
                           t.storage().unsafeGetStorageImpl()->sym_nbytes().is_heap_allocated());
  };
  if (metadata_only(q) || metadata_only(k) || metadata_only(v) || (mask.has_value() && metadata_only(*mask)))
    return at::native::_fused_sdp_choice_cpp(q, k, v, mask, dropout, causal, scale, gqa);
  // The CPU choice reads requires_grad (a mask that requires grad needs math): the aliases keep it.
  HostCall call(q.device().index(), /*wait=*/false);
  auto in = [&](const at::Tensor& t) {
    at::Tensor a = call.in(t);
    if (t.requires_grad() && !a.requires_grad()) a.set_requires_grad(true);  // no dispatch: fake tensors too
    return a;
  };
  std::optional<at::Tensor> m;
  if (mask.has_value() && mask->defined()) m = in(*mask);
  return at::native::_fused_sdp_choice_cpp(in(q), in(k), in(v), m, dropout, causal, scale, gqa);
}
}  // namespace

// The fallback, for kernels in other translation units (cuda_parity.cpp) that adapt arguments first.
void run_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  neuron_fallback(op, ks, stack);
}
}  // namespace tnl

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &tnl::neuron_sdp_choice)
}  // namespace at::native

// torch._fused_sdp_choice on neuron tensors answers what scaled_dot_product_attention will use.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) { m.impl("_fused_sdp_choice", tnl::neuron_sdp_choice); }
