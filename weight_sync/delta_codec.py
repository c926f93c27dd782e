"""The sparse weight-delta format: per-tensor encodings, the base checksum, and the one-blob wire form.

A delta moves a set of tensors from a *base* (bit patterns the receiver must hold) to a *result*. Per
tensor the sender compares bit patterns (the tensor viewed as an integer of its width) and picks whichever
of these costs the fewest bytes:

- positions (`pos`): `none` (nothing changed), `all` (every element, in order), `mask` (one bit per
  element, little-endian within a byte), `gaps` (LEB128 varints of p[i] - p[i-1], with p[-1] = -1, so
  a valid gap is >= 1: a zero gap is a duplicate and is refused, as is a position past the end);
- values (`val`): `raw` (the new elements' bytes, little-endian) or `diff` (LEB128 varints of the
  zigzag of new - old bit patterns, read as signed integers of the dtype's width: after one small optimizer step most changed bf16
  elements move by one or two units in the last place, so most diffs take one byte).

At ~2% of bf16 elements changed a gap plus a diff is ~2 bytes per changed element, so the payload
is ~1/50 of the dense tensor; 4-byte indices plus raw values would be 6 bytes.

The base checksum is weight_sync/delta_bits.py's (additive: cheap to keep current).

The wire form (`DeltaUpdate.to_bytes`) is a valid safetensors file: one U8 tensor `delta_payload` and
the JSON entry list in `__metadata__["delta_metadata"]`, so HTTP (base64), disk (a file), shared
memory and torch.distributed (a uint8 tensor) all carry the same bytes and nothing is ever unpickled.
`DeltaUpdate.from_blob` validates the structure (framing, lengths, offsets, field types, a truncated
blob); `decode_entry` validates one tensor's code (varints, counts, order, range). What the receiver's
weights are (names, shapes, the base) is the receiver's to check. Not here: choosing what to send
(weight_sync/delta.py) or applying it (runner/weights/delta.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from weight_sync.delta_bits import (  # noqa: F401 - re-exported: the format's public names
    BIT_DTYPES,
    DTYPE_NAMES,
    NAME_DTYPES,
    DeltaFormatError,
    check_dtype,
    combine,
    from_bits,
    hash_change,
    hash_terms,
    tensor_hash,
    to_bits,
)

FORMAT = "rollout-delta"
VERSION = 1
PAYLOAD_KEY = "delta_payload"
META_KEY = "delta_metadata"
STALE_BASE = "stale base"  # in every refusal because the receiver's weights are not the delta's base
POS_KINDS = ("none", "all", "mask", "gaps")
VAL_KINDS = ("raw", "diff")
MAX_VARINT_BYTES = 5  # 35 bits: gaps < 2^35 elements, zigzag diffs of 32-bit patterns < 2^33


# ---- varints ----------------------------------------------------------------------------------------
def varint_lengths(v: torch.Tensor) -> torch.Tensor:
    """Bytes of each non-negative value's LEB128 varint. [k] int64"""
    n = torch.ones_like(v)
    for k in range(1, MAX_VARINT_BYTES):
        n += (v >= (1 << (7 * k))).to(torch.int64)
    return n


def varint_encode(v: torch.Tensor) -> torch.Tensor:
    """Non-negative int64 values -> their LEB128 varints back to back. [sum(lengths)] uint8"""
    if v.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if int(v.min()) < 0 or int(v.max()) >= 1 << (7 * MAX_VARINT_BYTES):
        raise DeltaFormatError(f"varint_encode: values must lie in [0, 2^{7 * MAX_VARINT_BYTES})")
    n = varint_lengths(v)
    width = int(n.max())
    j = torch.arange(width, dtype=torch.int64)[None]  # [1, width]
    groups = (v[:, None] >> (7 * j)) & 0x7F  # [k, width]
    groups |= (j < n[:, None] - 1).to(torch.int64) << 7  # continuation bit on all but the last byte
    return groups[j < n[:, None]].to(torch.uint8)


