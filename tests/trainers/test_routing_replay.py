"""Routing replay (trainers/routing_replay.py) on tiny transformers Qwen3-MoE and Mixtral models.

Oracles: the model's own forward (replaying its own routing must change nothing, bit for bit), a
hand-written per-token MoE block (softmax over the router logits, gathered at the replayed experts,
renormalised, times each expert's SiLU-gated MLP) for the values and for the router's gradient, and
the base64 bytes written with numpy for the wire format. The engine half (the rollout's routing
replayed by the trainer; the logprob mismatch with and without replay; a GRPO run) needs an Engine
that returns routed experts.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import load_hf_model
from tests.moe_checkpoints import NUM_EXPERTS, TOP_K, hf_routed_experts, make_moe_checkpoint
from tests.rl_surface.conftest import make_engine, read_state_dict
from tests.rollout.oracle import random_prompts
from tests.trainers.test_grpo_e2e import length_reward
from trainers.config import RLConfig
from trainers.experience import Experience
from trainers.grpo import GRPOTrainer
from trainers.losses import logprob_mismatch
from trainers.policy import checkpoint_named_tensors, policy_logprobs
from trainers.ppo import PPOTrainer
from trainers.routing_replay import (
    decode_routed_experts,
    find_routers,
    pack_routed_experts,
    routing_replay,
)
from trainers.tasks import Task, make_toy_prompts

# (case id, arch, config overrides): a Qwen3-MoE with a dense middle layer and unnormalised top-k
# weights, and Mixtral (always renormalised).
CASES = [
    ("qwen3_moe-dense-layer", "qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False)),
    ("qwen3_moe", "qwen3_moe", {}),
    ("mixtral", "mixtral", {}),
]
SEQS = [[5, 17, 30, 99, 4, 250, 61], [8, 9, 10, 11]]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def hf_moe(request, tmp_path_factory):
    name, arch, kw = request.param
    path = make_moe_checkpoint(tmp_path_factory.mktemp(f"replay-{name}"), arch, **kw)
    return load_hf_model(path)


def _batch(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids and attention mask, [B, T] each."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def _random_routing(model, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """[B, T, num_layers, top_k] distinct random experts per row; -1 on dense layers (as the engine)."""
    gen = torch.Generator().manual_seed(seed)
    num_layers = model.config.num_hidden_layers
    routed = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K]
                          for _ in range(shape[0] * shape[1] * num_layers)]).int()
    routed = routed.view(*shape, num_layers, TOP_K)
    for layer_id in range(num_layers):
        if layer_id not in find_routers(model):
            routed[:, :, layer_id] = -1
    return routed


def _router_hooks(model) -> dict[int, list]:
    """The forward hooks on each router (transformers keeps its own output recorders there)."""
    return {layer_id: list(r._forward_hooks) for layer_id, r in find_routers(model).items()}


def _naive_block(block, router_weight: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                 renormalize: bool) -> torch.Tensor:
    """Per token: sum over the given experts of softmax(router logits)[e] (renormalised) * expert_e(x)."""
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()  # transformers 5: stacked
    probs = torch.softmax(F.linear(x, router_weight).float(), dim=-1)  # [N, E]
    out = []
    for t in range(x.shape[0]):
        w = probs[t, ids[t]]
        if renormalize:
            w = w / w.sum()
        acc = torch.zeros_like(x[t])
        for slot, e in enumerate(ids[t].tolist()):
            gate, up = F.linear(x[t], w13[e]).chunk(2)
            acc = acc + w[slot] * F.linear(F.silu(gate) * up, w2[e])
        out.append(acc)
    return torch.stack(out)


def test_replaying_the_models_own_routing_changes_nothing(hf_moe):
    """Replaying HF's own top-k (and -1 rows, which route themselves) gives bitwise the plain logits."""
    ids, mask = _batch(SEQS)
    with torch.no_grad():
        plain = hf_moe(input_ids=ids, attention_mask=mask).logits
        own = torch.stack([torch.nn.functional.pad(hf_routed_experts(hf_moe, s), (0, 0, 0, 0, 0, ids.shape[1] - len(s)),
                                                   value=-1) for s in SEQS])  # [B, T, L, K]
        own[0, 3] = -1  # one position routes itself
        with routing_replay(hf_moe, own):
            replayed = hf_moe(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(replayed, plain)


def test_replayed_experts_and_weights_equal_a_naive_block_with_its_gradient(hf_moe):
    """Under replay of random routes, each sparse block's output equals the hand-written block on the
    replayed experts, the logits differ from the model's own routing, and the router's gradient equals
    the gradient of the hand-written block (the weights stay differentiable)."""
    ids, mask = _batch(SEQS)
    routed = _random_routing(hf_moe, tuple(ids.shape), seed=1)
    routers = find_routers(hf_moe)
    last = max(routers)
    block = hf_moe.model.layers[last].mlp
    seen = {}

    def keep(module, args, output):
        seen["x"] = args[0].detach().reshape(-1, args[0].shape[-1])
        output.retain_grad()
        seen["y"] = output

    handle = block.register_forward_hook(keep)
    try:
        hf_moe.zero_grad(set_to_none=True)
        with routing_replay(hf_moe, routed):
            logits = hf_moe(input_ids=ids, attention_mask=mask).logits
        probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
        (logits * probe).sum().backward()
    finally:
        handle.remove()
    with torch.no_grad():
        plain = hf_moe(input_ids=ids, attention_mask=mask).logits
    assert (logits.detach() - plain).abs().max() > 1e-3  # the replayed routes were used, not the own ones

    renormalize = getattr(block.gate, "norm_topk_prob", True)
    flat_ids = routed[:, :, last].reshape(-1, TOP_K).long()
    got_y, upstream = seen["y"].detach().reshape(-1, seen["x"].shape[-1]), seen["y"].grad.reshape(-1, seen["x"].shape[-1])
    weight = block.gate.weight.detach().clone().requires_grad_(True)
    want_y = _naive_block(block, weight, seen["x"], flat_ids, renormalize)
    (want_y * upstream).sum().backward()
    torch.testing.assert_close(got_y, want_y.detach(), atol=1e-5, rtol=1e-5)
    got_grad = block.gate.weight.grad
    assert got_grad is not None and got_grad.abs().sum() > 0
    torch.testing.assert_close(got_grad, weight.grad, atol=1e-5, rtol=1e-4)
    hf_moe.zero_grad(set_to_none=True)


def test_hooks_are_removed_after_the_block(hf_moe):
    """Leaving the context (normally or by an exception) restores the model's own routing."""
    ids, mask = _batch(SEQS)
    routed = _random_routing(hf_moe, tuple(ids.shape), seed=2)
    hooks_before = _router_hooks(hf_moe)
    with torch.no_grad():
        plain = hf_moe(input_ids=ids, attention_mask=mask).logits
        with pytest.raises(RuntimeError, match="boom"), routing_replay(hf_moe, routed):
            raise RuntimeError("boom")
        assert torch.equal(hf_moe(input_ids=ids, attention_mask=mask).logits, plain)
    assert _router_hooks(hf_moe) == hooks_before


def test_bad_routing_is_refused_naming_the_problem(hf_moe, tiny_llama):
    """A dense model, a wrong shape, expert ids out of range, and a forward on another batch shape are
    refused with errors that name the problem; nothing stays patched."""
    ids, mask = _batch(SEQS)
    num_layers = hf_moe.config.num_hidden_layers
    good = _random_routing(hf_moe, tuple(ids.shape), seed=4)
    hooks_before = _router_hooks(hf_moe)
    dense = load_hf_model(tiny_llama)
    with pytest.raises(ValueError, match="mixture-of-experts"), routing_replay(dense, good):
        pass
    with pytest.raises(ValueError, match=f"num_layers={num_layers}"), routing_replay(hf_moe, good[:, :, :1]):
        pass
    out_of_range = good.clone()
    out_of_range[0, 0, next(iter(find_routers(hf_moe))), 0] = NUM_EXPERTS
    with pytest.raises(ValueError, match="outside"), routing_replay(hf_moe, out_of_range):
        pass
    with pytest.raises(ValueError, match="positions"), torch.no_grad(), routing_replay(hf_moe, good):
        hf_moe(input_ids=ids[:1], attention_mask=mask[:1])
    assert _router_hooks(hf_moe) == hooks_before


def test_wire_format_round_trip_and_packing():
    """base64 int32 rows (SGLang's layout, written with numpy) decode to [rows, L, K]; packing pads
    with -1 at the right positions; a payload of the wrong size is refused naming the row size."""
    rows = np.arange(5 * 3 * 2, dtype="<i4").reshape(5, 3, 2) - 1
    encoded = base64.b64encode(rows.tobytes()).decode("ascii")
    decoded = decode_routed_experts(encoded, num_layers=3, top_k=2)
    assert decoded.dtype == torch.int32 and torch.equal(decoded, torch.from_numpy(rows))
    packed = pack_routed_experts([decoded, decoded[:2]], seq_len=7)
    assert packed.shape == (2, 7, 3, 2)
    assert torch.equal(packed[0, :5], decoded) and (packed[0, 5:] == -1).all()
    assert torch.equal(packed[1, :2], decoded[:2]) and (packed[1, 2:] == -1).all()
    with pytest.raises(ValueError, match=r"\[num_layers=4\]\[top_k=2\]"):
        decode_routed_experts(encoded, num_layers=4, top_k=2)
    with pytest.raises(ValueError, match="more than"):
        pack_routed_experts([decoded], seq_len=4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_policy_weights_leave_under_checkpoint_names(arch, tmp_path):
    """checkpoint_named_tensors of a transformers MoE (experts stacked in memory) equals the checkpoint's
    own tensors, read with safetensors, name for name and bit for bit (so a weight sync reaches the engine)."""
    dense_layer = {"mlp_only_layers": [1]} if arch == "qwen3_moe" else {}
    path = make_moe_checkpoint(tmp_path, arch, num_hidden_layers=3, **dense_layer)
    got = {name: t.detach() for name, t in checkpoint_named_tensors(load_hf_model(path))}
    want = read_state_dict(path)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


# ---- with the engine: the rollout's routing, replayed by the trainer ------------------------------------


@pytest.fixture(scope="module")
def qwen_moe_path(tmp_path_factory):
    return make_moe_checkpoint(tmp_path_factory.mktemp("replay-engine"), "qwen3_moe")


def _rollout_experience(path, num_layers: int):
    """16 sampled completions (4 prompts x 4) with the engine's logprobs and routed experts."""
    prompts = random_prompts([4, 7, 12, 20], seed=21)
    with make_engine(path, enable_return_routed_experts=True) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={"n": 4, "temperature": 1.0, "max_new_tokens": 12,
                                                                  "ignore_eos": True, "seed": 5},
                               return_logprob=True, return_routed_experts=True)
    expanded = [p for p in prompts for _ in range(4)]
    exp = Experience.from_rollouts(expanded, [o["output_ids"] for o in outs],
                                   [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs],
                                   [0.0] * len(outs), pad_token_id=2)
    routed = [decode_routed_experts(o["meta_info"]["routed_experts"], num_layers, TOP_K) for o in outs]
    exp.routed_experts = pack_routed_experts(routed, exp.input_ids.shape[1])
    return exp


def _mismatch(hf, exp, replay: bool) -> float:
    with torch.no_grad():
        logp = policy_logprobs(hf, exp, temperature=1.0, replay=replay)
    return float(logprob_mismatch(exp.rollout_logprobs, logp, exp.completion_mask))


def _flipped_after(hf, exp) -> tuple[torch.Tensor, float]:
    """([B, T] bool: completion tokens downstream of a position where the model's own top-k set differs
    from the rollout's, in some sparse layer; fraction of (position, sparse layer) routes that differ)."""
    downstream = torch.zeros_like(exp.completion_mask, dtype=torch.bool)
    flips = total = 0
    for i in range(len(exp)):
        n = int(exp.attention_mask[i].sum()) - 1  # rows the engine returned
        own = hf_routed_experts(hf, exp.input_ids[i, :n].tolist()).sort(-1).values
        rollout = exp.routed_experts[i, :n].sort(-1).values
        sparse = own[:, :, 0] >= 0
        differs = (own != rollout).any(-1) & sparse  # [n, num_layers]
        flips, total = flips + int(differs.sum()), total + int(sparse.sum())
        first = differs.any(-1).nonzero()
        if len(first):
            downstream[i, int(first[0]) + 1 :] = True  # token t reads positions < t: their hidden states moved
    return downstream & exp.completion_mask.bool(), flips / total


def test_replay_removes_the_mismatch_of_flipped_routes(qwen_moe_path):
    """Same weights: engine and trainer route alike and the mismatch is float noise, with or without
    replay. A trainer whose router weights are rounded to bf16 flips some top-k choices: on the tokens
    downstream of a flip the logprob is far from the engine's without replay and back to the rounding's
    own small effect with it; on every other token replay changes nothing, bit for bit."""
    hf = load_hf_model(qwen_moe_path)
    exp = _rollout_experience(qwen_moe_path, hf.config.num_hidden_layers)
    downstream, flip_rate = _flipped_after(hf, exp)
    assert flip_rate == 0.0 and not downstream.any()
    same = {"own": _mismatch(hf, exp, replay=False), "replay": _mismatch(hf, exp, replay=True)}
    assert same["own"] < 1e-5 and same["replay"] < 1e-5, same

    with torch.no_grad():
        for router in find_routers(hf).values():
            router.weight.copy_(router.weight.bfloat16().float())
        own, replayed = policy_logprobs(hf, exp, 1.0), policy_logprobs(hf, exp, 1.0, replay=True)
    downstream, flip_rate = _flipped_after(hf, exp)
    others = exp.completion_mask.bool() & ~downstream
    gap_own = (own - exp.rollout_logprobs).abs()
    gap_replay = (replayed - exp.rollout_logprobs).abs()
    figures = {"flip_rate": flip_rate, "tokens_downstream": int(downstream.sum()),
               "downstream_own": float(gap_own[downstream].mean()), "downstream_replay": float(gap_replay[downstream].mean()),
               "others": float(gap_own[others].mean())}
    print(f"\nrouter weights in bf16: {figures}")
    assert downstream.any()  # the rounding did flip routes: the comparison below means something
    assert torch.equal(own[others], replayed[others])
    assert figures["downstream_replay"] * 10 < figures["downstream_own"], figures
    assert figures["downstream_replay"] < 5 * figures["others"], figures


@pytest.mark.parametrize("trainer_cls", [GRPOTrainer, PPOTrainer], ids=["grpo", "ppo"])
def test_rl_loop_with_routing_replay_on_a_moe_policy(qwen_moe_path, tmp_path, trainer_cls):
    """Two GRPO (PPO) steps with --routing-replay on a tiny Qwen3-MoE: the engine's routing reaches the
    trainer, the replayed mismatch stays at float noise, the policy gradient is nonzero, the router
    trains and its stacked experts sync back to the engine under per-expert names."""
    cfg = RLConfig(model=str(qwen_moe_path), steps=2, prompts_per_step=4, group_size=4, no_wandb=True,
                   output_dir=str(tmp_path), eval_every=0, lr=1e-2, routing_replay=True)
    trainer = trainer_cls(cfg)
    try:
        trainer.task = Task("length", make_toy_prompts, length_reward)
        probe = "model.layers.0.mlp.gate.weight"
        before = trainer.policy.state_dict()[probe].detach().clone()
        history = trainer.train()
        after = trainer.policy.state_dict()[probe]
        # The engine serves the trained experts: one expert's down projection, read back by its HF name.
        served = trainer.engine.get_weights_by_name("model.layers.1.mlp.experts.3.down_proj.weight", truncate_size=1000)
        trained = trainer.policy.model.layers[1].mlp.experts.down_proj[3]
    finally:
        trainer.close()
    assert trainer.routed_experts_shape == (2, TOP_K)
    for m in history:
        assert m["logprob_mismatch"] < 1e-4 and m["logprob_mismatch_no_replay"] < 1e-2, m
        assert m["grad_norm"] > 0
    assert not torch.equal(before, after)  # the router trained (its gradient flows through replay)
    assert torch.equal(torch.tensor(served), trained.detach())
