"""Bad weight updates: each returns (False, reason naming the tensor or file) and changes nothing.

One engine serves the whole module; after every refused update its parameters are torch.equal to the
snapshot taken at the start, its outputs are bit-identical, and weight_version has not moved. Tensor
lists put valid tensors *before* the bad one, so a loader that wrote as it checked would be caught.
"""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.rl_surface.conftest import assert_same_tensors, make_engine, read_state_dict, run, snapshot
from weight_sync import iter_buckets

Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.1.self_attn.k_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"
NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def setup(ckpt_factory):
    """(engine on A, B's checkpoint dir, B's state dict, A's snapshot, A's outputs)."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    with make_engine(a) as engine:
        yield engine, b, read_state_dict(b), snapshot(engine), run(engine)


def _valid_first(sd: dict, name: str, bad) -> list:
    """B's tensors with `name` replaced by `bad`, moved to the end."""
    return [(n, t) for n, t in sd.items() if n != name] + [(name, bad)]


TENSOR_CASES = {
    "unknown name": lambda sd: (
        [*sd.items(), ("model.layers.7.mlp.gate_proj.weight", sd[UP])],
        ["model.layers.7.mlp.gate_proj.weight", "unknown"],
    ),
    "wrong shape (fused shard)": lambda sd: (_valid_first(sd, K, sd[K][:, :-1]), [K, "shape"]),
    "wrong shape (norm)": lambda sd: (_valid_first(sd, NORM, sd[NORM][:-1]), [NORM, "shape"]),
    "int dtype": lambda sd: (_valid_first(sd, NORM, sd[NORM].to(torch.int32)), [NORM, "int32"]),
    "bool dtype": lambda sd: (_valid_first(sd, NORM, sd[NORM] > 1), [NORM, "bool"]),
    "nan": lambda sd: (
        _valid_first(sd, UP, sd[UP].clone().index_fill_(0, torch.tensor([3]), float("nan"))),
        [UP, "NaN"],
    ),
    "inf": lambda sd: (
        _valid_first(sd, EMBED, sd[EMBED].clone().index_fill_(1, torch.tensor([0]), -float("inf"))),
        [EMBED, "inf"],
    ),
    "not a tensor": lambda sd: (_valid_first(sd, NORM, sd[NORM].tolist()), [NORM, "torch.Tensor"]),
    # A name sent twice takes its last value (test_weight_updates.py), but every value is still checked.
    "duplicate name, first value bad": lambda sd: (
        [(Q, sd[Q].clone().index_fill_(0, torch.tensor([1]), float("nan"))), *sd.items()], [Q, "NaN"]),
    "not pairs": lambda sd: ([Q], ["(name, tensor)"]),
    # torch builds sparse tensors unchecked by default: an index past the size must be refused, not written
    "sparse index past the size": lambda sd: (
        _valid_first(sd, NORM, torch.sparse_coo_tensor(torch.tensor([[10**9]]), torch.tensor([1.0]), sd[NORM].shape)),
        [NORM, "invalid sparse tensor", "1000000000"]),
    "sparse negative index": lambda sd: (
        _valid_first(sd, NORM, torch.sparse_coo_tensor(torch.tensor([[-5]]), torch.tensor([1.0]), sd[NORM].shape)),
        [NORM, "invalid sparse tensor"]),
    "sparse csr bad column": lambda sd: (
        _valid_first(sd, UP, torch.sparse_csr_tensor(torch.tensor([0, 1] + [1] * (sd[UP].shape[0] - 1)),
                                                     torch.tensor([sd[UP].shape[1] + 7]), torch.tensor([1.0]),
                                                     sd[UP].shape)),
        [UP, "invalid sparse tensor"]),
    "empty": lambda sd: ([], ["no tensors to load"]),  # would move the version for nothing
    # Names the engine skips (old checkpoints carry rotary buffers): as empty, not a no-op that moves the version
    "only ignored names": lambda sd: ([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))],
                                      ["no tensors to load", "rotary_emb.inv_freq"]),
    "nested": lambda sd: (_valid_first(sd, NORM, torch.nested.nested_tensor([sd[NORM]])), [NORM, "nested"]),
    "None": lambda sd: (None, ["named_tensors must be", "got NoneType"]),
}


