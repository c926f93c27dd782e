// The sampler's plain path on the CPU as one op: no logit processors (penalties, bias, bans), no top-k,
// top-p or min-p, no top / token_ids / raw logprobs; greedy rows, temperature and the counter-based
// seeded draw. What RL rollouts sample with (temperature 1, n samples, the token's logprob). Called
// from runner/sampler.py, which keeps its Python path for everything else.
//
// It runs runner/sampler.py's ops for that case in the same order on the same ATen kernels (argmax in
// 128-wide chunks, log_softmax at the argmax, softmax, the two-level inverse CDF, the argmax fallback
// for a draw that lands on a zero-probability token), so its ids and logprobs are bitwise the Python
// path's; only the splitmix64 hash and the uniform are scalar loops here, integer and IEEE double
// arithmetic that rounds as torch's tensor ops do. What it saves is ~30 interpreted op calls per
// step, and it runs without the GIL.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "entry_points.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t kArgmaxChunk = 128;  // runner/sampler.py _ARGMAX_CHUNK
constexpr int64_t kCdfChunk = 128;     // runner/sampler.py _CDF_CHUNK

inline uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// runner/sampler.py first_argmax: x.argmax(-1) of [bs, vocab], first index of the max, NaN the max.
Tensor first_argmax(const Tensor& x) {
  const int64_t bs = x.size(0), vocab = x.size(1), c = kArgmaxChunk;
  const int64_t main = vocab - vocab % c;
  if (!x.is_contiguous() || main == 0) return x.argmax(-1);
  const Tensor chunks = x.as_strided({bs, main / c, c}, {vocab, c, 1});
  const Tensor chunk_max = chunks.amax(-1);  // [bs, n_chunks]
  const Tensor best = chunk_max.argmax(-1);  // [bs]
  const Tensor rows = at::arange(bs, x.options().dtype(at::kLong));
  Tensor ids = best * c + chunks.index({rows, best}).argmax(-1);
  if (main < vocab) {
    const Tensor tail = x.slice(1, main);
    const Tensor tail_ids = tail.argmax(-1);
    const Tensor head_max = chunk_max.index({rows, best}), tail_max = tail.index({rows, tail_ids});
    const Tensor take_tail = (tail_max > head_max) | (tail_max.isnan() & ~head_max.isnan());
    ids = at::where(take_tail, tail_ids + main, ids);
  }
  return ids;
}

// runner/sampler.py logsumexp_at_argmax.
Tensor logsumexp_at_argmax(const Tensor& x, const Tensor& argmax) {
  const Tensor at_ = argmax.unsqueeze(1);
  const Tensor top = x.gather(1, at_).squeeze(1);
  const Tensor lse = top - at::log_softmax(x, -1).gather(1, at_).squeeze(1);
  return at::where(top.isinf(), top, lse);
}

// runner/sampler.py inverse_cdf: probs [bs, vocab], u [bs] -> [bs] int64.
Tensor inverse_cdf(const Tensor& probs, const Tensor& u) {
  const int64_t bs = probs.size(0), vocab = probs.size(1), c = kCdfChunk;
  const int64_t n = (vocab + c - 1) / c, main = (vocab / c) * c;
  Tensor sums;
  if (main == vocab) {
    sums = probs.view({bs, n, c}).sum(-1);
  } else {
    std::vector<Tensor> parts;
    if (main) parts.push_back(probs.slice(1, 0, main).reshape({bs, n - 1, c}).sum(-1));
    parts.push_back(probs.slice(1, main).sum(-1, /*keepdim=*/true));
    sums = at::cat(parts, 1);
  }
  const Tensor chunk_cdf = sums.cumsum_(-1);  // [bs, n]
  const Tensor target = (u * chunk_cdf.select(1, -1)).unsqueeze(1);  // [bs, 1]
  const Tensor chunk = at::searchsorted(chunk_cdf, target, /*out_int32=*/false, /*right=*/true).clamp_(std::nullopt, n - 1);
  const Tensor before = chunk_cdf.gather(1, (chunk - 1).clamp(0, std::nullopt)).masked_fill_(chunk == 0, 0.0);
  const Tensor cols = chunk * c + at::arange(c, probs.options().dtype(at::kLong));  // [bs, c]
  const Tensor local = probs.gather(1, cols.clamp(std::nullopt, vocab - 1)).masked_fill_(cols >= vocab, 0.0);
  const Tensor local_cdf = local.cumsum_(-1).add_(before);
  const Tensor pos = at::searchsorted(local_cdf, target, false, true).clamp_(std::nullopt, c - 1);
  return (chunk * c + pos).squeeze(1).clamp_(std::nullopt, vocab - 1);
}

