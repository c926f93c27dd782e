"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against Hugging Face transformers on tiny random
checkpoints, fp32 on the CPU: prefill and decode logits, the routed experts of every position, greedy
Engine.generate vs HF generate, the fused experts layer against a naive per-token loop (both of its
paths), and weight updates by per-expert HF names equal a fresh engine on the new weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner.layers import moe as moe_layer
from runner.layers.moe import FusedExperts, select_experts
from runner.weights.loader import WeightUpdateError
from tests.checkpoints import load_hf_model
from tests.moe_checkpoints import NUM_EXPERTS, TOP_K, expert_counts, hf_routed_experts, make_moe_checkpoint
from tests.rl_surface.conftest import make_engine, read_state_dict, run
from tests.rollout.oracle import hf_generate, random_prompts
from tests.runner.driver import RunnerDriver, make_runner
from tests.runner.parity import PROMPT_LENS, MaxDiffs, hf_logits, ragged_prompts

# (case id, arch, config overrides): Qwen3-MoE with a dense middle layer and unnormalized top-k
# covers mlp_only_layers and norm_topk_prob=False.
CASES = [
    ("qwen3_moe", "qwen3_moe", {}),
    ("mixtral", "mixtral", {}),
    ("qwen3_moe-dense-layer", "qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False)),
]
DIFFS = MaxDiffs()


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """`moe_ckpt(arch, **overrides) -> Path`, written once per module per argument set."""
    cache: dict = {}

    def get(arch: str, **kw):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            cache[key] = make_moe_checkpoint(tmp_path_factory.mktemp(f"moe-{arch}"), arch, **kw)
        return cache[key]

    return get


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, moe_ckpt):
    """(case id, checkpoint path, HF reference model)."""
    name, arch, kw = request.param
    path = moe_ckpt(arch, **kw)
    return name, path, load_hf_model(path)


@pytest.fixture(scope="module", autouse=True)
def _report_max_diffs():
    yield
    DIFFS.report()


def test_ragged_prefill_matches_hf_at_every_position(case):
    """One EXTEND over prompts of lengths 3, 9, 17 gives HF's logits at every position of each."""
    name, path, hf = case
    drv = RunnerDriver(make_runner(path))
    prompts = ragged_prompts()
    out = drv.extend([drv.new_request() for _ in prompts], prompts, return_all_logits=True)
    DIFFS.check(name, "prefill", out.all_logits, torch.cat([hf_logits(hf, p) for p in prompts]))
    DIFFS.check(name, "prefill_last", out.next_token_logits, torch.stack([hf_logits(hf, p)[-1] for p in prompts]))


def _decode_logits(runner, prompts: list[list[int]], fed: torch.Tensor) -> torch.Tensor:
    """Prefill `prompts`, then feed fed[:, step] one DECODE step at a time: [bs, steps, vocab]."""
    drv = RunnerDriver(runner)
    rows = [drv.new_request() for _ in prompts]
    drv.extend(rows, prompts)
    return torch.stack([drv.decode(rows, fed[:, s].tolist()).next_token_logits for s in range(fed.shape[1])], dim=1)


def test_decode_steps_match_hf(case):
    """12 batched DECODE steps after a ragged prefill give HF's logits after every fed token."""
    name, path, hf = case
    prompts = ragged_prompts(2)
    fed = torch.randint(4, 384, (len(prompts), 12), generator=torch.Generator().manual_seed(7))
    got = _decode_logits(make_runner(path), prompts, fed)
    for i, p in enumerate(prompts):
        DIFFS.check(name, "decode", got[i], hf_logits(hf, p + fed[i].tolist())[len(p) :])