def _check_refused(setup, ok_msg, expected):
    engine, _, _, before, outputs = setup
    ok, msg = ok_msg[:2]  # update_weights_from_disk adds num_paused_requests
    assert not ok, msg
    for part in expected:
        assert part in msg, (part, msg)
    assert engine.weight_version == "default"
    assert_same_tensors(before, engine)
    assert run(engine) == outputs


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_bad_tensor_update_changes_nothing(setup, case):
    """A bad (name, tensor) anywhere in the list -> (False, reason naming it); weights and outputs intact."""
    engine, _, sd, _, _ = setup
    named, expected = TENSOR_CASES[case](sd)
    _check_refused(setup, engine.update_weights_from_tensor(named), expected)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_valid_sparse_tensors_load_as_their_dense_values(ckpt_factory, layout):
    """A well-formed sparse tensor (COO or CSR) loads exactly its dense value: the checks refuse only bad ones."""
    a = ckpt_factory("llama", seed=0)
    with make_engine(a) as engine:
        dense = torch.zeros(128, 64)
        dense[3, 5], dense[120, 1] = 0.25, -1.5
        sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
        ok, msg = engine.update_weights_from_tensor([(Q, sparse)])
        assert ok, msg
        assert torch.equal(torch.tensor(engine.get_weights_by_name(Q, dense.numel())).view(128, 64), dense)


# ---- flattened buckets ------------------------------------------------------------------------------
def _buckets(sd):
    return [bk.to_dict() for bk in iter_buckets(sd, bucket_bytes=64 << 10)]


def _edit_meta(sd, name, **changes):
    """B as buckets, with the metadata entry of `name` edited."""
    buckets = _buckets(sd)
    for bk in buckets:
        for m in bk["metadata"]:
            if m["name"] == name:
                m.update(changes)
    return buckets


def _bucket_with(sd, name, tensor):
    buckets = _buckets({n: t for n, t in sd.items() if n != name})
    return buckets + [bk.to_dict() for bk in iter_buckets({name: tensor})]


BUCKET_CASES = {
    "no metadata key": lambda sd: ([*_buckets(sd)[:-1], {"flattened_tensor": sd[NORM]}], ["metadata"]),
    "metadata not a list": lambda sd: (
        [{"flattened_tensor": sd[NORM], "metadata": "x"}],
        ["metadata", "list"],
    ),
    "offsets out of bounds": lambda sd: (_edit_meta(sd, UP, end=10**9), [UP, "out of bounds"]),
    "numel != shape": lambda sd: (_edit_meta(sd, K, shape=[3, 3]), [K, "shape"]),
    "unknown dtype": lambda sd: (_edit_meta(sd, NORM, dtype="float13"), [NORM, "float13"]),
    "dtype != flat tensor's": lambda sd: (_edit_meta(sd, NORM, dtype="float16"), [NORM, "float16"]),
    "2-D flat tensor": lambda sd: ([{"flattened_tensor": sd[Q], "metadata": []}], ["1-D"]),
    "unknown name": lambda sd: (
        _bucket_with(sd, "model.layers.9.mlp.up_proj.weight", sd[UP]),
        ["model.layers.9.mlp.up_proj.weight"],
    ),
    "nan in bucket": lambda sd: (_bucket_with(sd, Q, sd[Q].clone().fill_(float("nan"))), [Q, "NaN"]),
    "int bucket": lambda sd: (_bucket_with(sd, NORM, sd[NORM].to(torch.int64)), [NORM, "int64"]),
}


@pytest.mark.parametrize("case", BUCKET_CASES)
def test_bad_flattened_bucket_changes_nothing(setup, case):
    """A malformed bucket (any one of several in a call) -> (False, reason); weights and outputs intact."""
    engine, _, sd, _, _ = setup
    buckets, expected = BUCKET_CASES[case](sd)
    _check_refused(
        setup, engine.update_weights_from_tensor(buckets, load_format="flattened_bucket"), expected
    )


