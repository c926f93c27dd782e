"""Flattened tensor buckets: the wire format for moving many weights as one tensor.

A bucket packs tensors that share one dtype and one device into a single 1-D tensor plus a list of
`TensorMeta` (name, shape, dtype, element offsets). Sending one big tensor instead of hundreds of small
ones is what makes CUDA IPC handles, shared memory and `broadcast` cheap. The design is ours, in the
spirit of SGLang's `FlattenedTensorBucket`.

What this module does: pack (one `torch.cat`), unpack (views, no copies), convert to and from a dict of
plain Python types plus the flat tensor (for transport), validate a received dict, and split a model's
weights lazily into size-bounded single-dtype buckets (`iter_buckets`).

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


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a bucket: `flat[start:end].view(shape)` (element offsets)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int


class FlattenedTensorBucket:
    """Many same-dtype, same-device tensors packed into one 1-D tensor.

    Build it from `(name, tensor)` pairs, or from an existing `flattened_tensor` plus `metadata`
    (validated). `named_tensors()` returns views into the flat tensor, never copies.
    """

    def __init__(
        self,
        named_tensors: NamedTensors | None = None,
        *,
        flattened_tensor: Tensor | None = None,
        metadata: list[TensorMeta] | None = None,
    ):
        if named_tensors is not None:
            if flattened_tensor is not None or metadata is not None:
                raise ValueError("pass either named_tensors or flattened_tensor+metadata, not both")
            self.flattened_tensor, self.metadata = _flatten(named_tensors)
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("pass named_tensors, or both flattened_tensor and metadata")
            _validate(flattened_tensor, metadata)
            self.flattened_tensor, self.metadata = flattened_tensor, list(metadata)

    @property
    def dtype(self) -> torch.dtype:
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
        """`(name, view)` pairs; each view shares storage with `flattened_tensor`."""
        flat = self.flattened_tensor
        return [(m.name, flat[m.start : m.end].view(m.shape)) for m in self.metadata]

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
    def from_dict(cls, d: Mapping) -> FlattenedTensorBucket:
        """Inverse of `to_dict`; every entry is checked, ValueError names the first bad one.

        A received payload gets ValueError for every defect, wrong types included, so a receiver
        needs one `except ValueError` to turn any malformed bucket into `(False, reason)`.
        """
        if not isinstance(d, Mapping) or "flattened_tensor" not in d or "metadata" not in d:
            raise ValueError("bucket dict needs keys 'flattened_tensor' and 'metadata'")
        entries = d["metadata"]
        if not isinstance(entries, (list, tuple)):
            raise ValueError(f"bucket metadata must be a list, got {type(entries).__name__}")  # noqa: TRY004
        metadata = [_meta_from_dict(i, e) for i, e in enumerate(entries)]
        return cls(flattened_tensor=d["flattened_tensor"], metadata=metadata)


def _flatten(named_tensors: NamedTensors) -> tuple[Tensor, list[TensorMeta]]:
    """One `torch.cat` of detached 1-D views; checks one dtype, one device, unique names."""
    names, flats, metadata = set(), [], []
    dtype = device = None
    offset = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in names:
            raise ValueError(f"duplicate tensor name {name!r} in bucket")
        if dtype is None:
            dtype, device = tensor.dtype, tensor.device
            dtype_to_str(dtype)  # refuse unsupported dtypes up front
        elif tensor.dtype != dtype or tensor.device != device:
            raise ValueError(
                f"tensor {name!r} is {tensor.dtype} on {tensor.device}, but this bucket holds "
                f"{dtype} on {device}; a bucket takes one dtype and one device"
            )
        names.add(name)
        flats.append(tensor.detach().reshape(-1))  # [numel]
        metadata.append(TensorMeta(name, tuple(tensor.shape), dtype, offset, offset + tensor.numel()))
        offset += tensor.numel()
    if not flats:
        raise ValueError("cannot build a bucket from zero tensors")
    return torch.cat(flats), metadata  # [total_numel]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _meta_from_dict(index: int, e) -> TensorMeta:
    if not isinstance(e, Mapping):
        raise ValueError(f"metadata entry {index} is a {type(e).__name__}, not a dict")  # noqa: TRY004
    missing = {"name", "shape", "dtype", "start", "end"} - set(e)
    if missing:
        raise ValueError(f"metadata entry {index} ({e.get('name')!r}) lacks keys {sorted(missing)}")
    name, shape = e["name"], e["shape"]
    if not isinstance(shape, (list, tuple)):
        raise ValueError(f"metadata entry {name!r}: shape {shape!r} is not a list")  # noqa: TRY004
    try:
        dtype = str_to_dtype(e["dtype"])
    except ValueError as err:
        raise ValueError(f"metadata entry {name!r}: {err}") from None
    return TensorMeta(name, tuple(shape), dtype, e["start"], e["end"])


def _validate(flat: Tensor, metadata: list[TensorMeta]) -> None:
    """Checks every entry against the flat tensor; raises ValueError naming the entry."""
    if not isinstance(flat, Tensor) or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D torch.Tensor")
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
        if m.dtype != flat.dtype:
            raise ValueError(f"metadata entry {m.name!r}: dtype {m.dtype} != flattened tensor's {flat.dtype}")
        if not (_is_int(m.start) and _is_int(m.end) and 0 <= m.start <= m.end <= numel):
            raise ValueError(
                f"metadata entry {m.name!r}: offsets [{m.start}, {m.end}) out of bounds for {numel} elements"
            )
        if m.end - m.start != math.prod(m.shape):
            raise ValueError(
                f"metadata entry {m.name!r}: {m.end - m.start} elements in [{m.start}, {m.end}) "
                f"but shape {list(m.shape)} needs {math.prod(m.shape)}"
            )


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