def varint_decode(buf: torch.Tensor, count: int, what: str) -> torch.Tensor:
    """LEB128 varints -> exactly `count` int64 values; refuses truncated, over-long or miscounted codes."""
    if buf.numel() == 0:
        if count:
            raise DeltaFormatError(f"{what}: {count} varints announced, no bytes given (truncated)")
        return torch.empty(0, dtype=torch.int64)
    last = buf < 0x80  # uint8 compare: a byte without the continuation bit ends a varint
    if not bool(last[-1]):
        raise DeltaFormatError(f"{what}: the last varint is cut off (truncated payload)")
    ends = torch.nonzero(last).reshape(-1)
    if ends.numel() != count:
        raise DeltaFormatError(f"{what}: holds {ends.numel()} varints, {count} announced")
    if ends.numel() == buf.numel():  # every varint one byte (the common case after a small step)
        return buf.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
    lens = ends - starts + 1
    longest = int(lens.max())
    if longest > MAX_VARINT_BYTES:
        raise DeltaFormatError(f"{what}: a varint longer than {MAX_VARINT_BYTES} bytes")
    low = (buf & 0x7F).to(torch.int64)
    out = low[starts]
    for t in range(1, longest):  # only the (few) longer varints take these passes
        sel = torch.nonzero(lens > t).reshape(-1)
        out[sel] += low[starts[sel] + t] << (7 * t)
    return out


def zigzag(d: torch.Tensor) -> torch.Tensor:
    return (d << 1) ^ (d >> 63)


def unzigzag(z: torch.Tensor) -> torch.Tensor:
    return (z >> 1) ^ -(z & 1)


# ---- bitmasks ---------------------------------------------------------------------------------------
def mask_encode(mask: torch.Tensor) -> torch.Tensor:
    """[N] bool -> [ceil(N/8)] uint8, bit j of byte i is element 8i + j."""
    pad = (-mask.numel()) % 8
    m = torch.cat([mask.reshape(-1).to(torch.uint8), torch.zeros(pad, dtype=torch.uint8)]).view(-1, 8)
    out = m[:, 0].clone()
    for j in range(1, 8):  # uint8 throughout: one byte of temporaries per element
        out |= m[:, j] << j
    return out


