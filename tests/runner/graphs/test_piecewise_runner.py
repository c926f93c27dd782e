"""Piecewise prefill graphs' bookkeeping on the CPU: token buckets, padding into the static buffers, what
runs eagerly, the split of the captured forward at every attention call, and a replay (real batch in a
padded bucket, attention eager between the pieces) equal to an eager runner's logits.

No CUDA graph is captured here. `StandInPiecewiseApi` is a stand-in for torch.cuda's capture calls (named
as such). Capture on the CPU simply runs the forward eagerly; the stand-in's replay of piece j re-runs
the model's code between attention calls j-1 and j on the same static buffers (the forward runs in a
worker thread that stops at each attention call, writes that piece's static q and resumes on the static
output), which is what replaying that piece's graph does. The real capture runs in tests/gpu/.
"""

from __future__ import annotations

import threading

import pytest
import torch

from runner.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context
from runner.graphs.piecewise_runner import PiecewiseExtendRunner, StaticExtendInputs, token_buckets
from runner.layers.attention import PagedAttention
from tests.runner.driver import RunnerDriver, make_runner


class _StandInGraph:
    def __init__(self, api, pool):
        self.api, self._pool = api, pool if pool is not None else object()
        self.index = None  # (bucket tokens, piece number), known once capture ends

    def pool(self):
        return self._pool

    def replay(self):
        self.api.replay(self)


class _Pause:
    """The backend the re-run forward sees: at attention call j, hand q to the static buffer and wait."""

    def __init__(self, api, bucket):
        self.api, self.bucket, self.j = api, bucket, 0

    def forward_extend(self, q, layer, fb=None):
        assert self.bucket.layers[self.j] is layer
        n, pw = q.shape[0], self.api.pw
        pw.static_q[:n].copy_(q.reshape(pw.static_q[:n].shape))  # the graph's last op: q into the static buffer
        self.j += 1
        self.api.yield_to_runner()
        return pw.static_out[:n]  # the graph after reads the static output the runner filled


class StandInPiecewiseApi:
    """Stand-in for the torch.cuda piecewise capture calls (see module docstring)."""

    def __init__(self, runner):
        self.runner, self.log, self.pw = runner, [], None
        self._go, self._back = threading.Semaphore(0), threading.Semaphore(0)

    def new_stream(self):
        return None

    def stream(self, stream):
        return torch.no_grad()

    def synchronize(self):
        pass

    def empty_cache(self):
        pass

    def begin(self, pool):
        g = _StandInGraph(self, pool)
        self.log.append(("begin", pool))
        return g

    def end(self, graph):
        self.log.append(("end",))

    # -- replay: the forward runs in a worker thread, one piece per replay() --------------------------
    def yield_to_runner(self):
        self._back.release()
        self._go.acquire()

    def replay(self, graph):
        bucket = next(b for b in self.pw.captured.values() if graph in b.graphs)
        j = bucket.graphs.index(graph)
        self.log.append(("replay", bucket.tokens, j))
        if j == 0:
            threading.Thread(target=self._forward, args=(bucket,), daemon=True).start()
        else:
            self._go.release()
        assert self._back.acquire(timeout=60), "the re-run forward did not reach the next split"

    def _forward(self, bucket):
        n, inp, r = bucket.tokens, self.pw.inputs, self.runner
        fb = ForwardBatch(ForwardMode.EXTEND, 1, inp.input_ids[:n], inp.positions[:n],
                          torch.zeros(1, dtype=torch.int64), torch.tensor([n]), inp.out_cache_loc[:n], [n],
                          extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[n])
        with torch.no_grad(), forward_context(ForwardContext(_Pause(self, bucket), r.token_to_kv_pool,
                                                             r.req_to_token_pool)):
            bucket.hidden.copy_(r.model.model(fb.input_ids, fb.positions, fb))
        self._back.release()


def _piecewise(path, buckets, **kw):
    runner = make_runner(path, disable_cuda_graph=True, **kw)
    api = StandInPiecewiseApi(runner)
    pw = PiecewiseExtendRunner(runner, buckets=buckets, api=api)
    api.pw = pw
    return runner, api, pw


