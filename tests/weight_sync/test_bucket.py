"""Flattened-bucket wire format: packing, unpacking, validation and lazy bucketing."""

import pytest
import torch
from torch import nn

from weight_sync import FlattenedTensorBucket, TensorMeta, dtype_to_str, iter_buckets, str_to_dtype


def _tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 4, generator=g).to(dtype)),
        ("b.bias", torch.randn(5, generator=g).to(dtype)),
        ("c.scalar", torch.randn((), generator=g).to(dtype)),
        ("d.empty", torch.randn(0, 2, generator=g).to(dtype)),
    ]


def _mixed_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8), nn.Linear(8, 64))
    model[1].to(torch.bfloat16)
    model[3].to(torch.bfloat16)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_round_trip_is_bit_exact_views(dtype):
    """A one-dtype bucket is SGLang's layout (uint8 bytes, byte offsets); unpacked tensors equal the
    inputs bit for bit and are views of the one flat tensor."""
    src = _tensors(dtype)
    bucket = FlattenedTensorBucket(src)
    assert bucket.flattened_tensor.dim() == 1 and bucket.dtype == torch.uint8
    assert torch.equal(bucket.get_flattened_tensor(), torch.cat([t.reshape(-1).view(torch.uint8) for _, t in src]))
    sizes = [t.numel() * t.element_size() for _, t in src]
    assert [(m.start_idx, m.end_idx, m.numel) for m in bucket.metadata] == [
        (sum(sizes[:i]), sum(sizes[: i + 1]), sizes[i]) for i in range(len(src))]
    assert bucket.nbytes == sum(sizes)
    out = bucket.named_tensors()
    flat_ptr = bucket.flattened_tensor.untyped_storage().data_ptr()
    assert [n for n, _ in out] == [n for n, _ in src]
    for (_, want), (_, got) in zip(src, out):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        assert got.untyped_storage().data_ptr() == flat_ptr


def test_to_dict_from_dict_round_trip_plain_types():
    """to_dict carries only plain types besides the flat tensor, and from_dict rebuilds it without copying."""
    bucket = FlattenedTensorBucket(_tensors(torch.bfloat16))
    d = bucket.to_dict()
    want = {"name": "a.weight", "shape": [3, 4], "dtype": "bfloat16", "start": 0, "end": 24}  # bytes
    assert d["metadata"][0] == want
    back = FlattenedTensorBucket.from_dict(d)
    assert back.flattened_tensor is bucket.flattened_tensor
    assert back.metadata == bucket.metadata
    for (_, a), (_, b) in zip(bucket.named_tensors(), back.named_tensors()):
        assert torch.equal(a, b)


def test_a_strided_flat_tensor_is_a_value_error():
    """from_dict's contract (every defect a ValueError): a non-contiguous flattened_tensor is refused by name
    instead of failing later with torch's RuntimeError when an entry is viewed."""
    d = FlattenedTensorBucket(_tensors(torch.bfloat16)).to_dict()
    strided = torch.zeros(2 * d["flattened_tensor"].numel(), dtype=torch.uint8)[::2]
    with pytest.raises(ValueError, match="flattened_tensor must be contiguous"):
        FlattenedTensorBucket.from_dict({**d, "flattened_tensor": strided})


def test_flattening_detaches():
    """A bucket built from parameters carries no autograd graph."""
    p = nn.Parameter(torch.randn(4, 4))
    bucket = FlattenedTensorBucket([("p", p * 2)])
    assert not bucket.flattened_tensor.requires_grad and bucket.flattened_tensor.grad_fn is None


def test_mixed_dtypes_pack_as_bytes_and_round_trip():
    """Mixed dtypes make a uint8 bucket of the tensors' bytes back to back (SGLang's layout); each
    unpacks bit-exact in its own dtype; mixed devices are refused, naming the tensor."""
    src = [("x", torch.randn(3)), ("y", torch.randn(2, 3).to(torch.bfloat16)), ("z", torch.arange(5))]
    bucket = FlattenedTensorBucket(src)
    want_bytes = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in src])
    assert bucket.dtype == torch.uint8 and torch.equal(bucket.flattened_tensor, want_bytes)
    assert [(m.start, m.end) for m in bucket.metadata] == [(0, 12), (12, 24), (24, 64)]
    for (name, want), (got_name, got) in zip(src, FlattenedTensorBucket.from_dict(bucket.to_dict()).named_tensors()):
        assert got_name == name and got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(ValueError, match="'m'.*one device"):
        FlattenedTensorBucket([("x", torch.zeros(2)), ("m", torch.zeros(2, device="meta"))])


def test_duplicate_and_empty_inputs_raise():
    """Names in a bucket are unique and a bucket is never empty."""
    with pytest.raises(ValueError, match="duplicate.*'x'"):
        FlattenedTensorBucket([("x", torch.zeros(2)), ("x", torch.zeros(2))])
    with pytest.raises(ValueError, match="zero tensors"):
        FlattenedTensorBucket([])


