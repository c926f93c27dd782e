"""RemoteEngine: start-up errors reach the caller fast, streams are refused without killing the child,
calls from many threads are serialised, and shared memory is attached safely.

Protocol tests use `fake_engine.EchoEngine` (no model: each answer is a function of its call, the
oracle for "this reply belongs to this call"); start-up failures use the real `rollout:Engine`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

from tests.weight_sync import fake_engine
from weight_sync import FlattenedTensorBucket
from weight_sync.cross_process import RemoteEngine
from weight_sync.shm import bucket_from_shm, bucket_to_shm, new_segment_prefix

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def echo():
    with RemoteEngine("tests.weight_sync.fake_engine:EchoEngine", start_timeout_s=120, delay_s=0.01) as r:
        yield r


# ---------------------------------------------------------------------------------------------
# start-up


def test_construction_errors_reach_the_caller_within_seconds(tmp_path):
    """A child whose Engine cannot be built (bad path; max_total_tokens=0) fails the constructor with
    the child's own reason, in seconds rather than the start timeout."""
    missing = tmp_path / "no-such-model"
    for kwargs, pattern in [({"model_path": str(missing)}, "no-such-model"),
                            ({"model_path": str(REPO / "assets" / "demo-model"), "max_total_tokens": 0},
                             "max_total_tokens")]:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"engine construction failed.*{pattern}"):
            RemoteEngine("rollout:Engine", start_timeout_s=600, **kwargs)
        assert time.monotonic() - t0 < 120  # spawn + imports on a loaded 2-core box; far below 600


