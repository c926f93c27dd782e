"""LoRA under tensor parallelism on the CPU: 2 ranks over gloo (rank 0 here, rank 1 spawned).

A Qwen2 checkpoint (q/k/v bias) with one KV head, so rank 1's k/v LoRA B rows are the replicated head's,
and all-target adapters (column-parallel q/k/v/gate/up: B by output rows; row-parallel o/down: A by input
columns, the term summed by the all-reduce). The oracles are HF transformers + peft (PeftModel) on the
same adapter files, and a tp_size=1 engine.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from runner.lora.manager import new_uid
from tests.checkpoints import load_hf_model
from tests.lora_adapters import peft_model
from tests.rollout.oracle import hf_generate, random_prompts
from weight_sync.bucket import FlattenedTensorBucket

MAX_NEW = 6
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": MAX_NEW}
PROMPTS = random_prompts([3, 8], seed=7)
SHAPE = dict(tie_word_embeddings=True, num_key_value_heads=1)
Q = "base_model.model.model.layers.1.self_attn.q_proj"
DOWN = "base_model.model.model.layers.0.mlp.down_proj"


def _files(adapter):
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    return tensors, json.loads((adapter / "adapter_config.json").read_text())


def _gen(engine, lora_path):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, lora_path=lora_path)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _same(got, want, atol):
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def env(ckpt_factory, adapter_factory, module_engines):
    """(checkpoint, adapters a/b/c, peft references per adapter name (None: base), the tp=2 engine)."""
    ckpt = ckpt_factory("qwen2", **SHAPE)
    adapters = {"a": adapter_factory(ckpt, r=8, alpha=16, seed=21),
                "b": adapter_factory(ckpt, r=4, alpha=8, seed=22, use_rslora=True),
                "c": adapter_factory(ckpt, r=6, alpha=12, seed=23, targets=["q_proj", "v_proj", "down_proj"])}
    refs = {n: [hf_generate(peft_model(ckpt, p), q, MAX_NEW) for q in PROMPTS] for n, p in adapters.items()}
    refs[None] = [hf_generate(load_hf_model(ckpt), q, MAX_NEW) for q in PROMPTS]
    assert all(refs[n] != refs[None] for n in adapters)  # every adapter changes what is generated
    tp2 = module_engines(ckpt, tp_size=2, lora_paths={"a": str(adapters["a"]), "b": str(adapters["b"])},
                         max_lora_rank=8, lora_target_modules=["all"], max_loras_per_batch=4,
                         enable_memory_saver=True)
    return ckpt, adapters, refs, tp2


def _ranks_agree(engine) -> dict[str, dict]:
    per_rank = engine.runner.rank_lora_adapters()
    assert all(r == per_rank[0] for r in per_rank[1:]), per_rank  # same names, uids, paths on every rank
    return per_rank[0]


def test_tp2_adapters_equal_tp1_and_peft(env, module_engines):
    """Under tp=2 each adapter's greedy tokens equal tp=1's and PeftModel's; logprobs within 1e-5 of tp=1, 1e-4 of peft."""
    ckpt, adapters, refs, tp2 = env
    tp1 = module_engines(ckpt, lora_paths={"a": str(adapters["a"]), "b": str(adapters["b"])}, max_lora_rank=8,
                         lora_target_modules=["all"])
    for name in ("a", "b", None):
        got = _gen(tp2, name)
        _same(got, _gen(tp1, name), atol=1e-5)
        _same(got, refs[name], atol=1e-4)
    assert set(_ranks_agree(tp2)) == {"a", "b"}


def test_tp2_mixed_batch_equals_each_alone(env):
    """One tp=2 batch over the base model and two adapters (interleaved) gives each request its own model's output."""
    _, _, refs, tp2 = env
    names = ["a", None, "b", "b", "a", None]
    prompts = [PROMPTS[i % 2] for i in range(len(names))]
    outs = tp2.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, lora_path=names)
    for i, (out, name) in enumerate(zip(outs, names, strict=True)):
        got = (out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        _same([got], [refs[name][i % 2]], atol=1e-4)


def test_tp2_load_unload_and_from_tensors_reach_every_rank(env):
    """Load from a directory, unload, and load from a flattened bucket under the same name on tp=2: every rank
    holds the same adapters under the same uid, and each load equals PeftModel on its adapter."""
    _, adapters, refs, tp2 = env
    res = tp2.load_lora_adapter("c", str(adapters["c"]))
    assert res.success, res.error_message
    first = _ranks_agree(tp2)["c"]
    _same(_gen(tp2, "c"), refs["c"], atol=1e-4)
    assert tp2.unload_lora_adapter("c").success
    assert "c" not in _ranks_agree(tp2)
    tensors, config = _files(adapters["a"])
    bucket = FlattenedTensorBucket(named_tensors=list(tensors.items())).to_dict()
    res = tp2.load_lora_adapter_from_tensors("c", bucket, config, load_format="flattened_bucket")
    assert res.success, res.error_message
    second = _ranks_agree(tp2)["c"]
    assert second["uid"] != first["uid"] and second["path"] == "__tensor__"
    _same(_gen(tp2, "c"), refs["a"], atol=1e-4)  # a's outputs now, not the old c's cached KV
    assert tp2.unload_lora_adapter("c").success
    assert set(_ranks_agree(tp2)) == {"a", "b"}


def test_tp2_bad_adapters_change_nothing_on_any_rank(env):
    """Bad adapters are refused by name; one that only rank 1 refuses commits on no rank; outputs stay the same."""
    _, adapters, refs, tp2 = env
    before = _ranks_agree(tp2)
    tensors, config = _files(adapters["a"])
    nan = tensors[f"{DOWN}.lora_A.weight"].clone()
    nan[0, -1] = float("nan")  # in the input columns rank 1 holds
    cases = {"non-finite": ({**tensors, f"{DOWN}.lora_A.weight": nan}, config),
             "max_lora_rank": (tensors, {**config, "r": 16}),
             "shape": ({**tensors, f"{Q}.lora_B.weight": torch.zeros(65, 8)}, config)}
    for needle, (bad, cfg) in cases.items():
        res = tp2.load_lora_adapter_from_tensors("bad", bad, cfg)
        assert not res.success and needle in res.error_message, (needle, res.error_message)
        assert _ranks_agree(tp2) == before
    # Rank 0 checks and stages a good adapter, rank 1 receives a NaN copy: rank 1's refusal aborts rank 0 too.
    runner = tp2.runner
    with tp2._cv:
        staged = runner.local.stage_lora_adapter("bad", str(adapters["c"]))
        named = [(n, nan_copy(t) if n.endswith(f"{DOWN}.lora_B.weight") else t) for n, t in staged.tensors.items()]
        with pytest.raises(ValueError, match="rank 1 refused the load of LoRA adapter 'bad'.*non-finite"):
            runner._load_staged_lora(staged, new_uid(), named)
    assert _ranks_agree(tp2) == before
    for name in ("a", None):
        _same(_gen(tp2, name), refs[name], atol=1e-4)
    assert tp2.load_lora_adapter("bad", str(adapters["c"])).success  # the name was never taken on any rank
    assert tp2.unload_lora_adapter("bad").success
    assert _ranks_agree(tp2) == before


def nan_copy(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[0] = float("nan")
    return out
