"""flashinfer's planning inputs, checked on the CPU: the pure metadata functions against the torch-native
backend's gather on the same batch, the attention those indices describe against torch-native's output,
and the FlashInferAttnBackend's call order through a real ModelRunner.

No flashinfer kernel runs here. `StandInFlashInfer` is a stand-in for the CUDA library, used only for
the backend's call-order and buffer logic (which wrapper is planned when, with what, in graph mode or
not): it checks each call against flashinfer 0.6's documented rules (int32 indices, indptr of B+1,
fixed batch size and buffer capacity in graph mode, q dtype as planned) and computes attention with
`paged_reference_attention`, a naive loop over the paged layout.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runner.attention import choose_attention_backend
from runner.attention import flashinfer_metadata as md
from runner.attention.flashinfer import FlashInferAttnBackend, decode_uses_tensor_cores
from runner.attention.torch_native import TorchNativeAttnBackend
from runner.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context
from runner.memory.kv_pool import ReqToTokenPool, TokenToKVPool
from tests.runner.driver import RunnerDriver, make_runner

HQ, HKV, D = 4, 2, 8


def paged_reference_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale):
    """Causal attention of each request's queries over its paged KV (page size 1), query block aligned to
    the end of the KV range. q: [num_q, hq, d]; k_buf, v_buf: [slots, hkv, d] -> [num_q, hq, d]."""
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_buf.shape[1]
    for i in range(len(kv_indptr) - 1):
        q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
        slots = kv_indices[int(kv_indptr[i]) : int(kv_indptr[i + 1])].long()
        k = k_buf[slots].repeat_interleave(hq // hkv, dim=1).float()  # [L, hq, d]
        v = v_buf[slots].repeat_interleave(hq // hkv, dim=1).float()
        n, L = q1 - q0, len(slots)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * sm_scale  # [hq, n, L]
        allowed = torch.arange(L).view(1, L) <= (L - n + torch.arange(n)).view(n, 1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


class _StandInWrapper:
    """Stand-in for a flashinfer paged wrapper (see module docstring): validates, records, computes."""

    def __init__(self, lib, kind, workspace, layout, use_cuda_graph=False, use_tensor_cores=False,
                 backend="auto", **buffers):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.lib, self.kind, self.use_cuda_graph, self.use_tensor_cores = lib, kind, use_cuda_graph, use_tensor_cores
        self.backend = backend
        if use_cuda_graph:  # decode's keyword names (the only graph-mode wrapper the backend builds)
            self.indptr_buf = buffers["paged_kv_indptr_buffer"]
            self.indices_buf = buffers["paged_kv_indices_buffer"]
            self.lpl_buf = buffers["paged_kv_last_page_len_buffer"]
            if len(self.indptr_buf) != len(self.lpl_buf) + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self.plan_args = None
        lib.log.append(("init", kind, use_cuda_graph, use_tensor_cores))

    def plan(self, *args, **kw):
        if self.kind == "decode":
            indptr, indices, lpl, hq, hkv, d, page = args
            qo = torch.arange(len(indptr), dtype=torch.int32)
        else:
            qo, indptr, indices, lpl, hq, hkv, d, page = args
            assert kw["causal"] is True
        for name, t in (("qo_indptr", qo), ("indptr", indptr), ("indices", indices), ("last_page_len", lpl)):
            assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
        assert indptr.device.type == "cpu" and lpl.device.type == "cpu", "plan reads indptrs on the host"
        assert page == 1 and bool((lpl == 1).all()) and len(indptr) == len(lpl) + 1 == len(qo)
        assert int(indptr[-1]) == len(indices) and (hq, hkv, d) == (self.lib.hq, self.lib.hkv, self.lib.d)
        assert kw["q_data_type"] == kw["kv_data_type"] and "sm_scale" in kw
        if self.use_cuda_graph:
            if len(lpl) != len(self.lpl_buf):
                raise ValueError(f"batch size {len(lpl)} != the graph wrapper's fixed {len(self.lpl_buf)}")
            if len(indices) > len(self.indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            # Graph mode: plan copies into the static buffers, run reads only those.
            self.indptr_buf.copy_(indptr)
            self.indices_buf[: len(indices)].copy_(indices)
            self.lpl_buf.copy_(lpl)
            indptr, indices = self.indptr_buf, self.indices_buf[: len(indices)]
        self.plan_args = (qo.clone(), indptr, indices, kw["q_data_type"], kw["sm_scale"])
        self.lib.log.append(("plan", self.kind, self.use_cuda_graph, len(lpl)))

    def run(self, q, paged_kv):
        qo, indptr, indices, q_dtype, scale = self.plan_args
        assert q.dtype == q_dtype, f"q is {q.dtype}, planned for {q_dtype}"
        k, v = paged_kv
        assert k.dim() == 4 and k.shape[1] == 1, "page-size-1 layout [slots, 1, hkv, d]"
        assert q.shape[0] == int(qo[-1])
        self.lib.log.append(("run", self.kind, self.use_cuda_graph))
        return paged_reference_attention(q, k[:, 0], v[:, 0], qo, indptr, indices, scale)


class StandInFlashInfer:
    """Stand-in for the `flashinfer` module (named as such): two wrapper classes and a call log."""

    def __init__(self, hq: int, hkv: int, d: int) -> None:
        self.hq, self.hkv, self.d, self.log = hq, hkv, d, []
        self.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: _StandInWrapper(self, "decode", *a, **k)
        self.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **k: _StandInWrapper(self, "prefill", *a, **k)


# ---- pure metadata ------------------------------------------------------------------------------
def _table(seed=0, rows=6, ctx=40, slots=300):
    """A ReqToTokenPool whose rows hold distinct random slots (as the allocator hands them out)."""
    gen = torch.Generator().manual_seed(seed)
    pool = ReqToTokenPool(rows, ctx, "cpu")
    pool.req_to_token.copy_(torch.randperm(slots, generator=gen)[: rows * ctx].view(rows, ctx) + 1)
    return pool


def _fb(mode, rows, seq_lens, prefix=None):
    bs = len(rows)
    q_lens = [1] * bs if mode == ForwardMode.DECODE else [s - p for s, p in zip(seq_lens, prefix)]
    n = sum(q_lens)
    return ForwardBatch(
        forward_mode=mode, batch_size=bs, input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.zeros(n, dtype=torch.int64), req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens), out_cache_loc=torch.zeros(n, dtype=torch.int64), seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=None if mode == ForwardMode.DECODE else q_lens,
    )


def test_kv_indices_equal_torch_native_gather():
    """Per request, kv_indices[indptr[i]:indptr[i+1]] is exactly torch-native's gathered row cut at seq_len."""
    pool = _table()
    rows, seq_lens = [4, 0, 5, 2], [7, 1, 33, 12]
    native = TorchNativeAttnBackend(SimpleNamespace(device=torch.device("cpu"), req_to_token_pool=pool),
                                    decode_kernel=False)  # its gather plan is the reference
    native.init_forward_metadata(_fb(ForwardMode.DECODE, rows, seq_lens))
    indptr, lpl, total = md.decode_metadata(seq_lens)
    got = md.kv_indices(pool.req_to_token, torch.tensor(rows), torch.tensor(seq_lens), total)
    assert got.dtype == torch.int32 and indptr.dtype == lpl.dtype == torch.int32
    assert indptr.tolist() == [0, 7, 8, 41, 53] and lpl.tolist() == [1, 1, 1, 1] and total == 53
    for i, n in enumerate(seq_lens):
        assert got[indptr[i] : indptr[i + 1]].tolist() == native.forward_metadata.kv_indices[i, :n].tolist()
    # The graph path writes into a static buffer: same values, tail untouched.
    buf = torch.full((64,), -1, dtype=torch.int32)
    md.kv_indices(pool.req_to_token, torch.tensor(rows), torch.tensor(seq_lens), total, out=buf)
    assert buf[:total].tolist() == got.tolist() and bool((buf[total:] == -1).all())
    # A padding row over a table entry nobody wrote (garbage after a resume) still names a real slot.
    pool.req_to_token[0, 0] = 10**9
    clamped = md.kv_indices(pool.req_to_token, torch.tensor([0]), torch.tensor([1]), 1, max_slot=300)
    assert clamped.tolist() == [300]


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_metadata_attention_equals_torch_native(mode):
    """Paged attention over (qo_indptr, kv_indptr, kv_indices) equals torch-native's attention on the same
    batch and KV pool: decode, and extend over cached prefixes (new-token counts 1..9, one with no prefix)."""
    gen = torch.Generator().manual_seed(1)
    pool = _table(seed=1)
    kv = TokenToKVPool(300, torch.float32, 1, HKV, D, "cpu")
    kv.k_buffer.copy_(torch.randn(kv.k_buffer.shape, generator=gen))
    kv.v_buffer.copy_(torch.randn(kv.v_buffer.shape, generator=gen))
    rows, seq_lens = [3, 1, 5], [9, 14, 4]
    if mode == "decode":
        fb = _fb(ForwardMode.DECODE, rows, seq_lens)
        qo, kv_ptr, _, total = md.indptr([1, 1, 1]), *md.decode_metadata(seq_lens)
    else:
        fb = _fb(ForwardMode.EXTEND, rows, seq_lens, prefix=[8, 5, 0])
        qo, kv_ptr, _, total = md.extend_metadata(fb.extend_seq_lens_cpu, seq_lens)
    q = torch.randn(fb.num_tokens, HQ, D, generator=gen)
    layer = SimpleNamespace(layer_id=0, num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D**-0.5)
    native = TorchNativeAttnBackend(SimpleNamespace(device=torch.device("cpu"), req_to_token_pool=pool),
                                    decode_kernel=False)  # its gather plan is the reference
    with forward_context(ForwardContext(native, kv, pool)):
        native.init_forward_metadata(fb)
        want = native.forward_extend(q, layer, fb)
    indices = md.kv_indices(pool.req_to_token, fb.req_pool_indices, fb.seq_lens, total)
    got = paged_reference_attention(q, kv.k_buffer[0], kv.v_buffer[0], qo, kv_ptr, indices, D**-0.5)
    torch.testing.assert_close(got, want.view_as(got), atol=1e-5, rtol=1e-5)


