"""The captured decode step (runner/graphs/graph_runner.py, runner/graphs/cpu_graph_runner.py) is an accelerator only:
with capture on and off the engine generates what HF generates, and a captured step stays correct
across every weight-update route, release/resume and retraction. Sizes are few and small (each
capture compiles for seconds); `cuda_graph_bs` captures them at init."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from rollout import Engine
from runner.forward_batch import ForwardBatch, ForwardMode
from runner.graphs.graph_runner import PAD_REQ_ROW, StaticDecodeInputs, capture_batch_sizes, padded_size
from runner.layers import prepack
from tests.rollout.oracle import hf_generate, random_prompts
from weight_sync import iter_buckets

PROMPTS = random_prompts([5, 9, 3], seed=3) + random_prompts([12], seed=4)
GREEDY = dict(temperature=0, max_new_tokens=6, ignore_eos=True)
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=6, ignore_eos=True)
KW = dict(show_progress=False, max_total_tokens=1024, max_running_requests=8)


def _run(engine: Engine, prompts=PROMPTS, params=None) -> tuple[list[list[int]], torch.Tensor]:
    engine.flush_cache()
    params = params or [GREEDY] * (len(prompts) - 1) + [SAMPLED]
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return [o["output_ids"] for o in outs], torch.tensor(
        [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]])


def _assert_same(got, want) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)


def _num_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_capture_batch_sizes():
    """[1, 2, 4, 8] then steps of 8 up to max_bs (always included); padding picks the next size up."""
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert padded_size(3, [1, 2, 4]) == 4 and padded_size(5, [1, 2, 4]) is None
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_batch_sizes(0)


def test_static_inputs_pad_to_dummy_rows():
    """Rows [:bs] copy the batch; padding rows get id 0, position 0, KV slot 0, the pad row, seq_len 1."""
    inp = StaticDecodeInputs(8, torch.device("cpu"))
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    fb = ForwardBatch(ForwardMode.DECODE, 3, t([7, 8, 9]), t([4, 5, 6]), t([3, 1, 2]), t([5, 6, 7]),
                      t([11, 12, 13]), [5, 6, 7])
    assert inp.fill(fb, 4) == [5, 6, 7, 1]
    assert inp.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert inp.positions[:4].tolist() == [4, 5, 6, 0]
    assert inp.out_cache_loc[:4].tolist() == [11, 12, 13, 0]
    assert inp.req_pool_indices[:4].tolist() == [3, 1, 2, PAD_REQ_ROW]
    assert inp.seq_lens[:4].tolist() == [5, 6, 7, 1]
    with pytest.raises(ValueError, match="cannot be padded"):
        inp.fill(fb, 9)


def test_captured_equals_eager_and_hf(tiny_qwen2):
    """Capture on == capture off (tokens, logprobs within 1e-5) == HF greedy, through padded replays."""
    from transformers import AutoModelForCausalLM

    with Engine(str(tiny_qwen2), cuda_graph_bs=[4], **KW) as captured, \
            Engine(str(tiny_qwen2), disable_cuda_graph=True, **KW) as eager:
        gr = captured.runner.graph_runner
        assert eager.runner.graph_runner is None and gr.captured == {4}
        _assert_same(_run(captured), _run(eager))  # 4 requests: replays at 4
        _assert_same(_run(captured, PROMPTS[:3]), _run(eager, PROMPTS[:3]))  # 3 padded to 4
        _assert_same(_run(captured, PROMPTS[:1]), _run(eager, PROMPTS[:1]))  # 1 padded to 4
        assert gr.num_replays >= 3 * (GREEDY["max_new_tokens"] - 1)
        hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
        ids, _ = _run(captured, PROMPTS[:3], [GREEDY] * 3)
        assert ids == [hf_generate(hf, p, GREEDY["max_new_tokens"])[0] for p in PROMPTS[:3]]


def test_batches_beyond_capture_run_eagerly(tiny_llama):
    """A decode batch larger than the largest captured size is not replayed, and still equals eager."""
    with Engine(str(tiny_llama), cuda_graph_bs=[2], **KW) as captured, \
            Engine(str(tiny_llama), disable_cuda_graph=True, **KW) as eager:
        gr = captured.runner.graph_runner
        before = gr.num_replays
        _assert_same(_run(captured), _run(eager))  # 4 requests, decode batches of 4 > 2
        assert gr.num_replays == before


class _ThreadHandle:
    """What DistributedTarget needs of an engine (call_async/result), for an in-process Engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.pool, self.future = engine, ThreadPoolExecutor(1), None

    def call_async(self, name: str, **kwargs) -> None:
        self.future = self.pool.submit(getattr(self.engine, name), **kwargs)

    def result(self):
        return self.future.result(timeout=60)


