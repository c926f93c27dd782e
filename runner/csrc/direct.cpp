// The per-step ops as plain Python functions (pybind11), beside their torch.ops registrations: what
// runner/models/fused_layer.py (model_forward, model_forward_sample) and runner/sampler.py (sample_plain)
// call every step.
//
// Why not torch.ops. A torch.ops call copies its arguments into an IValue stack, releases the GIL, runs
// the kernel, and drops the stack while the GIL is still released. Since torch's PyObject preservation,
// a tensor that has a Python object takes the GIL whenever its C++ reference count goes from 2 to 1,
// which is what dropping such a copy does: model_forward's ~15 weights per layer, the KV pool and the
// step's own tensors each took the GIL once at the end of every step, and whenever another thread was
// running Python (the overlap schedule's scheduler, a server's event loop) each of those waited for it,
// up to a switch interval (5 ms) apiece: a 0.6 ms decode step of the tiny model took 44 ms beside a
// thread spinning in Python (bench/gil_convoy.py).
//
// Here the arguments are converted and dropped while the GIL is held, and the kernel runs without it:
// the layers' parameter lists live in a `FusedWeights` built once (runner/models/fused_layer.py keeps
// it until a weight update repacks), so the C++ copies made inside the forward never bring a tensor's
// count down to 1, and no GIL is taken between the release and the return.
//
// What it does not do: compute anything itself (it calls decoder_layer.cpp's and sampler.cpp's
// functions), or check more than they do.
// Only what the bindings need: tensor types and the one ATen op model_forward_sample calls itself, not all
// of ATen's operator declarations (torch/extension.h would also compile the C++ frontend).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/ops/empty.h>         // model_forward_sample_steps' outputs
#include <ATen/ops/index_select.h>  // model_forward_sample fills a step's input ids

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "entry_points.h"

