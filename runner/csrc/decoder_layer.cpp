// One Llama-family decoder layer on the CPU as a single op (decoder_layer): input RMSNorm (with the
// residual add), q|k|v projection, optional per-head q/k RMSNorm (Qwen3), rotary, the K/V write into the
// paged pool, paged attention, o_proj, post-attention RMSNorm, and the gated MLP; and the whole forward
// (model_forward): embedding, the step's cos/sin rows, every layer, the final norm and the LM head.
// Called from runner/models/fused_layer.py, which decides when they apply.
//
// Why. It runs exactly the ops the Python layer runs, in the same order, on the same kernels
// (this extension's norm, rotary and attention; oneDNN's prepacked linears or at::linear; at::silu and
// at::mul), so its output is bitwise the Python layer's. What it removes is the Python between them: a
// small model's decode layer is ~15 op calls, and at decode sizes each costs more in the interpreter
// than in its kernel. It also runs the whole layer without the GIL (a torch.ops call releases it), so a
// thread beside the forward (the overlap schedule's scheduler, a server's event loop) runs meanwhile.
//
// Not here: LoRA terms, tensor parallelism, MoE blocks, batch-invariant or HF-numerics modes,
// autograd. Its caller keeps the Python layer for those.
//
// A linear is given as (params, kind): kind 0 = dense [weight, bias?] through at::linear (F.linear);
// kind 1 = oneDNN-prepacked [weight, bias?] (runner/layers/prepack.py); the gate|up projection's kind 2 =
// prepacked halves [gate_w, gate_b?, up_w, up_b?] with SiLU and the product in oneDNN's epilogues.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "entry_points.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using rollout_cpu::OptList;

