"""Mixture-of-experts observability over HTTP: /generate with return_routed_experts (SGLang's base64 int32
in meta_info, streamed too) and the expert-distribution endpoints, on a tiny random Qwen3-MoE checkpoint
with a dense middle layer. Oracle: HF transformers' router top-k on the same checkpoint."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from tests.checkpoints import load_hf_model
from tests.moe_checkpoints import NUM_EXPERTS, TOP_K, expert_counts, hf_routed_experts, make_moe_checkpoint
from tests.server.conftest import start_server

PROMPTS = [[5, 6, 7, 8, 9, 10], [13, 40, 41, 42] * 2]
SAMPLING = dict(temperature=0, max_new_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(served engine, HF reference model)."""
    path = make_moe_checkpoint(tmp_path_factory.mktemp("moe-http"), "qwen3_moe", num_hidden_layers=3,
                               mlp_only_layers=[1])
    with start_server(path, engine_kw=dict(enable_return_routed_experts=True)) as s:
        yield s, load_hf_model(path)


def _routed(meta: dict, num_layers: int) -> torch.Tensor:
    raw = base64.b64decode(meta["routed_experts"])
    return torch.from_numpy(np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, TOP_K).copy())


def test_generate_returns_routed_experts_equal_hf(moe):
    """/generate return_routed_experts: base64 int32 [prompt + output - 1, layers, top_k] = HF's top-k (-1 on
    the dense layer), in the plain and the streamed answer; absent unless asked."""
    served, hf = moe
    num_layers = hf.config.num_hidden_layers
    with served.client() as c:
        c.post("/flush_cache")
        outs = c.post("/generate", json=dict(input_ids=PROMPTS, sampling_params=SAMPLING,
                                             return_routed_experts=True)).json()
        for prompt, out in zip(PROMPTS, outs):
            want = hf_routed_experts(hf, (prompt + out["output_ids"])[:-1])
            assert torch.equal(_routed(out["meta_info"], num_layers), want)
        assert (want[:, 1] == -1).all()
        with c.stream("POST", "/generate", json=dict(input_ids=PROMPTS[0], sampling_params=SAMPLING, stream=True,
                                                      return_routed_experts=True)) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert chunks[-1]["output_ids"] == outs[0]["output_ids"]
        assert torch.equal(_routed(chunks[-1]["meta_info"], num_layers),
                           hf_routed_experts(hf, (PROMPTS[0] + outs[0]["output_ids"])[:-1]))
        plain = c.post("/generate", json=dict(input_ids=PROMPTS[0], sampling_params=SAMPLING)).json()
        assert "routed_experts" not in plain["meta_info"]


def test_expert_distribution_endpoints_equal_hf_counts(moe):
    """start -> generate -> stop -> generate -> dump over HTTP: logical_count = HF's per-layer expert counts
    over exactly the recorded request's positions; a second dump is empty (the dump resets)."""
    served, hf = moe
    with served.client() as c:
        c.post("/flush_cache")
        assert c.post("/start_expert_distribution_record").status_code == 200
        out = c.post("/generate", json=dict(input_ids=PROMPTS[1], sampling_params=SAMPLING)).json()
        assert c.post("/stop_expert_distribution_record").status_code == 200
        c.post("/generate", json=dict(input_ids=PROMPTS[0], sampling_params=SAMPLING))  # not recorded
        r = c.post("/dump_expert_distribution_record")
        assert r.status_code == 200, r.text
        want = expert_counts(hf_routed_experts(hf, (PROMPTS[1] + out["output_ids"])[:-1]), NUM_EXPERTS)
        assert want.sum() > 0 and torch.equal(torch.tensor(r.json()["logical_count"]), want)
        again = c.post("/dump_expert_distribution_record").json()
        assert torch.tensor(again["logical_count"]).sum() == 0


def test_expert_endpoints_on_a_dense_model_are_400(server, client):
    """On a dense model the three expert-distribution endpoints answer 400 saying it has no experts."""
    for path in ("/start_expert_distribution_record", "/stop_expert_distribution_record",
                 "/dump_expert_distribution_record"):
        r = client.post(path)
        assert r.status_code == 400 and "mixture-of-experts" in r.json()["error"]["message"], (path, r.text)
