"""ModelRunner logits equal Hugging Face transformers' on the same checkpoint, for every supported
architecture and a tied-embedding variant: ragged prefill, decode, extend over a cached prefix,
embedding overrides, and the IDLE no-op. fp32 on the CPU, so the tolerance is tight."""

from __future__ import annotations

import pytest
import torch

from runner.forward_batch import ForwardBatch
from tests.checkpoints import ARCHS, load_hf_model
from tests.runner.driver import RunnerDriver, make_runner
from tests.runner.parity import PROMPT_LENS, MaxDiffs, hf_logits, ragged_prompts

CASES = [(arch, False) for arch in ARCHS] + [("qwen2", True)]
CASE_IDS = [f"{arch}-tied" if tied else arch for arch, tied in CASES]
DIFFS = MaxDiffs()


@pytest.fixture(scope="module", params=CASES, ids=CASE_IDS)
def case(request, ckpt_factory):
    """(name, checkpoint path, HF reference model)."""
    arch, tied = request.param
    path = ckpt_factory(arch, tie_word_embeddings=True) if tied else ckpt_factory(arch)
    return CASE_IDS[CASES.index(request.param)], path, load_hf_model(path)


@pytest.fixture(scope="module", autouse=True)
def _report_max_diffs():
    yield
    DIFFS.report()


def test_ragged_prefill_matches_hf_at_every_position(case):
    """One EXTEND over prompts of lengths 3, 9, 17 gives HF's logits at every position of each."""
    _, path, hf = case
    drv = RunnerDriver(make_runner(path))
    prompts = ragged_prompts()
    rows = [drv.new_request() for _ in prompts]
    out = drv.extend(rows, prompts, return_all_logits=True)
    want = torch.cat([hf_logits(hf, p) for p in prompts])
    DIFFS.check(case[0], "prefill", out.all_logits, want)
    last = torch.stack([hf_logits(hf, p)[-1] for p in prompts])
    DIFFS.check(case[0], "prefill_last", out.next_token_logits, last)


def test_decode_steps_match_hf(case):
    """20 batched DECODE steps over ragged prompts give HF's logits after every fed token. The fed
    tokens are a seeded random stream: greedy on the tied model just repeats one token."""
    _, path, hf = case
    drv = RunnerDriver(make_runner(path))
    prompts = ragged_prompts(1)
    num_steps = 20
    fed = torch.randint(4, 384, (len(prompts), num_steps), generator=torch.Generator().manual_seed(6))
    rows = [drv.new_request() for _ in prompts]
    drv.extend(rows, prompts)
    got = torch.stack([drv.decode(rows, fed[:, step].tolist()).next_token_logits for step in range(num_steps)],
                      dim=1)  # [bs, steps, vocab]
    for i, p in enumerate(prompts):
        want = hf_logits(hf, p + fed[i].tolist())[len(p) :]
        DIFFS.check(case[0], "decode", got[i], want)


def test_extend_over_cached_prefix_matches_full_prefill(case):
    """Prefill k tokens, then EXTEND the rest with extend_prefix_lens=k: logits equal HF's."""
    _, path, hf = case
    drv = RunnerDriver(make_runner(path))
    prompts = ragged_prompts(2)
    ks = [1, 4, 11]
    rows = [drv.new_request() for _ in prompts]
    drv.extend(rows, [p[:k] for p, k in zip(prompts, ks)])
    out = drv.extend(rows, [p[k:] for p, k in zip(prompts, ks)], return_all_logits=True)
    want = torch.cat([hf_logits(hf, p)[k:] for p, k in zip(prompts, ks)])
    DIFFS.check(case[0], "extend_prefix", out.all_logits, want)
    # Same batch with one request already fully cached but for its last token (a 1-token extend).
    rows2 = [drv.new_request() for _ in prompts]
    drv.extend(rows2, [p[:-1] for p in prompts])
    out2 = drv.extend(rows2, [p[-1:] for p in prompts], return_all_logits=True)
    DIFFS.check(case[0], "extend_prefix", out2.all_logits, torch.stack([hf_logits(hf, p)[-1] for p in prompts]))


def test_input_embeds_override(case):
    """input_embeds = HF's embeddings reproduce the ids' logits; replace_embeds at replace_positions
    equal HF run on inputs_embeds with those rows replaced."""
    _, path, hf = case
    runner = make_runner(path)
    drv = RunnerDriver(runner)
    prompts = ragged_prompts(3)
    embed = hf.get_input_embeddings()
    with torch.no_grad():
        embeds = [embed(torch.tensor(p)) for p in prompts]  # [len, hidden] each
    rows = [drv.new_request() for _ in prompts]
    out = drv.extend(rows, prompts, return_all_logits=True, input_embeds=torch.cat(embeds))
    DIFFS.check(case[0], "input_embeds", out.all_logits, torch.cat([hf_logits(hf, p) for p in prompts]))

    gen = torch.Generator().manual_seed(4)
    flat_positions = [0, 4, 5, 12, 20, 28]  # flattened token indices across the 3 + 9 + 17 tokens
    new_rows = torch.randn(len(flat_positions), embeds[0].shape[1], generator=gen)
    replaced = torch.cat(embeds).clone()
    replaced[flat_positions] = new_rows
    rows = [drv.new_request() for _ in prompts]
    out = drv.extend(rows, prompts, return_all_logits=True, replace_embeds=new_rows,
                     replace_positions=torch.tensor(flat_positions))
    want = torch.cat([hf_logits(hf, embeds=e) for e in replaced.split(list(PROMPT_LENS))])
    DIFFS.check(case[0], "replace_embeds", out.all_logits, want)
    # The replacement must matter, or this comparison proves nothing.
    assert (want - torch.cat([hf_logits(hf, p) for p in prompts])).abs().max() > 1e-2


def test_idle_is_a_no_op(case):
    """IDLE returns None and changes no KV buffer, allocator or request row."""
    _, path, _ = case
    runner = make_runner(path)
    drv = RunnerDriver(runner)
    drv.extend([drv.new_request()], [ragged_prompts()[1]])  # some state that must survive
    kv = runner.token_to_kv_pool
    before = (kv.k_buffer.clone(), kv.v_buffer.clone(), kv.free_slots.clone(),
              runner.req_to_token_pool.req_to_token.clone(), list(runner.req_to_token_pool.free_slots))
    fb = ForwardBatch.idle()
    planned = runner.attn_backend.forward_metadata
    assert runner.forward(fb) is None
    after = (kv.k_buffer, kv.v_buffer, kv.free_slots, runner.req_to_token_pool.req_to_token,
             runner.req_to_token_pool.free_slots)
    for b, a in zip(before[:4], after[:4]):
        assert torch.equal(b, a)
    assert before[4] == after[4]
    assert runner.attn_backend.forward_metadata is planned  # IDLE plans nothing


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_bias_variant_matches_hf(ckpt_factory, arch):
    """Llama/Qwen3 with attention_bias=true (biases on q, k, v and o_proj) load and match HF."""
    path = ckpt_factory(arch, attention_bias=True)
    hf = load_hf_model(path)
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    drv = RunnerDriver(make_runner(path))
    prompts = ragged_prompts(5)
    out = drv.extend([drv.new_request() for _ in prompts], prompts, return_all_logits=True)
    want = torch.cat([hf_logits(hf, p) for p in prompts])
    DIFFS.check(f"{arch}-attention_bias", "prefill", out.all_logits, want)
