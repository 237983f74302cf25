// What CUDA supports, neuron supports.
//
// Libraries take CUDA-shaped paths whenever `device.type != "cpu"` (torch.nn's recurrent cells call
// ATen's fused cell kernels, Hugging Face's MoE calls integer histc), and ATen's CPU kernels lack some
// of the ops and dtypes CUDA has. This file closes that gap on the host:
//   * ops CUDA has and the CPU lacks (the fused LSTM/GRU cells and their backward) are composed from
//     ATen ops that run on the device through the fallback, in the order of the CPU's unfused path,
//     so results match the CPU's numerics;
//   * dtypes CUDA's kernel accepts and the CPU's rejects are upcast: arguments are widened (int ->
//     double, half/bfloat16 -> float, complex32 -> complex64, bool -> uint8), the CPU kernel runs
//     through the fallback, results are narrowed back (out= and in-place arguments written back).
// What stays unsupported is listed in README.md ("CUDA parity").
#include "neuron.h"

#include <ATen/record_function.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/TypeProperties.h>
#include <torch/library.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace tnl {

void run_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);  // kernels.cpp

namespace {

using at::Tensor;

// ------------------------------------------------------------------------------------------------
// Fused recurrent cells (CUDA-only ATen kernels chosen by torch.nn for every non-CPU device).
//
// The CPU's unfused LSTM cell computes gates = (hx @ W_hh^T + b_hh) + (x @ W_ih^T + b_ih), activates
// the chunks in place, cy = f * cx + i * c, hy = o * tanh(cy). Here the matmuls arrive without bias
// (torch.nn's non-CPU path), the biases are added in the same order. The workspace holds the
// activated gates [i, f, c, o] (as CUDA's), the backward applies autograd's formulas for the CPU
// graph in the same order (mul, tanh_backward, sigmoid_backward), so gradients round the same way.

void check_cell_sizes(const Tensor& ig, const Tensor& hg, const Tensor& prev, int64_t gates, const char* what) {
  TORCH_CHECK(ig.dim() == 2 && hg.dim() == 2 && prev.dim() == 2, what,
              ": expected 2-D input_gates, hidden_gates and state, got ", ig.dim(), "-D, ", hg.dim(), "-D and ",
              prev.dim(), "-D");
  TORCH_CHECK(ig.sizes() == hg.sizes(), what, ": input_gates ", ig.sizes(), " and hidden_gates ", hg.sizes(),
              " differ");
  TORCH_CHECK(ig.size(1) == gates * prev.size(1) && ig.size(0) == prev.size(0), what, ": gates ", ig.sizes(),
              " do not match state ", prev.sizes());
}

Tensor with_bias(const Tensor& gates, const std::optional<Tensor>& bias) {
  return bias.has_value() && bias->defined() ? gates.add(*bias) : gates;
}

std::tuple<Tensor, Tensor, Tensor> fused_lstm_cell(const Tensor& input_gates, const Tensor& hidden_gates,
                                                   const Tensor& cx, const std::optional<Tensor>& input_bias,
                                                   const std::optional<Tensor>& hidden_bias) {
  check_cell_sizes(input_gates, hidden_gates, cx, 4, "_thnn_fused_lstm_cell");
  Tensor gates = with_bias(hidden_gates, hidden_bias);
  if (gates.is_same(hidden_gates)) gates = gates.clone();
  gates.add_(with_bias(input_gates, input_bias));
  auto chunks = gates.unsafe_chunk(4, 1);
  chunks[0].sigmoid_();
  chunks[1].sigmoid_();
  chunks[2].tanh_();
  chunks[3].sigmoid_();
  Tensor cy = (chunks[1] * cx).add_(chunks[0] * chunks[2]);
  Tensor hy = chunks[3] * cy.tanh();
  return {hy, cy, gates};  // gates now holds the activated [i, f, c, o]: the workspace
}

std::tuple<Tensor, Tensor, Tensor> fused_lstm_cell_backward_impl(const std::optional<Tensor>& grad_hy_opt,
                                                                 const std::optional<Tensor>& grad_cy_opt,
                                                                 const Tensor& cx, const Tensor& cy,
                                                                 const Tensor& workspace, bool has_bias) {
  const bool has_hy = grad_hy_opt.has_value() && grad_hy_opt->defined();
  const bool has_cy = grad_cy_opt.has_value() && grad_cy_opt->defined();
  if (!has_hy && !has_cy) return {Tensor(), Tensor(), Tensor()};
  auto w = workspace.unsafe_chunk(4, 1);
  const Tensor &ig = w[0], &fg = w[1], &cg = w[2], &og = w[3];
  Tensor grad_og, gcy;
  if (has_hy) {
    const Tensor& go = *grad_hy_opt;
    Tensor tanh_cy = cy.tanh();
    grad_og = go * tanh_cy;
    gcy = at::tanh_backward(go * og, tanh_cy);
    if (has_cy) gcy = gcy + *grad_cy_opt;
  } else {
    grad_og = at::zeros_like(og);
    gcy = *grad_cy_opt;
  }
  Tensor grad_gates = at::cat({at::sigmoid_backward(gcy * cg, ig), at::sigmoid_backward(gcy * cx, fg),
                               at::tanh_backward(gcy * ig, cg), at::sigmoid_backward(grad_og, og)},
                              1);
  Tensor grad_cx = gcy * fg;
  Tensor grad_bias = has_bias ? grad_gates.sum(0) : Tensor();
  return {grad_gates, grad_cx, grad_bias};
}

// The CPU's unfused GRU cell: r = sigmoid(hg_r + ig_r), z = sigmoid(hg_z + ig_z),
// n = tanh(ig_n + hg_n * r), hy = (hx - n) * z + n (biases folded into ig/hg). Workspace [r, z, n, hg_n, hx].
std::tuple<Tensor, Tensor> fused_gru_cell(const Tensor& input_gates, const Tensor& hidden_gates, const Tensor& hx,
                                          const std::optional<Tensor>& input_bias,
                                          const std::optional<Tensor>& hidden_bias) {
  check_cell_sizes(input_gates, hidden_gates, hx, 3, "_thnn_fused_gru_cell");
  Tensor ig = with_bias(input_gates, input_bias);
  Tensor hg = with_bias(hidden_gates, hidden_bias);
  auto ic = ig.unsafe_chunk(3, 1);
  auto hc = hg.unsafe_chunk(3, 1);
  Tensor r = (hc[0] + ic[0]).sigmoid_();
  Tensor z = (hc[1] + ic[1]).sigmoid_();
  Tensor n = ic[2].add(hc[2] * r).tanh_();
  Tensor hy = (hx - n).mul_(z).add_(n);
  Tensor workspace = at::cat({r, z, n, hc[2], hx}, 1);
  return {hy, workspace};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fused_gru_cell_backward(const Tensor& grad_hy,
                                                                           const Tensor& workspace, bool has_bias) {
  TORCH_CHECK(workspace.dim() == 2 && workspace.size(1) % 5 == 0,
              "_thnn_fused_gru_cell_backward: expected a [batch, 5 * hidden] workspace, got ", workspace.sizes());
  auto w = workspace.unsafe_chunk(5, 1);
  const Tensor &r = w[0], &z = w[1], &n = w[2], &hn = w[3], &hx = w[4];
  Tensor grad_d = grad_hy * z;                       // d = hx - n, hy = d * z + n
  Tensor grad_z = grad_hy * (hx - n);
  Tensor grad_n = grad_hy + grad_d.neg();
  Tensor grad_s = at::tanh_backward(grad_n, n);      // n = tanh(s), s = ig_n + hn * r
  Tensor grad_r = at::sigmoid_backward(grad_s * hn, r);
  Tensor grad_zp = at::sigmoid_backward(grad_z, z);
  Tensor grad_hn = grad_s * r;
  Tensor grad_input_gates = at::cat({grad_r, grad_zp, grad_s}, 1);
  Tensor grad_hidden_gates = at::cat({grad_r, grad_zp, grad_hn}, 1);
  Tensor grad_input_bias = has_bias ? grad_input_gates.sum(0) : Tensor();
  Tensor grad_hidden_bias = has_bias ? grad_hidden_gates.sum(0) : Tensor();
  return {grad_input_gates, grad_hidden_gates, grad_d, grad_input_bias, grad_hidden_bias};
}

// ------------------------------------------------------------------------------------------------
// Upcasting: dtypes CUDA's kernel has and the CPU's lacks.

struct Upcast {
  std::vector<c10::ScalarType> from;  // argument dtypes widened ...
  c10::ScalarType to;                 // ... to this one
  bool narrow_results = true;         // results of the widened dtype go back to the argument dtype
};

c10::ScalarType widen_for(const Upcast& rule, c10::ScalarType t) {
  for (auto f : rule.from)
    if (f == t) return c10::isComplexType(t) ? c10::toComplexType(rule.to) : rule.to;
  return t;
}

// op name (with overload) -> rule
const std::unordered_map<std::string, Upcast>& upcast_rules() {
  using c10::ScalarType;
  static const std::unordered_map<std::string, Upcast> rules = [] {
    std::unordered_map<std::string, Upcast> r;
    const Upcast ints{{ScalarType::Byte, ScalarType::Char, ScalarType::Short, ScalarType::Int, ScalarType::Long},
                      ScalarType::Double};
    const Upcast halfs{{ScalarType::Half, ScalarType::BFloat16}, ScalarType::Float};
    const Upcast half_only{{ScalarType::Half}, ScalarType::Float};
    const Upcast chalf{{ScalarType::ComplexHalf}, ScalarType::ComplexFloat};
    for (const char* n : {"histc", "histc.out"}) r[n] = ints;
    for (const char* n : {"avg_pool3d", "avg_pool3d.out", "avg_pool3d_backward", "avg_pool3d_backward.grad_input",
                          "_upsample_bilinear2d_aa", "_upsample_bilinear2d_aa.out",
                          "_upsample_bilinear2d_aa_backward", "_upsample_bilinear2d_aa_backward.grad_input",
                          "multi_margin_loss", "multi_margin_loss.out", "multi_margin_loss_backward",
                          "multi_margin_loss_backward.grad_input", "multilabel_margin_loss_forward",
                          "multilabel_margin_loss_forward.output", "multilabel_margin_loss_backward",
                          "multilabel_margin_loss_backward.grad_input"})
      r[n] = halfs;
    for (const char* n : {"rrelu_with_noise", "rrelu_with_noise.out", "rrelu_with_noise_"}) r[n] = half_only;
    r["abs"] = Upcast{{ScalarType::Bool}, ScalarType::Byte};
    r["abs.out"] = r["abs"];
    r["trace"] = Upcast{{ScalarType::Bool}, ScalarType::Byte, /*narrow_results=*/false};
    // complex32: CUDA's elementwise kernels and reductions have it.
    for (const char* n : {"acos", "acos.out", "acosh", "acosh.out", "asin", "asin.out", "asinh", "asinh.out",
                          "atan", "atan.out", "atanh", "atanh.out", "cos", "cos.out", "cosh", "cosh.out", "sin",
                          "sin.out", "sinh", "sinh.out", "tan", "tan.out", "tanh", "tanh.out", "exp", "exp.out",
                          "log", "log.out", "sqrt", "sqrt.out", "rsqrt", "rsqrt.out", "sigmoid", "sigmoid.out",
                          "angle", "angle.out", "div.Tensor", "div.out", "logaddexp", "logaddexp.out",
                          "pow.Tensor_Tensor", "pow.Tensor_Scalar", "pow.Tensor_Tensor_out",
                          "pow.Tensor_Scalar_out", "pow.Scalar", "pow.Scalar_out", "lerp.Scalar", "lerp.Tensor",
                          "lerp.Scalar_out", "lerp.Tensor_out", "sum.dim_IntList", "sum.IntList_out", "sum",
                          "prod", "prod.dim_int", "prod.int_out",
                          // in place, as out of place (CUDA's kernels are the same TensorIterator loops)
                          "acos_", "acosh_", "asin_", "asinh_", "atan_", "atanh_", "cos_", "cosh_", "sin_", "sinh_",
                          "tan_", "tanh_", "exp_", "log_", "sqrt_", "rsqrt_", "sigmoid_", "div_.Tensor",
                          "pow_.Scalar", "pow_.Tensor", "lerp_.Scalar", "lerp_.Tensor"})
      if (!r.count(n)) r[n] = chalf;
    return r;
  }();
  return rules;
}

const Upcast& rule_of(const c10::FunctionSchema& schema) {
  thread_local std::unordered_map<const c10::FunctionSchema*, const Upcast*> cache;
  auto hit = cache.find(&schema);
  if (hit != cache.end()) return *hit->second;
  const std::string name = schema.overload_name().empty() ? schema.name().substr(6)
                                                          : schema.name().substr(6) + "." + schema.overload_name();
  auto it = upcast_rules().find(name);
  TORCH_INTERNAL_ASSERT(it != upcast_rules().end(), "no upcast rule for ", name);
  cache.emplace(&schema, &it->second);
  return it->second;
}

bool is_write_arg(const c10::FunctionSchema& schema, size_t i) {
  const auto& a = schema.arguments()[i];
  return a.alias_info() && a.alias_info()->isWrite();
}

// the dtype a widened result goes back to: the same kind of dtype as the argument that was widened
c10::ScalarType narrow_to(c10::ScalarType result, c10::ScalarType widened, c10::ScalarType original) {
  if (result == widened) return original;
  if (c10::isComplexType(widened) && result == c10::toRealValueType(widened) && c10::isComplexType(original))
    return c10::toRealValueType(original);
  if (!c10::isComplexType(widened) && result == c10::toComplexType(widened) && !c10::isComplexType(original) &&
      original == c10::ScalarType::Half)
    return c10::ScalarType::ComplexHalf;
  return result;
}

// The dtypes the op returns for these arguments, from its Meta kernel (type promotion, `dtype=`, out=), and
// whether the Meta kernel refused them (a check the CPU kernel makes too: dtypes of `end`/`weight`, out=
// dtypes). nullopt: no Meta kernel (or a tensor list argument), nothing known.
struct MetaVerdict {
  bool refused = false;
  std::vector<std::optional<c10::ScalarType>> returns;
};
std::optional<MetaVerdict> meta_verdict(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t base,
                                        size_t nargs) {
  torch::jit::Stack ms;
  ms.reserve(nargs);
  for (size_t i = 0; i < nargs; ++i) {
    const c10::IValue& v = stack[base + i];
    if (v.isTensorList()) return std::nullopt;
    if (v.isTensor() && v.toTensor().defined()) {
      const Tensor& t = v.toTensor();
      ms.emplace_back(at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta)));
    } else {
      ms.push_back(v);
    }
  }
  MetaVerdict out;
  try {
    at::RecordFunctionGuard no_op_events(false);  // a Python Meta kernel's ATen calls are not the program's ops
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &ms);
  } catch (const c10::NotImplementedError&) {  // the dispatcher's: no Meta kernel
    return std::nullopt;
  } catch (const std::exception&) {  // a check of a C++ or a Python (torch._meta_registrations) Meta kernel
    rethrow_if_interrupt();  // but a Ctrl-C is the user's
    out.refused = true;
    return out;
  }
  for (const auto& r : ms)
    out.returns.push_back(r.isTensor() && r.toTensor().defined() ? std::optional(r.toTensor().scalar_type())
                                                                  : std::nullopt);
  return out;
}

