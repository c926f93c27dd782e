"""runner/attention/decode_mirror.py: decode attention over the running batch's dense copy equals a naive
float64 softmax over each request's own keys in the pool, step after step, across every change that must
rebuild it (a batch change, a prefill, a rolled-back step, a release), and past its memory bound."""

from __future__ import annotations

import types

import pytest
import torch

from runner.attention import decode_mirror
from runner.attention.torch_native import TorchNativeAttnBackend
from runner.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context
from runner.memory.kv_pool import TokenToKVPool

HQ, HKV, D, LAYERS, SLOTS, CTX = 4, 2, 16, 2, 512, 128


class Harness:
    """A torch-native backend over a real pool and request table, stepping decode by hand."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.pool = TokenToKVPool(SLOTS, dtype, LAYERS, HKV, D, "cpu")
        self.req_to_token = torch.zeros(8, CTX, dtype=torch.int64)
        runner = types.SimpleNamespace(device=torch.device("cpu"),
                                       req_to_token_pool=types.SimpleNamespace(req_to_token=self.req_to_token))
        self.backend = TorchNativeAttnBackend(runner)
        self.lens: dict[int, int] = {}
        self.next_slot = 1

    def _new_token(self, row: int) -> int:
        slot = self.next_slot
        self.next_slot += 1
        self.req_to_token[row, self.lens.get(row, 0)] = slot
        self.lens[row] = self.lens.get(row, 0) + 1
        for buf in (self.pool.k_buffer, self.pool.v_buffer):
            buf[:, slot] = torch.randn(LAYERS, HKV, D, generator=self.gen).to(self.dtype)
        return slot

    def admit(self, row: int, n: int) -> None:
        """A new request in `row` with n prompt tokens (its KV written, as a prefill would)."""
        self.lens[row] = 0
        for _ in range(n):
            self._new_token(row)

    def prefill_plan(self, row: int) -> None:
        """Plan an extend step (as the runner does before any prefill)."""
        n = self.lens[row]
        fb = ForwardBatch(ForwardMode.EXTEND, 1, torch.zeros(n, dtype=torch.int64), torch.arange(n),
                          torch.tensor([row]), torch.tensor([n]), torch.zeros(n, dtype=torch.int64), [n],
                          extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[n])
        self.backend.init_forward_metadata(fb)

    def decode(self, rows: list[int], write: bool = True) -> list[torch.Tensor]:
        """One decode step of `rows` (each gets one new token unless write=False: a re-run of the same
        step); checks every layer against the naive oracle and returns the outputs."""
        locs = [self._new_token(r) for r in rows] if write else self._last_locs
        self._last_locs = locs
        seq = [self.lens[r] for r in rows]
        bs = len(rows)
        fb = ForwardBatch(ForwardMode.DECODE, bs, torch.zeros(bs, dtype=torch.int64), torch.tensor(seq) - 1,
                          torch.tensor(rows), torch.tensor(seq), torch.tensor(locs), seq)
        self.backend.init_forward_metadata(fb)
        outs = []
        with forward_context(ForwardContext(self.backend, self.pool, None)):
            for layer_id in range(LAYERS):
                layer = types.SimpleNamespace(layer_id=layer_id, num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                              scaling=D**-0.5)
                q = torch.randn(bs, HQ, D, generator=self.gen).to(self.dtype)
                out = self.backend.forward_decode(q, layer, fb)
                self._check(out, q, rows, layer_id)
                outs.append(out)
        return outs

    def _check(self, out: torch.Tensor, q: torch.Tensor, rows: list[int], layer_id: int) -> None:
        assert out.shape == (len(rows), HQ, D) and out.dtype == self.dtype
        tol = 1e-5 if self.dtype == torch.float32 else 2e-2
        for b, row in enumerate(rows):
            locs = self.req_to_token[row, : self.lens[row]]
            k = self.pool.k_buffer[layer_id, locs].double()
            v = self.pool.v_buffer[layer_id, locs].double()
            for h in range(HQ):
                kv = h // (HQ // HKV)
                p = torch.softmax(k[:, kv] @ q[b, h].double() * D**-0.5, dim=0)
                torch.testing.assert_close(out[b, h].double(), p @ v[:, kv], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consecutive_steps_append_and_stay_exact(dtype):
    """Steps of one batch reuse the mirror (only the new tokens are copied) and equal the oracle."""
    h = Harness(dtype)
    for row, n in ((1, 5), (2, 1), (3, 9)):
        h.admit(row, n)
    h.decode([1, 2, 3])  # builds the mirror
    assert not h.backend.mirror.stale
    for _ in range(4):
        h.decode([1, 2, 3])
        md = h.backend.forward_metadata
        assert md.mirror_ready and not h.backend.mirror.stale  # appended, not rebuilt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_changes_rebuild_the_mirror(dtype, monkeypatch):
    """A finished request, a prefill that reuses its row, a step re-run after a rollback and capacity
    growth all rebuild from the pool: outputs keep equalling the oracle over the pool's current contents."""
    monkeypatch.setattr(decode_mirror, "CAPACITY_ALIGN", 8)  # grow within a few steps
    h = Harness(dtype, seed=1)
    h.admit(1, 4)
    h.admit(2, 6)
    h.decode([1, 2])
    h.decode([1, 2])
    # Request 1 finishes and a new request takes row 1 with a prompt as long as the old one's sequence,
    # so the next [1, 2] step looks exactly like the next step of the mirrored batch: the prefill's
    # plan must have dropped the mirror, or row 1 would attend to the old request's keys.
    h.admit(1, h.lens[1])
    h.prefill_plan(1)
    h.decode([1, 2])
    h.decode([2])  # a different batch
    h.decode([2, 1])
    h.decode([2, 1], write=False)  # the same step again (a rolled-back or failed step re-run)
    for row in (2, 1):  # a step the mirror did not see (a captured step's): two tokens further on
        h._new_token(row)
    h.decode([2, 1])
    capacity = h.backend.mirror.capacity
    while h.backend.mirror.capacity == capacity:  # past the capacity: a bigger buffer, rebuilt
        h.decode([2, 1])
    h.decode([2, 1])