def test_token_buckets():
    """Buckets ascend to max_tokens (always included); padding adds at most 16 tokens up to 256 and at most a
    quarter of the batch above."""
    b = token_buckets(8192)
    assert b[0] == 16 and b[-1] == 8192 and b == sorted(set(b))
    for n in range(1, 8193):
        padded = next(s for s in b if s >= n)
        assert padded - n < 16 if n <= 256 else (padded - n) / n < 0.25
    assert token_buckets(100)[-1] == 100 and token_buckets(5) == [5]
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens=0"):
        token_buckets(0)


def test_fill_pads_with_the_padding_slot():
    """A batch of n tokens fills rows [:n]; rows [n:padded] become id 0, position 0, KV slot 0."""
    inp = StaticExtendInputs(16, torch.device("cpu"))
    for buf in vars(inp).values():
        if isinstance(buf, torch.Tensor):
            buf.fill_(7)
    fb = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([3, 4, 5]), torch.tensor([0, 1, 2]), torch.tensor([2]),
                      torch.tensor([3]), torch.tensor([9, 10, 11]), [3])
    assert inp.fill(fb, 8) == 3
    assert inp.input_ids[:8].tolist() == [3, 4, 5, 0, 0, 0, 0, 0] and inp.out_cache_loc[3:8].tolist() == [0] * 5
    assert inp.input_ids[8:].tolist() == [7] * 8  # beyond the bucket: untouched
    with pytest.raises(ValueError, match="3 tokens cannot be padded to 2"):
        inp.fill(fb, 2)


def test_capture_splits_at_every_attention_call(tiny_llama):
    """Each bucket is captured as layers + 1 graphs, largest bucket first, split at each layer's attention
    in order, all in one pool; the capture forward's hidden states equal an eager forward's."""
    runner, api, pw = _piecewise(tiny_llama, [8, 24])
    pw.capture()
    layers = [m for m in runner.model.modules() if isinstance(m, PagedAttention)]
    begins = [e for e in api.log if e[0] == "begin"]
    assert len(begins) == 2 * (len(layers) + 1) and begins[0][1] is None
    assert all(p is pw.pool for _, p in begins[1:]) and [e[0] for e in api.log[:2]] == ["begin", "end"]
    assert list(pw.captured) == [24, 8]
    for n, bucket in pw.captured.items():
        assert len(bucket.graphs) == len(layers) + 1 and bucket.layers == layers
        fb = pw._dummy_batch(n)
        runner.attn_backend.init_forward_metadata(fb)
        with torch.no_grad(), forward_context(ForwardContext(runner.attn_backend, runner.token_to_kv_pool,
                                                             runner.req_to_token_pool)):
            want = runner.model.model(fb.input_ids, fb.positions, fb)
        torch.testing.assert_close(bucket.hidden, want)