// Structured kernels whose out= dtype the CPU checks against the result's ("Expected out tensor to have
// dtype ...", in the wrapper of the out= kernel; their Meta kernels do not).
bool checks_out_dtype(const std::string& name) {
  return name == "avg_pool3d.out" || name == "avg_pool3d_backward.grad_input" ||
         name == "_upsample_bilinear2d_aa.out" || name == "_upsample_bilinear2d_aa_backward.grad_input";
}

void upcast_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const Upcast& rule = rule_of(schema);
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;

  // the dtype CUDA's kernel has and the CPU's lacks: of a tensor argument, or asked for by `dtype=`
  std::optional<c10::ScalarType> original;
  for (size_t i = 0; i < nargs && !original; ++i) {
    const c10::IValue& v = (*stack)[base + i];
    if (v.isTensor() && v.toTensor().defined() && widen_for(rule, v.toTensor().scalar_type()) != v.toTensor().scalar_type())
      original = v.toTensor().scalar_type();
    else if (schema.arguments()[i].name() == "dtype" && v.isInt() &&
             widen_for(rule, static_cast<c10::ScalarType>(v.toInt())) != static_cast<c10::ScalarType>(v.toInt()))
      original = static_cast<c10::ScalarType>(v.toInt());
  }
  if (!original.has_value()) return run_fallback(op, ks, stack);
  const c10::ScalarType widened = widen_for(rule, *original);
  const bool is_histc = schema.name() == "aten::histc";

  // What the op makes of the original dtypes. A refusal is the CPU's too: the op runs un-widened, so the
  // CPU kernel raises its own error (lerp's dtype of `end`, abs's out= dtype). A result of a dtype the CPU
  // computes (complex32 promoted with complex64: div, pow, sum(dtype=complex64)) needs no widening: the CPU
  // kernel runs as on CPU. histc takes any out= dtype on CUDA (it copies its result), so it is not asked.
  const std::string name = schema.overload_name().empty() ? schema.name().substr(6)
                                                          : schema.name().substr(6) + "." + schema.overload_name();
  std::optional<MetaVerdict> verdict = is_histc ? std::nullopt : meta_verdict(op, *stack, base, nargs);
  if (verdict && verdict->refused) return run_fallback(op, ks, stack);
  // complex32 computed into a wider out= (exp(x, out=complex64), angle(x, out=float32)): CUDA computes in the
  // inputs' dtype, complex32, and casts into the out= tensor (TensorIterator's cast of its common dtype; angle's
  // complex temporary). Reductions are not: their out= dtype is the dtype they compute in.
  const bool reduction = name.rfind("sum", 0) == 0 || name.rfind("prod", 0) == 0;
  bool round_outs = false;
  if (*original == c10::ScalarType::ComplexHalf && !reduction) {
    at::native::ResultTypeState state;
    for (size_t i = 0; i < nargs; ++i) {
      const c10::IValue& v = (*stack)[base + i];
      if (schema.arguments()[i].is_out()) continue;
      if (v.isTensor() && v.toTensor().defined()) state = at::native::update_result_type_state(v.toTensor(), state);
      else if (v.isScalar()) state = at::native::update_result_type_state(v.toScalar(), state);
    }
    round_outs = at::native::result_type(state) == c10::ScalarType::ComplexHalf;
  }
  if (verdict && *original == c10::ScalarType::ComplexHalf && !round_outs) {
    bool all_wide = !verdict->returns.empty();
    for (const auto& r : verdict->returns)
      all_wide = all_wide && r && c10::isComplexType(*r) && *r != c10::ScalarType::ComplexHalf;
    if (all_wide) return run_fallback(op, ks, stack);
  }
  if (checks_out_dtype(name)) {
    for (size_t i = 0; i < nargs; ++i) {
      const c10::IValue& v = (*stack)[base + i];
      if (schema.arguments()[i].is_out() && v.isTensor() && v.toTensor().scalar_type() != *original)
        TORCH_CHECK(false, "Expected out tensor to have dtype ", c10::scalarTypeToTypeMeta(*original), ", but got ",
                    v.toTensor().dtype(), " instead");
    }
  }

  // histc on integers (CUDA): min and max are taken as values of the input's type
  if (is_histc && c10::isIntegralType(*original, false)) {
    for (size_t i = 0; i < nargs; ++i) {
      const auto& a = schema.arguments()[i];
      c10::IValue& v = (*stack)[base + i];
      if ((a.name() == "min" || a.name() == "max") && v.isScalar()) {
        const int64_t x = v.toScalar().toLong();
        double narrowed = 0;
        AT_DISPATCH_INTEGRAL_TYPES(*original, "histc_bounds", [&] { narrowed = static_cast<double>(static_cast<scalar_t>(x)); });
        v = c10::IValue(c10::Scalar(narrowed));
      }
    }
  }

  struct Written {
    Tensor orig, up;     // the argument and its widened copy
    bool round = false;  // a wider out=: the widened result is rounded to complex32 (half) before the cast
  };
  std::vector<Written> written;
  for (size_t i = 0; i < nargs; ++i) {
    c10::IValue& v = (*stack)[base + i];
    if (schema.arguments()[i].name() == "dtype" && v.isInt()) {
      v = c10::IValue(static_cast<int64_t>(widen_for(rule, static_cast<c10::ScalarType>(v.toInt()))));
      continue;
    }
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    const Tensor t = v.toTensor();
    if (round_outs && schema.arguments()[i].is_out() && t.scalar_type() != *original) {
      // computed into a temporary of the widened dtype (or its real dtype: angle), rounded, then cast
      const c10::ScalarType temp = c10::isComplexType(t.scalar_type()) ? widened : c10::toRealValueType(widened);
      Tensor up = at::empty({0}, t.options().dtype(temp));
      written.push_back({t, up, /*round=*/true});
      v = c10::IValue(up);
      continue;
    }
    // histc's out= (CUDA copies its result into any dtype): computed in the widened dtype, copied back
    const c10::ScalarType w = is_histc && is_write_arg(schema, i) ? widened : widen_for(rule, t.scalar_type());
    if (w == t.scalar_type()) continue;
    Tensor up = t.to(w);
    if (is_write_arg(schema, i)) written.push_back({t, up});
    v = c10::IValue(up);
  }
  run_fallback(op, ks, stack);
  for (Written& w : written) {
    if (w.orig.sizes() != w.up.sizes()) w.orig.resize_(w.up.sizes());
    w.orig.copy_(w.round ? w.up.to(narrow_to(w.up.scalar_type(), widened, *original)) : w.up);
  }
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  for (size_t i = 0; i < nret; ++i) {
    c10::IValue& v = (*stack)[rbase + i];
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    const Tensor r = v.toTensor();
    bool done = false;
    for (const Written& w : written) {
      if (r.is_same(w.up)) {
        v = c10::IValue(w.orig);
        done = true;
        break;
      }
    }
    if (done || !rule.narrow_results) continue;
    // the Meta kernel's dtype for the original arguments where it has one, else the argument's kind
    const c10::ScalarType back = verdict && i < verdict->returns.size() && verdict->returns[i]
                                     ? *verdict->returns[i]
                                     : narrow_to(r.scalar_type(), widened, *original);
    if (back != r.scalar_type()) v = c10::IValue(r.to(back));
  }
}