def test_release_frees_the_mirror():
    """drop_decode_mirror frees the buffers; the next step rebuilds and stays exact."""
    h = Harness(torch.float32, seed=2)
    h.admit(1, 3)
    h.decode([1])
    assert h.backend.mirror.k[0] is not None
    h.backend.drop_decode_mirror()
    assert all(t is None for t in h.backend.mirror.k + h.backend.mirror.v)
    h.decode([1])
    assert h.backend.mirror.k[0] is not None


def test_past_the_memory_bound_steps_gather_instead(monkeypatch):
    """A batch whose mirror would exceed MAX_BYTES attends by gathering, with the same results."""
    monkeypatch.setattr(decode_mirror, "MAX_BYTES", 1024)
    h = Harness(torch.float32, seed=3)
    h.admit(1, 3)
    h.admit(2, 7)
    h.decode([1, 2])
    h.decode([1, 2])
    assert h.backend.forward_metadata.mirror_ready is False
    assert h.backend.mirror.k[0] is None


def test_garbage_in_unwritten_columns_never_reaches_an_output():
    """Columns of the mirror a rebuild did not copy are zeroed: NaN left there by an earlier batch (or
    uninitialised memory) cannot reach a masked score while shorter rows decode into longer steps."""
    h = Harness(torch.float32, seed=4)
    h.admit(1, 2)
    h.admit(2, 9)
    h.decode([1, 2])
    for buf in h.backend.mirror.k + h.backend.mirror.v:
        buf.fill_(float("nan"))
    h.decode([2, 1])  # another batch order: rebuilt from the pool
    for _ in range(3):
        h.decode([2, 1])