def test_metadata_refuses_bad_lengths():
    """Inconsistent lengths and undersized buffers are clear errors naming the limit."""
    with pytest.raises(ValueError, match="request 1: 5 new tokens but only 4"):
        md.extend_metadata([1, 5], [3, 4])
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        md.decode_metadata([3, -1])
    with pytest.raises(ValueError, match="cannot pad a batch of 3 down to 2"):
        md.pad_decode_batch([1, 2, 3], 2)
    with pytest.raises(ValueError, match="buffer holds 4 slots, the batch needs 5"):
        md.kv_indices(_table().req_to_token, torch.tensor([0]), torch.tensor([5]), 5,
                      out=torch.zeros(4, dtype=torch.int32))
    assert md.pad_decode_batch([7, 3], 4) == [7, 3, 1, 1]


def test_tensor_cores_for_group_sizes_outside_the_plain_kernel():
    """GQA groups 1/2/4/8 use the plain decode kernel; 7 (Qwen2.5) and 3 need the tensor-core path."""
    assert [decode_uses_tensor_cores(h, 1) for h in (1, 2, 4, 8)] == [False] * 4
    assert decode_uses_tensor_cores(14, 2) and decode_uses_tensor_cores(28, 4) and decode_uses_tensor_cores(3, 1)


def test_backend_choice_is_explicit_or_torch_native_on_cpu():
    """Default on the CPU is torch_native; asking for flashinfer without CUDA is a clear error."""
    assert choose_attention_backend(None, "cpu") == "torch_native"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_attention_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="unknown attention_backend 'triton'"):
        choose_attention_backend("triton", "cpu")