def test_unknown_load_format_changes_nothing(setup):
    """An unsupported load_format is refused by name for both update paths."""
    engine, b, sd, _, _ = setup
    _check_refused(setup, engine.update_weights_from_tensor(list(sd.items()), load_format="npz"), ["npz"])
    _check_refused(setup, engine.update_weights_from_disk(str(b), load_format="pt"), ["'pt'"])


# ---- checkpoints on disk ----------------------------------------------------------------------------
def _copy(b, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(b, dst)
    return dst


def _rewrite_header(path, edit):
    """Rewrite the JSON header of a safetensors file in place (same length, padded with spaces)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = edit(json.loads(data[8 : 8 + n]))
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    raw = raw.ljust(n, b" ")
    assert len(raw) == n
    path.write_bytes(data[:8] + raw + data[8 + n :])


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del cfg[k]
    (d / "config.json").write_text(json.dumps(cfg))


def _missing_dir(b, tmp_path, ckpt_factory):
    return tmp_path / "nowhere", ["nowhere", "does not exist"]


def _a_file_not_a_dir(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    return d / "model.safetensors", ["model.safetensors", "is not a directory"]


def _nul_in_path(b, tmp_path, ckpt_factory):
    return str(_copy(b, tmp_path)) + "\x00", ["NUL byte"]


def _no_config(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    (d / "config.json").unlink()
    return d, ["config.json"]


def _no_weights(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    (d / "model.safetensors").unlink()
    return d, ["no *.safetensors"]


def _missing_shard(b, tmp_path, ckpt_factory):
    d = _copy(ckpt_factory("llama", seed=1, shard=True), tmp_path)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    return d, [shard.name, "missing"]


def _truncated_data(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    return d, ["model.safetensors", "truncated"]


def _truncated_header(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:200])
    return d, ["model.safetensors"]


def _empty_file(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    (d / "model.safetensors").write_bytes(b"")
    return d, ["model.safetensors", "truncated"]


def _corrupt_header(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    _rewrite_header(
        d / "model.safetensors",
        lambda h: json.dumps(h, separators=(",", ":")).encode()[:-9] + b"\xff\x00garbage",
    )
    return d, ["model.safetensors", "corrupt"]


def _header_not_a_dict(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    _rewrite_header(d / "model.safetensors", lambda h: b"[1, 2, 3]")
    return d, ["model.safetensors", "corrupt"]


def _header_offsets_inconsistent(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)

    def edit(h):
        begin, end = h[NORM]["data_offsets"]
        h[NORM]["data_offsets"] = [begin, end - 4]  # shape kept, data range one element short
        return h

    _rewrite_header(d / "model.safetensors", edit)
    return d, ["model.safetensors"]


def _other_architecture(b, tmp_path, ckpt_factory):
    d = _copy(ckpt_factory("qwen2", seed=1), tmp_path)
    return d, ["config.json", "Qwen2ForCausalLM"]


def _unsupported_architecture(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    return d, ["config.json", "GPT2LMHeadModel"]


def _other_shapes(b, tmp_path, ckpt_factory):
    d = _copy(ckpt_factory("llama", seed=1, hidden_size=96), tmp_path)
    return d, ["config.json", "hidden_size"]


def _other_depth(b, tmp_path, ckpt_factory):
    d = _copy(ckpt_factory("llama", seed=1, num_hidden_layers=3), tmp_path)
    return d, ["config.json", "num_hidden_layers"]


def _config_missing_key(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    _edit_config(d, num_attention_heads=None)
    return d, ["config.json", "num_attention_heads"]


def _tensor_missing(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    sd = read_state_dict(d)
    del sd[UP]
    save_file(sd, d / "model.safetensors")
    return d, [UP, "missing"]


def _extra_tensor(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    sd = read_state_dict(d)
    sd["model.layers.5.mlp.up_proj.weight"] = sd[UP].clone()
    save_file(sd, d / "model.safetensors")
    return d, ["model.layers.5.mlp.up_proj.weight", "model.safetensors"]


def _wrong_shape_in_file(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    sd = read_state_dict(d)
    sd[K] = sd[K][:-1].contiguous()
    save_file(sd, d / "model.safetensors")
    return d, [K, "shape", "model.safetensors"]


def _int_tensor_in_file(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    sd = read_state_dict(d)
    sd[NORM] = sd[NORM].to(torch.int32)
    save_file(sd, d / "model.safetensors")
    return d, [NORM, "model.safetensors"]


def _nan_in_file(b, tmp_path, ckpt_factory):
    d = _copy(b, tmp_path)
    sd = read_state_dict(d)
    sd["model.layers.1.mlp.down_proj.weight"][5, 7] = float("nan")  # sorted late: read after good ones
    save_file(sd, d / "model.safetensors")
    return d, ["model.layers.1.mlp.down_proj.weight", "NaN", "model.safetensors"]


DISK_CASES = [
    _missing_dir,
    _a_file_not_a_dir,
    _nul_in_path,
    _no_config,
    _no_weights,
    _missing_shard,
    _truncated_data,
    _truncated_header,
    _empty_file,
    _corrupt_header,
    _header_not_a_dict,
    _header_offsets_inconsistent,
    _other_architecture,
    _unsupported_architecture,
    _other_shapes,
    _other_depth,
    _config_missing_key,
    _tensor_missing,
    _extra_tensor,
    _wrong_shape_in_file,
    _int_tensor_in_file,
    _nan_in_file,
]


@pytest.mark.parametrize("make_bad", DISK_CASES, ids=lambda f: f.__name__.strip("_"))
def test_bad_checkpoint_changes_nothing(setup, tmp_path, ckpt_factory, make_bad):
    """A missing, truncated, corrupt or mismatched checkpoint -> (False, reason naming the file or tensor);
    the old weights keep serving bit-identically."""
    engine, b, _, _, _ = setup
    path, expected = make_bad(b, tmp_path, ckpt_factory)
    _check_refused(setup, engine.update_weights_from_disk(str(path)), expected)


# A valid update with a bool option given as a string: truthiness read abort_all_requests="false" as True (every
# request in flight aborted) and online="false" as True (retracted instead of refused); a load_format that is
# not a string failed as "unhashable type: 'list'".
MISTYPED_OPTIONS = {
    "tensor flush_cache string": lambda e, b, sd: (e.update_weights_from_tensor(list(sd.items()), flush_cache="no"),
                                                   ["flush_cache must be a bool", "'no'"]),
    "tensor online string": lambda e, b, sd: (e.update_weights_from_tensor(list(sd.items()), online="false"),
                                              ["online must be a bool", "'false'"]),
    "tensor abort_all_requests string": lambda e, b, sd: (
        e.update_weights_from_tensor(list(sd.items()), abort_all_requests="false"), ["abort_all_requests", "'false'"]),
    "tensor load_format list": lambda e, b, sd: (
        e.update_weights_from_tensor(list(sd.items()), load_format=["flattened_bucket"]), ["load_format must be"]),
    "disk online int": lambda e, b, sd: (e.update_weights_from_disk(str(b), online=0), ["online must be a bool"]),
    "disk abort_all_requests None": lambda e, b, sd: (e.update_weights_from_disk(str(b), abort_all_requests=None),
                                                      ["abort_all_requests must be a bool", "None"]),
}


@pytest.mark.parametrize("call", ["tensor", "disk", "disk path None", "surrogate version", "relabel surrogate",
                                  *MISTYPED_OPTIONS])
def test_mistyped_update_argument_changes_nothing(setup, call):
    """A valid update with a non-string or non-UTF-8 weight_version, a model_path that is not a path, a bool option
    that is not a bool or a load_format that is not a string: refused naming it, nothing loaded or relabelled."""
    engine, b, sd, _, _ = setup
    if call in MISTYPED_OPTIONS:
        res, expected = MISTYPED_OPTIONS[call](engine, b, sd)
    elif call == "surrogate version":
        res, expected = engine.update_weights_from_disk(str(b), weight_version="v\ud800"), ["weight_version",
                                                                                            "surrogate"]
    elif call == "relabel surrogate":
        with pytest.raises(ValueError, match="weight_version .* lone surrogate"):
            engine.update_weight_version("v\ud800")
        res, expected = (False, "weight_version lone surrogate"), ["weight_version"]
    elif call == "tensor":
        res, expected = engine.update_weights_from_tensor(list(sd.items()), weight_version=5), ["weight_version", "5"]
    elif call == "disk":
        res, expected = engine.update_weights_from_disk(str(b), weight_version=5), ["weight_version", "5"]
    else:
        res, expected = engine.update_weights_from_disk(None), ["model_path", "NoneType"]
    _check_refused(setup, res, expected)


def test_get_weights_by_name_with_a_mistyped_argument_is_a_clear_error(setup):
    """A name that is not a string or a truncate_size that is not an int raises ValueError naming the argument
    (they failed as a bare TypeError from a dict lookup or a slice); an int truncate_size reads the checkpoint."""
    engine, _, _, _, _ = setup
    for args, field in [((["model.norm.weight"],), "name"), ((NORM, "3"), "truncate_size"),
                        ((NORM, 2.0), "truncate_size"), ((Q, None), "truncate_size")]:
        with pytest.raises(ValueError, match=f"{field} must be"):
            engine.get_weights_by_name(*args)
    expected = read_state_dict(engine.model_path)[NORM][:3].tolist()
    assert engine.get_weights_by_name(NORM, 3) == engine.get_weights_by_name(NORM, np.int64(3)) == expected


def test_get_weights_by_name_max_values_bounds_the_slice(setup):
    """max_values refuses a slice of more values (ValueError naming truncate_size and the count) and reads one
    of at most that many as without it; a bad max_values is named."""
    engine, _, _, _, _ = setup
    q = read_state_dict(engine.model_path)[Q]  # [rows, cols]
    cols = q.shape[1]
    assert engine.get_weights_by_name(Q, 2, max_values=2 * cols) == q[:2].tolist()
    with pytest.raises(ValueError, match=f"first 3 rows of '{Q}' hold {3 * cols} values.*truncate_size"):
        engine.get_weights_by_name(Q, 3, max_values=2 * cols)
    with pytest.raises(ValueError, match=f"hold {q.numel()} values"):
        engine.get_weights_by_name(Q, 10**9, max_values=q.numel() - 1)
    assert engine.get_weights_by_name(NORM, 10**9, max_values=q.numel()) == \
        read_state_dict(engine.model_path)[NORM].tolist()
    for bad in (-1, 2.5, "7"):
        with pytest.raises(ValueError, match="max_values must be"):
            engine.get_weights_by_name(Q, 2, max_values=bad)


def test_get_weights_by_name_truncates_as_a_python_slice(setup):
    """truncate_size slices the rows of a 2-D weight and the elements of a 1-D one as a list slice does (SGLang's
    [:truncate_size]): 0 is empty and -1 all but the last, the same rule for both (2-D read 0 and -1 as one row)."""
    engine, _, _, _, _ = setup
    sd = read_state_dict(engine.model_path)
    for name in (Q, NORM):
        rows = sd[name].tolist()
        for k in (0, -1, -3, 2, 10**9):
            assert engine.get_weights_by_name(name, k) == rows[:k], (name, k)


def test_valid_update_still_works_after_refusals(setup, reference_outputs):
    """After every refusal above, a valid update loads and equals a fresh engine on B (runs last)."""
    engine, b, _, _, _ = setup
    ok, msg, _ = engine.update_weights_from_disk(str(b))
    assert ok, msg
    assert run(engine) == reference_outputs(b)
