"""Every weight-sync transport makes the engine serve exactly the trainer's weights.

The oracle is independent of weight_sync: the trainer's in-memory model is written with HF's own
`save_pretrained` and loaded into a fresh Engine; after a sync, the engine under test must give the
same greedy tokens and logprobs as that fresh engine. The trainer's weights are a seeded perturbation
of the checkpoint, so no file on disk holds them before the test writes one, and each test first
checks that the engine's outputs differ from the target (a sync that does nothing cannot pass).

Transports: in-process buckets, a RemoteEngine child fed through shared memory (one child per
module), a gloo broadcast group between this process and that child, and atomic HF checkpoints.
"""

from __future__ import annotations

import pickle
import shutil
import socket
import time
from multiprocessing import shared_memory

import pytest
import torch
from torch import nn

from rollout import Engine
from tests.checkpoints import load_hf_model
from tests.rollout.oracle import random_prompts
from weight_sync import DiskTarget, sync_weights
from weight_sync.cross_process import RemoteEngine
from weight_sync.distributed import DistributedTarget, create_weight_update_group, destroy_weight_update_group

ENGINE_KW = dict(show_progress=False, max_total_tokens=1024, max_running_requests=16, disable_radix_cache=True)
PROMPTS = random_prompts([5, 9, 3], seed=7)
SMALL_BUCKET = 32 << 10  # the tiny llama is ~590 KB of fp32: many buckets
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def perturbed_model(ckpt, seed: int) -> nn.Module:
    """The trainer's model: the checkpoint plus seeded noise (half each tensor's std), fp32 CPU."""
    model = load_hf_model(ckpt)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp_min(0.05))
    return model


def outputs(engine) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for PROMPTS (works for Engine and RemoteEngine)."""
    outs = engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 0.0, "max_new_tokens": 8},
                           return_logprob=True)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def assert_same(got, want, atol: float = 1e-5) -> None:
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids
        assert torch.allclose(torch.tensor(lps), torch.tensor(ref_lps), atol=atol, rtol=0)


def differ(a, b) -> bool:
    return [ids for ids, _ in a] != [ids for ids, _ in b]


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("llama")


@pytest.fixture(scope="module")
def trainer(ckpt, tmp_path_factory):
    """`trainer(seed, base=ckpt) -> (model, reference outputs)`: `base` perturbed with `seed`, and
    the outputs of a fresh Engine on the model's own `save_pretrained` output. Cached per module."""
    cache: dict = {}

    def get(seed: int, base=None):
        base = base or ckpt
        key = (str(base), seed)
        if key not in cache:
            model = perturbed_model(base, seed)
            path = tmp_path_factory.mktemp(f"trainer-{seed}")
            model.save_pretrained(path)
            for f in TOKENIZER_FILES:
                if (base / f).exists():
                    shutil.copy(base / f, path / f)
            with Engine(str(path), **ENGINE_KW) as fresh:
                cache[key] = (model, outputs(fresh))
        return cache[key]

    return get


# ---------------------------------------------------------------------------------------------
# in-process


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_in_process_sync_in_many_buckets_equals_fresh_engine(ckpt_factory, trainer, tied):
    """sync_weights into an in-process Engine, bucket by bucket, gives the fresh engine's outputs."""
    base = ckpt_factory("llama", tie_word_embeddings=tied)
    model, want = trainer(1, base)
    with Engine(str(base), **ENGINE_KW) as engine:
        assert differ(outputs(engine), want)
        calls = []
        real = engine.update_weights_from_tensor

        def counting(*args, **kwargs):
            calls.append(kwargs.get("load_format"))
            return real(*args, **kwargs)

        engine.update_weights_from_tensor = counting
        ok, msg = sync_weights(model, engine, bucket_bytes=SMALL_BUCKET)
        assert ok, msg
        assert len(calls) > 3 and set(calls) == {"flattened_bucket"}
        assert_same(outputs(engine), want)