# ---- the backend's call order through a real runner (stand-in library) ------------------------------
def _standin_runner(path):
    runner = make_runner(path, disable_cuda_graph=True)
    mc = runner.model_config
    lib = StandInFlashInfer(mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim)
    runner.attn_backend = FlashInferAttnBackend(runner, flashinfer_module=lib)
    return runner, lib


def test_backend_logits_equal_torch_native_through_the_runner(tiny_qwen2):
    """Prefill, extend over a cached prefix and decode through FlashInferAttnBackend (stand-in kernels) give
    torch-native's logits; each step plans exactly one wrapper once and runs it once per layer."""
    runner, lib = _standin_runner(tiny_qwen2)
    ref = make_runner(tiny_qwen2, disable_cuda_graph=True)
    layers = runner.model_config.num_hidden_layers
    outs = {}
    for name, r in (("fi", runner), ("ref", ref)):
        drv = RunnerDriver(r, seed=3)
        a, b = drv.new_request(), drv.new_request()
        steps = [drv.extend([a, b], [[5, 6, 7], [8, 9, 10, 11, 12]]),
                 drv.extend([a], [[13, 14]]),  # extend after a cached prefix
                 drv.decode([a, b], [15, 16]), drv.decode([a, b], [17, 18])]
        outs[name] = [s.next_token_logits for s in steps]
    for got, want in zip(outs["fi"], outs["ref"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    plans = [e for e in lib.log if e[0] == "plan"]
    runs = [e for e in lib.log if e[0] == "run"]
    assert [p[1] for p in plans] == ["prefill", "prefill", "decode", "decode"]
    assert len(runs) == 4 * layers and not any(e[2] for e in lib.log if e[0] != "init")
    inits = [e for e in lib.log if e[0] == "init"]
    assert inits == [("init", "decode", False, False), ("init", "prefill", False, False)]


def test_graph_hooks_plan_padded_static_buffers(tiny_qwen2):
    """Capture builds one graph-mode decode wrapper per batch size over shared static buffers; replay of 3
    requests in the size-4 graph plans the padded lengths (pad row: one slot) and gives eager's logits."""
    runner, lib = _standin_runner(tiny_qwen2)
    be = runner.attn_backend
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    assert be.cuda_graph_kv_indices.numel() == 8 * runner.context_len
    static_rows, static_lens = torch.zeros(8, dtype=torch.int64), torch.ones(8, dtype=torch.int64)
    for bs in (4, 2):
        be.init_forward_metadata_capture_cuda_graph(bs, static_rows[:bs], static_lens[:bs])
    assert sorted(be.graph_wrappers) == [2, 4]
    assert all(w.indices_buf is be.cuda_graph_kv_indices for w in be.graph_wrappers.values())
    with pytest.raises(ValueError, match="exceeds cuda_graph_max_bs=8"):
        be.init_forward_metadata_capture_cuda_graph(16, static_rows, static_lens)

    drv = RunnerDriver(runner, seed=5)
    rows = [drv.new_request() for _ in range(3)]
    drv.extend(rows, [[5, 6], [7, 8, 9, 10], [11]])
    eager = drv.decode(rows, [12, 13, 14]).next_token_logits
    # Replay the same decode step (the KV slots of the new tokens are already written) in the size-4 graph.
    seq_lens = [drv.cached[r] for r in rows]
    static_rows[:3] = torch.tensor(rows)
    static_rows[3] = 0
    static_lens[:4] = torch.tensor([*seq_lens, 1])
    be.init_forward_metadata_replay_cuda_graph(4, static_rows, static_lens, seq_lens)
    w = be.graph_wrappers[4]
    assert w.indptr_buf.tolist() == md.indptr([*seq_lens, 1]).tolist()
    locs = runner.req_to_token_pool.req_to_token[torch.tensor(rows + [0])[:, None], torch.arange(16)]
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=4, input_ids=torch.tensor([12, 13, 14, 0]),
        positions=torch.tensor([s - 1 for s in seq_lens] + [0]), req_pool_indices=static_rows[:4],
        seq_lens=static_lens[:4], out_cache_loc=torch.cat([locs[torch.arange(3), torch.tensor(seq_lens) - 1],
                                                           torch.zeros(1, dtype=torch.int64)]),
        seq_lens_cpu=[*seq_lens, 1],
    )
    with torch.no_grad(), forward_context(ForwardContext(be, runner.token_to_kv_pool, runner.req_to_token_pool)):
        padded = runner.model(fb.input_ids, fb.positions, fb).next_token_logits
    torch.testing.assert_close(padded[:3], eager, atol=1e-4, rtol=1e-4)
    with pytest.raises(KeyError, match="no CUDA-graph decode wrapper for batch size 8"):
        be.init_forward_metadata_replay_cuda_graph(8, static_rows, static_lens, seq_lens)


# ---- backend choice: import, dtype; heads under tensor parallelism ------------------------------------
@pytest.fixture
def broken_flashinfer(tmp_path, monkeypatch):
    """A `flashinfer` package that find_spec finds but whose import fails (a broken CUDA install)."""
    import runner.attention as attention

    pkg = tmp_path / "flashinfer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(attention, "_import_error", {})
    yield
    import sys

    sys.modules.pop("flashinfer", None)


def test_flashinfer_chosen_only_when_it_imports(broken_flashinfer, caplog):
    """find_spec finds the package but `import flashinfer` fails: the default is torch_native with one log
    line giving the reason; asking for flashinfer by name is a clear error carrying it."""
    import importlib.util
    import logging

    assert importlib.util.find_spec("flashinfer") is not None
    with caplog.at_level(logging.INFO, logger="runner.attention"):
        assert choose_attention_backend(None, "cuda", torch.bfloat16) == "torch_native"
    why = [r.getMessage() for r in caplog.records if "import flashinfer" in r.getMessage()]
    assert len(why) == 1 and "libcudart.so.13" in why[0]
    with pytest.raises(ValueError, match="`import flashinfer` failed .*libcudart"):
        choose_attention_backend("flashinfer", "cuda", torch.bfloat16)


def test_float32_on_cuda_never_gets_flashinfer(monkeypatch):
    """flashinfer has no fp32 kernels: float32 on CUDA defaults to torch_native even when flashinfer imports,
    and an explicit flashinfer + float32 is refused at construction, naming the dtype."""
    import runner.attention as attention

    monkeypatch.setattr(attention, "_import_error", {"flashinfer": None})  # as if it imported
    assert choose_attention_backend(None, "cuda", torch.bfloat16) == "flashinfer"
    assert choose_attention_backend(None, "cuda", torch.float32) == "torch_native"
    with pytest.raises(ValueError, match="no kernels for dtype torch.float32"):
        choose_attention_backend("flashinfer", "cuda", torch.float32)


@pytest.mark.parametrize("hq,hkv,tp", [(4, 2, 2), (8, 2, 4), (4, 1, 2)])
def test_flashinfer_under_tp_plans_the_rank_heads(hq, hkv, tp):
    """A tensor-parallel rank plans and reshapes with its own heads (q split, KV split or replicated), and
    its decode attention equals the naive reference on that rank's KV pool."""
    from runner.attention.flashinfer import rank_head_counts

    lq, lkv = rank_head_counts(hq, hkv, tp)
    assert (lq, lkv) == (hq // tp, max(1, hkv // tp))
    req = _table(rows=2, ctx=12, slots=30)
    kv = TokenToKVPool(40, torch.float32, 1, lkv, D, "cpu")
    kv.k_buffer.normal_()
    kv.v_buffer.normal_()
    mc = SimpleNamespace(num_attention_heads=hq, num_key_value_heads=hkv, head_dim=D)
    rank = SimpleNamespace(model_config=mc, device=torch.device("cpu"), context_len=12, req_to_token_pool=req,
                           token_to_kv_pool=kv, dtype=torch.float32, kv_cache_dtype=torch.float32,
                           tp=SimpleNamespace(size=tp, rank=0))
    lib = StandInFlashInfer(lq, lkv, D)  # asserts plan() gets exactly these head counts
    be = FlashInferAttnBackend(rank, flashinfer_module=lib)
    fb = _fb(ForwardMode.DECODE, [0, 1], [5, 9])
    be.init_forward_metadata(fb)
    q = torch.randn(2, lq * D)  # what a rank's q projection gives: [bs, local heads * d]
    with forward_context(ForwardContext(be, kv, req)):
        out = be.forward_decode(q, SimpleNamespace(layer_id=0), fb)
    indptr, _, total = md.decode_metadata([5, 9])
    indices = md.kv_indices(req.req_to_token, fb.req_pool_indices, fb.seq_lens, total, max_slot=40)
    want = paged_reference_attention(q.view(2, lq, D), kv.k_buffer[0], kv.v_buffer[0], torch.arange(3), indptr,
                                     indices, D**-0.5)
    torch.testing.assert_close(out, want)
    wrong = SimpleNamespace(**{**vars(rank), "tp": None})  # the model's full counts vs the rank's pool
    if (hq, hkv) != (lq, lkv) and hkv != lkv:
        with pytest.raises(ValueError, match=f"KV pool holds {lkv} KV heads"):
            FlashInferAttnBackend(wrong, flashinfer_module=lib)
