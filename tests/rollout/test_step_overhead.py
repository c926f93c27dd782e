"""Per-step host shortcuts keep results: the reused sampling info equals a fresh build, the attention
plan equals the naive one, and a small CPU model's scheduler thread steps on one intra-op thread
without changing anyone else's thread count."""

from __future__ import annotations

import dataclasses
import threading

import torch

from rollout.batch import SamplingInfoCache, sampling_info
from rollout.request import Req
from rollout.sampling_params import SamplingParams
from runner.attention.torch_native import TorchNativeAttnBackend
from runner.forward_batch import ForwardBatch, ForwardMode

VOCAB = 50


def _req(rid: str, sp: SamplingParams, seed: int, n_out: int, **kw) -> Req:
    req = Req(rid, [3, 4, 5], sp, seed=seed, **kw)
    req.output_ids = list(range(7, 7 + n_out))
    return req


def _assert_same_info(a, b) -> None:
    for f in dataclasses.fields(a):
        if f.name == "seed_mix":  # filled by the sampler on first use, not by the builder
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


def test_sampling_info_cache_matches_fresh_build_each_step():
    """Across decode steps, after a params change and with min_new_tokens, the cached info equals sampling_info()."""
    sp_a = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    sp_b = SamplingParams(temperature=0.0)
    reqs = [_req("a", sp_a, 11, 2, return_logprob=True, top_logprobs_num=3),
            _req("b", sp_b, 12, 2, return_logprob=True, token_ids_logprob=[1, 2])]
    cache = SamplingInfoCache(VOCAB, [1], "cpu")
    first = cache(reqs)
    _assert_same_info(first, sampling_info(reqs, VOCAB, [1], "cpu"))
    for _ in range(3):  # a decode step: one more token each
        for r in reqs:
            r.output_ids.append(9)
        info = cache(reqs)
        assert info.temperatures is first.temperatures  # reused, not rebuilt
        _assert_same_info(info, sampling_info(reqs, VOCAB, [1], "cpu"))
    reqs[0].sampling_params = dataclasses.replace(sp_a, temperature=1.3)  # a replaced params object
    reqs[1].top_logprobs_num = 4
    _assert_same_info(cache(reqs), sampling_info(reqs, VOCAB, [1], "cpu"))
    reqs.append(_req("c", SamplingParams(temperature=1.0, min_new_tokens=4, stop_token_ids=[2]), 13, 1))
    for _ in range(4):  # the ban lifts as "c" grows: rebuilt while it holds, then equal to fresh
        _assert_same_info(cache(reqs), sampling_info(reqs, VOCAB, [1], "cpu"))
        for r in reqs:
            r.output_ids.append(9)


class _Pool:
    def __init__(self, rows: int, cols: int) -> None:
        self.req_to_token = torch.randint(0, 1000, (rows, cols))


class _Runner:
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.req_to_token_pool = _Pool(6, 40)


def test_attention_plan_matches_naive_construction():
    """kv_indices, mask and q_index of decode and extend plans equal an element-by-element construction."""
    backend = TorchNativeAttnBackend(_Runner(), decode_kernel=False)  # the gather plan itself
    r2t = backend.req_to_token
    rows, prefix, new = [4, 1, 3], [5, 0, 9], [3, 7, 1]
    seq = [p + n for p, n in zip(prefix, new)]
    cases = [
        (ForwardMode.DECODE, [1] * 3, [s - 1 for s in seq]),
        (ForwardMode.EXTEND, new, prefix),
    ]
    for mode, q_lens, prefix_lens in cases:
        fb = ForwardBatch(forward_mode=mode, batch_size=3, input_ids=torch.zeros(sum(q_lens), dtype=torch.int64),
                          positions=torch.zeros(sum(q_lens), dtype=torch.int64),
                          req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq),
                          out_cache_loc=torch.zeros(sum(q_lens), dtype=torch.int64), seq_lens_cpu=seq,
                          extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=q_lens)
        backend.init_forward_metadata(fb)
        md = backend.forward_metadata
        max_kv, max_q = max(seq), max(q_lens)
        for b in range(3):
            for j in range(max_kv):
                assert int(md.kv_indices[b, j]) == (int(r2t[rows[b], j]) if j < seq[b] else 0)
                assert md.mask.shape == (3, 1, max_q, max_kv)
                for i in range(max_q):  # query i of row b sits at position prefix_lens[b] + i
                    want = j < seq[b] and j <= prefix_lens[b] + i
                    if mode == ForwardMode.EXTEND and j == 0:
                        want = True  # padded query rows see key 0
                    assert bool(md.mask[b, 0, i, j]) == want, (mode, b, i, j)
        if max_q > 1:
            naive = [b * max_q + i for b in range(3) for i in range(q_lens[b])]
            assert md.q_index.tolist() == naive
        else:
            assert md.q_index is None


def test_small_cpu_model_steps_on_one_thread_without_changing_others(make_engine, tiny_llama):
    """The scheduler thread of a tiny CPU model steps with 1 intra-op thread; main and new threads keep theirs."""
    before = torch.get_num_threads()
    engine = make_engine(tiny_llama)
    seen: list[int] = []
    step = engine.scheduler.step

    def recording_step():
        seen.append(torch.get_num_threads())
        return step()

    engine.scheduler.step = recording_step
    engine.generate(input_ids=[[5, 6, 7]], sampling_params=dict(max_new_tokens=3, ignore_eos=True), show_progress=False)
    assert seen and seen[-1] == 1
    assert torch.get_num_threads() == before
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
    t.start()
    t.join(timeout=10)
    assert other == [before]
