"""Memory saver backends on the CPU: the chunked persistent host backup, the portable backend's address
epoch, the backend choice, and the torch_memory_saver backend's call order.

torch_memory_saver cannot run without CUDA. `StandInTMS` is a stand-in for it (named as such), used only
for the backend's call-order logic: region entry per namespaced tag, one pause/resume per state change
(the library kills the process on a double pause), and lost contents on pause (it scribbles NaN into
paused memory, as a resume hands back fresh pages), so only our own backup can bring weights back.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from runner.memory.memory_saver import (
    HostBackup,
    PortableMemorySaver,
    TorchMemorySaver,
    choose_memory_saver_backend,
    create_memory_saver,
)


def test_host_backup_round_trip_in_chunks_into_one_persistent_buffer():
    """save/restore copy every byte through one host buffer in ceil(n / chunk) copies per storage, and a
    second save reuses the same buffer."""
    gen = torch.Generator().manual_seed(0)
    storages = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (2500, 1000, 1)]
    want = [s.clone() for s in storages]
    backup = HostBackup(torch.device("cpu"), chunk_bytes=1000)
    backup.save(storages)
    assert backup.num_copies == 3 + 1 + 1 and backup.buffer.numel() == 3501
    ptr = backup.buffer.data_ptr()
    for s in storages:
        s.fill_(0)
    backup.restore(storages)
    assert all(torch.equal(s, w) for s, w in zip(storages, want))
    backup.save(storages)
    assert backup.buffer.data_ptr() == ptr
    with pytest.raises(RuntimeError, match="no host backup of 7 bytes"):
        HostBackup(torch.device("cpu")).restore([torch.zeros(7, dtype=torch.uint8)])


def test_portable_resume_bumps_the_address_epoch():
    """A portable resume reallocates storages (graphs must be recaptured): the epoch moves; a resume of an
    empty region or of a resident one does not."""
    saver = PortableMemorySaver(torch.device("cpu"))
    saver.track("kv_cache", [torch.zeros(1000)])
    saver.pause("kv_cache")
    assert saver.bytes_held("kv_cache") == 0
    saver.resume("kv_cache")
    saver.resume("kv_cache")
    saver.pause("cuda_graph")
    saver.resume("cuda_graph")
    assert saver.address_epoch == 1 and saver.bytes_held("kv_cache") == 4000
    assert not saver.preserves_addresses


def test_backend_choice():
    """CPU gets the portable backend; torch_memory_saver on the CPU or an unknown name is a clear error."""
    assert choose_memory_saver_backend(torch.device("cpu")) == "portable"
    assert isinstance(create_memory_saver(True, torch.device("cpu")), PortableMemorySaver)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_memory_saver_backend(torch.device("cpu"), "torch_memory_saver")
    with pytest.raises(ValueError, match="unknown memory saver backend 'vmm'"):
        choose_memory_saver_backend(torch.device("cpu"), "vmm")


class StandInTMS:
    """Stand-in for the torch_memory_saver singleton (see module docstring)."""

    def __init__(self):
        self.log, self.active, self.paused, self.owned = [], None, set(), {}

    @contextmanager
    def region(self, tag):
        self.log.append(("region", tag))
        self.active = tag
        yield
        self.active = None

    def note(self, tag, tensors):  # what the real library learns through its allocator hook
        self.owned.setdefault(tag, []).extend(tensors)

    def pause(self, tag):
        assert tag not in self.paused, f"double pause of {tag} (the library would exit(1))"
        self.paused.add(tag)
        self.log.append(("pause", tag))
        for t in self.owned.get(tag, []):
            t.fill_(float("nan"))

    def resume(self, tag):
        assert tag in self.paused, f"resume of {tag} that is not paused (the library would exit(1))"
        self.paused.discard(tag)
        self.log.append(("resume", tag))


def _tms_saver(tms):
    saver = TorchMemorySaver(torch.device("cpu"), saver=tms, hook_mode="torch")
    real_own = saver._own

    def own(tag, tensors):  # let the stand-in see the consolidated buffers, as the hook would
        flats = real_own(tag, tensors)
        tms.note(saver._tag(tag), flats)
        return flats

    saver._own = own
    return saver


def test_tms_backend_call_order_and_our_backup():
    """Weights are consolidated inside their namespaced region and restored from our backup after the
    library lost them; each state change reaches the library once; paused tags hold 0 bytes; close()
    maps paused memory back; two savers never share a tag."""
    tms = StandInTMS()
    saver = _tms_saver(tms)
    weights = [torch.nn.Parameter(torch.randn(10, 3)), torch.nn.Parameter(torch.randn(7))]
    want = [w.detach().clone() for w in weights]
    with saver.region("weights", enable_cpu_backup=True):
        assert tms.active is None  # model construction stays outside the library
        saver.track("weights", weights)
    with saver.region("kv_cache"):
        assert tms.active == saver._tag("kv_cache")
        kv = torch.ones(16)
        tms.note(saver._tag("kv_cache"), [kv])
        saver.track("kv_cache", [kv])
    w_tag, kv_tag = saver._tag("weights"), saver._tag("kv_cache")
    assert tms.log == [("region", w_tag), ("region", kv_tag)] and w_tag.startswith("weights#")

    for tag in ("weights", "kv_cache", "cuda_graph"):
        saver.pause(tag)
        saver.pause(tag)  # idempotent here, fatal in the library
    assert saver.bytes_held("weights") == saver.bytes_held("kv_cache") == 0
    assert all(torch.isnan(w).all() for w in weights)  # the library lost them
    saver.resume("weights")
    assert all(torch.equal(w.detach(), x) for w, x in zip(weights, want))
    assert saver.bytes_held("weights") == (30 + 7) * 4
    assert [e for e in tms.log if e[0] != "region"] == [("pause", w_tag), ("pause", kv_tag), ("resume", w_tag)]
    saver.close()
    assert tms.log[-1] == ("resume", kv_tag) and not tms.paused and saver.is_resident("kv_cache")
    assert _tms_saver(tms)._tag("weights") != w_tag


# ---- shutdown frees the library's memory pools -------------------------------------------------------
class StandInPoolingTMS(StandInTMS):
    """StandInTMS plus torch_memory_saver 0.0.10's pool table (`_impl._mem_pools`, one pool per (tag,
    cpu backup, disk backup, backup backend, device)). A stand-in pool keeps the bytes allocated in it
    until the pool object is dropped, as a torch MemPool caches its freed blocks."""

    def __init__(self):
        super().__init__()
        self._impl = SimpleNamespace(_mem_pools={})

    @contextmanager
    def region(self, tag):
        self._impl._mem_pools.setdefault((tag, False, False, "", 0), {"bytes": 0})
        with super().region(tag):
            yield

    def note(self, tag, tensors):
        super().note(tag, tensors)
        self._impl._mem_pools[(tag, False, False, "", 0)]["bytes"] += sum(t.untyped_storage().nbytes()
                                                                          for t in tensors)

    def held(self) -> int:
        return sum(p["bytes"] for p in self._impl._mem_pools.values())


def test_engines_built_and_shut_down_hold_no_more_pool_memory_than_one(tiny_qwen2, monkeypatch):
    """N runners with the torch_memory_saver backend, each built, released/resumed and shut down in turn,
    leave the library holding no pool memory; while one lives it holds exactly its own KV + weights."""
    import runner.model_runner as mr
    from tests.runner.driver import make_runner

    tms = StandInPoolingTMS()
    monkeypatch.setattr(mr, "create_memory_saver", lambda enable, device: _tms_saver(tms))
    alive = []
    for _ in range(3):
        runner = make_runner(tiny_qwen2, enable_memory_saver=True, enable_weights_cpu_backup=True)
        saver = runner.memory_saver
        one = saver.bytes_held("weights") + saver.bytes_held("kv_cache")
        assert one > 0 and tms.held() == one  # this runner's pools only: the earlier ones are gone
        runner.release_memory_occupation()
        runner.resume_memory_occupation()
        runner.shutdown()
        alive.append(tms.held())
    assert alive == [0, 0, 0] and tms._impl._mem_pools == {}


def test_pause_that_returns_nothing_is_reported(caplog):
    """A pause whose mem_get_info shows (nearly) nothing returned logs once that the release is a no-op."""
    import logging

    import runner.memory.tms_saver as ms

    saver = TorchMemorySaver(torch.device("cpu"), saver=StandInTMS(), hook_mode="torch")
    free = iter([10 << 30, (10 << 30) + (1 << 20), 10 << 30, 10 << 30])  # 1 MiB back of 128 MiB
    saver._free_device_bytes = lambda: next(free)
    with saver.region("kv_cache"):
        saver.track("kv_cache", [torch.empty(128 << 20, dtype=torch.uint8)])
    with caplog.at_level(logging.WARNING, logger=ms.__name__):
        saver.pause("kv_cache")
        saver.resume("kv_cache")
        saver.pause("kv_cache")
    warnings = [r.getMessage() for r in caplog.records if "no-op" in r.getMessage()]
    assert len(warnings) == 1 and "'kv_cache'" in warnings[0] and "LD_PRELOAD" in warnings[0]
    assert saver.last_freed["kv_cache"] == 0