class Wrapped(nn.Module):
    """A trainer whose names are not HF's: `policy.`-prefixed, plus a value head the engine lacks."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.value_head = nn.Linear(policy.config.hidden_size, 1)


def hf_name(name: str) -> str | None:
    return None if name.startswith("value_head.") else name.removeprefix("policy.")


def test_name_map_renames_and_skips(ckpt, trainer):
    """name_map maps prefixed trainer names back to HF names and drops tensors mapped to None;
    without it the first bucket is refused and the engine keeps its old weights."""
    model, want = trainer(2)
    wrapped = Wrapped(model)
    with Engine(str(ckpt), **ENGINE_KW) as engine:
        before = outputs(engine)
        assert differ(before, want)
        ok, msg = sync_weights(wrapped, engine, bucket_bytes=SMALL_BUCKET)
        assert not ok and "policy.model" in msg
        assert_same(outputs(engine), before)
        ok, msg = sync_weights(wrapped, engine, bucket_bytes=SMALL_BUCKET, name_map=hf_name)
        assert ok, msg
        assert_same(outputs(engine), want)


def test_a_name_collision_is_refused_before_any_bucket_and_a_late_failure_names_what_was_applied(ckpt, trainer):
    """A name_map that maps two tensors to one name is refused before anything is sent (the engine's checksum
    and version unchanged; it used to raise after most buckets were written); a NaN in a late bucket fails
    that bucket by name and the message says how many buckets were applied before it."""
    model, want = trainer(3)
    with Engine(str(ckpt), **ENGINE_KW) as engine:
        before, version = engine.get_weights_checksum()["checksum"], engine.weight_version
        last = list(dict(model.named_parameters()))[-1]
        collide = lambda name: last if name == list(dict(model.named_parameters()))[0] else name  # noqa: E731
        with pytest.raises(ValueError, match="duplicate tensor name.*nothing was sent"):
            sync_weights(model, engine, bucket_bytes=SMALL_BUCKET, name_map=collide, weight_version="bad")
        assert engine.get_weights_checksum()["checksum"] == before and engine.weight_version == version
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state[last] = torch.full_like(state[last], float("nan"))
        ok, msg = sync_weights(state, engine, bucket_bytes=SMALL_BUCKET, weight_version="step-9")
        assert not ok and last in msg and "were applied before it" in msg, msg
        # the version it did not reach is not claimed: the label says a part of it landed
        assert engine.weight_version.startswith("step-9-partial-") and engine.weight_version != "step-9"
        ok, msg = sync_weights(model, engine, bucket_bytes=SMALL_BUCKET, weight_version="step-10")
        assert ok, msg
        assert engine.weight_version == "step-10"  # a complete sync: the new weights, under its version
        assert_same(outputs(engine), want)


def test_a_source_with_no_tensors_is_a_failure_not_a_success_that_changed_nothing(ckpt, trainer):
    """A source with no tensors (empty dict, list, generator, a name_map dropping every name) fails, as the
    engine's own update refuses an empty one, for every target kind; a generator's tensors still all arrive."""
    model, want = trainer(4)

    class Recorder:  # a transport with its own protocol: must not be asked to sync nothing
        calls = 0

        def sync_from(self, *args, **kwargs):
            Recorder.calls += 1
            return True, "synced"

    with Engine(str(ckpt), **ENGINE_KW) as engine:
        before, version = engine.get_weights_checksum()["checksum"], engine.weight_version
        assert not engine.update_weights_from_tensor([])[0]  # the oracle: the engine refuses an empty update
        empties = [lambda: {}, lambda: [], lambda: iter([]), lambda: nn.Module(),
                   lambda: (p for p in model.named_parameters() if False)]
        for make in empties:
            for target in (engine, [engine, engine], Recorder()):
                ok, msg = sync_weights(make(), target)
                assert not ok and "nothing to sync" in msg, msg
            ok, msg = sync_weights(model, engine, name_map=lambda name: None)
            assert not ok and "after name_map" in msg, msg
        assert Recorder.calls == 0
        assert engine.get_weights_checksum()["checksum"] == before and engine.weight_version == version
        skip_first = lambda name: None if name == "model.embed_tokens.weight" else name  # noqa: E731
        ok, msg = sync_weights(iter(list(model.named_parameters())), engine, bucket_bytes=SMALL_BUCKET,
                               name_map=skip_first)  # a generator read ahead past a dropped name loses nothing
        assert ok and f"synced {len(list(model.parameters())) - 1} tensors" in msg, msg
        ok, msg = sync_weights((p for p in model.named_parameters()), engine, bucket_bytes=SMALL_BUCKET)
        assert ok, msg
        assert_same(outputs(engine), want)


# ---------------------------------------------------------------------------------------------
# disk


def test_disk_sync_equals_fresh_engine_and_leaves_hf_checkpoint(ckpt, trainer, tmp_path):
    """DiskTarget saves an HF checkpoint atomically and the engine reloads it: outputs equal the
    fresh engine's, the directory loads with transformers to the trainer's exact tensors, and no
    temp directory is left behind."""
    model, want = trainer(3)
    out_dir = tmp_path / "sync" / "policy"
    with Engine(str(ckpt), **ENGINE_KW) as engine:
        assert differ(outputs(engine), want)
        ok, msg = sync_weights(model, DiskTarget(engine, out_dir, ckpt / "config.json"))
        assert ok, msg
        assert_same(outputs(engine), want)
    reloaded = load_hf_model(out_dir)
    mine = dict(model.named_parameters())
    for name, p in reloaded.named_parameters():
        assert torch.equal(p, mine[name]), name
    assert [p.name for p in out_dir.parent.iterdir()] == ["policy"]


# ---------------------------------------------------------------------------------------------
# cross-process: one engine child for the rest of the module


@pytest.fixture(scope="module")
def groups():
    """Trainer-side broadcast groups (and their stores), kept alive until the child has shut down."""
    return []


@pytest.fixture(scope="module")
def remote(ckpt, groups):
    with RemoteEngine(model_path=str(ckpt), **ENGINE_KW) as r:  # no factory: this package's Engine
        yield r


def test_remote_engine_defaults_to_this_packages_engine(remote, ckpt):
    """RemoteEngine(model_path=...) without a factory runs rollout's Engine: same greedy outputs in-process."""
    with Engine(str(ckpt), **ENGINE_KW) as local:
        want = outputs(local)
    assert_same(outputs(remote), want)


