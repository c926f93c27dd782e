// The ops runner/csrc/direct.cpp also exposes as plain Python functions (their definitions, and their
// torch.ops registrations, stay in decoder_layer.cpp and sampler.cpp).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace rollout_cpu {

using OptList = c10::List<std::optional<at::Tensor>>;

// decoder_layer.cpp: the whole Llama forward -> next-token logits [bs, vocab] fp32.
at::Tensor model_forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& embed,
                         const at::Tensor& cos_table, const at::Tensor& sin_table, const OptList& layer_params,
                         c10::IntArrayRef layer_kinds, double eps, double qk_eps, const at::Tensor& norm,
                         const OptList& head, int64_t head_kind, const std::optional<at::Tensor>& last_index,
                         const at::Tensor& k_buffer, const at::Tensor& v_buffer, const at::Tensor& out_cache_loc,
                         const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                         const at::Tensor& seq_lens, const std::optional<at::Tensor>& extend_lens, int64_t num_heads,
                         int64_t num_kv_heads, double scale);

// decoder_layer.cpp: the same with the LM head's output in the model dtype -> [bs, vocab].
at::Tensor model_forward_head(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& embed,
                              const at::Tensor& cos_table, const at::Tensor& sin_table, const OptList& layer_params,
                              c10::IntArrayRef layer_kinds, double eps, double qk_eps, const at::Tensor& norm,
                              const OptList& head, int64_t head_kind, const std::optional<at::Tensor>& last_index,
                              const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                              const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                              const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                              const std::optional<at::Tensor>& extend_lens, int64_t num_heads, int64_t num_kv_heads,
                              double scale);

// sampler.cpp: the plain sampling path (logits fp32, or bf16/fp16 widened row block by row block)
// -> (ids [bs] int64, logprobs [bs] fp32 or empty).
std::tuple<at::Tensor, at::Tensor> sample_plain(const at::Tensor& logits, const at::Tensor& temperatures,
                                                const at::Tensor& seeds, const std::optional<at::Tensor>& seed_mix,
                                                const at::Tensor& steps, bool all_greedy, bool has_greedy,
                                                bool need_temperature, bool want_logprobs);

}  // namespace rollout_cpu