// Every op of the plain path works row by row, so a batch is sampled in blocks of rows whose fp32
// temporaries ([rows, vocab] each: the scaled logits, softmax, log_softmax) stay under kBlockBytes, with
// the same bits as the whole batch at once. Why: glibc serves an allocation above its mmap threshold
// (which it raises to at most 32 MiB) with a fresh mapping, whose pages fault on first touch, every step.
// 64 rows x 151,936 (Qwen2.5's vocabulary) are 39 MB a temporary: softmax + log_softmax took 24 ms over the
// whole batch and 4.8 ms in blocks of 16 rows, 2 threads on a Zen 5.
constexpr int64_t kBlockBytes = 8 << 20;

std::tuple<Tensor, Tensor> sample_block(const Tensor& logits, const Tensor& temperatures, const Tensor& seeds,
                                        const std::optional<Tensor>& seed_mix_in, const Tensor& steps,
                                        bool all_greedy, bool has_greedy, bool need_temperature, bool want_logprobs) {
  const int64_t bs = logits.size(0);
  const bool any_greedy = all_greedy || has_greedy;
  Tensor argmax, lse, greedy, logprobs_all;
  if (any_greedy) {
    argmax = first_argmax(logits);
    if (want_logprobs) lse = logsumexp_at_argmax(logits, argmax);
    greedy = temperatures == 0;
  }
  Tensor ids;
  if (all_greedy) {
    ids = argmax;
  } else {
    Tensor scaled = logits;
    if (need_temperature) {
      const Tensor g = temperatures == 0;
      const Tensor temps = at::where(g, at::ones_like(temperatures), temperatures);
      scaled = logits / temps.unsqueeze(1).expand_as(logits);
    }
    const Tensor probs = at::softmax(scaled, -1);
    if (want_logprobs) logprobs_all = at::log_softmax(scaled, -1);
    // The uniform per row: splitmix64(seed_mix ^ step), its top 24 bits, (bits + 0.5) / 2^24 in double,
    // then rounded to float32 (runner/sampler.py uniform_from_seed_mix and its .to(probs.dtype)).
    const Tensor seeds_c = seeds.contiguous(), steps_c = steps.contiguous();
    const Tensor mix_c = seed_mix_in.has_value() ? seed_mix_in->contiguous() : Tensor();
    TORCH_CHECK(!mix_c.defined() || (mix_c.scalar_type() == at::kLong && mix_c.numel() == bs),
                "sample_plain: seed_mix must be int64 [", bs, "]");
    Tensor u = at::empty({bs}, probs.options());
    const int64_t* sp = seeds_c.data_ptr<int64_t>();
    const int64_t* tp = steps_c.data_ptr<int64_t>();
    const int64_t* mp = mix_c.defined() ? mix_c.data_ptr<int64_t>() : nullptr;
    float* up = u.data_ptr<float>();
    for (int64_t i = 0; i < bs; ++i) {
      const uint64_t mix = mp ? static_cast<uint64_t>(mp[i]) : splitmix64(static_cast<uint64_t>(sp[i]));
      const uint64_t h = splitmix64(mix ^ static_cast<uint64_t>(tp[i]));
      // The largest value, 1 - 2^-25, rounds to 1.0f: kept at the largest float under 1 (runner/sampler.py
      // below_one), or inverse_cdf would take the last vocabulary id whatever its probability.
      up[i] = std::min(static_cast<float>((static_cast<double>(h >> 40) + 0.5) / static_cast<double>(1 << 24)),
                       0x1.fffffep-1f);
    }
    ids = inverse_cdf(probs, u);
    const Tensor chosen_ok = probs.gather(1, ids.unsqueeze(1)).squeeze(1) > 0;
    if (!argmax.defined() && !chosen_ok.all().item<bool>()) argmax = first_argmax(logits);
    if (argmax.defined()) ids = at::where(chosen_ok, ids, argmax);
    if (has_greedy) ids = at::where(greedy, argmax, ids);
  }
  Tensor logprobs;
  if (want_logprobs) {
    const Tensor at_ = ids.unsqueeze(1);
    Tensor vals;
    if (!logprobs_all.defined()) {
      vals = logits.gather(1, at_) - lse.unsqueeze(1);
    } else if (has_greedy) {
      vals = at::where(greedy.unsqueeze(1), logits.gather(1, at_) - lse.unsqueeze(1), logprobs_all.gather(1, at_));
    } else {
      vals = logprobs_all.gather(1, at_);
    }
    logprobs = vals.squeeze(1);
  } else {
    logprobs = at::empty({0}, logits.options());
  }
  return {ids, logprobs};
}

}  // namespace

