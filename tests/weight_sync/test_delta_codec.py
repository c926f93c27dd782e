"""The sparse delta code round-trips exactly and is checked, against naive pure-Python references.

Oracles: a byte-by-byte LEB128 decoder, a per-element Python-int evaluation of the checksum's defining
formula, and element-by-element bit comparison of the decoded tensor with the target. Cases come from
hypothesis (random sizes, change rates, dtypes, magnitudes).
"""

from __future__ import annotations

import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync import delta_bits as db
from weight_sync import delta_codec as dc

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def naive_varints(buf: bytes) -> list[int]:
    out, cur, shift = [], 0, 0
    for byte in buf:
        cur |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            out.append(cur)
            cur, shift = 0, 0
    assert shift == 0, "dangling varint"
    return out


def naive_hash(t: torch.Tensor) -> int:
    """The checksum's definition, one element at a time in Python integers."""
    _, width = dc.BIT_DTYPES[t.dtype]
    bits = dc.to_bits(t).tolist()
    P = db._P
    sums = [0, 0]
    for i, v in enumerate(bits):
        words = [v & 0xFFFF] if width == 16 else [v & 0xFFFF, v >> 16]
        us = [(w - 65536 if w >= 32768 else w) + 32769 for w in words]
        for h in (0, 1):
            inner = sum(u * int(db._R[h][i % db._B, k]) for k, u in enumerate(us))
            s = int(db._mix(torch.tensor([(i // db._B) * 2 + h + (1 << 40)]))[0]) % (P - 1) + 1
            sums[h] = (sums[h] + (inner % P) * s) % P
    return (sums[0] << 31) | sums[1]


def apply_naive(base: torch.Tensor, entry: dict, payload: torch.Tensor) -> torch.Tensor:
    """Decode an entry with the naive varint reader and plain Python loops."""
    width = dc.BIT_DTYPES[base.dtype][1]
    bits = dc.to_bits(base).tolist()
    pb = bytes(payload[entry["pos_bytes"][0]: entry["pos_bytes"][1]].tolist())
    vb = bytes(payload[entry["val_bytes"][0]: entry["val_bytes"][1]].tolist())
    if entry["pos"] == "none":
        positions = []
    elif entry["pos"] == "all":
        positions = list(range(len(bits)))
    elif entry["pos"] == "mask":
        positions = [i for i in range(len(bits)) if pb[i // 8] >> (i % 8) & 1]
    else:
        positions, p = [], -1
        for g in naive_varints(pb):
            p += g
            positions.append(p)
    if entry["val"] == "raw":
        step = width // 8
        values = [int.from_bytes(vb[k * step:(k + 1) * step], "little", signed=True) for k in range(len(positions))]
    else:
        values = [bits[p] + ((z >> 1) ^ -(z & 1)) for p, z in zip(positions, naive_varints(vb))]
    for p, v in zip(positions, values):
        bits[p] = v
    return dc.from_bits(torch.tensor(bits, dtype=torch.int64), base.dtype).view(base.shape)


@st.composite
def tensor_pairs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from([(1,), (7,), (64,), (33, 5), (3, 4, 9), (300, 11)]))
    seed = draw(st.integers(0, 2**31 - 1))
    rate = draw(st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]))
    scale = draw(st.sampled_from([1e-6, 1e-3, 1.0]))
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    noise = torch.randn(shape, generator=g) * scale * (torch.rand(shape, generator=g) < rate)
    new = (base.float() + noise).to(dtype)
    return base, new


@settings(max_examples=60, deadline=None)
@given(tensor_pairs())
def test_encode_matches_naive_decoder_bit_for_bit(pair):
    """Every chosen code, decoded naively, gives exactly the new tensor; the result checksum is the new tensor's."""
    base, new = pair
    enc = dc.encode_tensor("w", base, new, dc.tensor_hash(base))
    update = dc.DeltaUpdate.pack([enc])
    assert torch.equal(apply_naive(base, update.entries[0], update.payload).view(torch.uint8),
                       new.view(torch.uint8))
    assert enc.changed == int((dc.to_bits(base) != dc.to_bits(new)).sum())
    assert update.entries[0]["result"] == dc.tensor_hash(new)
    # and the library's own decoder agrees
    dec = dc.decode_entry(update.entries[0], update.payload)
    bits = dc.to_bits(base)
    if dec.positions is None:
        bits = dec.new_bits(bits)
    else:
        bits[dec.positions] = dec.new_bits(bits[dec.positions])
    assert torch.equal(dc.from_bits(bits, new.dtype).view(torch.uint8), new.reshape(-1).view(torch.uint8))


@settings(max_examples=25, deadline=None)
@given(tensor_pairs())
def test_encoding_is_never_larger_than_dense(pair):
    """The chosen code costs at most the dense tensor (plus nothing): the cheapest is picked."""
    base, new = pair
    enc = dc.encode_tensor("w", base, new, 0)
    assert enc.pos_bytes.numel() + enc.val_bytes.numel() <= new.numel() * new.element_size()


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 9000), st.integers(0, 1000))
def test_checksum_matches_its_definition(dtype, n, seed):
    """tensor_hash (blocked float64 products) equals the per-element Python evaluation of the formula."""
    t = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    assert dc.tensor_hash(t) == naive_hash(t)


def test_checksum_slices_add_up():
    """Partial checksums of disjoint slices (with their global indices) combine to the whole tensor's."""
    t = torch.randn(40, 300).to(torch.bfloat16)
    whole = dc.tensor_hash(t)
    h = 0
    for rows in (range(0, 13), range(13, 40)):
        part = t[rows.start: rows.stop]
        off = rows.start * 300
        h = dc.combine(h, (dc.tensor_hash(part, lambda s, e, off=off: torch.arange(s, e) + off) >> 31,
                           dc.tensor_hash(part, lambda s, e, off=off: torch.arange(s, e) + off) & db._M31))
    assert h == whole
    changed = t.clone()
    changed[5, 7] = 1.5
    assert dc.tensor_hash(changed) != whole


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**35 - 1), max_size=50))
def test_varints_round_trip(values):
    """varint_encode / varint_decode agree with a byte-by-byte LEB128 reader."""
    v = torch.tensor(values, dtype=torch.int64)
    buf = dc.varint_encode(v)
    assert naive_varints(bytes(buf.tolist())) == values
    assert dc.varint_decode(buf, len(values), "t").tolist() == values


