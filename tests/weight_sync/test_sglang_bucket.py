"""SGLang's flattened-bucket interface: its buckets are accepted, ours read like its, and metadata that
overlaps or runs out of range is refused before any tensor is built.

The SGLang side is written here from its documented layout, not with weight_sync's code: a metadata
dataclass with torch.Size / torch.dtype fields (name, shape, dtype, start_idx, end_idx, numel) and a
bucket with `get_flattened_tensor()` / `get_metadata()`, in both of SGLang's layouts (its original one
dtype with element offsets; its current uint8 bytes with byte offsets, for one dtype or several).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from weight_sync import FlattenedTensorBucket


@dataclass
class SglangMeta:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class SglangBucket:
    """Only SGLang's two getters: what `from_dict` must accept by duck typing."""

    def __init__(self, flat, metadata) -> None:
        self._flat, self._metadata = flat, metadata

    def get_flattened_tensor(self):
        return self._flat

    def get_metadata(self):
        return self._metadata


def sglang_bytes_bucket(named) -> SglangBucket:
    """SGLang's multi-dtype layout: uint8 bytes back to back; offsets and numel in bytes."""
    parts, metas, offset = [], [], 0
    for name, t in named:
        b = t.reshape(-1).view(torch.uint8)
        metas.append(SglangMeta(name, t.shape, t.dtype, offset, offset + b.numel(), b.numel()))
        parts.append(b)
        offset += b.numel()
    return SglangBucket(torch.cat(parts), metas)


def sglang_typed_bucket(named) -> SglangBucket:
    """SGLang's original layout: one dtype, offsets and numel in elements."""
    parts, metas, offset = [], [], 0
    for name, t in named:
        metas.append(SglangMeta(name, t.shape, t.dtype, offset, offset + t.numel(), t.numel()))
        parts.append(t.reshape(-1))
        offset += t.numel()
    return SglangBucket(torch.cat(parts), metas)


def mixed():
    g = torch.Generator().manual_seed(1)
    return [("w.bf16", torch.randn(3, generator=g).to(torch.bfloat16)),  # 6 bytes: the next is misaligned
            ("w.f32", torch.randn(2, 2, generator=g)),
            ("w.i64", torch.arange(3)),
            ("w.scalar", torch.tensor(2.5, dtype=torch.float16))]


def assert_same(got, want) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def test_sglang_buckets_are_accepted_in_both_layouts():
    """from_dict takes SGLang's bucket objects (duck-typed getters) and its {"flattened_tensor",
    "metadata"} dict with SGLang metadata, in the bytes and the one-dtype layouts, bit-exact."""
    named = mixed()
    assert_same(FlattenedTensorBucket.from_dict(sglang_bytes_bucket(named)).named_tensors(), named)
    b = sglang_bytes_bucket(named)
    as_dict = {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}
    assert_same(FlattenedTensorBucket.from_dict(as_dict).reconstruct_tensors(), named)
    typed = [(n, t.float()) for n, t in named]
    assert_same(FlattenedTensorBucket.from_dict(sglang_typed_bucket(typed)).named_tensors(), typed)
    plain = {"flattened_tensor": b.get_flattened_tensor(),
             "metadata": [{"name": m.name, "shape": list(m.shape), "dtype": str(m.dtype).removeprefix("torch."),
                           "start_idx": m.start_idx, "end_idx": m.end_idx, "numel": m.numel}
                          for m in b.get_metadata()]}
    assert_same(FlattenedTensorBucket.from_dict(plain).named_tensors(), named)


def test_our_buckets_read_like_sglangs():
    """Our bucket has SGLang's getters, flag and metadata fields, and SGLang's own reconstruction
    recipe (slice start_idx:end_idx, view as dtype, reshape) applied to it gives the tensors back."""
    named = [(n, t) for n, t in mixed() if n != "w.bf16"]  # aligned, so SGLang's plain .view works
    bucket = FlattenedTensorBucket(named)
    assert FlattenedTensorBucket.supports_multi_dtypes is True
    flat = bucket.get_flattened_tensor()
    assert flat.dtype == torch.uint8
    rebuilt = [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in bucket.get_metadata()]
    assert_same(rebuilt, named)
    assert all(m.numel == m.end_idx - m.start_idx for m in bucket.get_metadata())
    assert_same(bucket.reconstruct_tensors(), named)