def _bad_dict(**changes):
    d = FlattenedTensorBucket(_tensors()).to_dict()
    d["metadata"][1].update(changes)
    return d


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"end": 10_000}, "'b.bias'.*out of bounds"),
        ({"start": -1}, "'b.bias'.*out of bounds"),
        ({"start": 14, "end": 13}, "'b.bias'.*out of bounds"),
        ({"dtype": "float13"}, "'b.bias'.*unknown dtype"),
        ({"dtype": "bfloat16"}, "'b.bias'.*bfloat16 needs 10 bytes"),  # byte offsets: the size shows it
        ({"name": "a.weight"}, "'a.weight'.*duplicate"),
        ({"shape": [6]}, "'b.bias'.*needs 24 bytes"),
        ({"shape": [5.0]}, "'b.bias'.*shape"),
        ({"shape": 5}, "'b.bias'.*shape"),
        ({"start": True}, "'b.bias'.*out of bounds"),
    ],
)
def test_from_dict_rejects_bad_entries(changes, pattern):
    """from_dict refuses bad offsets, bad dtype, duplicate names and size mismatch, naming the entry."""
    with pytest.raises(ValueError, match=pattern):
        FlattenedTensorBucket.from_dict(_bad_dict(**changes))


def test_from_dict_rejects_malformed_payload():
    """Missing keys, a non-1-D flat tensor and a missing metadata field are ValueErrors too."""
    good = FlattenedTensorBucket(_tensors()).to_dict()
    with pytest.raises(ValueError, match="flattened_tensor"):
        FlattenedTensorBucket.from_dict({"metadata": []})
    with pytest.raises(ValueError, match="1-D"):
        FlattenedTensorBucket.from_dict({**good, "flattened_tensor": good["flattened_tensor"].view(1, -1)})
    del good["metadata"][0]["end"]
    with pytest.raises(ValueError, match="'a.weight'.*end"):
        FlattenedTensorBucket.from_dict(good)


def test_dtype_strings_whitelist():
    """dtype names round-trip for the whitelist and anything else is refused."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8, torch.bool):
        assert str_to_dtype(dtype_to_str(dtype)) is dtype
    if hasattr(torch, "float8_e4m3fn"):
        assert dtype_to_str(torch.float8_e4m3fn) == "float8_e4m3fn"
    for bad in ("half", "torch.float32", "complex64", ""):
        with pytest.raises(ValueError):
            str_to_dtype(bad)
    with pytest.raises(ValueError):
        dtype_to_str(torch.complex64)


def test_tensor_meta_direct_construction_validated():
    """A bucket built from flat tensor + TensorMeta list is checked like a received dict."""
    flat = torch.zeros(6)
    ok = FlattenedTensorBucket(flattened_tensor=flat, metadata=[TensorMeta("w", (2, 3), torch.float32, 0, 6)])
    assert ok.named_tensors()[0][1].shape == (2, 3)
    with pytest.raises(ValueError, match="'w'"):
        FlattenedTensorBucket(flattened_tensor=flat, metadata=[TensorMeta("w", (2, 4), torch.float32, 0, 6)])


@pytest.mark.parametrize("bucket_bytes", [1, 256, 1024, 4096, 1 << 30])
def test_iter_buckets_covers_every_parameter_once(bucket_bytes):
    """Each parameter lands in exactly one single-dtype bucket, bit-exact, within bucket_bytes or alone."""
    model = _mixed_model()
    params = dict(model.named_parameters())
    seen = {}
    for bucket in iter_buckets(model, bucket_bytes=bucket_bytes):
        assert len({m.dtype for m in bucket.metadata}) == 1
        assert bucket.nbytes <= bucket_bytes or len(bucket) == 1
        for name, t in bucket.named_tensors():
            assert name not in seen
            seen[name] = t
    assert seen.keys() == params.keys()
    for name, p in params.items():
        assert seen[name].dtype == p.dtype and torch.equal(seen[name], p.detach())


def test_iter_buckets_packs_greedily():
    """Buckets fill up to bucket_bytes: four 64-byte tensors make two 128-byte buckets."""
    tensors = {f"t{i}": torch.zeros(16) for i in range(4)}
    buckets = list(iter_buckets(tensors, bucket_bytes=128))
    assert [len(b) for b in buckets] == [2, 2]


def test_iter_buckets_accepts_iterable_and_mapping():
    """A state dict and a generator of pairs bucket the same way as the module."""
    model = _mixed_model()
    want = sorted(n for n, _ in model.named_parameters())
    for source in (dict(model.named_parameters()), (kv for kv in model.named_parameters())):
        got = sorted(n for b in iter_buckets(source, bucket_bytes=512) for n, _ in b.named_tensors())
        assert got == want


def test_iter_buckets_name_map_renames_and_skips():
    """name_map translates names before bucketing and None drops a tensor."""
    model = _mixed_model()

    def name_map(name):
        return None if name.startswith("3.") else f"model.layers.{name}"

    names = {n for b in iter_buckets(model, name_map=name_map) for n, _ in b.named_tensors()}
    assert names == {f"model.layers.{i}.{p}" for i in range(3) for p in ("weight", "bias")}


def test_iter_buckets_rejects_duplicate_mapped_names():
    """Two trainer names mapped onto one HF name is an error, not a silent overwrite."""
    model = _mixed_model()
    with pytest.raises(ValueError, match="duplicate"):
        list(iter_buckets(model, name_map=lambda n: "same"))


def test_iter_buckets_is_lazy():
    """Buckets come out before the input is exhausted, so memory stays near one bucket per dtype."""
    consumed = []

    def gen():
        for i in range(10):
            consumed.append(i)
            yield f"t{i}", torch.zeros(16)

    first = next(iter_buckets(gen(), bucket_bytes=128))
    assert len(first) == 2 and len(consumed) <= 3


def test_package_is_a_leaf():
    """weight_sync imports none of runner, rollout or trainers (it is a leaf both ends use)."""
    import ast
    from pathlib import Path

    import weight_sync

    for path in Path(weight_sync.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in {"runner", "rollout", "trainers"} for n in names), path
