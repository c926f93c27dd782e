"""Checkpoint loading: single-file and sharded checkpoints give HF's exact weights, dtypes are cast,
`load_format="dummy"` reads nothing, and every broken checkpoint fails with a message naming the
tensor and/or file."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runner.weights.checkpoint import CheckpointIndex
from tests.checkpoints import load_hf_model
from tests.runner.driver import RunnerDriver, make_runner


def _assert_matches_hf(runner, hf_state: dict[str, torch.Tensor]) -> None:
    """Every HF tensor sits, bit for bit, in the runner parameter slice its name resolves to."""
    name_map = runner.name_map
    seen = set()
    for name, want in hf_state.items():
        got = name_map.resolve(name).view()  # a tied lm_head.weight reads as the embedding
        assert got.dtype == torch.float32, name
        assert torch.equal(got, want.float()), name
        if name in name_map.aliases:
            assert name == "lm_head.weight" and runner.model_config.tie_word_embeddings
        else:
            seen.add(name)
    assert seen == set(name_map.hf_names())


def test_single_file_load_equals_hf_state_dict(tiny_ckpt):
    """Every parameter (fused q/k/v and gate/up slices included) equals HF's tensor of that name."""
    _assert_matches_hf(make_runner(tiny_ckpt), load_hf_model(tiny_ckpt).state_dict())


def test_tied_checkpoint_shares_the_embedding(ckpt_factory):
    """With tie_word_embeddings the LM head is the embedding Parameter, loaded from embed_tokens."""
    path = ckpt_factory("qwen2", tie_word_embeddings=True)
    runner = make_runner(path)
    _assert_matches_hf(runner, load_hf_model(path).state_dict())
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    assert "lm_head.weight" not in runner.name_map.hf_names()


def test_sharded_load_equals_single_file(ckpt_factory):
    """A checkpoint split into shards + index loads to exactly the weights of the single file."""
    sharded, single = ckpt_factory("llama", shard=True), ckpt_factory("llama")
    assert len(list(sharded.glob("*.safetensors"))) >= 2
    a, b = make_runner(sharded), make_runner(single)
    _assert_matches_hf(a, load_hf_model(single).state_dict())
    for name, p in a.name_map.params.items():
        assert torch.equal(p, b.name_map.params[name]), name


def test_bf16_checkpoint_is_cast_to_requested_dtype(ckpt_factory):
    """A bf16 checkpoint loaded with dtype float32 ('auto' on CPU too) holds the bf16 values in fp32."""
    path = ckpt_factory("llama", dtype=torch.bfloat16)
    index = CheckpointIndex(path)
    assert {e.dtype for e in index.entries.values()} == {torch.bfloat16}
    file_state = dict(index.iter_tensors())
    for dtype in ("float32", "auto"):
        runner = make_runner(path, dtype=dtype)
        assert {p.dtype for p in runner.model.parameters()} == {torch.float32}
        _assert_matches_hf(runner, file_state)


def test_dummy_format_reads_no_tensors(ckpt_factory, tmp_path, monkeypatch):
    """load_format='dummy' with only config.json gives HF's parameter shapes and finite logits, and
    never opens a checkpoint index or safetensors file."""
    src = ckpt_factory("qwen3")
    shutil.copy(src / "config.json", tmp_path / "config.json")

    def forbidden(*args, **kwargs):
        raise AssertionError("dummy load read the checkpoint")

    monkeypatch.setattr("runner.model_runner.CheckpointIndex", forbidden)
    monkeypatch.setattr("runner.weights.checkpoint.CheckpointIndex", forbidden)
    runner = make_runner(tmp_path, load_format="dummy")
    hf_state = load_hf_model(src).state_dict()
    for name, tensor in hf_state.items():
        assert tuple(runner.name_map.resolve(name).view().shape) == tuple(tensor.shape), name
    assert set(runner.name_map.hf_names()) == set(hf_state)
    drv = RunnerDriver(runner)
    out = drv.extend([drv.new_request()], [[5, 6, 7, 8]])
    assert out.next_token_logits.isfinite().all() and out.next_token_logits.std() > 0


# ---- broken checkpoints ------------------------------------------------------------------------

def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, edit) -> None:
    """Rewrite <path>/model.safetensors after `edit(state_dict)`."""
    f = path / "model.safetensors"
    state = load_file(f)
    edit(state)
    save_file(state, f, metadata={"format": "pt"})


def _expect_error(path, *fragments: str) -> str:
    with pytest.raises(ValueError) as info:
        make_runner(path)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in error: {msg}"
    return msg


KEY = "model.layers.1.mlp.down_proj.weight"


