"""CudaGraphRunner's bookkeeping on the CPU: capture order and the shared pool, padding into the static
buffers, replay equal to an eager runner, and recapture after a portable-saver resume moved memory.

No CUDA graph is captured here. `StandInCudaGraphApi` is a stand-in for torch.cuda's graph calls (named
as such), used only for the runner's call-order logic: its "graph" re-runs the captured step on the
same static buffers and copies into the same output tensor, which is what a CUDA graph replay does.
The real capture runs in tests/gpu/.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from runner.graphs.cuda_graph_runner import CudaGraphRunner
from tests.runner.driver import RunnerDriver, make_runner


class _StandInGraph:
    def __init__(self, step, pool):
        self.step, self._pool, self.out = step, pool if pool is not None else object(), None

    def pool(self):
        return self._pool

    def replay(self):
        self.out.copy_(self.step())


class StandInCudaGraphApi:
    """Stand-in for the torch.cuda graph calls (see module docstring); logs every capture."""

    def __init__(self):
        self.log = []

    def new_stream(self):
        return SimpleNamespace(wait_stream=lambda other: None)

    def current_stream(self):
        return None

    def stream(self, stream):
        return nullcontext()

    def synchronize(self):
        pass

    def capture(self, saver, pool, stream, step):
        graph = _StandInGraph(step, pool)
        graph.out = step()
        self.log.append(("capture", graph.out.shape[0], pool))
        return graph, graph.out


def _graph_runner(path, **kw):
    runner = make_runner(path, disable_cuda_graph=True, **kw)
    api = StandInCudaGraphApi()
    runner.graph_runner = CudaGraphRunner(runner, capture_sizes=[1, 2, 4, 8], api=api)
    return runner, api


def _decode_logits(runner, batches, seed=7):
    """Prefill len(b) requests per batch, then two decode steps; returns the decode logits."""
    drv = RunnerDriver(runner, seed=seed)
    out = []
    for prompts in batches:
        rows = [drv.new_request() for _ in prompts]
        drv.extend(rows, prompts)
        out.append(drv.decode(rows, [p[-1] + 1 for p in prompts]).next_token_logits.clone())
        out.append(drv.decode(rows, [p[-1] + 2 for p in prompts]).next_token_logits.clone())
        for r in rows:
            runner.req_to_token_pool.free(r)
    return out


BATCHES = [[[5, 6, 7], [8, 9], [10, 11, 12, 13]],  # 3 -> padded to 4
           [[20 + i, 30 + i] for i in range(5)]]  # 5 -> padded to 8


def test_capture_order_and_padded_replay_equal_eager(tiny_llama):
    """Sizes are captured largest first into one pool; padded replays (3 -> 4, 5 -> 8) give eager logits,
    and the padding rows in the static buffers read slot 0 with length 1."""
    runner, api = _graph_runner(tiny_llama)
    gr = runner.graph_runner
    assert gr.capture_order == [8, 4, 2, 1]
    first_pool = api.log[0][2]
    assert first_pool is None and all(p is gr.graphs[8].pool() for _, _, p in api.log[1:])
    ref = make_runner(tiny_llama, disable_cuda_graph=True)
    for got, want in zip(_decode_logits(runner, BATCHES), _decode_logits(ref, BATCHES)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The last replay was 5 requests in the size-8 graph.
    assert gr.inputs.seq_lens[5:8].tolist() == [1, 1, 1] and gr.inputs.out_cache_loc[5:8].tolist() == [0, 0, 0]
    assert gr.num_captures == 1


def test_can_run_only_replayable_decode_batches(tiny_llama):
    """Extend batches, batches beyond the largest size and embedding overrides run eagerly."""
    runner, _ = _graph_runner(tiny_llama)
    drv = RunnerDriver(runner)
    rows = [drv.new_request() for _ in range(9)]
    seen = []
    real_can_run = runner.graph_runner.can_run
    runner.graph_runner.can_run = lambda fb: seen.append((fb.batch_size, real_can_run(fb))) or seen[-1][1]
    drv.extend(rows, [[5, 6]] * 9)
    drv.decode(rows, [7] * 9)
    drv.decode(rows[:8], [8] * 8)
    assert seen == [(9, False), (8, True)]


def test_portable_resume_recaptures_before_replay(tiny_llama):
    """After release/resume with the portable saver (addresses moved) the next replay recaptures every size
    first, and decode logits still equal an eager runner's."""
    runner, api = _graph_runner(tiny_llama, enable_memory_saver=True, enable_weights_cpu_backup=True)
    ref = make_runner(tiny_llama, disable_cuda_graph=True)
    want = _decode_logits(ref, BATCHES)
    runner.release_memory_occupation()
    runner.resume_memory_occupation()
    assert runner.memory_saver.address_epoch > runner.graph_runner.epoch
    got = _decode_logits(runner, BATCHES)
    assert runner.graph_runner.num_captures == 2 and len(api.log) == 8
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_cuda_graph_bs_is_honoured(tiny_llama):
    """With cuda_graph_bs given, exactly those sizes (deduplicated, none above max_running_requests) are
    captured, largest first, and a batch of 3 replays in the size-5 graph with eager's logits."""
    runner = make_runner(tiny_llama, disable_cuda_graph=True, cuda_graph_bs=[5, 1, 5, 64], max_running_requests=16)
    api = StandInCudaGraphApi()
    gr = CudaGraphRunner(runner, api=api)  # no sizes passed: read from the config, as ModelRunner builds it
    assert gr.capture_bs == [1, 5] and gr.capture_order == [5, 1] and [e[1] for e in api.log] == [5, 1]
    runner.graph_runner = gr
    replayed = []
    real = gr.replay
    gr.replay = lambda fb: replayed.append(fb.batch_size) or real(fb)
    ref = make_runner(tiny_llama, disable_cuda_graph=True)
    for got, want in zip(_decode_logits(runner, BATCHES[:1]), _decode_logits(ref, BATCHES[:1])):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert replayed == [3, 3]
    with pytest.raises(ValueError, match="every size exceeds max_running_requests=16"):
        CudaGraphRunner(runner, capture_sizes=[32], api=api)


