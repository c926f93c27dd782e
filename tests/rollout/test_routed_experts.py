"""Mixture-of-experts observability through the Engine: generate(..., return_routed_experts=True) and
the expert-distribution recorder (start/stop/dump_expert_distribution_record), on tiny random
Qwen3-MoE (with a dense middle layer) and Mixtral checkpoints, fp32 on the CPU.

Oracles: HF transformers' router logits on the same checkpoint (top-k of their softmax per position
and layer; -1 on the dense layer) for the routed experts, and per-layer bincounts of those for the
recorder's counts. Routed experts are checked on every position the engine processed (prompt rows
first, then every sampled token but the last), through chunked prefill, decode batches and prefix
cache hits (the n samples of a prompt prefill it once; the others read its rows from the per-KV-slot
store).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from tests.checkpoints import load_hf_model
from tests.moe_checkpoints import NUM_EXPERTS, TOP_K, expert_counts, hf_routed_experts, make_moe_checkpoint
from tests.rollout.oracle import random_prompts

CASES = [
    ("qwen3_moe-dense-layer", "qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
    ("mixtral", "mixtral", {}),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def moe(request, tmp_path_factory):
    """(checkpoint path, HF reference model, num_layers)."""
    name, arch, kw = request.param
    path = make_moe_checkpoint(tmp_path_factory.mktemp(f"routed-{name}"), arch, **kw)
    hf = load_hf_model(path)
    return path, hf, hf.config.num_hidden_layers


def _decode(meta: dict, num_layers: int) -> torch.Tensor:
    """SGLang's wire format: base64 of little-endian int32, [rows, num_layers, top_k] in C order."""
    raw = base64.b64decode(meta["routed_experts"])
    return torch.from_numpy(np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, TOP_K).copy())


def test_routed_experts_equal_hf_topk_at_every_position(moe, make_engine):
    """Every sample's routed experts equal HF's top-k at every position it processed (prompt + output
    minus the last token), through chunked prefill (chunks of 8), batched decode and prefix-cache hits
    (n=3 samples share each prompt; repeats of a prompt hit the cache too)."""
    path, hf, num_layers = moe
    engine = make_engine(path, enable_return_routed_experts=True, chunked_prefill_size=8)
    prompts = random_prompts([3, 11, 20], seed=5)
    sampling = {"n": 3, "temperature": 1.0, "max_new_tokens": 7, "ignore_eos": True, "seed": 11}
    outs = engine.generate(input_ids=prompts, sampling_params=sampling, return_routed_experts=True)
    outs += engine.generate(input_ids=prompts[2], sampling_params=sampling, return_routed_experts=True)
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0  # some prompt rows came from the cache
    prompt_of = [p for p in prompts for _ in range(3)] + [prompts[2]] * 3
    for i, (prompt, out) in enumerate(zip(prompt_of, outs)):
        got = _decode(out["meta_info"], num_layers)
        seq = prompt + out["output_ids"]
        want = hf_routed_experts(hf, seq[:-1])  # the last sampled token is never fed back
        assert got.shape == want.shape == (len(seq) - 1, num_layers, TOP_K), (i, got.shape, want.shape)
        assert torch.equal(got, want), f"sample {i}: routed experts differ from HF's top-k"
    dense = [layer for layer in range(num_layers) if (want[:, layer] == -1).all()]
    assert dense == ([1] if num_layers == 3 else []) and (want >= 0).any()


