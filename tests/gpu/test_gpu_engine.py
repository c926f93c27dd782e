"""The GPU path end to end (CUDA only): greedy generation equals HF transformers on the GPU in bf16, with
flashinfer and torch-native attention, with and without CUDA graphs; graphs stay right across a weight
update and a release/resume cycle (outputs equal a fresh engine); torch_memory_saver really returns the
memory; a CUDA tensor crosses a process boundary through IPC descriptors.

bf16 tolerance: the engine's tokens are checked by teacher forcing HF on prompt + output, so a token is
accepted when HF's logit for it is within BF16_GAP of HF's best (a near-tie may flip in bf16), and its
logprob within LOGPROB_ATOL of HF's. The head_dim is 64 (a size flashinfer compiles for) and one case
has GQA group 7 (Qwen2.5's), which takes the tensor-core decode path.
"""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

from tests.gpu.conftest import needs

pytestmark = pytest.mark.gpu

BF16_GAP = 0.1
LOGPROB_ATOL = 0.08
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 40, 41, 42] * 5, [7], list(range(20, 60))]
GREEDY = dict(temperature=0, max_new_tokens=16, ignore_eos=True)
ENGINE_KW = dict(device="cuda", dtype="bfloat16", max_total_tokens=8192, max_running_requests=16,
                 show_progress=False)
CONFIGS = {  # id -> engine options
    "flashinfer-graphs": dict(attention_backend="flashinfer"),
    "flashinfer-eager": dict(attention_backend="flashinfer", disable_cuda_graph=True),
    "torch_native-graphs": dict(attention_backend="torch_native"),
}


@pytest.fixture(scope="module")
def gpu_ckpt(ckpt_factory):
    """arch -> tiny checkpoint with head_dim 64 (4 q / 2 kv heads), plus 'qwen2-g7' with 7 q / 1 kv heads."""
    ckpts = {arch: ckpt_factory(arch, hidden_size=256, head_dim=64) for arch in ("llama", "mistral", "qwen2", "qwen3")}
    ckpts["qwen2-g7"] = ckpt_factory("qwen2", hidden_size=448, num_attention_heads=7, num_key_value_heads=1,
                                     head_dim=64)
    return ckpts


def _engine(path, **kw):
    from rollout import Engine

    return Engine(str(path), **{**ENGINE_KW, **kw})


def _run(engine, prompts=PROMPTS):
    engine.flush_cache()
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


@torch.no_grad()
def _check_against_hf(path, results):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    for prompt, (ids, logprobs) in zip(PROMPTS, results):
        full = torch.tensor([prompt + ids], device="cuda")
        logits = hf(full).logits[0, len(prompt) - 1 : -1].float()  # [len(ids), vocab]
        chosen = logits[torch.arange(len(ids)), torch.tensor(ids, device="cuda")]
        gap = (logits.max(-1).values - chosen).max().item()
        assert gap <= BF16_GAP, f"prompt {prompt[:5]}: a token {gap:.3f} below HF's best logit"
        hf_lp = logits.log_softmax(-1)[torch.arange(len(ids)), torch.tensor(ids, device="cuda")]
        diff = (hf_lp.cpu() - torch.tensor(logprobs)).abs().max().item()
        assert diff <= LOGPROB_ATOL, f"prompt {prompt[:5]}: logprob off HF by {diff:.3f}"


# Every architecture with the default path (flashinfer + graphs); the other two paths on two shapes, so
# the whole file fits the quick device check's test budget.
CASES = [(arch, "flashinfer-graphs") for arch in ("llama", "mistral", "qwen2", "qwen3", "qwen2-g7")] + \
    [(arch, config) for config in ("flashinfer-eager", "torch_native-graphs") for arch in ("llama", "qwen2-g7")]


@pytest.mark.parametrize("arch, config", CASES)
def test_greedy_matches_hf_on_gpu(gpu_ckpt, arch, config):
    """Greedy tokens and logprobs equal HF's bf16 forward on the GPU up to bf16 near-ties."""
    if config.startswith("flashinfer"):
        pytest.importorskip("flashinfer")
    with _engine(gpu_ckpt[arch], **CONFIGS[config]) as engine:
        graphs = engine.runner.graph_runner
        assert (graphs is None) == ("eager" in config)
        _check_against_hf(gpu_ckpt[arch], _run(engine))


@needs("flashinfer")
def test_default_backend_on_cuda_is_flashinfer_and_graphs_equal_eager(gpu_ckpt):
    """Without an override CUDA picks flashinfer; graph replay gives the same tokens as eager decode."""
    from runner.attention.flashinfer import FlashInferAttnBackend

    with _engine(gpu_ckpt["qwen2-g7"]) as engine:
        assert isinstance(engine.runner.attn_backend, FlashInferAttnBackend)
        with_graphs = _run(engine)
    with _engine(gpu_ckpt["qwen2-g7"], disable_cuda_graph=True) as engine:
        eager = _run(engine)
    assert [ids for ids, _ in with_graphs] == [ids for ids, _ in eager]
    for (_, a), (_, b) in zip(with_graphs, eager):
        assert max(abs(x - y) for x, y in zip(a, b)) <= LOGPROB_ATOL


