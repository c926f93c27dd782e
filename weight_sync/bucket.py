"""Flattened tensor buckets: the wire format for moving many weights as one tensor.

A bucket packs tensors that share one device into a single 1-D tensor plus a list of `TensorMeta`
(name, shape, dtype, offsets). Sending one big tensor instead of hundreds of small ones is what makes
CUDA IPC handles, shared memory and `broadcast` cheap. The layout built here is SGLang's current one
(its `supports_multi_dtypes` bucket), whatever the dtypes: the flat tensor is uint8, the tensors' bytes
back to back in order without padding, offsets (`start_idx`, `end_idx`, `numel`) count bytes, and each
entry's bytes are viewed as its own dtype. That is also the layout of SGLang's bucketed
`update_weights_from_distributed` broadcast. Received buckets may also use SGLang's original layout
(one dtype, the flat tensor of that dtype, offsets in elements); both are accepted.

SGLang's interface is mirrored (`get_flattened_tensor()`, `get_metadata()`, `reconstruct_tensors()`,
metadata fields `start_idx` / `end_idx` / `numel`), and `from_dict` accepts our plain dict, SGLang's
metadata objects (torch.Size / torch.dtype fields) and any object with SGLang's two getters.

What this module does: pack (one `torch.cat`), unpack (views, no copies, except an entry whose byte
offset is not aligned to its dtype, which is copied), convert to and from a dict of plain Python types
plus the flat tensor (for transport), validate received metadata (names, dtypes, sizes, bounds, no two
entries overlapping) before any tensor is built, and split a model's weights lazily into size-bounded
single-dtype buckets (`iter_buckets`).

What it does not do: move bytes between processes or devices, or load weights into a model; those are
the transports' and the runner's jobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

NamedTensors = Iterable[tuple[str, Tensor]]
NameMap = Callable[[str], str | None]

# Only real, fixed-width dtypes cross the wire; anything else (complex, quantized, unsigned >8 bit)
# is refused rather than guessed at.
_DTYPE_NAMES = (
    "float16", "bfloat16", "float32", "float64",
    "int8", "int16", "int32", "int64", "uint8", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)  # fmt: skip
_STR_TO_DTYPE: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
_DTYPE_TO_STR: dict[torch.dtype, str] = {d: n for n, d in _STR_TO_DTYPE.items()}


def dtype_to_str(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`; ValueError for a dtype outside the whitelist."""
    try:
        return _DTYPE_TO_STR[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(_STR_TO_DTYPE)}") from None


