"""Weights enter the runner in one place, and a distributed update never stalls serving.

Every Engine route (tensor pairs, flattened buckets, disk, a torch.distributed broadcast) must end in
the runner's one writer: the test records what `WeightWriter.write` receives. The distributed tests
run the trainer (rank 0) and the engine (rank 1) as two threads of this process over a gloo group;
the oracle for the received weights is B's safetensors file. Also: EngineArgs is RunnerConfig +
SchedulerConfig + FrontendConfig, not a copy of them.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest
import torch

from rollout.engine_args import EngineArgs, FrontendConfig, SGLangCompatConfig
from rollout.scheduler import SchedulerConfig
from runner.config import RunnerConfig
from runner.weights.loader import WeightWriter
from tests.rl_surface.conftest import make_engine, read_state_dict, run
from weight_sync import iter_buckets
from weight_sync.distributed import (
    broadcast_named_tensors,
    create_weight_update_group,
    destroy_weight_update_group,
)

NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record_writes(monkeypatch) -> list[str]:
    written: list[str] = []
    real = WeightWriter.write

    def write(self, target, tensor):
        written.append(target.hf_name)
        return real(self, target, tensor)

    monkeypatch.setattr(WeightWriter, "write", write)
    return written


def _join(engine, name: str, timeout_s: float = 20.0):
    """Engine joins as rank 1 in a thread while this thread hosts the store as the trainer (rank 0)."""
    port, result = _free_port(), {}
    joiner = threading.Thread(target=lambda: result.setdefault("r", engine.init_weights_update_group(
        "127.0.0.1", port, 1, 2, name, backend="gloo", timeout_s=timeout_s)))
    joiner.start()
    group = create_weight_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s)
    joiner.join(timeout=timeout_s + 5)
    ok, msg = result["r"]
    assert ok, msg
    return group


@pytest.mark.parametrize("route", ["pairs", "buckets", "disk"])
def test_every_route_ends_in_the_runner_writer(ckpt_pair, reference_outputs, monkeypatch, route):
    """Pairs, flattened buckets and a disk checkpoint all reach the runner's one writer, each HF tensor
    exactly once, and the result == a fresh engine on B."""
    a, b = ckpt_pair("llama")
    sd_b = read_state_dict(b)
    with make_engine(a) as engine:
        written = _record_writes(monkeypatch)
        if route == "pairs":
            ok, msg = engine.update_weights_from_tensor(list(sd_b.items()))
        elif route == "buckets":
            buckets = [bk.to_dict() for bk in iter_buckets(sd_b, bucket_bytes=64 << 10)]
            ok, msg = engine.update_weights_from_tensor(buckets, load_format="flattened_bucket")
        else:
            ok, msg, _ = engine.update_weights_from_disk(str(b))
        assert ok, msg
        assert sorted(written) == sorted(engine.runner.name_map.hf_names())
        monkeypatch.undo()
        assert run(engine) == reference_outputs(b)


def test_distributed_update_receives_without_stalling_serving(ckpt_pair, monkeypatch):
    """While the trainer is alive but silent, the engine keeps serving (generate returns); once it
    broadcasts, the update lands through the runner's writer and equals B's tensors; the group can then
    be destroyed (SGLang's name), which frees the name for a new join."""
    a, b = ckpt_pair("llama")
    sd_b = read_state_dict(b)
    with make_engine(a) as engine:
        group = _join(engine, "g-silent")
        written = _record_writes(monkeypatch)
        shapes = [list(sd_b[n].shape) for n in NAMES]
        result: dict = {}
        receiver = threading.Thread(target=lambda: result.setdefault("r", engine.update_weights_from_distributed(
            NAMES, ["float32"] * len(NAMES), shapes, "g-silent", weight_version="dist")))
        receiver.start()
        time.sleep(0.3)  # the receive is now waiting for the trainer
        t0 = time.monotonic()
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 4})
        assert time.monotonic() - t0 < 10 and len(out["output_ids"]) == 4
        assert receiver.is_alive() and not written  # still waiting, nothing written
        broadcast_named_tensors(group, [(n, sd_b[n]) for n in NAMES])  # SGLang's default: one per tensor
        receiver.join(timeout=20)
        ok, msg = result["r"]
        assert ok, msg
        assert sorted(written) == sorted(NAMES) and engine.weight_version == "dist"
        for n in NAMES:
            assert torch.equal(torch.tensor(engine.get_weights_by_name(n, truncate_size=10**6)), sd_b[n]), n
        assert engine.destroy_weights_update_group("g-silent")[0]
        ok, msg = engine.destroy_weights_update_group("g-silent")
        assert not ok and "g-silent" in msg
        ok, msg = engine.update_weights_from_distributed(NAMES, ["float32"] * 3, shapes, "g-silent")
        assert not ok and "no weight update group" in msg
        destroy_weight_update_group(group)
        group = _join(engine, "g-silent")  # the name is free again
        assert engine.destroy_weights_update_group("g-silent")[0]
        destroy_weight_update_group(group)


def test_engine_args_compose_the_parts_without_redeclaring():
    """EngineArgs' options are exactly the union of RunnerConfig, SchedulerConfig, FrontendConfig and
    SGLangCompatConfig fields; from_kwargs splits them back; a bad value is refused by the part that owns it."""
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    parts = [f.name for part in (RunnerConfig, SchedulerConfig, FrontendConfig, SGLangCompatConfig)
             for f in dataclasses.fields(part)]
    assert sorted(names) == sorted(set(parts)) and len(names) == len(set(names))
    args = EngineArgs.from_kwargs("/m", dtype="float32", chunked_prefill_size=64, max_running_requests=8,
                                  show_progress=False)
    rc, sc = args.runner_config(), args.scheduler_config()
    assert (rc.model_path, rc.dtype, rc.max_running_requests) == ("/m", "float32", 8)
    assert (sc.chunked_prefill_size, sc.max_running_requests) == (64, 8)
    assert args.show_progress is False and args.model_path == "/m"
    with pytest.raises(TypeError, match="no_such_option"):
        EngineArgs.from_kwargs("/m", no_such_option=1)
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs.from_kwargs("/m", dtype="float13")
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        EngineArgs.from_kwargs("/m", chunked_prefill_size=0)