// nansum on complex inputs: CUDA has it, the CPU kernel refuses; NaN entries (either part) count as 0.
void nansum_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t base = stack->size() - schema.arguments().size();
  c10::IValue& self = (*stack)[base];
  if (!self.isTensor() || !c10::isComplexType(self.toTensor().scalar_type())) return run_fallback(op, ks, stack);
  const Tensor t = self.toTensor();
  self = c10::IValue(at::where(at::isnan(t), at::zeros({}, t.options()), t));
  static const auto sum = c10::Dispatcher::singleton().findSchemaOrThrow("aten::sum", "dim_IntList");
  static const auto sum_out = c10::Dispatcher::singleton().findSchemaOrThrow("aten::sum", "IntList_out");
  run_fallback(schema.overload_name() == "out" ? sum_out : sum, ks, stack);
}

}  // namespace

// div_.Tensor is registered by kernels.cpp (its fast path for in-place arithmetic); what that path does not take
// comes here, so that complex32 is upcast as div.Tensor is.
void upcast_or_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  upcast_kernel(op, ks, stack);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_thnn_fused_lstm_cell", fused_lstm_cell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", fused_lstm_cell_backward_impl);
  m.impl("_thnn_fused_gru_cell", fused_gru_cell);
  m.impl("_thnn_fused_gru_cell_backward", fused_gru_cell_backward);
  for (const auto& kv : upcast_rules())
    if (kv.first != "div_.Tensor") m.impl(kv.first.c_str(), torch::CppFunction::makeFromBoxedFunction<&upcast_kernel>());
  m.impl("nansum", torch::CppFunction::makeFromBoxedFunction<&nansum_kernel>());
  m.impl("nansum.out", torch::CppFunction::makeFromBoxedFunction<&nansum_kernel>());
}

}  // namespace tnl