def test_cross_process_sync_equals_fresh_engine(remote, trainer):
    """sync_weights through shared memory into a RemoteEngine child gives the fresh engine's outputs,
    twice in a row with different weights (the trainer's segment is reused between buckets)."""
    model_a, want_a = trainer(11)
    model_b, want_b = trainer(12)
    assert differ(want_a, want_b)
    for i, (model, want) in enumerate([(model_a, want_a), (model_b, want_b)]):
        ok, msg = sync_weights(model, remote, bucket_bytes=SMALL_BUCKET, weight_version=f"x{i}")
        assert ok, msg
        assert_same(outputs(remote), want)
        assert remote.weight_version == f"x{i}"  # the child's version, as an Engine's attribute reads
    assert remote.update_weight_version("relabelled")[0] and remote.weight_version == "relabelled"


def test_malformed_descriptor_is_refused_and_old_weights_kept(remote, trainer):
    """A bad shared-memory descriptor sent straight to the child comes back (False, reason) and the
    engine keeps serving its previous weights."""
    model, want = trainer(11)
    ok, msg = sync_weights(model, remote)
    assert ok, msg
    seg = shared_memory.SharedMemory(name=f"{remote.segment_prefix}ff00", create=True, size=64)
    try:
        meta = {"name": "model.norm.weight", "shape": [64], "dtype": "float32", "start": 0, "end": 64}
        good = {"shm_name": seg.name, "nbytes": 64, "dtype": "float32", "metadata": []}
        bad_descriptors = {
            "not a dict": ["model.norm.weight"],
            "missing key": {"shm_name": seg.name, "nbytes": 64, "dtype": "float32"},
            "extra key": {**good, "__reduce__": "os.system"},
            "no such segment": {**good, "shm_name": f"{remote.segment_prefix}ff01"},
            "another sender's segment": {**good, "shm_name": "psm_0123abcd"},
            "path in the name": {**good, "shm_name": f"{remote.segment_prefix}ff00/../x"},
            "nbytes past the segment": {**good, "nbytes": 1 << 20},
            "negative nbytes": {**good, "nbytes": -4},
            "unknown dtype": {**good, "dtype": "object"},
            "offsets past the data": {**good, "metadata": [meta]},  # 64 elements need 256 bytes
            "shape/offset mismatch": {**good, "metadata": [{**meta, "shape": [3], "end": 16}]},
            "metadata not a list": {**good, "metadata": "model.norm.weight"},
            "overlapping entries": {**good, "metadata": [{**meta, "shape": [8], "end": 8},
                                                         {**meta, "name": "model.embed_tokens.weight", "shape": [4],
                                                          "start": 4, "end": 8}]},
        }
        for what, descriptor in bad_descriptors.items():
            ok, msg = remote.call("update_weights_from_tensor", named_tensors=descriptor, load_format="shm_bucket")
            assert ok is False, what
            assert "bad bucket" in msg, (what, msg)
    finally:
        seg.close()
        seg.unlink()
    assert_same(outputs(remote), want)


def test_disallowed_methods_are_refused(remote):
    """Only Engine's public RL surface can be called remotely: other names fail on both ends."""
    for method in ("__init__", "runner", "_update", "shutdown_everything"):
        with pytest.raises(RuntimeError, match="not allowed"):
            remote.call(method)
    with pytest.raises(AttributeError):
        remote.runner  # noqa: B018 - the proxy itself refuses names outside ALLOWED_METHODS
    assert remote.get_server_info()["num_in_flight"] == 0  # still serving