def test_factory_errors_and_silent_deaths_are_reported():
    """A raising factory's message comes back; a child that exits without a word is reported with its
    exit code; a factory that cannot be re-imported in the child is refused up front."""
    with pytest.raises(RuntimeError, match="refusing to start with \\['x'\\]"):
        RemoteEngine(fake_engine.failing_engine, start_timeout_s=120, x=1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exit code 3"):
        RemoteEngine("tests.weight_sync.fake_engine:dying_engine", start_timeout_s=600)
    assert time.monotonic() - t0 < 120
    with pytest.raises(ValueError, match="cannot be re-imported"):
        RemoteEngine(lambda **kw: None)
    with pytest.raises(ValueError, match="module:callable"):
        RemoteEngine("rollout.Engine")


# ---------------------------------------------------------------------------------------------
# streams and unsendable results


def test_stream_is_refused_and_the_child_keeps_serving(echo):
    """generate(stream=True) fails with a clear error before anything is sent; a result JSON cannot
    carry (a generator) comes back as an error; after both the same child answers normally."""
    pid = echo.get_weights_by_name("x")[0]
    with pytest.raises(ValueError, match=r"stream=True\) is not supported"):
        echo.generate(prompt="abc", stream=True)
    with pytest.raises(RuntimeError, match=r"stream=True\) is not supported across processes"):
        echo.call("generate", prompt="abc", stream=True)  # below the proxy: the child refuses too
    with pytest.raises(RuntimeError, match="generator cannot be sent back"):
        echo.get_server_info()
    assert echo.generate(prompt="abc") == {"text": "cba"}
    assert echo.get_weights_by_name("y") == [pid, "y"]


def test_update_takes_engines_keywords_and_last_value_of_a_name(echo):
    """update_weights_from_tensor takes Engine's online / abort_all_requests and hands them to the child's
    engine; a name given twice (two buckets, or twice in the pairs) arrives once, with its last value, as
    Engine's own update takes it (it was refused as a duplicate); a non-bool flag is refused by name."""
    import json

    from weight_sync import iter_buckets

    one, two = torch.full((2,), 1.0), torch.full((2,), 2.0)
    b1, b2 = (next(iter_buckets([("w", t), ("u", t)])).to_dict() for t in (one, two))
    ok, msg = echo.update_weights_from_tensor([b1, b2], load_format="flattened_bucket", online=True,
                                              abort_all_requests=True)
    got = json.loads(msg)
    assert ok and got["kwargs"]["online"] is True and got["kwargs"]["abort_all_requests"] is True, got
    assert got["tensors"] == [["w", [2.0, 2.0]], ["u", [2.0, 2.0]]]
    ok, msg = echo.update_weights_from_tensor([("w", one), ("u", one), ("w", two)])
    got = json.loads(msg)
    assert ok and got["kwargs"]["online"] is False and got["tensors"] == [["w", [2.0, 2.0]], ["u", [1.0, 1.0]]]
    ok, msg = echo.update_weights_from_tensor([("w", one)], online="yes")
    assert not ok and "online must be a bool" in msg, msg


def test_numpy_scalars_in_arguments_reach_the_child(echo):
    """A logit_bias built from numpy arrays (int64 keys, float32 values) crosses to the child as numbers, as the
    in-process Engine takes it (it failed in the parent: "Object of type float32 is not JSON serializable")."""
    import numpy as np

    sp = {"logit_bias": {np.int64(5): np.float32(1.5)}, "max_new_tokens": np.int64(4)}
    assert echo.generate(prompt="abc", sampling_params=sp) == {"text": "cba"}


# ---------------------------------------------------------------------------------------------
# threads


def test_calls_from_many_threads_each_get_their_own_reply(echo):
    """Eight threads calling at once (each call sleeping in the child) all get the replies to their
    own calls; a call_async in flight makes other threads wait, and its owner gets its own result."""
    errors, replies = [], {}

    def worker(k: int) -> None:
        try:
            replies[k] = [echo.get_weights_by_name(f"t{k}.{i}")[1] for i in range(5)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and all(not t.is_alive() for t in threads)
    assert replies == {k: [f"t{k}.{i}" for i in range(5)] for k in range(8)}

    echo.call_async("get_weights_by_name", "mine")
    other: list = []
    t = threading.Thread(target=lambda: other.append(echo.get_weights_by_name("theirs")[1]))
    t.start()
    time.sleep(0.3)
    assert other == []  # waiting for our call to finish
    with pytest.raises(RuntimeError, match="already in flight"):
        echo.call("get_weights_by_name", "again")
    assert echo.result()[1] == "mine"
    t.join(30)
    assert other == ["theirs"]


# ---------------------------------------------------------------------------------------------
# shared memory


def _bucket():
    return FlattenedTensorBucket([("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(3))])


def test_foreign_segments_are_refused_and_left_alone():
    """A descriptor naming a segment without this handle's random prefix is refused before it is
    opened, and that segment's bytes stay as they were."""
    prefix = new_segment_prefix()
    descriptor, seg = bucket_to_shm(_bucket(), None)  # no prefix: a random psm_ name
    try:
        with pytest.raises(ValueError, match="not created by this engine's sender"):
            bucket_from_shm(descriptor, prefix)
        for name in (prefix, prefix + "../x", prefix + "1/2", "/" + prefix + "1", prefix.upper() + "1"):
            with pytest.raises(ValueError, match="not created"):
                bucket_from_shm({**descriptor, "shm_name": name}, prefix)
        assert torch.equal(torch.frombuffer(seg.buf, dtype=torch.float32, count=9)[:6], torch.arange(6.0))
    finally:
        seg.close()
        seg.unlink()


ATTACH = textwrap.dedent("""
    import json, sys
    from multiprocessing import shared_memory
    from weight_sync.shm import bucket_from_shm
    how, descriptor, prefix = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    if how == "ours":
        bucket, seg = bucket_from_shm(descriptor, prefix)
        print([t.tolist() for _, t in bucket.named_tensors()], flush=True)
        del bucket
        seg.close()
    else:
        shm = shared_memory.SharedMemory(name=descriptor["shm_name"])
        shm.close()
""")


def test_attaching_does_not_hand_the_segment_to_a_resource_tracker():
    """A process that attaches to the sender's segment (reads the bucket, exits) leaves it in place: it
    is not registered with the attaching process's resource tracker, which would unlink it at exit
    (what a plain SharedMemory attach does before Python 3.13: shown as the control)."""
    import json

    prefix = new_segment_prefix()
    descriptor, seg = bucket_to_shm(_bucket(), None, prefix)
    try:
        proc = subprocess.run([sys.executable, "-c", ATTACH, "ours", json.dumps(descriptor), prefix], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "[[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 1.0, 1.0]]"
        assert "leaked" not in proc.stderr
        again = shared_memory.SharedMemory(name=descriptor["shm_name"])  # still there
        again.close()
        if sys.version_info < (3, 13):
            proc = subprocess.run([sys.executable, "-c", ATTACH, "plain", json.dumps(descriptor), prefix], cwd=REPO,
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stderr
            with pytest.raises(FileNotFoundError):
                shared_memory.SharedMemory(name=descriptor["shm_name"])
    finally:
        seg.close()
        try:
            seg.unlink()
        except FileNotFoundError:  # the control run's tracker already removed it
            pass


NOT_SHUT_DOWN = textwrap.dedent("""
    import sys
    from weight_sync.cross_process import RemoteEngine
    r = RemoteEngine("rollout:Engine", start_timeout_s=300, model_path=sys.argv[1], tp_size=2,
                     show_progress=False, max_total_tokens=1024)
    out = r.generate(input_ids=[5, 6, 7], sampling_params=dict(temperature=0, max_new_tokens=4, ignore_eos=True))
    print("ids", out["output_ids"], flush=True)
    # no shutdown: the interpreter's exit must stop the engine process (and its rank worker), not wait on it
""")


def test_a_tp_engine_in_a_remote_process_starts_and_an_unclosed_one_does_not_hang_exit(tiny_llama):
    """RemoteEngine(tp_size=2) starts (its child may start rank workers: not a daemon) and generates what an
    in-process engine does; a script that never shuts it down still exits, leaving no process behind."""
    from rollout import Engine

    with Engine(str(tiny_llama), show_progress=False, max_total_tokens=1024) as e:
        want = e.generate(input_ids=[5, 6, 7], sampling_params=dict(temperature=0, max_new_tokens=4,
                                                                     ignore_eos=True))["output_ids"]
    proc = subprocess.Popen([sys.executable, "-c", NOT_SHUT_DOWN, str(tiny_llama)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:]
    assert f"ids {want}" in out, out[-2000:]
    deadline = time.monotonic() + 20  # helpers (multiprocessing's resource tracker) exit once the script has
    while (leftover := subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()):
        assert time.monotonic() < deadline, f"processes left in the script's session: {leftover}"
        time.sleep(0.2)