def str_to_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`; ValueError for an unknown name (no aliases like "half")."""
    try:
        return _STR_TO_DTYPE[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}; supported: {sorted(_STR_TO_DTYPE)}") from None


def as_dtype(value) -> torch.dtype:
    """A whitelisted `torch.dtype` from a dtype name or a `torch.dtype`; ValueError otherwise."""
    if isinstance(value, torch.dtype):
        dtype_to_str(value)  # whitelist check
        return value
    return str_to_dtype(value)


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a bucket: `flat[start:end]`, in units of the flat tensor's elements
    (elements of `dtype` in a one-dtype bucket, bytes in a uint8 one), viewed as `dtype` and `shape`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    # SGLang's FlattenedTensorMetadata field names, so code written against it reads ours.
    @property
    def start_idx(self) -> int:
        return self.start

    @property
    def end_idx(self) -> int:
        return self.end

    @property
    def numel(self) -> int:
        """Length of the entry in the flat tensor (SGLang's meaning: bytes in a uint8 bucket)."""
        return self.end - self.start


class FlattenedTensorBucket:
    """Many same-device tensors packed into one 1-D uint8 tensor of their bytes (or, when received, one
    1-D tensor of their common dtype with element offsets: SGLang's original layout).

    Build it from `(name, tensor)` pairs, or from an existing `flattened_tensor` plus `metadata`
    (validated). `named_tensors()` returns views into the flat tensor, not copies.
    """

    supports_multi_dtypes = True  # SGLang's flag: senders may put several dtypes in one bucket

    def __init__(
        self,
        named_tensors: NamedTensors | None = None,
        *,
        flattened_tensor: Tensor | None = None,
        metadata: list | None = None,
    ):
        if named_tensors is not None:
            if flattened_tensor is not None or metadata is not None:
                raise ValueError("pass either named_tensors or flattened_tensor+metadata, not both")
            self.flattened_tensor, self.metadata = _flatten(named_tensors)
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("pass named_tensors, or both flattened_tensor and metadata")
            if not isinstance(metadata, (list, tuple)):
                raise ValueError(f"bucket metadata must be a list, got {type(metadata).__name__}")  # noqa: TRY004
            metadata = [_meta_from_any(i, e) for i, e in enumerate(metadata)]
            _validate(flattened_tensor, metadata)
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    @property
    def dtype(self) -> torch.dtype:
        """The flat tensor's dtype: uint8 for a bucket built here (the tensors' for a typed one received)."""
        return self.flattened_tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.flattened_tensor.device

    @property
    def nbytes(self) -> int:
        return self.flattened_tensor.numel() * self.flattened_tensor.element_size()

    def __len__(self) -> int:
        return len(self.metadata)

    def __repr__(self) -> str:
        return f"FlattenedTensorBucket({len(self)} tensors, {self.dtype}, {self.device}, {self.nbytes} bytes)"

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        """`(name, tensor)` pairs; each shares storage with `flattened_tensor`, except an entry of a
        mixed-dtype bucket whose byte offset is not a multiple of its dtype's size (torch cannot view
        it). In a one-dtype bucket every offset is aligned, so every entry is a view."""
        flat = self.flattened_tensor
        out = []
        for m in self.metadata:
            region = flat[m.start : m.end]
            if m.dtype != flat.dtype:  # uint8 bytes -> the entry's dtype
                if (flat.storage_offset() + m.start) % m.dtype.itemsize:
                    region = region.clone()
                region = region.view(m.dtype)
            out.append((m.name, region.view(m.shape)))
        return out

    # SGLang's names for the same things.
    def get_flattened_tensor(self) -> Tensor:
        """The flat tensor: uint8 bytes for a bucket built here, as SGLang's class returns."""
        return self.flattened_tensor

    def get_metadata(self) -> list[TensorMeta]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, Tensor]]:
        return self.named_tensors()

    def to_dict(self) -> dict:
        """The flat tensor plus metadata as plain types (lists, str, int) for pickling or RPC."""
        return {
            "flattened_tensor": self.flattened_tensor,
            "metadata": [
                {"name": m.name, "shape": list(m.shape), "dtype": dtype_to_str(m.dtype),
                 "start": m.start, "end": m.end}
                for m in self.metadata
            ],
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d) -> FlattenedTensorBucket:
        """A validated bucket from a received payload; ValueError names the first bad entry.

        Accepts `to_dict()`'s form, SGLang's (`{"flattened_tensor", "metadata"}` with
        `FlattenedTensorMetadata`-like entries: attributes or keys name, shape, dtype, start_idx,
        end_idx, numel; torch.Size / torch.dtype or plain values), and any object with SGLang's
        `get_flattened_tensor()` / `get_metadata()`. Every defect, wrong types included, is a
        ValueError, so a receiver needs one `except ValueError` to turn any malformed bucket into
        `(False, reason)`; nothing is viewed before the whole metadata list has passed.
        """
        if hasattr(d, "get_flattened_tensor") and hasattr(d, "get_metadata"):
            flat, entries = d.get_flattened_tensor(), d.get_metadata()
        elif isinstance(d, Mapping) and "flattened_tensor" in d and "metadata" in d:
            flat, entries = d["flattened_tensor"], d["metadata"]
        else:
            raise ValueError("a bucket is a dict with keys 'flattened_tensor' and 'metadata', or an object with "
                             "get_flattened_tensor() and get_metadata()")
        return cls(flattened_tensor=flat, metadata=entries)


def as_one_bucket(named_tensors, load_format: str | None, last_wins: bool = True) -> FlattenedTensorBucket:
    """An Engine update argument as one bucket: with load_format "flattened_bucket" a bucket, its dict (ours
    or SGLang's) or a list of them (merged into one); otherwise (name, tensor) pairs or a mapping. A name
    given twice (in two buckets, or twice in the pairs) takes its last value, as Engine's weight update does;
    `last_wins=False` (a LoRA adapter's tensors) refuses it instead."""
    if load_format == "flattened_bucket":
        parts = named_tensors if isinstance(named_tensors, list) else [named_tensors]
        buckets = [b if isinstance(b, FlattenedTensorBucket) else FlattenedTensorBucket.from_dict(b) for b in parts]
        if len(buckets) == 1:
            return buckets[0]
        pairs = [p for b in buckets for p in b.named_tensors()]
    else:
        pairs = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    return FlattenedTensorBucket(_last_value_of_each(pairs) if last_wins else pairs)


def _last_value_of_each(pairs: list) -> list:
    """(name, tensor) pairs with each name once, at its first place, holding its last value."""
    last: dict = {}
    for item in pairs:
        if not isinstance(item, tuple | list) or len(item) != 2:
            return pairs  # not pairs: FlattenedTensorBucket names the problem
        name, tensor = item
        try:
            last[name] = tensor
        except TypeError:  # an unhashable name: left for FlattenedTensorBucket to refuse
            return pairs
    return list(last.items()) if len(last) < len(pairs) else pairs


def _flatten(named_tensors: NamedTensors) -> tuple[Tensor, list[TensorMeta]]:
    """One `torch.cat` of the tensors' bytes (SGLang's layout for one dtype too); one device, unique names."""
    pairs = []
    names: set[str] = set()
    for name, tensor in named_tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in names:
            raise ValueError(f"duplicate tensor name {name!r} in bucket")
        dtype_to_str(tensor.dtype)  # refuse unsupported dtypes up front
        if pairs and tensor.device != pairs[0][1].device:
            raise ValueError(f"tensor {name!r} is on {tensor.device}, but this bucket holds tensors on "
                             f"{pairs[0][1].device}; a bucket takes one device")
        names.add(name)
        pairs.append((name, tensor.detach()))
    if not pairs:
        raise ValueError("cannot build a bucket from zero tensors")
    flats, metadata, offset = [], [], 0
    for name, tensor in pairs:
        flat = tensor.reshape(-1).contiguous().view(torch.uint8)  # [numel * itemsize]
        metadata.append(TensorMeta(name, tuple(tensor.shape), tensor.dtype, offset, offset + flat.numel()))
        flats.append(flat)
        offset += flat.numel()
    return torch.cat(flats), metadata  # [total bytes] uint8


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _field(e, key: str, default=None):
    return e.get(key, default) if isinstance(e, Mapping) else getattr(e, key, default)


def _meta_from_any(index: int, e) -> TensorMeta:
    """Our dict entry, SGLang's metadata (dict or object), or a TensorMeta -> TensorMeta (types
    checked later, in `_validate`, except the dtype, which must resolve here)."""
    if isinstance(e, TensorMeta):
        return e
    if not isinstance(e, Mapping) and not hasattr(e, "start_idx"):
        raise ValueError(f"metadata entry {index} is a {type(e).__name__}, not a dict or tensor metadata")
    name = _field(e, "name")
    sglang = _field(e, "start_idx") is not None or _field(e, "end_idx") is not None
    keys = ("name", "shape", "dtype", "start_idx", "end_idx") if sglang else ("name", "shape", "dtype", "start", "end")
    missing = [k for k in keys if _field(e, k) is None]
    if missing:
        raise ValueError(f"metadata entry {index} ({name!r}) lacks keys {missing}")
    shape = _field(e, "shape")
    if not isinstance(shape, (list, tuple)):  # torch.Size is a tuple
        raise ValueError(f"metadata entry {name!r}: shape {shape!r} is not a list")  # noqa: TRY004
    try:
        dtype = as_dtype(_field(e, "dtype"))
    except ValueError as err:
        raise ValueError(f"metadata entry {name!r}: {err}") from None
    start, end = (_field(e, "start_idx"), _field(e, "end_idx")) if sglang else (_field(e, "start"), _field(e, "end"))
    numel = _field(e, "numel")
    if numel is not None and _is_int(start) and _is_int(end) and numel != end - start:
        raise ValueError(f"metadata entry {name!r}: numel {numel!r} != end_idx - start_idx = {end - start}")
    return TensorMeta(name, tuple(shape), dtype, start, end)


def _validate(flat: Tensor, metadata: list[TensorMeta]) -> None:
    """Checks every entry against the flat tensor, then that no two entries overlap; raises
    ValueError naming the entry (both, for an overlap)."""
    if not isinstance(flat, Tensor) or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D torch.Tensor")
    if not flat.is_contiguous():  # its entries are viewed as other dtypes, which needs stride 1
        raise ValueError(f"flattened_tensor must be contiguous (stride {flat.stride()}); pass .contiguous()")
    dtype_to_str(flat.dtype)
    numel = flat.numel()
    seen = set()
    for i, m in enumerate(metadata):
        if not isinstance(m, TensorMeta):
            raise TypeError(f"metadata entry {i} is a {type(m).__name__}, not a TensorMeta")
        if not isinstance(m.name, str) or not m.name:
            raise ValueError(f"metadata entry {i}: name {m.name!r} is not a non-empty string")
        if m.name in seen:
            raise ValueError(f"metadata entry {m.name!r}: duplicate name")
        seen.add(m.name)
        if not isinstance(m.shape, tuple) or not all(_is_int(s) and s >= 0 for s in m.shape):
            raise ValueError(f"metadata entry {m.name!r}: shape {m.shape!r} is not non-negative ints")
        dtype_to_str(m.dtype)
        if m.dtype != flat.dtype and flat.dtype != torch.uint8:
            raise ValueError(f"metadata entry {m.name!r}: dtype {m.dtype} != flattened tensor's {flat.dtype} "
                             f"(a mixed-dtype bucket carries uint8 bytes)")
        if not (_is_int(m.start) and _is_int(m.end) and 0 <= m.start <= m.end <= numel):
            raise ValueError(
                f"metadata entry {m.name!r}: offsets [{m.start}, {m.end}) out of bounds for {numel} elements"
            )
        if m.dtype == flat.dtype:
            if m.end - m.start != math.prod(m.shape):
                raise ValueError(
                    f"metadata entry {m.name!r}: {m.end - m.start} elements in [{m.start}, {m.end}) "
                    f"but shape {list(m.shape)} needs {math.prod(m.shape)}"
                )
        elif m.end - m.start != math.prod(m.shape) * m.dtype.itemsize:
            raise ValueError(
                f"metadata entry {m.name!r}: {m.end - m.start} bytes in [{m.start}, {m.end}) but shape "
                f"{list(m.shape)} of {m.dtype} needs {math.prod(m.shape) * m.dtype.itemsize} bytes"
            )
    # Overlaps: sorted by start, each non-empty entry must begin at or after the previous one's end.
    spans = sorted((m for m in metadata if m.end > m.start), key=lambda m: (m.start, m.end))
    for prev, cur in zip(spans, spans[1:]):
        if cur.start < prev.end:
            raise ValueError(f"metadata entries {prev.name!r} [{prev.start}, {prev.end}) and {cur.name!r} "
                             f"[{cur.start}, {cur.end}) overlap")


def iter_named_tensors(
    source: NamedTensors | nn.Module | Mapping[str, Tensor], name_map: NameMap | None = None
) -> Iterator[tuple[str, Tensor]]:
    """Lazily yields detached `(name, tensor)` pairs from a module, a state dict or an iterable.

    A module contributes its `named_parameters()` only (buffers are not weights an engine loads;
    tied parameters appear once, under their first name). `name_map` renames each tensor
    (trainer name -> HF name); returning None drops it (e.g. a value head).
    """
    if isinstance(source, nn.Module):
        pairs = source.named_parameters()
    elif isinstance(source, Mapping):
        pairs = source.items()
    else:
        pairs = source
    for name, tensor in pairs:
        if name_map is not None:
            name = name_map(name)
            if name is None:
                continue
        yield name, tensor.detach()


def iter_buckets(
    named_tensors: NamedTensors | nn.Module | Mapping[str, Tensor],
    bucket_bytes: int = 512 << 20,
    name_map: NameMap | None = None,
) -> Iterator[FlattenedTensorBucket]:
    """Splits weights into single-dtype buckets of at most `bucket_bytes` each, lazily.

    One pending bucket is kept per (dtype, device); it is packed and yielded when the next tensor would
    push it past `bucket_bytes`, so besides the inputs only about one bucket per dtype is alive at once.
    A tensor larger than `bucket_bytes` is yielded alone in its own bucket. Order within a dtype follows
    the input; buckets of different dtypes interleave. Names (after `name_map`) must be unique.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    pending: dict[tuple[torch.dtype, torch.device], tuple[list[tuple[str, Tensor]], int]] = {}
    seen: set[str] = set()
    for name, tensor in iter_named_tensors(named_tensors, name_map):
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r} (after name_map)")
        seen.add(name)
        key = (tensor.dtype, tensor.device)
        nbytes = tensor.numel() * tensor.element_size()
        group, group_bytes = pending.get(key, ([], 0))
        if group and group_bytes + nbytes > bucket_bytes:
            yield FlattenedTensorBucket(group)
            group, group_bytes = [], 0
        group.append((name, tensor))
        group_bytes += nbytes
        if group_bytes >= bucket_bytes:  # full (or one oversized tensor): no need to wait
            yield FlattenedTensorBucket(group)
            group, group_bytes = [], 0
        pending[key] = (group, group_bytes)
    for group, _ in pending.values():
        if group:
            yield FlattenedTensorBucket(group)