namespace {

namespace py = pybind11;
using at::Tensor;

// The layers' and the LM head's parameters and the model's constants, as model_forward takes them.
struct FusedWeights {
  rollout_cpu::OptList layer_params;
  std::vector<int64_t> layer_kinds;
  rollout_cpu::OptList head;
  int64_t head_kind;
  double eps, qk_eps;
  int64_t num_heads, num_kv_heads;
  double scale;
};

rollout_cpu::OptList to_list(const std::vector<std::optional<Tensor>>& v) {
  rollout_cpu::OptList out;
  out.reserve(v.size());
  for (const auto& t : v) out.push_back(t);
  return out;
}

// c10::Error's what() carries a C++ backtrace; the Python error gets only the message, as torch.ops gives.
template <typename F>
auto without_gil(F&& f) -> decltype(f()) {
  try {
    py::gil_scoped_release release;
    return f();
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

// FusedWeights as fused_layer.py's cache holds it; input_ids, positions: [num_tokens]; the embedding,
// rotary tables, final norm and KV pool are passed per step (a resume may reallocate them)
// -> logits [bs, vocab] fp32.
Tensor model_forward(const FusedWeights& w, const Tensor& input_ids, const Tensor& positions, const Tensor& embed,
                     const Tensor& cos_table, const Tensor& sin_table, const Tensor& norm,
                     const std::optional<Tensor>& last_index, const Tensor& k_buffer, const Tensor& v_buffer,
                     const Tensor& out_cache_loc, const Tensor& req_to_token, const Tensor& req_pool_indices,
                     const Tensor& seq_lens, const std::optional<Tensor>& extend_lens) {
  return without_gil([&] {
    return rollout_cpu::model_forward(input_ids, positions, embed, cos_table, sin_table, w.layer_params,
                                      w.layer_kinds, w.eps, w.qk_eps, norm, w.head, w.head_kind, last_index,
                                      k_buffer, v_buffer, out_cache_loc, req_to_token, req_pool_indices, seq_lens,
                                      extend_lens, w.num_heads, w.num_kv_heads, w.scale);
  });
}

std::tuple<Tensor, Tensor> sample_plain(const Tensor& logits, const Tensor& temperatures, const Tensor& seeds,
                                        const std::optional<Tensor>& seed_mix, const Tensor& steps, bool all_greedy,
                                        bool has_greedy, bool need_temperature, bool want_logprobs) {
  return without_gil([&] {
    return rollout_cpu::sample_plain(logits, temperatures, seeds, seed_mix, steps, all_greedy, has_greedy,
                                     need_temperature, want_logprobs);
  });
}

// A decode step of the overlap schedule as one call (runner/models/fused_layer.py run_sample): input_ids
// first takes the step before's sampled ids (`fill_from`, rows `fill_index` of it when given), then
// model_forward, then sample_plain on its logits -> (logits in the model dtype, ids, logprobs), the same
// functions on the same tensors as the three calls they replace (but for the logits' fp32 copy, which the
// sampler makes a row block at a time: at 64 rows x 151,936 a [bs, vocab] fp32 copy is a fresh 39 MB
// mapping faulted in every step), with the GIL taken once instead of three times: each time a
// step gives it back, the scheduler thread's Python (building the next step meanwhile) may hold it.
std::tuple<Tensor, Tensor, Tensor> model_forward_sample(
    const FusedWeights& w, const Tensor& input_ids, const Tensor& positions, const Tensor& embed,
    const Tensor& cos_table, const Tensor& sin_table, const Tensor& norm, const std::optional<Tensor>& last_index,
    const Tensor& k_buffer, const Tensor& v_buffer, const Tensor& out_cache_loc, const Tensor& req_to_token,
    const Tensor& req_pool_indices, const Tensor& seq_lens, const std::optional<Tensor>& extend_lens,
    const std::optional<Tensor>& fill_from, const std::optional<Tensor>& fill_index, const Tensor& temperatures,
    const Tensor& seeds, const std::optional<Tensor>& seed_mix, const Tensor& steps, bool all_greedy,
    bool has_greedy, bool need_temperature, bool want_logprobs) {
  return without_gil([&] {
    if (fill_from.has_value()) {
      if (fill_index.has_value()) {
        Tensor out = input_ids;  // a view of the batch's index rows: written in place, never resized
        at::index_select_out(out, *fill_from, 0, *fill_index);
      } else {
        input_ids.copy_(*fill_from);
      }
    }
    Tensor logits = rollout_cpu::model_forward_head(input_ids, positions, embed, cos_table, sin_table,
                                                    w.layer_params, w.layer_kinds, w.eps, w.qk_eps, norm, w.head,
                                                    w.head_kind, last_index, k_buffer, v_buffer, out_cache_loc,
                                                    req_to_token, req_pool_indices, seq_lens, extend_lens,
                                                    w.num_heads, w.num_kv_heads, w.scale);
    auto [ids, logprobs] = rollout_cpu::sample_plain(logits, temperatures, seeds, seed_mix, steps, all_greedy,
                                                     has_greedy, need_temperature, want_logprobs);
    return std::make_tuple(logits, ids, logprobs);
  });
}

// `num_steps` decode steps of one batch as one call (the scheduler's decode block, rollout/scheduler.py
// _run_decode_block): step j > 0 takes step j - 1's sampled ids as its input, every row one position
// further on (positions, seq_lens and the sampler's output position `steps` + j), and writes its KV into
// out_cache_locs[j] (the caller put those slots into req_to_token before the call). Each step runs the same
// functions on the same tensors as model_forward_sample, so step j's ids and logprobs are bitwise those of
// the j-th of `num_steps` separate steps. input_ids, positions, seq_lens and steps are not written (copies
// advance). `stop_flag` (int32 [1], host): when another thread has set it non-zero, no further step starts
// (the scheduler's engine sets it when a request or a control call arrives, so a block delays them by one
// step at most). out_cache_locs: [num_steps, bs] -> (ids [done, bs] int64, logprobs [done, bs] fp32 or [0, bs]),
// done >= 1 the steps run.
std::tuple<Tensor, Tensor> model_forward_sample_steps(
    const FusedWeights& w, const Tensor& input_ids, const Tensor& positions, const Tensor& embed,
    const Tensor& cos_table, const Tensor& sin_table, const Tensor& norm, const Tensor& k_buffer,
    const Tensor& v_buffer, const Tensor& out_cache_locs, const Tensor& req_to_token,
    const Tensor& req_pool_indices, const Tensor& seq_lens, const Tensor& temperatures, const Tensor& seeds,
    const std::optional<Tensor>& seed_mix, const Tensor& steps, bool all_greedy, bool has_greedy,
    bool need_temperature, bool want_logprobs, const std::optional<Tensor>& stop_flag) {
  return without_gil([&] {
    const int64_t num_steps = out_cache_locs.size(0), bs = input_ids.size(0);
    TORCH_CHECK(out_cache_locs.dim() == 2 && out_cache_locs.size(1) == bs,
                "out_cache_locs must be [num_steps, bs], got ", out_cache_locs.sizes());
    TORCH_CHECK(!stop_flag.has_value() || (stop_flag->device().is_cpu() && stop_flag->scalar_type() == at::kInt &&
                                           stop_flag->numel() == 1),
                "stop_flag must be one int32 on the CPU");
    // Written by another thread while this one runs without the GIL: read through volatile, once per step.
    const volatile int32_t* stop = stop_flag.has_value() ? stop_flag->data_ptr<int32_t>() : nullptr;
    Tensor ids = at::empty({num_steps, bs}, input_ids.options().dtype(at::kLong));
    Tensor logprobs = at::empty({want_logprobs ? num_steps : 0, bs}, temperatures.options().dtype(at::kFloat));
    Tensor in = input_ids.clone(), pos = positions.clone(), lens = seq_lens.clone(), at_step = steps.clone();
    int64_t done = 0;
    for (int64_t j = 0; j < num_steps; ++j) {
      if (j > 0) {
        if (stop != nullptr && *stop != 0) break;
        in.copy_(ids[j - 1]);
        pos.add_(1);
        lens.add_(1);
        at_step.add_(1);
      }
      Tensor logits = rollout_cpu::model_forward_head(in, pos, embed, cos_table, sin_table, w.layer_params,
                                                      w.layer_kinds, w.eps, w.qk_eps, norm, w.head, w.head_kind,
                                                      std::nullopt, k_buffer, v_buffer, out_cache_locs[j],
                                                      req_to_token, req_pool_indices, lens, std::nullopt,
                                                      w.num_heads, w.num_kv_heads, w.scale);
      auto [step_ids, step_logprobs] = rollout_cpu::sample_plain(logits, temperatures, seeds, seed_mix, at_step,
                                                                 all_greedy, has_greedy, need_temperature,
                                                                 want_logprobs);
      ids[j].copy_(step_ids);
      if (want_logprobs) logprobs[j].copy_(step_logprobs);
      done = j + 1;
    }
    return std::make_tuple(ids.narrow(0, 0, done), want_logprobs ? logprobs.narrow(0, 0, done) : logprobs);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rollout-engine's per-step CPU ops, called without torch.ops' GIL round trips (runner/csrc/direct.cpp)";
  py::class_<FusedWeights>(m, "FusedWeights")
      .def(py::init([](const std::vector<std::optional<Tensor>>& layer_params, std::vector<int64_t> layer_kinds,
                       const std::vector<std::optional<Tensor>>& head, int64_t head_kind, double eps, double qk_eps,
                       int64_t num_heads, int64_t num_kv_heads, double scale) {
             return FusedWeights{to_list(layer_params), std::move(layer_kinds), to_list(head), head_kind, eps, qk_eps,
                                 num_heads, num_kv_heads, scale};
           }),
           py::arg("layer_params"), py::arg("layer_kinds"), py::arg("head"), py::arg("head_kind"), py::arg("eps"),
           py::arg("qk_eps"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("scale"));
  m.def("model_forward", &model_forward, "runner/csrc/decoder_layer.cpp model_forward over a FusedWeights");
  m.def("sample_plain", &sample_plain, "runner/csrc/sampler.cpp sample_plain");
  m.def("model_forward_sample", &model_forward_sample,
        "input ids from the step before, model_forward, then sample_plain, in one call without the GIL");
  m.def("model_forward_sample_steps", &model_forward_sample_steps,
        "several decode steps of one batch, each fed the one before's sampled ids, in one call without the GIL");
}