def test_missing_tensor(tiny_llama, tmp_path):
    """A checkpoint without one of the model's tensors is refused, naming that tensor."""
    path = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_tensors(path, lambda s: s.pop(KEY))
    _expect_error(path, KEY, "missing")


def test_missing_fused_shard(tiny_llama, tmp_path):
    """Missing one piece of a fused parameter (v_proj of qkv_proj) is named by its HF name."""
    path = _copy(tiny_llama, tmp_path / "ckpt")
    name = "model.layers.0.self_attn.v_proj.weight"
    _edit_tensors(path, lambda s: s.pop(name))
    _expect_error(path, name)


def test_unexpected_tensor(tiny_llama, tmp_path):
    """A tensor the model has no parameter for is refused, naming it and its file."""
    path = _copy(tiny_llama, tmp_path / "ckpt")
    name = "model.layers.0.self_attn.extra_proj.weight"
    _edit_tensors(path, lambda s: s.__setitem__(name, torch.zeros(4, 4)))
    _expect_error(path, name, "model.safetensors")


def test_misshaped_tensor(tiny_llama, tmp_path):
    """A tensor of the wrong shape is refused, naming it, its file and both shapes."""
    path = _copy(tiny_llama, tmp_path / "ckpt")
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit_tensors(path, lambda s: s.__setitem__(name, s[name][:-1].clone()))
    _expect_error(path, name, "model.safetensors", "(63, 64)", "(64, 64)")


def test_non_float_tensor(tiny_llama, tmp_path):
    """An integer tensor of the right shape is refused, naming it and its file."""
    path = _copy(tiny_llama, tmp_path / "ckpt")
    name = "model.norm.weight"
    _edit_tensors(path, lambda s: s.__setitem__(name, torch.ones_like(s[name], dtype=torch.int32)))
    _expect_error(path, name, "model.safetensors", "int32")


@pytest.mark.parametrize("kind", ["random_bytes", "bad_json_header", "non_object_header", "empty"])
def test_corrupt_file(tiny_llama, tmp_path, kind):
    """A safetensors file of garbage (random bytes, a broken or non-object JSON header, zero bytes)
    is refused, naming the file."""
    path = _copy(tiny_llama, tmp_path / "ckpt")
    f = path / "model.safetensors"
    if kind == "random_bytes":
        f.write_bytes(bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                          dtype=torch.uint8).tolist()))
    elif kind == "bad_json_header":
        body = b'{"model.norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]'  # no }
        f.write_bytes(len(body).to_bytes(8, "little") + body + bytes(256))
    elif kind == "non_object_header":
        f.write_bytes(b"\x04" + bytes(7) + b"1234" + bytes(64))
    else:
        f.write_bytes(b"")
    _expect_error(path, str(f))


@pytest.mark.parametrize("keep", [0.5, 0.999, 20])
def test_truncated_file(tiny_llama, tmp_path, keep):
    """A file cut short (in the data, one byte short, or inside the header) is refused naming the
    file; a cut in the data also names a tensor that lies past the end."""
    path = _copy(tiny_llama, tmp_path / "ckpt")
    f = path / "model.safetensors"
    data = f.read_bytes()
    cut = keep if isinstance(keep, int) else int(len(data) * keep)
    f.write_bytes(data[:cut])
    msg = _expect_error(path, str(f))
    if cut > 100:
        assert re.search(r"tensor 'model\.[\w.]+'", msg), msg


def test_missing_shard(ckpt_factory, tmp_path):
    """A shard listed in model.safetensors.index.json but absent is refused, naming the shard."""
    path = _copy(ckpt_factory("llama", shard=True), tmp_path / "ckpt")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(weight_map.values()))[1]
    (path / shard).unlink()
    _expect_error(path, shard, "missing")