c10::OperatorHandle op_handle(const char* name, const char* overload) {
  // Kept in function-local statics at first use; the dispatcher keeps a handle valid for the process.
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

Tensor boxed1(const c10::OperatorHandle& op, std::vector<c10::IValue> stack) {
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// mkldnn::_linear_pointwise(X, W, B, attr, [], "") as runner/layers/ops.py calls it.
Tensor linear_pointwise(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b, const char* attr) {
  static const auto op = op_handle("mkldnn::_linear_pointwise", "");
  return boxed1(op, {x, w, b.has_value() ? c10::IValue(*b) : c10::IValue(), std::string(attr),
                     c10::List<std::optional<c10::Scalar>>(), std::string("")});
}

Tensor linear_pointwise_mul(const Tensor& x, const Tensor& other, const Tensor& w, const std::optional<Tensor>& b) {
  static const auto op = op_handle("mkldnn::_linear_pointwise", "binary");
  return boxed1(op, {x, other, w, b.has_value() ? c10::IValue(*b) : c10::IValue(), std::string("mul")});
}

Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  static const auto op = op_handle("rollout_cpu::rms_norm", "").typed<Tensor(const Tensor&, const Tensor&, double)>();
  return op.call(x, w, eps);
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& res, const Tensor& w, double eps) {
  static const auto op = op_handle("rollout_cpu::add_rms_norm", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>();
  return op.call(x, res, w, eps);
}

Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  static const auto op =
      op_handle("rollout_cpu::rotary", "").typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>();
  return op.call(x, cos, sin);
}

Tensor param(const OptList& p, size_t i, const char* name) {
  TORCH_CHECK(p.size() > i && p.get(i).has_value(), "decoder_layer: ", name, " is missing its weight");
  return *p.get(i);
}

std::optional<Tensor> opt(const OptList& p, size_t i) { return p.size() > i ? p.get(i) : std::nullopt; }

// x: [num_tokens, in] -> [num_tokens, out], as runner/layers/linear.py's Linear._base.
Tensor linear(const Tensor& x, const OptList& p, int64_t kind, const char* name) {
  const Tensor w = param(p, 0, name);
  if (kind == 0) return at::linear(x, w, opt(p, 1));
  TORCH_CHECK(kind == 1, "decoder_layer: ", name, " kind ", kind, " (0 dense, 1 prepacked)");
  // An fp32 shadow of bf16 weights upcasts x and rounds once (runner/layers/ops.py packed_linear).
  return linear_pointwise(x.to(w.scalar_type()).contiguous(), w, opt(p, 1), "none").to(x.scalar_type());
}

// The MLP's activation: silu(x Wg^T) * (x Wu^T), as runner/layers/activation.py gated_silu_and_mul.
Tensor gated_mlp(const Tensor& x, const OptList& p, int64_t kind) {
  if (kind == 2) {
    const Tensor gw = param(p, 0, "gate_up_proj"), uw = param(p, 2, "gate_up_proj");
    const Tensor xc = x.to(gw.scalar_type()).contiguous();
    const Tensor gate = linear_pointwise(xc, gw, opt(p, 1), "swish");
    return linear_pointwise_mul(xc, gate, uw, opt(p, 3)).to(x.scalar_type());
  }
  const Tensor gu = linear(x, p, kind, "gate_up_proj");  // [num_tokens, 2 * inter]
  const auto halves = gu.chunk(2, -1);
  return at::mul(at::silu(halves[0]), halves[1]);
}

// A prefill's MLP runs over row blocks of this many tokens when both its linears are prepacked: the
// [rows, intermediate] activations of a block stay in cache between gate|up and down instead of making
// a round trip through memory. On a 2-core Xeon with AMX (24 layers' worth of 0.5B-shaped MLPs, 2048
// tokens, bf16) 37.9 ms a layer whole against 28.7 in blocks of 512 and 30.9 in blocks of 256; fp32
// 187 -> 167 ms. oneDNN computes each output row the same whatever the rows beside it (checked bitwise
// there, and by the fused-vs-modules tests), so the blocks change no bits.
constexpr int64_t kMlpRowBlock = 512;

// hidden: [num_tokens, hidden] -> the MLP's output [num_tokens, hidden].
Tensor mlp(const Tensor& hidden, const OptList& gate_up, int64_t gate_up_kind, const OptList& down,
           int64_t down_kind) {
  const int64_t n = hidden.size(0);
  if (n <= kMlpRowBlock || gate_up_kind != 2 || down_kind != 1)
    return linear(gated_mlp(hidden, gate_up, gate_up_kind), down, down_kind, "down_proj");
  std::vector<Tensor> blocks;
  for (int64_t start = 0; start < n; start += kMlpRowBlock) {
    const Tensor rows = hidden.narrow(0, start, std::min(kMlpRowBlock, n - start));
    blocks.push_back(linear(gated_mlp(rows, gate_up, gate_up_kind), down, down_kind, "down_proj"));
  }
  return at::cat(blocks);
}

// hidden: [num_tokens, hidden]; residual: the same, or None on the first layer; cos, sin_signed:
// [num_tokens, 1, head_dim] (runner/layers/rotary.py); k_cache, v_cache: this layer's pool
// [slots, kv_heads, head_dim]; out_cache_loc: [num_tokens] int64 slots of the new tokens; the paged
// attention's plan as runner/attention/cpu_decode.py takes it (extend_lens None for decode)
// -> (mlp output, residual), both [num_tokens, hidden].
std::tuple<Tensor, Tensor> decoder_layer(
    const Tensor& hidden_in, const std::optional<Tensor>& residual_in, const Tensor& cos, const Tensor& sin,
    const Tensor& ln1, const Tensor& ln2, double eps, const OptList& qkv, int64_t qkv_kind, const OptList& o,
    int64_t o_kind, const OptList& gate_up, int64_t gate_up_kind, const OptList& down, int64_t down_kind,
    const std::optional<Tensor>& q_norm, const std::optional<Tensor>& k_norm, double qk_eps, const Tensor& k_cache,
    const Tensor& v_cache, const Tensor& out_cache_loc, const Tensor& req_to_token, const Tensor& req_pool_indices,
    const Tensor& seq_lens, const std::optional<Tensor>& extend_lens, int64_t num_heads, int64_t num_kv_heads,
    double scale) {
  TORCH_CHECK(hidden_in.dim() == 2, "decoder_layer: hidden must be [num_tokens, hidden], got ", hidden_in.sizes());
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == num_kv_heads, "decoder_layer: k_cache ", k_cache.sizes(),
              " is not [slots, ", num_kv_heads, ", head_dim]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decoder_layer: q_norm and k_norm come together");
  const int64_t n = hidden_in.size(0), d = k_cache.size(2);
  const int64_t q_size = num_heads * d, kv_size = num_kv_heads * d;

  Tensor hidden, residual;
  if (residual_in.has_value()) {
    std::tie(hidden, residual) = add_rms_norm(hidden_in, *residual_in, ln1, eps);
  } else {
    residual = hidden_in.clone();  // the layer's input itself in the Python layer; an op returns no alias of an input
    hidden = rms_norm(hidden_in, ln1, eps);
  }

  const Tensor qkv_out = linear(hidden, qkv, qkv_kind, "qkv_proj");  // [n, q_size + 2 * kv_size]
  TORCH_CHECK(qkv_out.size(1) == q_size + 2 * kv_size, "decoder_layer: qkv_proj gives ", qkv_out.size(1),
              " features, the heads need ", q_size + 2 * kv_size);
  const Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, d});
  Tensor q, k;
  if (q_norm.has_value()) {
    q = rotary(rms_norm(qkv_out.narrow(1, 0, q_size).view({n, num_heads, d}), *q_norm, qk_eps), cos, sin);
    k = rotary(rms_norm(qkv_out.narrow(1, q_size, kv_size).view({n, num_kv_heads, d}), *k_norm, qk_eps), cos, sin);
  } else {
    // q and k heads rotated as one tensor, as runner/models/llama.py does.
    const Tensor qk = rotary(qkv_out.narrow(1, 0, q_size + kv_size).view({n, num_heads + num_kv_heads, d}), cos, sin);
    q = qk.narrow(1, 0, num_heads);
    k = qk.narrow(1, num_heads, num_kv_heads);
  }

  // The pool write of runner/memory/kv_pool.py set_kv (same dtype: the caller checked).
  k_cache.index_copy_(0, out_cache_loc, k);
  v_cache.index_copy_(0, out_cache_loc, v);
  const Tensor qc = q.view({-1, num_heads, d}).contiguous();
  Tensor attn;
  if (extend_lens.has_value()) {
    static const auto op = op_handle("rollout_cpu::paged_extend_attention", "")
                               .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                             const Tensor&, const Tensor&, double)>();
    attn = op.call(qc, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, *extend_lens, scale);
  } else {
    static const auto op = op_handle("rollout_cpu::paged_decode_attention", "")
                               .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                             const Tensor&, double)>();
    attn = op.call(qc, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale);
  }
  const Tensor attn_out = linear(attn.reshape({n, q_size}), o, o_kind, "o_proj");

  std::tie(hidden, residual) = add_rms_norm(attn_out, residual, ln2, eps);
  return {mlp(hidden, gate_up, gate_up_kind, down, down_kind), residual};
}