def test_one_dtype_bucket_is_sglangs_bytes_layout():
    """A one-dtype bucket built here is what SGLang's class builds for it: uint8 bytes back to back,
    start_idx/end_idx/numel in bytes (compared field by field with SGLang's layout written above)."""
    named = [("w.a", torch.randn(3, 5)), ("w.b", torch.randn(7)), ("w.c", torch.tensor(1.5))]
    ours, theirs = FlattenedTensorBucket(named), sglang_bytes_bucket(named)
    flat = ours.get_flattened_tensor()
    assert flat.dtype == torch.uint8 and torch.equal(flat, theirs.get_flattened_tensor())
    assert [(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) for m in ours.get_metadata()] == \
        [(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) for m in theirs.get_metadata()]


def test_engine_loads_sglangs_one_dtype_bytes_bucket(tiny_llama, ckpt_factory):
    """The engine's update_weights_from_tensor(load_format="flattened_bucket") takes SGLang's bytes
    bucket of one dtype (and its original typed one) and then equals a fresh engine on those weights."""
    from rollout import Engine
    from tests.rl_surface.conftest import read_state_dict

    b = ckpt_factory("llama", seed=1)
    sd = sorted(read_state_dict(b).items())
    kw = dict(device="cpu", max_total_tokens=512, show_progress=False)
    with Engine(str(b), **kw) as fresh:
        want = fresh.get_weights_checksum()["checksum"]
    for make in (sglang_bytes_bucket, sglang_typed_bucket):
        with Engine(str(tiny_llama), **kw) as engine:
            bucket = make(sd)
            payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
            ok, msg = engine.update_weights_from_tensor([payload], load_format="flattened_bucket")
            assert ok, msg
            assert engine.get_weights_checksum()["checksum"] == want, make.__name__


@pytest.mark.parametrize("change, pattern", [
    ({1: {"start_idx": 4, "end_idx": 20}}, r"'w.bf16' \[0, 6\) and 'w.f32' \[4, 20\) overlap"),
    ({2: {"start_idx": 18, "end_idx": 42}}, r"'w.f32' \[6, 22\) and 'w.i64' \[18, 42\) overlap"),
    ({3: {"start_idx": 47, "end_idx": 49}}, r"'w.scalar'.*out of bounds for 48"),
    ({3: {"start_idx": 100, "end_idx": 102}}, r"'w.scalar'.*out of bounds"),
    ({1: {"numel": 15}}, r"'w.f32'.*numel 15"),
    ({1: {"shape": torch.Size([3, 2])}}, r"'w.f32'.*needs 24 bytes"),
    ({0: {"dtype": torch.complex64}}, r"'w.bf16'.*unsupported dtype"),
])
def test_bad_sglang_metadata_is_refused_before_any_tensor_is_built(change, pattern, monkeypatch):
    """Overlapping, out-of-range or inconsistent entries are refused with the entry's name (both
    names for an overlap), and no tensor is viewed or copied before the refusal."""
    b = sglang_bytes_bucket(mixed())
    metas = b.get_metadata()
    for i, fields in change.items():
        for k, v in fields.items():
            setattr(metas[i], k, v)
        if "start_idx" in fields and "numel" not in fields:
            metas[i].numel = metas[i].end_idx - metas[i].start_idx
    built = []
    monkeypatch.setattr(FlattenedTensorBucket, "named_tensors", lambda self: built.append(1))
    with pytest.raises(ValueError, match=pattern):
        FlattenedTensorBucket.from_dict(b)
    assert built == []


def test_overlap_in_our_dict_form_is_refused():
    """The same overlap check guards our own dict form (what RemoteEngine's shared memory carries)."""
    d = FlattenedTensorBucket([("a", torch.zeros(4)), ("b", torch.zeros(4))]).to_dict()
    d["metadata"][1].update(start=8, end=24)  # byte offsets: b would start inside a
    with pytest.raises(ValueError, match="'a'.*'b'.*overlap"):
        FlattenedTensorBucket.from_dict(d)
    d["metadata"][1].update(start=4, end=8, name="a")
    with pytest.raises(ValueError, match="duplicate"):
        FlattenedTensorBucket.from_dict(d)
