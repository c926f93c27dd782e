"""A trainer process using SGLang's update-group helper (or ours) updates the engine over gloo.

The trainer (rank 0) runs in a child process: either a group built like SGLang's
`init_custom_process_group` plus `dist.broadcast` (what slime, verl and OpenRLHF run), or our
`weight_sync.distributed` helper. The engine joins as rank 1 with `master_port` given as a numeric
string, as SGLang's own test does. After the update the oracle is a fresh engine loaded from the
checkpoint the trainer sent: equal weight checksums and equal greedy/seeded outputs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.rl_surface.conftest import make_engine, read_state_dict, run
from tests.weight_sync.trainer_proc import chunks

REPO = Path(__file__).resolve().parents[2]
BUCKETS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_trainer(helper: str, port: int, name: str, ckpt, fmt: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "tests.weight_sync.trainer_proc", helper, str(port), name,
                             str(ckpt), fmt, str(BUCKETS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)


@pytest.mark.parametrize("fmt", ["per_tensor", "bucket"])
@pytest.mark.parametrize("helper", ["sglang", "ours"])
def test_trainer_helper_updates_the_engine_like_a_fresh_load(ckpt_pair, reference_outputs, helper, fmt):
    """Either trainer helper joins the engine's group (master_port a string), its per-tensor or bucketed
    broadcasts load, and the engine then equals a fresh engine on those weights. With SGLang's helper sending
    per tensor, every call leaves group_name out: SGLang's default name, "weight_update_group"."""
    a, b = ckpt_pair("llama")
    sd_b = sorted(read_state_dict(b).items())
    default = helper == "sglang" and fmt == "per_tensor"
    port, name = free_port(), "weight_update_group" if default else f"policy-{helper}-{fmt}"
    group = {} if default else {"group_name": name}
    with make_engine(a) as engine, make_engine(b) as fresh:
        proc = spawn_trainer(helper, port, name, b, fmt)
        try:
            ok, msg = engine.init_weights_update_group("127.0.0.1", str(port), 1, 2, backend="gloo", timeout_s=60,
                                                       **group)
            assert ok, msg
            assert proc.stdout.readline().strip() == "joined"
            extra = {} if fmt == "per_tensor" else {"load_format": "flattened_bucket"}
            for i, chunk in enumerate(chunks(sd_b, BUCKETS)):
                ok, msg = engine.update_weights_from_distributed(
                    [n for n, _ in chunk], [str(t.dtype).removeprefix("torch.") for _, t in chunk],
                    [list(t.shape) for _, t in chunk], weight_version=f"v{i}", **group, **extra)
                assert ok, msg
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0 and out.strip() == "done", err
            ok, msg = engine.destroy_weights_update_group(**group)
            assert ok, msg
        finally:
            proc.kill()
            proc.wait()
        assert engine.get_weights_checksum()["checksum"] == fresh.get_weights_checksum()["checksum"]
        assert run(engine) == reference_outputs(b)


def test_numeric_string_port_joins_and_a_bad_port_is_named(tiny_llama):
    """master_port "NNNN" is accepted on the Engine; a non-numeric one is refused naming master_port,
    and the engine keeps serving."""
    port = free_port()
    with make_engine(tiny_llama) as engine:
        ok, msg = engine.init_weights_update_group("127.0.0.1", "port", 1, 2, "g", backend="gloo", timeout_s=5)
        assert not ok and "master_port" in msg
        from weight_sync.distributed import create_weight_update_group, destroy_weight_update_group

        res = {}
        t = threading.Thread(target=lambda: res.setdefault("g", create_weight_update_group(
            "127.0.0.1", port, 0, 2, "g", "gloo", 30)))
        t.start()
        ok, msg = engine.init_weights_update_group("127.0.0.1", f"{port}", 1, 2, "g", backend="gloo", timeout_s=30)
        t.join(35)
        assert ok, msg
        destroy_weight_update_group(res["g"])
        assert engine.destroy_weights_update_group("g")[0]
        assert engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})["output_ids"]


def test_nccl_on_a_cpu_engine_is_refused_before_connecting(tiny_llama):
    """init_weights_update_group(backend="nccl") on a CPU engine is (False, reason naming gloo), and no
    connection reaches the trainer's address (it would wait there for this rank until its timeout)."""
    with socket.socket() as listener, make_engine(tiny_llama) as engine:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        ok, msg = engine.init_weights_update_group("127.0.0.1", str(port), 1, 2, "g", backend="nccl", timeout_s=30)
        assert not ok and "backend='nccl'" in msg and "gloo" in msg, msg
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()
        assert engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})["output_ids"]
