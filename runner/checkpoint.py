"""Reading Hugging Face safetensors checkpoints: single-file or sharded via
`model.safetensors.index.json`.

`CheckpointIndex` parses every shard's header itself (8-byte length + JSON) so names, shapes and
dtypes can be checked, and truncated or corrupt files rejected, before a byte of tensor data is
read. Errors name the file and the tensor. It does not read .bin/.pt pickles (unsafe by design).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    SAFETENSORS_DTYPES.update({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2})


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8 or header_len > 100 << 20:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors header "
                                      f"(claims {header_len} bytes, file has {size})")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint file: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    data_len = size - 8 - header_len
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {e}") from e
        if end > data_len:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {end} of the data "
                                  f"section but the file holds {data_len}")
        entries[name] = TensorEntry(name, path, dtype, shape)
    return entries


class CheckpointIndex:
    def __init__(self, model_path: str | Path) -> None:
        root = Path(model_path)
        if not root.is_dir():
            raise CheckpointError(f"checkpoint directory {root} does not exist")
        index_file = root / "model.safetensors.index.json"
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_file}: unreadable index: {e}") from e
            files = sorted({root / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    missing = [n for n, fn in weight_map.items() if root / fn == f]
                    raise CheckpointError(f"{f}: shard listed in {index_file.name} is missing "
                                          f"(holds {len(missing)} tensors, e.g. {missing[0]!r})")
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{root}: no *.safetensors files (only safetensors checkpoints are read)")
        self.root = root
        self.entries: dict[str, TensorEntry] = {}
        for f in files:
            for name, entry in read_safetensors_header(f).items():
                if name in self.entries:
                    raise CheckpointError(f"tensor {name!r} appears in both {self.entries[name].file} and {f}")
                self.entries[name] = entry

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) file by file; each tensor is read when yielded."""
        wanted = set(self.entries) if names is None else set(names)
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self.entries[name].file, []).append(name)
        for f, file_names in sorted(by_file.items()):
            try:
                with safe_open(str(f), framework="pt") as handle:
                    for name in sorted(file_names):
                        yield name, handle.get_tensor(name)
            except CheckpointError:
                raise
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{f}: cannot read tensor data: {e}") from e