def _distributed_update(engine: Engine, sd: dict) -> None:
    from tests.weight_sync.test_transports import free_port
    from weight_sync import sync_weights
    from weight_sync.distributed import DistributedTarget, create_weight_update_group

    port, name = free_port(), f"graph-{threading.get_ident()}-{free_port()}"
    handle = _ThreadHandle(engine)
    handle.call_async("init_weights_update_group", master_address="127.0.0.1", master_port=port, rank_offset=1,
                      world_size=2, group_name=name, backend="gloo")
    group = create_weight_update_group("127.0.0.1", port, rank=0, world_size=2, group_name=name, backend="gloo",
                                       timeout_s=30)
    ok, msg = handle.result()
    assert ok, msg
    ok, msg = sync_weights(sd, DistributedTarget(handle, group, name, timeout_s=30), bucket_bytes=1 << 16)
    assert ok, msg


def test_captured_step_survives_every_weight_route(ckpt_factory, monkeypatch):
    """After tensor, flattened-bucket, disk and distributed updates, release/resume with and without
    CPU backup, the captured engine equals a fresh eager engine on the expected weights, without
    recompiling (the graph reads the parameters and the prepacked copies at run time)."""
    monkeypatch.setattr(prepack, "MIN_PACK_NUMEL", 0)  # tiny layers: pack every linear, so repacks count
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    sd_a, sd_b = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    with Engine(str(a), disable_cuda_graph=True, **KW) as ref_a, Engine(str(b), disable_cuda_graph=True, **KW) as ref_b:
        want_a, want_b = _run(ref_a), _run(ref_b)
    assert want_a[0] != want_b[0]  # the checks below can fail
    kw = dict(KW, cuda_graph_bs=[4], enable_memory_saver=True, enable_weights_cpu_backup=True)
    with Engine(str(a), **kw) as engine:
        gr = engine.runner.graph_runner
        assert all(m.packed is not None for m in prepack.packable_modules(engine.runner.model))
        _assert_same(_run(engine), want_a)
        graphs, replays = _num_graphs(), gr.num_replays

        assert engine.update_weights_from_tensor(list(sd_b.items()))[0]
        _assert_same(_run(engine), want_b)
        (bucket,) = list(iter_buckets(sd_a, bucket_bytes=1 << 30))
        assert engine.update_weights_from_tensor(bucket.to_dict(), load_format="flattened_bucket")[0]
        _assert_same(_run(engine), want_a)
        assert engine.update_weights_from_disk(str(b))[0]
        _assert_same(_run(engine), want_b)
        engine.release_memory_occupation()
        engine.resume_memory_occupation()  # weights restored from the CPU backup, storages reallocated
        _assert_same(_run(engine), want_b)
        _distributed_update(engine, sd_a)
        _assert_same(_run(engine), want_a)
        assert gr.num_replays > replays and _num_graphs() == graphs and gr.captured == {4}

    kw["enable_weights_cpu_backup"] = False
    with Engine(str(a), **kw) as engine:
        gr = engine.runner.graph_runner
        engine.release_memory_occupation()
        engine.resume_memory_occupation()  # no backup: garbage until the trainer's weights arrive
        assert engine.update_weights_from_tensor(list(sd_b.items()))[0]
        replays = gr.num_replays
        _assert_same(_run(engine), want_b)
        assert gr.num_replays > replays


def test_captured_step_under_retraction(tiny_llama):
    """With forced retractions (tiny KV pool), captured and eager engines generate the same tokens."""
    prompts = random_prompts([5, 20, 12, 17, 8, 14, 9, 11], seed=5)
    params = [dict(GREEDY, max_new_tokens=6 + i % 5) for i in range(len(prompts))]
    kw = dict(KW, max_total_tokens=96, chunked_prefill_size=16, disable_radix_cache=True)
    with Engine(str(tiny_llama), cuda_graph_bs=[8], **kw) as captured, \
            Engine(str(tiny_llama), disable_cuda_graph=True, **kw) as eager:
        got, want = _run(captured, prompts, params), _run(eager, prompts, params)
        assert captured.get_server_info()["num_retractions"] > 0
        assert captured.runner.graph_runner.num_replays > 0
        _assert_same(got, want)