def test_replay_in_a_padded_bucket_equals_eager(tiny_llama):
    """Prefill of 3 requests (13 tokens -> bucket 16) and an extend over a cached prefix (2 tokens -> 8)
    replay piece by piece with attention eager in between, giving an eager runner's logits; every piece
    of the bucket replays once, in order."""
    runner, api, pw = _piecewise(tiny_llama, [8, 16, 32])
    runner.piecewise_runner = pw  # as init_device_graphs sets it on CUDA
    ref = make_runner(tiny_llama, disable_cuda_graph=True)
    outs = {}
    for name, r in (("pw", runner), ("ref", ref)):
        drv = RunnerDriver(r, seed=3)
        a, b, c = drv.new_request(), drv.new_request(), drv.new_request()
        outs[name] = [drv.extend([a, b, c], [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]).next_token_logits,
                      drv.extend([a], [[20, 21]]).next_token_logits]
    for got, want in zip(outs["pw"], outs["ref"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    layers = runner.model_config.num_hidden_layers
    replays = [e[1:] for e in api.log if e[0] == "replay"]
    assert replays == [(16, j) for j in range(layers + 1)] + [(8, j) for j in range(layers + 1)]
    assert pw.num_replays == 2 and pw.num_captures == 1


def test_what_runs_eagerly(tiny_llama):
    """Decode batches, more tokens than the largest bucket, input_embeds, and everything while the
    cuda_graph tag is released run eagerly; the release drops the graphs and the next prefill captures."""
    runner, api, pw = _piecewise(tiny_llama, [8, 16], enable_memory_saver=True, enable_weights_cpu_backup=True)
    runner.piecewise_runner = pw
    calls = []
    real = pw.replay
    pw.replay = lambda fb: calls.append(int(fb.input_ids.shape[0])) or real(fb)
    drv = RunnerDriver(runner)
    rows = [drv.new_request() for _ in range(2)]
    drv.extend(rows, [[5] * 10, [6] * 9])  # 19 tokens > 16
    drv.decode(rows, [7, 8])
    drv.extend(rows, [[1, 2], [3]])
    assert calls == [3]
    emb = torch.zeros(2, runner.model_config.hidden_size)
    assert not pw.can_run(ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([1, 2]), torch.tensor([0, 1]),
                                       torch.tensor([0]), torch.tensor([2]), torch.tensor([1, 2]), [2],
                                       input_embeds=emb))
    runner.release_memory_occupation(["cuda_graph"])
    assert pw.captured == {}
    drv.extend(rows, [[4], [5]])
    assert calls == [3]
    runner.resume_memory_occupation(["cuda_graph"])
    drv.extend(rows, [[6], [7]])
    assert calls == [3, 2] and pw.num_captures == 2


def test_piecewise_needs_cuda():
    """enable_piecewise_cuda_graph on the CPU is refused by name."""
    from runner.config import RunnerConfig

    with pytest.raises(ValueError, match="enable_piecewise_cuda_graph needs a CUDA device"):
        RunnerConfig(model_path="x", device="cpu", enable_piecewise_cuda_graph=True)


def test_shutdown_frees_the_piecewise_buffers(tiny_llama):
    """shutdown() frees the piecewise runner's static buffers in place and drops its graphs."""
    runner, api, pw = _piecewise(tiny_llama, [8])
    runner.piecewise_runner = pw
    pw.capture()
    bufs = [pw.static_q, pw.static_out, pw.inputs.input_ids]
    assert all(b.untyped_storage().nbytes() > 0 for b in bufs)
    runner.shutdown()
    assert all(b.untyped_storage().nbytes() == 0 for b in bufs) and pw.captured == {}
    assert runner.piecewise_runner is None


def test_a_resume_that_moves_memory_recaptures_the_pieces(tiny_llama):
    """Released and resumed weights and KV cache with the portable saver (new addresses; the cuda_graph tag kept):
    the next prefill captures every bucket again before replaying, and its logits equal an eager runner's (the
    pieces had kept replaying with the old addresses)."""
    runner, api, pw = _piecewise(tiny_llama, [8, 16], enable_memory_saver=True, enable_weights_cpu_backup=True)
    runner.piecewise_runner = pw
    ref = make_runner(tiny_llama, disable_cuda_graph=True)
    drivers = {"pw": RunnerDriver(runner, seed=4), "ref": RunnerDriver(ref, seed=4)}
    first = {k: d.extend([d.new_request()], [[5, 6, 7]]).next_token_logits for k, d in drivers.items()}
    torch.testing.assert_close(first["pw"], first["ref"], atol=1e-4, rtol=1e-4)
    assert pw.num_captures == 1
    weight = next(runner.model.parameters())
    before = (weight.data_ptr(), runner.token_to_kv_pool.k_buffer.data_ptr())
    runner.release_memory_occupation(["weights", "kv_cache"])
    runner.resume_memory_occupation(["weights", "kv_cache"])
    assert (weight.data_ptr(), runner.token_to_kv_pool.k_buffer.data_ptr()) != before
    again = {k: d.extend([d.new_request()], [[9, 10]]).next_token_logits for k, d in drivers.items()}
    assert pw.num_captures == 2 and pw.num_replays == 2
    torch.testing.assert_close(again["pw"], again["ref"], atol=1e-4, rtol=1e-4)
