"""LoRA outputs against HF transformers + peft (PeftModel on the same adapter files): greedy tokens equal,
logprobs within 1e-4, per architecture, rsLoRA and q/v-only adapters; a batch mixing the base model and
several adapters equals each request alone; the prefix cache never hands KV across adapters."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import load_hf_model
from tests.lora_adapters import peft_model
from tests.rollout.oracle import hf_generate, random_prompts

MAX_NEW = 8
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": MAX_NEW}
PROMPTS = random_prompts([3, 7, 12], seed=3)


def _check(outs, refs):
    for out, (ids, lps) in zip(outs, refs):
        assert out["output_ids"] == ids
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, torch.tensor(lps), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_adapter_equals_peft_per_arch(arch, ckpt_factory, adapter_factory, make_engine):
    """Greedy generation under an all-target adapter equals PeftModel token for token, logprobs to 1e-4."""
    ckpt = ckpt_factory(arch)
    adapter = adapter_factory(ckpt, r=8, alpha=16)
    refs = [hf_generate(peft_model(ckpt, adapter), p, MAX_NEW) for p in PROMPTS]
    base = [hf_generate(load_hf_model(ckpt), p, MAX_NEW)[0] for p in PROMPTS]
    assert [ids for ids, _ in refs] != base  # the adapter changes what is generated
    engine = make_engine(ckpt, lora_paths={"a": str(adapter)})
    _check(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, lora_path="a"), refs)


@pytest.mark.parametrize("kwargs", [dict(r=4, alpha=8, use_rslora=True), dict(r=6, alpha=12, targets=["q_proj", "v_proj"])],
                         ids=["rslora", "qv-only"])
def test_rslora_and_partial_targets_equal_peft(kwargs, ckpt_factory, adapter_factory, make_engine):
    """rsLoRA (alpha / sqrt(r)) and a q/v-only adapter of lower rank than max_lora_rank equal PeftModel."""
    ckpt = ckpt_factory("qwen2")
    adapter = adapter_factory(ckpt, **kwargs)
    refs = [hf_generate(peft_model(ckpt, adapter), p, MAX_NEW) for p in PROMPTS]
    engine = make_engine(ckpt, enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])
    assert engine.load_lora_adapter("x", str(adapter)).success
    _check(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, lora_path="x"), refs)


@pytest.fixture(scope="module")
def three(ckpt_factory, adapter_factory):
    """A qwen2 checkpoint, three different adapters and each one's peft reference on PROMPTS[1]."""
    ckpt = ckpt_factory("qwen2")
    adapters = {n: adapter_factory(ckpt, r=r, alpha=2 * r, seed=s) for n, r, s in (("a", 8, 1), ("b", 4, 2), ("c", 8, 3))}
    refs = {n: hf_generate(peft_model(ckpt, p), PROMPTS[1], MAX_NEW) for n, p in adapters.items()}
    refs[None] = hf_generate(load_hf_model(ckpt), PROMPTS[1], MAX_NEW)
    return ckpt, adapters, refs


@pytest.mark.parametrize("max_per_batch", [8, 2])
def test_mixed_batch_equals_each_alone(three, make_engine, max_per_batch):
    """One batch over base + three adapters (interleaved, n=2) equals each model alone; with
    max_loras_per_batch=2 the requests beyond wait and still get their own adapter's output."""
    ckpt, adapters, refs = three
    engine = make_engine(ckpt, lora_paths={n: str(p) for n, p in adapters.items()}, max_loras_per_batch=max_per_batch,
                         max_loaded_loras=8)
    names = ["a", None, "b", "c", None, "a", "c", "b"]
    manager, seen = engine.runner.lora_manager, []
    prepare = manager.prepare

    def recording(fb):  # the adapters of every step the runner runs
        seen.append({u for u in fb.lora_ids or () if u is not None})
        return prepare(fb)

    manager.prepare = recording
    outs = engine.generate(input_ids=[PROMPTS[1]] * len(names), sampling_params={**GREEDY, "n": 2},
                           return_logprob=True, lora_path=names)
    for i, name in enumerate(names):
        _check(outs[2 * i : 2 * i + 2], [refs[name]] * 2)
    assert max(len(s) for s in seen) == min(3, max_per_batch)  # never more adapters in one step than allowed


@pytest.mark.parametrize("formulation", ["masked", "segmented", "per-segment"])
def test_every_lora_formulation_equals_peft(three, make_engine, formulation):
    """Each formulation (the masked one, the segmented default padded and per segment) gives each request
    of a mixed batch (prefill of unequal lengths, then decode) its own adapter's PeftModel output."""
    ckpt, adapters, refs = three
    engine = make_engine(ckpt, lora_paths={n: str(p) for n, p in adapters.items()})
    manager = engine.runner.lora_manager
    manager.segmented = formulation != "masked"
    if formulation == "per-segment":
        manager.pad_limit = 0.0  # never pad: one matmul per adapter segment
    names = ["b", None, "a", "c", "a"]
    outs = engine.generate(input_ids=[PROMPTS[1]] * len(names), sampling_params=GREEDY, return_logprob=True,
                           lora_path=names)
    for out, name in zip(outs, names, strict=True):
        _check([out], [refs[name]])
    other = {n: hf_generate(peft_model(ckpt, p), PROMPTS[2], MAX_NEW) for n, p in adapters.items()}
    outs = engine.generate(input_ids=[PROMPTS[2], PROMPTS[1], PROMPTS[2]], sampling_params=GREEDY,
                           return_logprob=True, lora_path=["c", "b", "a"])
    _check(outs, [other["c"], refs["b"], other["a"]])


def test_prefix_cache_is_per_adapter(three, make_engine):
    """The same prompt under a, then the base, then b (radix cache on) equals each model: KV computed
    under one adapter is never reused for another, while a repeat under the same adapter is a cache hit."""
    ckpt, adapters, refs = three
    engine = make_engine(ckpt, lora_paths={n: str(p) for n, p in adapters.items()})
    hit = len(PROMPTS[1]) - 1  # all but the last prompt token, whose logits give the first new token
    for name, cached in (("a", 0), (None, 0), ("b", 0), ("a", hit), (None, hit)):
        out = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, return_logprob=True, lora_path=name)
        _check([out], [refs[name]])
        assert out["meta_info"]["cached_tokens"] == cached
