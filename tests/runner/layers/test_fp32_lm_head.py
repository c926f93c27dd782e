"""enable_fp32_lm_head (SGLang's option): the vocabulary projection of a bf16 model runs in fp32.

Oracles: F.linear on the upcast tensors (module level, and the dtypes F.linear is called with, as
SGLang's own test probes them), and transformers' bf16 forward whose final hidden states are projected
by hand in fp32 and in bf16 (engine level, with rl_on_policy_target="fsdp" so the hidden states are HF's).
"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rollout import Engine
from runner.layers.embedding import LMHead


@pytest.mark.parametrize("fp32", [True, False])
def test_lm_head_projects_in_the_dtype_asked(fp32):
    """fp32=True: F.linear gets fp32 hidden and weight and the logits equal that product exactly;
    fp32=False: it gets the bf16 tensors."""
    head = LMHead(128, 64)
    head.weight.data = torch.randn(128, 64).to(torch.bfloat16)
    head.fp32 = fp32
    hidden = torch.randn(3, 64).to(torch.bfloat16)
    seen = []
    real = F.linear

    def probe(x, w, b=None):
        seen.append((x.dtype, w.dtype))
        return real(x, w, b)

    with patch("torch.nn.functional.linear", new=probe):
        logits = head(hidden)
    want_dtype = torch.float32 if fp32 else torch.bfloat16
    assert seen == [(want_dtype, want_dtype)] and logits.dtype == want_dtype
    assert torch.equal(logits, real(hidden.to(want_dtype), head.weight.to(want_dtype)))


def _max_diffs(path, **engine_kw) -> tuple[float, float]:
    """(max |engine - fp32-head oracle|, max |engine - bf16-head oracle|) over every prompt and output
    position's logprob of the next token."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompt = torch.randint(4, 300, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    with Engine(str(path), device="cpu", dtype="bfloat16", show_progress=False, max_total_tokens=1024,
                rl_on_policy_target="fsdp", **engine_kw) as engine:
        out = engine.generate(input_ids=prompt, sampling_params=dict(temperature=0, max_new_tokens=8, ignore_eos=True),
                              return_logprob=True, logprob_start_len=0)
    seq = prompt + out["output_ids"]
    with torch.no_grad():
        hidden = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]  # [len, hidden], normed
    w = hf.get_output_embeddings().weight
    oracles = [torch.log_softmax(F.linear(hidden.float(), w.float()), -1),
               torch.log_softmax(F.linear(hidden, w).float(), -1)]
    meta = out["meta_info"]
    got = [lp for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    nxt = torch.tensor(seq[1:])
    return tuple((torch.tensor(got) - o[torch.arange(len(nxt)), nxt]).abs().max().item() for o in oracles)


def test_engine_logprobs_follow_the_fp32_head(ckpt_factory):
    """With the option the engine's logprobs are the fp32 projection's (to 1e-5), not the bf16 one's;
    without it, the other way round (the two oracles differ by more than that here)."""
    path = ckpt_factory("llama", dtype=torch.bfloat16, hidden_size=128)
    to_fp32, to_bf16 = _max_diffs(path, enable_fp32_lm_head=True)
    assert to_fp32 < 1e-5 < to_bf16, (to_fp32, to_bf16)
    to_fp32, to_bf16 = _max_diffs(path)
    assert to_bf16 < 1e-5 < to_fp32, (to_fp32, to_bf16)