class _Unpickled:
    """Unpickling this creates `path`: proof that a pickle was executed."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_protocol_never_unpickles(remote, tmp_path):
    """A pickle payload (or any non-object JSON) on the wire gets an error reply; nothing executes
    and the engine keeps serving."""
    marker = tmp_path / "unpickled"
    payloads = [pickle.dumps(_Unpickled(marker)), b"[1, 2, 3]", b"\xff\xfe not json"]
    remote._acquire()  # raw bytes on the pipe, below RemoteEngine's JSON encoder
    try:
        for payload in payloads:
            remote._conn.send_bytes(payload)
            with pytest.raises(RuntimeError, match="not JSON|not allowed"):
                remote._recv()
    finally:
        remote._release()
    assert not marker.exists()
    assert len(outputs(remote)) == len(PROMPTS)


# ---------------------------------------------------------------------------------------------
# torch.distributed (gloo): this process is rank 0, the engine child is rank 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(remote, name: str, timeout_s: float):
    """Both sides create the group at once: the child joins asynchronously while we host the store."""
    port = free_port()
    remote.call_async("init_weights_update_group", master_address="127.0.0.1", master_port=port, rank_offset=1,
                      world_size=2, group_name=name, backend="gloo", timeout_s=timeout_s)
    group = create_weight_update_group("127.0.0.1", port, rank=0, world_size=2, group_name=name, backend="gloo",
                                       timeout_s=timeout_s)
    ok, msg = remote.result()
    assert ok, msg
    return group


@pytest.mark.parametrize("load_format", [None, "flattened_bucket", "checked_bucket"])
def test_distributed_sync_equals_fresh_engine(remote, trainer, groups, load_format):
    """Broadcasting bucket by bucket over a gloo group gives the fresh engine's outputs, in each wire
    format (SGLang's per-tensor and flattened-bucket ones, and our checked one)."""
    name = f"test-broadcast-{load_format}"
    group = join_group(remote, name, timeout_s=30)
    groups.append(group)
    target = DistributedTarget(remote, group, name, load_format=load_format)
    for seed in (21, 22):
        model, want = trainer(seed)
        assert differ(outputs(remote), want)
        ok, msg = sync_weights(model, target, bucket_bytes=SMALL_BUCKET)
        assert ok, msg
        assert_same(outputs(remote), want)


def test_engine_refusing_a_broadcast_fails_cleanly(remote, trainer, groups):
    """When the engine refuses before receiving (unknown group name), sync_weights returns
    (False, the engine's reason) after the group timeout, and the handle stays usable."""
    model, want = trainer(11)
    ok, msg = sync_weights(model, remote)
    assert ok, msg
    group = join_group(remote, "test-refused", timeout_s=3)
    groups.append(group)
    ok, msg = sync_weights(model, DistributedTarget(remote, group, "no-such-group"))
    assert ok is False and "no-such-group" in msg, msg
    assert_same(outputs(remote), want)


def test_trainer_dying_mid_update_times_out_and_keeps_old_weights(remote, trainer, groups):
    """An update whose broadcast never comes fails after the group timeout with a message saying so,
    and the engine keeps serving the weights it had."""
    model, want = trainer(11)
    ok, msg = sync_weights(model, remote)
    assert ok, msg
    groups.append(join_group(remote, "test-dead-trainer", timeout_s=3))
    names, shapes = zip(*[(n, list(p.shape)) for n, p in model.named_parameters()])
    t0 = time.perf_counter()
    remote.call_async("update_weights_from_distributed", names=list(names), dtypes=["float32"] * len(names),
                      shapes=list(shapes), group_name="test-dead-trainer")
    # ... and the trainer "dies": it never broadcasts.
    ok, msg = remote.result()
    elapsed = time.perf_counter() - t0
    assert ok is False
    assert "timed out" in msg.lower() or "timeout" in msg.lower(), msg
    assert 2 < elapsed < 30
    assert_same(outputs(remote), want)


def test_group_name_and_port_are_reusable_after_destroy(remote, trainer):
    """After both ends destroy a group (the engine through destroy_weights_update_group), the same name
    and port join again and carry a sync that gives the fresh engine's outputs."""
    port = free_port()
    for seed in (23, 24):
        remote.call_async("init_weights_update_group", master_address="127.0.0.1", master_port=port, rank_offset=1,
                          world_size=2, group_name="reused", backend="gloo", timeout_s=30)
        group = create_weight_update_group("127.0.0.1", port, rank=0, world_size=2, group_name="reused",
                                           backend="gloo", timeout_s=30)
        ok, msg = remote.result()
        assert ok, msg
        model, want = trainer(seed)
        ok, msg = sync_weights(model, DistributedTarget(remote, group, "reused"), bucket_bytes=SMALL_BUCKET)
        assert ok, msg
        assert_same(outputs(remote), want)
        ok, msg = remote.destroy_weights_update_group("reused")
        assert ok, msg
        destroy_weight_update_group(group)