def test_captured_decode_step_matches_hf_and_yields_to_the_recorder(moe_ckpt):
    """The compiled CPU decode step (fused experts behind their opaque op, a dense layer among the
    sparse ones) gives HF's logits; while the recorder is on, decode runs eagerly instead (a captured
    step runs no hooks and pads the batch) and counts exactly the real tokens."""
    name, arch, kw = CASES[2]
    path = moe_ckpt(arch, **kw)
    hf = load_hf_model(path)
    runner = make_runner(path, cuda_graph_bs=[4])
    graphs = runner.graph_runner
    if graphs is None:
        pytest.fail("no graph runner on the CPU: this test needs the captured decode step")
    replays = []
    real_replay = graphs.replay
    graphs.replay = lambda fb: replays.append(fb.batch_size) or real_replay(fb)
    prompts = ragged_prompts(4)
    fed = torch.randint(4, 384, (len(prompts), 6), generator=torch.Generator().manual_seed(8))
    got = _decode_logits(runner, prompts, fed)
    assert replays == [len(prompts)] * 6  # every step was a replay (3 rows padded to 4)
    for i, p in enumerate(prompts):
        DIFFS.check(f"{name}-captured", "decode", got[i], hf_logits(hf, p + fed[i].tolist())[len(p) :])

    recorder = runner.model.expert_recorder
    recorder.start_record()
    extra = torch.randint(4, 384, (len(prompts), 1), generator=torch.Generator().manual_seed(9))
    drv = RunnerDriver(runner)
    rows = [drv.new_request() for _ in prompts]
    drv.extend(rows, prompts)
    drv.decode(rows, extra[:, 0].tolist())
    assert len(replays) == 6  # no replay while recording
    counts = recorder.dump_record()["logical_count"]
    want = sum(expert_counts(hf_routed_experts(hf, p + extra[i].tolist()), NUM_EXPERTS) for i, p in enumerate(prompts))
    assert torch.equal(counts, want)