def test_no_replay_while_cuda_graph_tag_is_released(tiny_llama):
    """Released cuda_graph memory is never replayed: decode runs eagerly (same logits) until the tag is
    resumed, then graphs replay again; capturing while it is released is refused."""
    runner, api = _graph_runner(tiny_llama, enable_memory_saver=True, enable_weights_cpu_backup=True)
    gr = runner.graph_runner
    replayed = []
    real = gr.replay
    gr.replay = lambda fb: replayed.append(fb.batch_size) or real(fb)
    ref = make_runner(tiny_llama, disable_cuda_graph=True)
    want = _decode_logits(ref, BATCHES[:1])
    runner.release_memory_occupation(["cuda_graph"])
    for g, w in zip(_decode_logits(runner, BATCHES[:1]), want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert replayed == []
    runner.resume_memory_occupation(["cuda_graph"])
    _decode_logits(runner, BATCHES[:1])
    assert replayed == [3, 3]

    from runner.memory.memory_saver import TorchMemorySaver

    saver = TorchMemorySaver(torch.device("cpu"), saver=SimpleNamespace(), hook_mode="preload")
    saver.regions["cuda_graph"].resident = False
    with pytest.raises(RuntimeError, match="cuda_graph memory tag is released"):
        with saver.graph_capture(object()):
            pass


def test_cpu_compiled_step_keeps_running_while_cuda_graph_is_released(tiny_llama):
    """A graph runner holding no releasable graph memory (the compiled CPU step) keeps replaying while the
    cuda_graph tag is released, so a rollout's numerics never switch paths."""

    class Recorder:  # stands in for CpuGraphRunner: no released_with_cuda_graph_tag
        def __init__(self):
            self.calls = 0

        def can_run(self, fb):
            return True

        def replay(self, fb):
            self.calls += 1
            return eager_forward(fb)

    runner = make_runner(tiny_llama, disable_cuda_graph=True, enable_memory_saver=True, enable_weights_cpu_backup=True)
    rec = Recorder()

    def eager_forward(fb):
        runner.graph_runner = None
        try:
            return runner.forward(fb)
        finally:
            runner.graph_runner = rec

    runner.graph_runner = rec
    runner.release_memory_occupation(["cuda_graph"])
    _decode_logits(runner, BATCHES[:1])
    assert rec.calls == 2


@pytest.mark.parametrize("which", ["portable", "tms_preload", "tms_torch_hooks"])
def test_graph_capture_errors_only_on_the_capturing_threads_calls(which, monkeypatch):
    """Every saver captures with capture_error_mode="thread_local" (torch.cuda.graph, or torch_memory_saver's
    cuda_graph for pauseable graphs): a recapture on the overlap worker after a resume must not fail on the
    scheduler thread's allocations and copies for the next step, which the default "global" mode refuses."""
    import contextlib

    from runner.memory.memory_saver import TorchMemorySaver
    from runner.memory.portable_saver import PortableMemorySaver

    seen = []

    @contextlib.contextmanager
    def record(*args, **kwargs):
        seen.append(kwargs.get("capture_error_mode"))
        yield

    monkeypatch.setattr(torch.cuda, "graph", record)
    if which == "portable":
        saver = PortableMemorySaver(torch.device("cpu"))
    else:
        hook = "preload" if which == "tms_preload" else "torch"
        saver = TorchMemorySaver(torch.device("cpu"), saver=SimpleNamespace(cuda_graph=record), hook_mode=hook)
    with saver.graph_capture(object()):
        pass
    assert seen == ["thread_local"]


def test_releasing_the_cuda_graph_tag_drops_graphs_the_saver_cannot_page(tiny_llama):
    """With a saver that cannot page graph memory (the portable one), releasing cuda_graph drops the decode
    graphs and their pool, so the memory really goes back; after the resume the first decode captures them
    again and its logits equal an eager runner's."""
    runner, api = _graph_runner(tiny_llama, enable_memory_saver=True, enable_weights_cpu_backup=True)
    ref = make_runner(tiny_llama, disable_cuda_graph=True)
    want = _decode_logits(ref, BATCHES[:1])
    _decode_logits(runner, BATCHES[:1])
    gr = runner.graph_runner
    assert gr.graphs and gr.num_captures == 1 and not getattr(runner.memory_saver, "graphs_pauseable", False)
    runner.release_memory_occupation(["cuda_graph"])
    assert not gr.graphs and gr.pool is None
    runner.resume_memory_occupation(["cuda_graph"])
    got = _decode_logits(runner, BATCHES[:1])
    assert gr.num_captures == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