def test_unsupported_architecture(tiny_llama, tmp_path):
    """config.json naming an architecture we do not implement is refused, naming it."""
    path = _copy(tiny_llama, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    _expect_error(path, "GPT2LMHeadModel", "unsupported architecture")


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type(tiny_llama, tmp_path, layout):
    """A rope type other than default/llama3 (yarn) is refused, in either config layout."""
    path = _copy(tiny_llama, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    if layout == "rope_parameters":
        cfg["rope_parameters"] = {**yarn, "rope_theta": 10000.0}
    else:
        del cfg["rope_parameters"]
        cfg.update(rope_theta=10000.0, rope_scaling={"type": "yarn", **{k: v for k, v in yarn.items()
                                                                        if k != "rope_type"}})
    (path / "config.json").write_text(json.dumps(cfg))
    _expect_error(path, "yarn", "rope")


def test_nccl_duplicate_gpu_is_explained(tiny_qwen2):
    """NCCL refusing two ranks on one GPU (at join or at the first receive) becomes a WeightUpdateError that
    names the group and the same-GPU paths; other errors pass through unchanged; the runner keeps working."""
    from runner.weights.loader import WeightUpdateError
    from tests.runner.driver import make_runner

    runner = make_runner(tiny_qwen2)
    nccl = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for "
                        "details), NCCL version 2.21.5\nncclInvalidUsage: Duplicate GPU detected : rank 1 and rank 0 "
                        "both on CUDA device 1a000")

    def refuse(*a, **k):
        raise nccl

    runner.update_groups.join = refuse
    runner.update_groups.receive = refuse
    with pytest.raises(WeightUpdateError, match="'g1': NCCL refuses two ranks on the same GPU.*cuda_ipc") as info:
        runner.init_weights_update_group("127.0.0.1", 1, 1, 2, "g1", backend="nccl")
    assert info.value.__cause__ is nccl
    with pytest.raises(WeightUpdateError, match="'g2': NCCL refuses.*load_format='cuda_ipc'"):
        runner.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "g2")

    def other(*a, **k):
        raise TimeoutError("no trainer at 127.0.0.1:1")

    runner.update_groups.join = other
    with pytest.raises(TimeoutError, match="no trainer"):
        runner.init_weights_update_group("127.0.0.1", 1, 1, 2, "g3", backend="gloo")
    assert runner.get_weights_by_name("model.norm.weight")


def _in_place(src, dst, keep_bytes: int | None = None) -> None:
    """What `cp src dst` does: the same inode, truncated, then written (keep_bytes: stop writing there)."""
    data = src.read_bytes()
    with open(dst, "r+b") as f:
        f.truncate(0)
        f.write(data if keep_bytes is None else data[:keep_bytes])


@pytest.mark.parametrize("keep", [None, 1000])
def test_shard_rewritten_in_place_during_an_update_fails_cleanly(ckpt_factory, tmp_path, keep):
    """A checkpoint opened for an update whose shard is then rewritten in place (another model's bytes, or
    cut short) fails the update naming the file, with the old weights intact; no read reaches past the
    file's new end (a mapped read there killed the process with SIGBUS). A fresh open then loads it."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    runner = make_runner(a)
    served = tmp_path / "served"
    shutil.copytree(b, served)
    before = {n: runner.name_map.resolve(n).view().clone() for n in runner.name_map.hf_names()}
    index = runner.open_checkpoint(served)
    _in_place(a / "model.safetensors", served / "model.safetensors", keep)
    with pytest.raises(Exception, match="model.safetensors") as e:
        runner.update_weights_from_disk(index)
    assert "rewritten in place" in str(e.value) or "ended while" in str(e.value)
    for n, t in before.items():
        assert torch.equal(runner.name_map.resolve(n).view(), t), n
    if keep is None:  # the file now holds A whole: a new open loads it
        runner.update_weights_from_disk(served)
        _assert_matches_hf(runner, load_hf_model(a).state_dict())


@pytest.mark.parametrize("when", ["before the write pass", "after its last read"])
def test_a_write_during_the_load_is_caught(ckpt_factory, tmp_path, monkeypatch, when):
    """A shard rewritten in place (same size) once the check pass read it fails the load, the old weights
    intact: at the next read, or, when it lands after the last read, at check_unchanged (what the write
    pass read may be a mix of the two files)."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    runner = make_runner(a)
    served = tmp_path / "served"
    shutil.copytree(b, served)
    before = runner.name_map.resolve("model.norm.weight").view().clone()
    index = runner.open_checkpoint(served)
    real = CheckpointIndex.iter_tensors
    calls = []

    def iter_then_rewrite(self, names=None):
        calls.append(1)
        rewrite = lambda: _in_place(a / "model.safetensors", served / "model.safetensors")  # noqa: E731
        if len(calls) == 2 and when == "before the write pass":
            rewrite()
        yield from real(self, names)
        if len(calls) == 2 and when == "after its last read":
            rewrite()

    monkeypatch.setattr(CheckpointIndex, "iter_tensors", iter_then_rewrite)
    with pytest.raises(Exception, match="rewritten in place"):
        runner.update_weights_from_disk(index)
    assert torch.equal(runner.name_map.resolve("model.norm.weight").view(), before)


@pytest.mark.parametrize("path", ["/nonexistent/ckpt", "/etc/hostname", "a\x00b"])
def test_a_refused_open_leaves_nothing_behind(path, monkeypatch):
    """An index whose open fails (missing, not a directory, NUL byte) raises naming the path, and its
    finalizer raises nothing (it had printed 'Exception ignored in __del__' for each refused update)."""
    import gc
    import sys

    from runner.weights.checkpoint import CheckpointError

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(CheckpointError):
        CheckpointIndex(path)
    gc.collect()
    assert unraisable == []