def mask_decode(buf: torch.Tensor, numel: int, count: int, what: str) -> torch.Tensor:
    """-> the set positions (sorted int64); refuses set padding bits and a wrong count."""
    if buf.numel() != (numel + 7) // 8:
        raise DeltaFormatError(f"{what}: a mask of {numel} elements takes {(numel + 7) // 8} bytes, got {buf.numel()}")
    bits = ((buf[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)
    if bool(bits[numel:].any()):
        raise DeltaFormatError(f"{what}: mask sets a position past the tensor's {numel} elements")
    pos = torch.nonzero(bits[:numel]).reshape(-1)
    if pos.numel() != count:
        raise DeltaFormatError(f"{what}: mask sets {pos.numel()} positions, {count} announced")
    return pos


# ---- one tensor -------------------------------------------------------------------------------------
@dataclass
class EncodedTensor:
    entry: dict  # the JSON entry, without byte offsets
    pos_bytes: torch.Tensor  # uint8
    val_bytes: torch.Tensor  # uint8
    changed: int


def encode_tensor(name: str, base: torch.Tensor, new: torch.Tensor, base_hash: int) -> EncodedTensor:
    """Encode `new` relative to `base` (same dtype and shape, on the host) in the fewest bytes."""
    check_dtype(new.dtype, f"tensor {name!r}")
    if base.dtype != new.dtype or base.shape != new.shape:
        raise DeltaFormatError(f"tensor {name!r}: base {base.dtype} {tuple(base.shape)} and new {new.dtype} "
                               f"{tuple(new.shape)} differ; send a full sync")
    int_dtype, width = BIT_DTYPES[new.dtype]
    esize = width // 8
    bflat, nflat = base.reshape(-1), new.reshape(-1)
    changed = bflat.view(int_dtype) != nflat.view(int_dtype)  # [N] bool: compared in the native width
    numel = nflat.numel()
    pos = torch.nonzero(changed).reshape(-1)
    k = pos.numel()
    entry = {"name": name, "dtype": DTYPE_NAMES[new.dtype], "shape": list(new.shape), "base": base_hash}
    empty = torch.empty(0, dtype=torch.uint8)
    if k == 0:
        return EncodedTensor({**entry, "pos": "none", "val": "raw", "count": 0, "result": base_hash}, empty, empty, 0)
    ob, nb = to_bits(bflat[pos]), to_bits(nflat[pos])  # only the changed elements in int64: [k]
    entry["result"] = combine(base_hash, hash_change(pos, ob, nb, width))
    zz = zigzag(nb - ob)
    gaps = torch.diff(pos, prepend=pos.new_full((1,), -1))
    diff_changed = int(varint_lengths(zz).sum())
    costs = {("gaps", "raw"): int(varint_lengths(gaps).sum()) + k * esize,
             ("mask", "raw"): (numel + 7) // 8 + k * esize,
             ("all", "raw"): numel * esize}
    costs[("gaps", "diff")] = costs[("gaps", "raw")] - k * esize + diff_changed
    costs[("mask", "diff")] = costs[("mask", "raw")] - k * esize + diff_changed
    costs[("all", "diff")] = diff_changed + (numel - k)  # unchanged elements: a one-byte zero each
    pos_kind, val_kind = min(costs, key=lambda kv: (costs[kv], kv[0] == "all"))
    pos_bytes = varint_encode(gaps) if pos_kind == "gaps" else mask_encode(changed) if pos_kind == "mask" else empty
    count = numel if pos_kind == "all" else k
    if pos_kind == "all" and val_kind == "raw":
        val_bytes = nflat.contiguous().view(torch.uint8).clone()
    elif pos_kind == "all":
        val_bytes = varint_encode(zigzag(to_bits(nflat) - to_bits(bflat)))
    elif val_kind == "raw":
        val_bytes = nflat[pos].contiguous().view(torch.uint8)
    else:
        val_bytes = varint_encode(zz)
    return EncodedTensor({**entry, "pos": pos_kind, "val": val_kind, "count": count}, pos_bytes, val_bytes, k)


@dataclass
class DecodedTensor:
    """One entry's change: positions (None: every element) and either raw bit patterns or diffs."""
    entry: dict
    dtype: torch.dtype
    numel: int
    positions: torch.Tensor | None  # [count] int64, strictly increasing, < numel
    values: torch.Tensor  # [count] int64: signed patterns (val "raw") or their diffs (val "diff")

    @property
    def name(self) -> str:
        return self.entry["name"]

    def new_bits(self, old_bits: torch.Tensor) -> torch.Tensor:
        """The new (signed) patterns at `positions` given the old ones there; refuses a diff that leaves
        the dtype's range."""
        if self.entry["val"] == "raw":
            return self.values
        _, width = BIT_DTYPES[self.dtype]
        new = old_bits + self.values
        if new.numel() and (int(new.min()) < -(1 << (width - 1)) or int(new.max()) >= 1 << (width - 1)):
            raise DeltaFormatError(f"tensor {self.name!r}: a value diff leaves the {width}-bit range")
        return new


def decode_entry(entry: dict, payload: torch.Tensor) -> DecodedTensor:
    """Decode one (structurally validated) entry against the payload it points into."""
    name = entry["name"]
    what = f"delta tensor {name!r}"
    dtype = NAME_DTYPES[entry["dtype"]]
    numel = math.prod(entry["shape"])
    count, pos_kind, val_kind = entry["count"], entry["pos"], entry["val"]
    pos_buf = payload[entry["pos_bytes"][0]: entry["pos_bytes"][1]]
    val_buf = payload[entry["val_bytes"][0]: entry["val_bytes"][1]]
    if pos_kind in ("none", "all") and pos_buf.numel():
        raise DeltaFormatError(f"{what}: pos={pos_kind!r} carries no position bytes, got {pos_buf.numel()}")
    if pos_kind == "none" and count != 0:
        raise DeltaFormatError(f"{what}: pos='none' with count={count}")
    if pos_kind == "all" and count != numel:
        raise DeltaFormatError(f"{what}: pos='all' needs count={numel} (the tensor's elements), got {count}")
    if count > numel:
        raise DeltaFormatError(f"{what}: {count} changes for a tensor of {numel} elements")
    if pos_kind == "gaps":
        gaps = varint_decode(pos_buf, count, f"{what} positions")
        if count > 1 and int(gaps[1:].min()) < 1:
            raise DeltaFormatError(f"{what}: duplicate positions (a zero gap); positions must strictly increase")
        if count and int(gaps[0]) < 1:
            raise DeltaFormatError(f"{what}: the first gap is 0 (positions start at gap 1 = index 0)")
        positions = torch.cumsum(gaps, 0) - 1
        if count and int(positions[-1]) >= numel:
            raise DeltaFormatError(f"{what}: position {int(positions[-1])} is out of range for {numel} elements")
    elif pos_kind == "mask":
        positions = mask_decode(pos_buf, numel, count, f"{what} mask")
    else:
        positions = None if pos_kind == "all" else torch.empty(0, dtype=torch.int64)
    _, width = BIT_DTYPES[dtype]
    if val_kind == "raw":
        if val_buf.numel() != count * (width // 8):
            raise DeltaFormatError(f"{what}: {count} raw {entry['dtype']} values take {count * (width // 8)} bytes, "
                                   f"got {val_buf.numel()} (truncated payload?)")
        values = to_bits(val_buf.clone().view(dtype))  # clone: an odd offset cannot be viewed as 2 bytes if count else torch.empty(0, dtype=torch.int64)
    else:
        values = unzigzag(varint_decode(val_buf, count, f"{what} values"))
    return DecodedTensor(entry, dtype, numel, positions, values)


# ---- the blob -----------------------------------------------------------------------------------
_ENTRY_FIELDS = {"name": str, "dtype": str, "shape": list, "pos": str, "val": str, "count": int, "base": int,
                 "result": int, "pos_bytes": list, "val_bytes": list}


class DeltaUpdate:
    """A delta: JSON entries (one per tensor, byte ranges into `payload`) and the payload. [P] uint8"""

    def __init__(self, entries: list[dict], payload: torch.Tensor) -> None:
        self.entries, self.payload = entries, payload

    @classmethod
    def pack(cls, encoded: list[EncodedTensor]) -> DeltaUpdate:
        entries, parts, off = [], [], 0
        for e in encoded:
            entry = dict(e.entry)
            entry["pos_bytes"] = [off, off + e.pos_bytes.numel()]
            off += e.pos_bytes.numel()
            entry["val_bytes"] = [off, off + e.val_bytes.numel()]
            off += e.val_bytes.numel()
            parts += [e.pos_bytes, e.val_bytes]
            entries.append(entry)
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        return cls(entries, payload)

    def names(self) -> list[str]:
        return [e["name"] for e in self.entries]

    def _header(self) -> bytes:
        n = self.payload.numel()
        header = {"__metadata__": {"format": FORMAT, "version": str(VERSION), META_KEY: json.dumps(self.entries)},
                  PAYLOAD_KEY: {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}
        h = json.dumps(header, separators=(",", ":")).encode()
        return h + b" " * ((-len(h)) % 8)  # safetensors aligns the data start to 8 bytes

    def to_bytes(self) -> bytes:
        """A safetensors file: header {delta_payload: U8 [P], __metadata__: {format, version, delta_metadata}}."""
        h = self._header()
        return len(h).to_bytes(8, "little") + h + self.payload.contiguous().numpy().tobytes()

    def wire_nbytes(self) -> int:
        """The size of `to_bytes()`, without building it."""
        return 8 + len(self._header()) + self.payload.numel()

    def to_tensor(self) -> torch.Tensor:
        """The blob as a uint8 tensor (what the tensor transports carry). [B] uint8"""
        return torch.frombuffer(bytearray(self.to_bytes()), dtype=torch.uint8)

    @classmethod
    def from_blob(cls, blob) -> DeltaUpdate:
        """bytes, a 1-D uint8 tensor or a DeltaUpdate -> a structurally valid DeltaUpdate."""
        if isinstance(blob, DeltaUpdate):
            return cls(blob.entries, blob.payload).validated()
        if isinstance(blob, bytes | bytearray | memoryview):
            buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if len(blob) else torch.empty(0, dtype=torch.uint8)
        elif isinstance(blob, torch.Tensor):
            if blob.dtype != torch.uint8 or blob.dim() != 1:
                raise DeltaFormatError(f"a delta blob is a 1-D uint8 tensor, got {blob.dtype} {tuple(blob.shape)}")
            buf = blob.to("cpu").contiguous()
        else:
            raise DeltaFormatError(f"a delta is bytes, a uint8 tensor or a DeltaUpdate, got {type(blob).__name__}")
        if buf.numel() < 8:
            raise DeltaFormatError(f"delta blob of {buf.numel()} bytes: shorter than its 8-byte header length")
        hlen = int.from_bytes(buf[:8].numpy().tobytes(), "little")
        if hlen > buf.numel() - 8:
            raise DeltaFormatError(f"delta blob: header of {hlen} bytes announced, {buf.numel() - 8} present (truncated)")
        try:
            header = json.loads(buf[8: 8 + hlen].numpy().tobytes())
            meta = header["__metadata__"]
            if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
                raise DeltaFormatError(f"not a {FORMAT} v{VERSION} blob (format {meta.get('format')!r}, "
                                       f"version {meta.get('version')!r})")
            entries = json.loads(meta[META_KEY])
            start, end = header[PAYLOAD_KEY]["data_offsets"]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            if isinstance(e, DeltaFormatError):
                raise
            raise DeltaFormatError(f"delta blob header is malformed: {type(e).__name__}: {e}") from None
        data = buf[8 + hlen:]
        if not (isinstance(start, int) and isinstance(end, int)) or start != 0 or end != data.numel():
            raise DeltaFormatError(f"delta blob: payload announced as bytes [{start}, {end}), {data.numel()} "
                                   f"present (truncated or padded)")
        return cls(entries, data).validated()

    def validated(self) -> DeltaUpdate:
        """Check every entry's fields, kinds and byte ranges (not the codes inside: decode_entry)."""
        if not isinstance(self.entries, list):
            raise DeltaFormatError("delta metadata must be a list of entries")
        if not isinstance(self.payload, torch.Tensor) or self.payload.dtype != torch.uint8 or self.payload.dim() != 1:
            raise DeltaFormatError("delta payload must be a 1-D uint8 tensor")
        size, seen = self.payload.numel(), set()
        for i, e in enumerate(self.entries):
            if not isinstance(e, dict):
                raise DeltaFormatError(f"delta entry {i} is not an object")
            for key, typ in _ENTRY_FIELDS.items():
                if not isinstance(e.get(key), typ) or isinstance(e.get(key), bool):
                    raise DeltaFormatError(f"delta entry {i} ({e.get('name')!r}): field {key!r} must be "
                                           f"{typ.__name__}, got {e.get(key)!r}")
            name = e["name"]
            if name in seen:
                raise DeltaFormatError(f"delta tensor {name!r} appears twice")
            seen.add(name)
            if e["dtype"] not in NAME_DTYPES or e["pos"] not in POS_KINDS or e["val"] not in VAL_KINDS:
                raise DeltaFormatError(f"delta tensor {name!r}: dtype {e['dtype']!r} / pos {e['pos']!r} / val "
                                       f"{e['val']!r}: choose from {sorted(NAME_DTYPES)} / {POS_KINDS} / {VAL_KINDS}")
            if not all(isinstance(d, int) and d >= 0 for d in e["shape"]) or e["count"] < 0:
                raise DeltaFormatError(f"delta tensor {name!r}: bad shape {e['shape']} or count {e['count']}")
            for key in ("pos_bytes", "val_bytes"):
                r = e[key]
                if len(r) != 2 or not all(isinstance(x, int) for x in r) or not 0 <= r[0] <= r[1] <= size:
                    raise DeltaFormatError(f"delta tensor {name!r}: {key} {r} outside the payload's {size} bytes "
                                           f"(truncated payload?)")
        return self



def delta_names(blob) -> list[str]:
    """The tensor names a delta touches, read from its header (for a group's snapshot)."""
    return DeltaUpdate.from_blob(blob).names()