def _entry_with_positions(positions: list[int], numel: int = 64) -> tuple[dict, torch.Tensor]:
    gaps = torch.diff(torch.tensor(positions, dtype=torch.int64), prepend=torch.tensor([-1]))
    pos = dc.varint_encode(gaps)
    vals = torch.ones(len(positions), dtype=torch.bfloat16).view(torch.uint8)
    enc = dc.EncodedTensor({"name": "w", "dtype": "bfloat16", "shape": [numel], "pos": "gaps", "val": "raw",
                            "count": len(positions), "base": 0, "result": 0}, pos, vals, len(positions))
    update = dc.DeltaUpdate.pack([enc])
    return update.entries[0], update.payload


def test_bad_codes_are_refused_by_name():
    """Duplicates, out-of-range positions, truncated varints and short value runs each raise naming the fault."""
    try:  # a decreasing run has a negative gap: not even encodable
        _entry_with_positions([5, 4])
        raise AssertionError("a decreasing run was encoded")
    except dc.DeltaFormatError as e:
        assert "varint_encode" in str(e)
    for words, positions in {"duplicate": [3, 3, 9], "out of range": [3, 64]}.items():
        entry, payload = _entry_with_positions(positions)
        try:
            dc.decode_entry(entry, payload)
        except dc.DeltaFormatError as e:
            assert words.split()[0] in str(e) or "gap" in str(e), (words, e)
        else:
            raise AssertionError(f"{words}: accepted")
    entry, payload = _entry_with_positions([1, 2, 300], numel=400)
    entry["val_bytes"][1] -= 1  # one value byte short
    try:
        dc.decode_entry(entry, payload)
        raise AssertionError("short values accepted")
    except dc.DeltaFormatError as e:
        assert "truncated" in str(e)
    cut = torch.tensor([0x81, 0x82], dtype=torch.uint8)  # continuation bit on the last byte
    try:
        dc.varint_decode(cut, 1, "t")
        raise AssertionError("cut varint accepted")
    except dc.DeltaFormatError as e:
        assert "cut off" in str(e)


def test_blob_is_safetensors_and_truncation_is_refused():
    """The wire blob loads with the safetensors library; every truncation of it is refused."""
    base = torch.randn(50, 20).to(torch.bfloat16)
    new = base.clone()
    new[3, 4] = 2.0
    update = dc.DeltaUpdate.pack([dc.encode_tensor("a", base, new, dc.tensor_hash(base)),
                                  dc.encode_tensor("b", new, base, dc.tensor_hash(new))])
    blob = update.to_bytes()
    assert len(blob) == update.wire_nbytes()
    loaded = safetensors.torch.load(blob)
    assert torch.equal(loaded[dc.PAYLOAD_KEY], update.payload)
    again = dc.DeltaUpdate.from_blob(blob)
    assert again.entries == update.entries and torch.equal(again.payload, update.payload)
    for cut in (1, 5, len(blob) // 2, len(blob) - 1):
        try:
            dc.DeltaUpdate.from_blob(blob[:cut])
            raise AssertionError(f"blob cut at {cut} accepted")
        except dc.DeltaFormatError as e:
            assert "truncated" in str(e) or "header" in str(e) or "shorter" in str(e)