constexpr int64_t kLayerParams = 14;  // per layer in model_forward's list (runner/models/fused_layer.py)
constexpr int64_t kLayerKinds = 4;

OptList slice(const OptList& p, int64_t start, int64_t n) {
  OptList out;
  out.reserve(n);
  for (int64_t i = start; i < start + n; ++i) out.push_back(p.get(i));
  return out;
}

}  // namespace

namespace rollout_cpu {

// The whole forward of runner/models/llama.py's LlamaForCausalLM as one op: embedding, the cos/sin rows
// of this step's positions, every decoder layer above, the final norm and the LM head (at every row
// for decode, at `last_index` rows for extend), logits in fp32. Per layer `layer_params` holds
// [ln1, ln2, qkv_w, qkv_b, o_w, o_b, gate_up x4, down_w, down_b, q_norm, k_norm] and `layer_kinds`
// [qkv, o, gate_up, down]. k_buffer, v_buffer: the pool [layers, slots, kv_heads, head_dim].
// input_ids, positions: [num_tokens] -> [bs, vocab] fp32.
// model_forward_head is the same with the LM head's output left in the model dtype (the one-call decode step
// samples from it: runner/csrc/sampler.cpp widens row blocks itself, so no [bs, vocab] fp32 copy is made).
Tensor model_forward_head(const Tensor& input_ids, const Tensor& positions, const Tensor& embed,
                          const Tensor& cos_table, const Tensor& sin_table, const OptList& layer_params,
                          c10::IntArrayRef layer_kinds, double eps, double qk_eps, const Tensor& norm,
                          const OptList& head, int64_t head_kind, const std::optional<Tensor>& last_index,
                          const Tensor& k_buffer, const Tensor& v_buffer, const Tensor& out_cache_loc,
                          const Tensor& req_to_token, const Tensor& req_pool_indices, const Tensor& seq_lens,
                          const std::optional<Tensor>& extend_lens, int64_t num_heads, int64_t num_kv_heads,
                          double scale) {
  const int64_t layers = static_cast<int64_t>(layer_kinds.size()) / kLayerKinds;
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(layer_kinds.size()) == layers * kLayerKinds &&
                  static_cast<int64_t>(layer_params.size()) == layers * kLayerParams,
              "model_forward: ", layer_params.size(), " layer params and ", layer_kinds.size(),
              " kinds do not describe whole layers (", kLayerParams, " and ", kLayerKinds, " each)");
  TORCH_CHECK(k_buffer.dim() == 4 && k_buffer.size(0) >= layers && v_buffer.sizes() == k_buffer.sizes(),
              "model_forward: k_buffer/v_buffer must be [layers >= ", layers, ", slots, kv_heads, head_dim], got ",
              k_buffer.sizes(), " and ", v_buffer.sizes());
  Tensor hidden = at::embedding(embed, input_ids);  // [num_tokens, hidden]
  // runner/layers/rotary.py cos_sin: the rows of this step's positions, in the model dtype, [n, 1, d].
  const Tensor cos = cos_table.index({positions}).to(hidden.scalar_type()).unsqueeze(1);
  const Tensor sin = sin_table.index({positions}).to(hidden.scalar_type()).unsqueeze(1);
  std::optional<Tensor> residual;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t b = l * kLayerParams;
    const int64_t* kinds = layer_kinds.data() + l * kLayerKinds;
    const std::optional<Tensor> q_norm = layer_params.get(b + 12), k_norm = layer_params.get(b + 13);
    auto out = decoder_layer(hidden, residual, cos, sin, *layer_params.get(b), *layer_params.get(b + 1), eps,
                             slice(layer_params, b + 2, 2), kinds[0], slice(layer_params, b + 4, 2), kinds[1],
                             slice(layer_params, b + 6, 4), kinds[2], slice(layer_params, b + 10, 2), kinds[3], q_norm,
                             k_norm, qk_eps, k_buffer.select(0, l), v_buffer.select(0, l), out_cache_loc, req_to_token,
                             req_pool_indices, seq_lens, extend_lens, num_heads, num_kv_heads, scale);
    hidden = std::get<0>(out);
    residual = std::get<1>(out);
  }
  hidden = std::get<0>(add_rms_norm(hidden, *residual, norm, eps));
  if (last_index.has_value()) hidden = hidden.index({*last_index});  // runner/layers/logits.py compute_logits
  return linear(hidden, head, head_kind, "lm_head");
}