namespace rollout_cpu {

// logits: [bs, vocab] fp32; temperatures [bs] fp32 (0 = greedy); seeds [bs] int64 and seed_mix
// (splitmix64(seeds), when the batch info already has it); steps [bs] int64 -> (ids [bs] int64,
// logprobs [bs] fp32, empty when want_logprobs is false), as runner/sampler.py Sampler.__call__.
std::tuple<Tensor, Tensor> sample_plain(const Tensor& logits, const Tensor& temperatures, const Tensor& seeds,
                                        const std::optional<Tensor>& seed_mix, const Tensor& steps,
                                        bool all_greedy, bool has_greedy, bool need_temperature, bool want_logprobs) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "sample_plain: logits must be CPU float32, bfloat16 or float16 [bs, vocab], got ", dtype, " ",
              logits.sizes());
  const int64_t bs = logits.size(0), vocab = logits.size(1);
  for (const Tensor* t : {&temperatures, &seeds, &steps})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == bs, "sample_plain: per-row tensors must be [", bs, "], got ", t->sizes());
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && seeds.scalar_type() == at::kLong &&
                  steps.scalar_type() == at::kLong,
              "sample_plain: temperatures float32, seeds and steps int64");
  TORCH_CHECK(!seed_mix.has_value() || (seed_mix->dim() == 1 && seed_mix->size(0) == bs &&
                                        seed_mix->scalar_type() == at::kLong),
              "sample_plain: seed_mix must be int64 [", bs, "]");
  const int64_t rows = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, vocab * 4));
  std::vector<Tensor> ids, logprobs;
  for (int64_t r0 = 0; r0 == 0 || r0 < bs; r0 += rows) {  // one block at least (an empty batch too)
    const int64_t r1 = std::min(bs, r0 + rows);
    std::optional<Tensor> mix;
    if (seed_mix.has_value()) mix = seed_mix->slice(0, r0, r1);
    // bf16/fp16 logits are widened to fp32 a block at a time (exactly: every such value is an fp32 value).
    auto [i, lp] = sample_block(logits.slice(0, r0, r1).to(at::kFloat), temperatures.slice(0, r0, r1),
                                seeds.slice(0, r0, r1), mix, steps.slice(0, r0, r1), all_greedy, has_greedy,
                                need_temperature, want_logprobs);
    ids.push_back(i);
    logprobs.push_back(lp);
  }
  if (ids.size() == 1) return {ids[0], logprobs[0]};
  return {at::cat(ids), want_logprobs ? at::cat(logprobs) : logprobs[0]};
}

}  // namespace rollout_cpu

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("sample_plain(Tensor logits, Tensor temperatures, Tensor seeds, Tensor? seed_mix, Tensor steps, "
        "bool all_greedy, bool has_greedy, bool need_temperature, bool want_logprobs) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) { m.impl("sample_plain", &rollout_cpu::sample_plain); }