def test_routed_experts_only_where_asked_and_refused_without_the_flag(moe, make_engine, tiny_llama):
    """Per-prompt return_routed_experts: only those outputs carry the key. Without
    enable_return_routed_experts (or on a dense model) the request is refused naming the option, and
    the engine goes on serving."""
    path, _, num_layers = moe
    engine = make_engine(path, enable_return_routed_experts=True)
    prompts = random_prompts([4, 6], seed=2)
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 3, "temperature": 0},
                           return_routed_experts=[True, False])
    assert "routed_experts" in outs[0]["meta_info"] and "routed_experts" not in outs[1]["meta_info"]
    assert _decode(outs[0]["meta_info"], num_layers).shape[0] == 4 + len(outs[0]["output_ids"]) - 1

    plain = make_engine(path)
    assert not plain.runner.model.expert_recorder.is_active  # nothing captured, nothing counted
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        plain.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2}, return_routed_experts=True)
    with pytest.raises(ValueError, match="return_routed_experts must be a bool"):
        engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2}, return_routed_experts="yes")
    out = plain.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert len(out["output_ids"]) == 2 and "routed_experts" not in out["meta_info"]
    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_engine(tiny_llama, enable_return_routed_experts=True)


def _hf_counts(hf, prompts: list[list[int]], outs: list[dict]) -> torch.Tensor:
    """[num_layers, num_experts]: every position each request had the model compute, routed by HF."""
    return sum(expert_counts(hf_routed_experts(hf, (p + o["output_ids"])[:-1]), NUM_EXPERTS)
               for p, o in zip(prompts, outs))


def test_recorder_stat_mode_equals_hf_counts(moe, make_engine, tmp_path):
    """start -> generate -> stop -> generate -> dump: logical_count equals HF's counts over exactly the
    recorded requests' positions, the file written holds the same, and a dump resets the record."""
    path, hf, num_layers = moe
    engine = make_engine(path)
    prompts = random_prompts([5, 9, 14], seed=7)
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    engine.start_expert_distribution_record()
    outs = engine.generate(input_ids=prompts, sampling_params=sampling)
    engine.stop_expert_distribution_record()
    engine.generate(input_ids=random_prompts([8], seed=8), sampling_params=sampling)  # not recorded
    dump = engine.dump_expert_distribution_record(str(tmp_path))
    want = _hf_counts(hf, prompts, outs)
    assert torch.equal(torch.tensor(dump["logical_count"]), want)
    assert want.sum() > 0 and dump["num_forward_passes"] >= 1 + 5  # one prefill, five decodes at least
    files = list(tmp_path.glob("expert_distribution_recorder_*.pt"))
    assert len(files) == 1
    assert torch.equal(torch.load(files[0])["logical_count"], want)
    again = engine.dump_expert_distribution_record()
    assert torch.tensor(again["logical_count"]).sum() == 0
    assert not engine.runner.model.expert_recorder.is_active


def test_recorder_per_pass_mode_records_every_forward(moe, make_engine):
    """per_pass: one record per forward pass, whose counts sum to logical_count (= HF's counts) and whose
    num_tokens sum to the positions computed."""
    path, hf, num_layers = moe
    engine = make_engine(path, expert_distribution_recorder_mode="per_pass")
    prompts = random_prompts([6, 10], seed=9)
    engine.start_expert_distribution_record()
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                               "ignore_eos": True})
    engine.stop_expert_distribution_record()
    dump = engine.dump_expert_distribution_record()
    want = _hf_counts(hf, prompts, outs)
    records = dump["records"]
    assert len(records) >= 4  # a prefill and three decodes
    assert torch.equal(sum(torch.tensor(r["global_physical_count"]) for r in records), want)
    assert torch.equal(torch.tensor(dump["logical_count"]), want)
    assert sum(r["num_tokens"] for r in records) == sum(len(p) + 3 for p in prompts)


def test_recorder_on_a_dense_model_is_a_clear_error(make_engine, tiny_llama):
    """A dense model has no experts: each recorder call raises naming it; the engine still serves."""
    engine = make_engine(tiny_llama)
    for call in (engine.start_expert_distribution_record, engine.stop_expert_distribution_record,
                 engine.dump_expert_distribution_record):
        with pytest.raises(ValueError, match="mixture-of-experts"):
            call()
    assert len(engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2, "ignore_eos": True})[
        "output_ids"]) == 2