Tensor model_forward(const Tensor& input_ids, const Tensor& positions, const Tensor& embed, const Tensor& cos_table,
                     const Tensor& sin_table, const OptList& layer_params, c10::IntArrayRef layer_kinds, double eps,
                     double qk_eps, const Tensor& norm, const OptList& head, int64_t head_kind,
                     const std::optional<Tensor>& last_index, const Tensor& k_buffer, const Tensor& v_buffer,
                     const Tensor& out_cache_loc, const Tensor& req_to_token, const Tensor& req_pool_indices,
                     const Tensor& seq_lens, const std::optional<Tensor>& extend_lens, int64_t num_heads,
                     int64_t num_kv_heads, double scale) {
  return model_forward_head(input_ids, positions, embed, cos_table, sin_table, layer_params, layer_kinds, eps, qk_eps,
                            norm, head, head_kind, last_index, k_buffer, v_buffer, out_cache_loc, req_to_token,
                            req_pool_indices, seq_lens, extend_lens, num_heads, num_kv_heads, scale)
      .to(at::kFloat);
}

}  // namespace rollout_cpu

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("decoder_layer(Tensor hidden, Tensor? residual, Tensor cos, Tensor sin, Tensor ln1, Tensor ln2, float eps, "
        "Tensor?[] qkv, int qkv_kind, Tensor?[] o, int o_kind, Tensor?[] gate_up, int gate_up_kind, "
        "Tensor?[] down, int down_kind, Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "Tensor? extend_lens, int num_heads, int num_kv_heads, float scale) -> (Tensor, Tensor)");
  m.def("model_forward(Tensor input_ids, Tensor positions, Tensor embed, Tensor cos_table, Tensor sin_table, "
        "Tensor?[] layer_params, int[] layer_kinds, float eps, float qk_eps, Tensor norm, Tensor?[] head, "
        "int head_kind, Tensor? last_index, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor out_cache_loc, "
        "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor? extend_lens, int num_heads, "
        "int num_kv_heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("model_forward", &rollout_cpu::model_forward);
}

// A oneDNN-prepacked weight is an MkldnnCPU tensor, and a call that holds one dispatches on that key.
TORCH_LIBRARY_IMPL(rollout_cpu, MkldnnCPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("model_forward", &rollout_cpu::model_forward);
}