def test_decode_steps_and_routed_experts_match_hf(case):
    """A ragged prefill then 12 batched DECODE steps: logits after every fed token equal HF's, and the
    captured routed experts of every position (prompt rows first) equal HF's top-k of its router logits.
    (Capturing runs the steps eagerly: a captured step runs no hooks.)"""
    name, path, hf = case
    runner = make_runner(path)
    recorder = runner.model.expert_recorder
    recorder.set_capture_routed_experts(True)
    drv = RunnerDriver(runner)
    prompts = ragged_prompts(1)
    num_steps = 12
    fed = torch.randint(4, 384, (len(prompts), num_steps), generator=torch.Generator().manual_seed(6))
    rows = [drv.new_request() for _ in prompts]
    drv.extend(rows, prompts)
    routed = list(recorder.last_routed_experts.split(list(PROMPT_LENS)))  # [len, num_layers, top_k] each
    logits = []
    for step in range(num_steps):
        logits.append(drv.decode(rows, fed[:, step].tolist()).next_token_logits)
        step_routed = recorder.last_routed_experts  # [bs, num_layers, top_k]: one row per request
        routed = [torch.cat([r, step_routed[i : i + 1]]) for i, r in enumerate(routed)]
    got = torch.stack(logits, dim=1)  # [bs, steps, vocab]
    for i, p in enumerate(prompts):
        seq = p + fed[i].tolist()
        DIFFS.check(name, "decode", got[i], hf_logits(hf, seq)[len(p) :])
        want = hf_routed_experts(hf, seq)
        assert routed[i].dtype == torch.int32 and routed[i].shape == want.shape
        assert torch.equal(routed[i], want), f"[{name}] request {i}: routed experts differ from HF's top-k"
    assert (want >= 0).any()  # the comparison saw real routing, not only dense -1 rows


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_greedy_engine_generate_matches_hf_generate(moe_ckpt, arch):
    """Engine.generate (greedy, batched, ragged prompts) equals HF generate per prompt, token for token."""
    path = moe_ckpt(arch)
    hf = load_hf_model(path)
    prompts = random_prompts([1, 5, 11, 23], seed=3)
    with make_engine(path) as engine:
        outs = engine.generate(input_ids=prompts,
                               sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == hf_generate(hf, prompt, 12)[0]


def test_mixtral_config_without_rope_theta_or_eps_runs_as_hf_loads_it(moe_ckpt, tmp_path):
    """A Mixtral config.json that leaves out rope_theta and rms_norm_eps (its rope_scaling null): HF uses
    MixtralConfig's defaults (1e6, 1e-5), and so does the engine (it used Llama's, 1e4 and 1e-6, and its greedy
    tokens left HF's at token 4; with the null it still read 1e4). hidden_act "swish" (SiLU) is taken for MoE too."""
    import json
    import shutil

    path = shutil.copytree(moe_ckpt("mixtral"), tmp_path / "mixtral")
    raw = json.loads((path / "config.json").read_text())
    for k in ("rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps"):
        raw.pop(k, None)
    raw["rope_scaling"] = None  # as transformers 4 writes it into every config: null is missing too
    (path / "config.json").write_text(json.dumps(raw))
    hf = load_hf_model(path)
    assert (hf.config.rope_parameters["rope_theta"], hf.config.rms_norm_eps) == (1e6, 1e-5)
    prompts = random_prompts([9, 30], seed=8)
    with make_engine(path) as engine:
        outs = engine.generate(input_ids=prompts,
                               sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == hf_generate(hf, prompt, 16)[0]
    from runner.config import ModelConfig
    from runner.models.moe import MoEConfig

    assert MoEConfig.from_model_config(ModelConfig.from_dict(dict(raw, hidden_act="swish"))).num_experts > 0


def _naive_experts(x, w13, w2, weights, ids) -> torch.Tensor:
    """Per token, per slot: the chosen expert's SiLU-gated MLP times its routing weight, summed."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += weights[t, slot] * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("path_kind", ["grouped_mm", "per_expert_loop"])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 40])
def test_fused_experts_equal_naive_loop(monkeypatch, path_kind, num_tokens):
    """FusedExperts (grouped_mm or its per-expert fallback) equals a per-token loop, with idle experts."""
    if path_kind == "per_expert_loop":
        monkeypatch.setattr(moe_layer, "_grouped_mm_works", lambda x, w: False)
    else:
        assert moe_layer._grouped_mm_works(torch.zeros(1, 16), torch.zeros(6, 24, 16))  # the path runs on CPU fp32
    gen = torch.Generator().manual_seed(num_tokens)
    experts = FusedExperts(num_experts=6, hidden_size=16, intermediate_size=12)
    with torch.no_grad():
        experts.w13_weight.copy_(torch.randn(6, 24, 16, generator=gen) / 4)
        experts.w2_weight.copy_(torch.randn(6, 16, 12, generator=gen) / 4)
    x = torch.randn(num_tokens, 16, generator=gen)
    # Only experts 0, 2, 3 and 5 are ever chosen: groups of size 0 sit between the others.
    logits = torch.randn(num_tokens, 6, generator=gen)
    logits[:, [1, 4]] = -1e4
    weights, ids = select_experts(logits, 2, renormalize=False)
    got = experts(x, weights, ids)
    want = _naive_experts(x, experts.w13_weight.detach(), experts.w2_weight.detach(), weights, ids)
    assert got.shape == (num_tokens, 16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_select_experts_matches_hf_routers():
    """Routing equals transformers' routers: Qwen3-MoE with and without norm_topk_prob, Mixtral (always)."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 16, generator=gen)
    routers = [(Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                                  norm_topk_prob=norm)), norm) for norm in (False, True)]
    routers.append((MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)),
                    True))
    for router, renormalize in routers:
        with torch.no_grad():
            router.weight.copy_(torch.randn(8, 16, generator=gen))
            logits, want_weights, want_ids = router(x)
        weights, ids = select_experts(logits, router.top_k, renormalize)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_update_by_per_expert_names_equals_fresh_engine(moe_ckpt, arch):
    """update_weights_from_tensor with B's HF state dict (per-expert names), then from disk back to A:
    outputs equal a fresh engine on each; one expert's tensor lands in exactly its slice; a bad expert
    tensor is refused by name and changes nothing."""
    a, b = moe_ckpt(arch, seed=0), moe_ckpt(arch, seed=1)
    with make_engine(b) as fresh:
        want_b = run(fresh)
    state_b = read_state_dict(b)
    prefix = "model.layers.1.mlp" if arch == "qwen3_moe" else "model.layers.1.block_sparse_moe"
    down = "down_proj" if arch == "qwen3_moe" else "w2"
    assert f"{prefix}.experts.{NUM_EXPERTS - 1}.{down}.weight" in state_b  # per-expert HF names
    with make_engine(a) as engine:
        want_a = run(engine)
        assert want_a != want_b  # the test can fail
        ok, msg = engine.update_weights_from_tensor(list(state_b.items()))
        assert ok, msg
        assert run(engine) == want_b

        # One expert's down projection: exactly its slice of the stacked tensor changes.
        runner = engine.runner
        stacked = dict(runner.model.named_parameters())["model.layers.1.mlp.experts.w2_weight"]
        before = stacked.detach().clone()
        new = torch.randn(before.shape[1:], generator=torch.Generator().manual_seed(9))
        ok, msg = engine.update_weights_from_tensor([(f"{prefix}.experts.3.{down}.weight", new)])
        assert ok, msg
        assert torch.equal(stacked[3], new)
        assert torch.equal(torch.cat([stacked[:3], stacked[4:]]), torch.cat([before[:3], before[4:]]))

        # Refused by name, nothing written: a wrong-shape expert tensor, an expert that does not exist.
        snapshot = stacked.detach().clone()
        for name, tensor, words in [
            (f"{prefix}.experts.2.{down}.weight", torch.zeros(3, 3), "shape"),
            (f"{prefix}.experts.{NUM_EXPERTS}.{down}.weight", new, "unknown weight name"),
        ]:
            ok, msg = engine.update_weights_from_tensor([(f"{prefix}.experts.0.{down}.weight", new * 2),
                                                         (name, tensor)])
            assert not ok and name in msg and words in msg, msg
            assert torch.equal(stacked, snapshot)
        with pytest.raises(WeightUpdateError, match="unknown weight name"):
            runner.name_map.resolve("model.layers.1.mlp.experts.w2_weight")  # runner names are not HF names

        ok, msg, _ = engine.update_weights_from_disk(str(a))
        assert ok, msg
        assert run(engine) == want_a


