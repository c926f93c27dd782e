"""trainers/master_weights.py: AdamW over fp32 masters of a bf16 policy steps exactly as AdamW on fp32 parameters fed
the same gradients, and writes their rounding into the policy; stepping the bf16 parameters directly loses the
small updates (the stall it fixes). fp32 parameters are stepped in place, as without it."""

from __future__ import annotations

import torch

from trainers.master_weights import MasterWeights


def _adam(groups, lr):
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)


def test_masters_step_as_fp32_parameters_and_the_policy_holds_their_rounding():
    """Forty steps each under half a bf16 step: the masters equal an fp32 AdamW run on the same gradients, the bf16
    parameters equal the masters rounded, and they moved; AdamW on the bf16 parameters directly left them as
    they were (every update under half a bf16 step)."""
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(64, 32, generator=gen) * 0.3 + 4.5  # values in [2, 8): a bf16 step is 2**-6 or 2**-5
    grads = [torch.randn(64, 32, generator=gen).abs() for _ in range(40)]  # one sign: the updates add up
    lr = 1e-3  # a step of <= ~1e-3 is under half a bf16 step there (>= 2**-7); forty of them are not
    bf16 = torch.nn.Parameter(init.to(torch.bfloat16))
    masters = MasterWeights([bf16])
    opt = _adam(masters.groups, lr)
    ref = torch.nn.Parameter(init.to(torch.bfloat16).float())
    ref_opt = _adam([ref], lr)
    direct = torch.nn.Parameter(init.to(torch.bfloat16))
    direct_opt = _adam([direct], lr)
    for g in grads:
        bf16.grad = g.to(torch.bfloat16)
        masters.grads_to_masters()
        assert bf16.grad is None
        opt.step()
        masters.masters_to_model()
        ref.grad = g.to(torch.bfloat16).float()
        ref_opt.step()
        direct.grad = g.to(torch.bfloat16)
        direct_opt.step()
    master = masters.pairs[0][1]
    assert torch.equal(master, ref.detach())
    assert torch.equal(bf16.detach(), ref.detach().to(torch.bfloat16))
    assert not torch.equal(bf16.detach(), init.to(torch.bfloat16))  # the accumulated updates reached the policy
    assert torch.equal(direct.detach(), init.to(torch.bfloat16))  # stepped in bf16: every update rounded away
    assert masters.bytes() == 64 * 32 * 4


def test_fp32_and_frozen_parameters_get_no_masters():
    """An fp32 parameter is stepped in place (the optimizer holds it), a frozen bf16 one is left out, groups keep
    their options."""
    fp32 = torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16), requires_grad=False)
    low = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    masters = MasterWeights([{"params": [fp32, frozen]}, {"params": [low], "lr": 0.5}])
    assert masters.groups[0]["params"][0] is fp32 and masters.groups[0]["params"][1] is frozen
    assert masters.groups[1]["lr"] == 0.5 and masters.groups[1]["params"][0].dtype == torch.float32
    assert [p for p, _ in masters.pairs] == [low]
    assert masters.trainable() == [fp32, masters.pairs[0][1]]