@pytest.mark.parametrize("config", ["flashinfer-graphs", "torch_native-graphs"])
def test_overlap_schedule_on_its_stream_equals_off(gpu_ckpt, config):
    """The overlap schedule on CUDA (forward on the worker's own stream, step N+1 queued behind N) gives the
    same greedy tokens and seeded samples as disable_overlap_schedule=True, and launched steps ahead."""
    if config.startswith("flashinfer"):
        pytest.importorskip("flashinfer")
    sampled = dict(temperature=1.0, top_p=0.9, n=4, seed=7, max_new_tokens=24, ignore_eos=True)
    results = {}
    for off in (False, True):
        with _engine(gpu_ckpt["llama"], disable_overlap_schedule=off, **CONFIGS[config]) as engine:
            greedy = _run(engine)
            samples = engine.generate(input_ids=PROMPTS, sampling_params=sampled)
            results[off] = (greedy, [o["output_ids"] for o in samples],
                            engine.get_server_info()["num_overlapped_steps"])
    assert [ids for ids, _ in results[False][0]] == [ids for ids, _ in results[True][0]]
    assert results[False][1] == results[True][1]
    assert results[False][2] > 0 and results[True][2] == 0


def _state_dict(path):
    from tests.rl_surface.conftest import read_state_dict

    return list(read_state_dict(path).items())


def test_graphs_survive_update_and_release_resume(ckpt_factory):
    """A graph-decoding engine on A, updated to B, equals a fresh engine on B; after release/resume (weights
    backed up) it still does, and the graphs were not recaptured with torch_memory_saver."""
    a = ckpt_factory("qwen2", hidden_size=256, head_dim=64)
    b = ckpt_factory("qwen2", hidden_size=256, head_dim=64, seed=1)
    with _engine(b) as fresh:
        want = _run(fresh)
    with _engine(a, enable_memory_saver=True, enable_weights_cpu_backup=True) as engine:
        gr = engine.runner.graph_runner
        assert gr is not None and gr.num_captures == 1
        assert engine.update_weights_from_tensor(_state_dict(b))[0]
        assert _run(engine) == want
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        assert _run(engine) == want
        saver = engine.runner.memory_saver
        assert gr.num_captures == (1 if saver.preserves_addresses else 2), saver.name


@needs("torch_memory_saver")
def test_release_returns_device_memory(ckpt_factory):
    """With torch_memory_saver, release frees >= 90% of the KV + weight bytes (mem_get_info) and resume
    brings outputs back equal to before."""
    path = ckpt_factory("qwen2", hidden_size=256, head_dim=64)
    with _engine(path, enable_memory_saver=True, enable_weights_cpu_backup=True, max_total_tokens=None,
                 mem_fraction_static=0.3) as engine:
        saver = engine.runner.memory_saver
        assert saver.name == "torch_memory_saver"
        before = _run(engine)
        held = saver.bytes_held("kv_cache") + saver.bytes_held("weights")
        free0 = torch.cuda.mem_get_info()[0]
        engine.release_memory_occupation()
        freed = torch.cuda.mem_get_info()[0] - free0
        assert freed >= 0.9 * held, f"freed {freed / 2**30:.2f} GiB of {held / 2**30:.2f} GiB"
        engine.resume_memory_occupation()
        assert _run(engine) == before


def _ipc_child(conn):
    import torch

    from weight_sync.bucket import FlattenedTensorBucket
    from weight_sync.cuda_ipc import encode_bucket, encode_tensor

    t = torch.arange(24, dtype=torch.float32, device="cuda").view(4, 6)[1:, 2:]  # a strided view
    bucket = FlattenedTensorBucket([("a", torch.full((3, 5), 2.5, device="cuda")),
                                    ("b", torch.arange(7, device="cuda", dtype=torch.float32))])
    conn.send(json.dumps({"tensor": encode_tensor(t), "bucket": encode_bucket(bucket)}))
    conn.recv()  # keep the memory alive until the parent has read it
    conn.close()


def test_cuda_ipc_maps_another_process_memory():
    """A strided view and a flattened bucket built by a spawned process arrive as JSON descriptors and map
    onto the same values on this side, without a host copy (the tensors are CUDA tensors)."""
    from weight_sync.cuda_ipc import decode_bucket, decode_tensor

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_child, args=(child,))
    proc.start()
    try:
        assert parent.poll(120), "child sent nothing"
        msg = json.loads(parent.recv())
        t = decode_tensor(msg["tensor"], device=0)
        assert t.is_cuda and torch.equal(t.cpu(), torch.arange(24.0).view(4, 6)[1:, 2:])
        named = dict(decode_bucket(msg["bucket"], device=0).named_tensors())
        assert named["a"].is_cuda and torch.equal(named["a"].cpu(), torch.full((3, 5), 2.5))
        assert torch.equal(named["b"].cpu(), torch.arange(7.0))
        del t, named
        torch.cuda.synchronize()
        parent.send("done")
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