def test_moe_config_errors_name_the_setting(moe_ckpt, tmp_path):
    """A bad MoE config (top_k > num_experts, a non-SiLU activation) is refused naming the key."""
    import json
    import shutil

    for key, value, words in [("num_experts_per_tok", NUM_EXPERTS + 1, "num_experts_per_tok"),
                              ("hidden_act", "gelu", "hidden_act")]:
        bad = tmp_path / key
        shutil.copytree(moe_ckpt("mixtral"), bad)
        config = json.loads((bad / "config.json").read_text())
        config[key] = value
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=words):
            make_runner(bad)
    assert TOP_K < NUM_EXPERTS


def test_cuda_decode_graphs_are_left_off_where_the_experts_read_back_to_the_host():
    """A CUDA graph may capture an MoE decode step only where F.grouped_mm takes its capturable kernels
    (bf16 on compute capability 9.x/10.x) and the deterministic mode is off; otherwise the reason names the
    cause. Dense models are never held back."""
    import torch
    from torch import nn

    from runner.layers.moe import FusedExperts, decode_graph_blocker

    moe, dense = nn.Sequential(nn.Linear(4, 4), FusedExperts(2, 4, 8)), nn.Sequential(nn.Linear(4, 4))
    assert decode_graph_blocker(dense, torch.float16, (8, 0), True) is None
    assert decode_graph_blocker(moe, torch.bfloat16, (9, 0), False) is None
    assert decode_graph_blocker(moe, torch.bfloat16, (10, 0), False) is None
    assert "float16 on 8.0" in decode_graph_blocker(moe, torch.float16, (8, 0), False)
    assert "bfloat16 on 12.0" in decode_graph_blocker(moe, torch.bfloat16, (12, 0), False)
    assert "deterministic" in decode_graph_blocker(moe, torch.bfloat16, (9, 0), True)
