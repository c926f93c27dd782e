"""Reading Hugging Face safetensors checkpoints: single-file or sharded via
`model.safetensors.index.json`, as one consistent snapshot of the directory.

`CheckpointIndex(path)` opens the directory once and, relative to that handle, reads the index (and
`config.json`) and opens every shard, all at construction. Every later read comes from those open files,
never from a path again, so a directory replaced meanwhile by an atomic saver (weight_sync/disk.py:
write a temp dir, rename it into place) is seen either whole as it was when opened or not at all (a file
already unlinked fails to open: a clean error, nothing read). A shard rewritten in place (`cp` over it)
is the one case an open file does not isolate: each read checks that the file still has the size and
modification time it had when opened, a short read is an error, and `check_unchanged()` (called after
the last read of a load) catches a write that landed in between, so such a load fails cleanly instead of
mixing two checkpoints. Tensors are read with pread, never through a mapping: a mapped file truncated
under the reader kills the process (SIGBUS). It parses every shard's header itself (8-byte length +
JSON) so names, shapes, dtypes and byte ranges are checked, and truncated or corrupt files rejected,
before a byte of tensor data is read. Shard names from the index must stay inside the directory. Errors
name the file and the tensor.

It does not read .bin/.pt pickles (unsafe by design) and does not load anything into a model.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

# safetensors dtype codes -> torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    SAFETENSORS_DTYPES.update({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2})

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MAX_HEADER_BYTES = 100 << 20


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int = 0  # byte range in the file (header included), [begin, end)
    end: int = 0


def parse_safetensors_header(path: Path, read_at, size: int) -> dict[str, TensorEntry]:
    """Entries of one safetensors file of `size` bytes; `read_at(n, offset) -> bytes`."""
    head = read_at(8, 0)
    if len(head) < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > size - 8 or header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors header "
                              f"(claims {header_len} bytes, file has {size})")
    try:
        header = json.loads(read_at(header_len, 8))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    data_start, data_len = 8 + header_len, size - 8 - header_len
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {e!r}") from e
        if end > data_len:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {end} of the data "
                                  f"section but the file holds {data_len}")
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != nbytes:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: data_offsets "
                                  f"[{begin}, {end}) do not hold shape {list(shape)} of {dtype} ({nbytes} bytes)")
        entries[name] = TensorEntry(name, path, dtype, shape, data_start + begin, data_start + end)
    return entries


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The entries of one file, read by path (for tools; loads use CheckpointIndex's snapshot)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return parse_safetensors_header(Path(path), lambda n, off: os.pread(f.fileno(), n, off), size)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint file: {e}") from e


def _check_inside(index_file: Path, shard: object) -> str:
    """A shard name from the index, refused unless it is a relative path inside the directory."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index_file}: shard file name {shard!r} is not a non-empty string")
    parts = PurePosixPath(shard).parts
    if shard.startswith(("/", "\\")) or os.path.isabs(shard) or ".." in parts or "\\" in shard:
        raise CheckpointError(f"{index_file}: shard {shard!r} lies outside the checkpoint directory "
                              f"(absolute paths and '..' are refused)")
    return shard


def _open_regular(dir_fd: int, name: str, root: Path) -> int:
    """Open a regular file only. O_NONBLOCK: opening a FIFO (or a device) must not block the caller;
    it is refused by the S_ISREG check right after (O_NONBLOCK changes nothing for a regular file)."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{root / name}: not a regular file (only regular files are read from a checkpoint)")
    return fd


class CheckpointIndex:
    """One checkpoint directory, opened once: entries (name -> TensorEntry) and the tensor data.

    Use as a context manager (or call close()) to close the files; tensors already yielded stay valid
    (each is its own buffer).
    """

    def __init__(self, model_path: str | os.PathLike) -> None:
        if "\x00" in os.fspath(model_path):  # the OS would refuse it deep inside open() with a bare ValueError
            raise CheckpointError(f"checkpoint directory {str(model_path)!r}: a path cannot hold a NUL byte")
        root = Path(model_path)
        try:
            dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint directory {root} does not exist") from None
        except NotADirectoryError:
            raise CheckpointError(f"checkpoint directory {root} is not a directory (pass the directory that holds "
                                  f"config.json and the safetensors files)") from None
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {root}: cannot open: {e}") from e
        self.root = root
        self.entries: dict[str, TensorEntry] = {}
        self._files: dict[Path, tuple[int, int, int]] = {}  # path -> (fd, size, mtime_ns) at open
        self._closed = False
        try:
            listing = set(os.listdir(dir_fd))
            self.config_text = self._read_text(dir_fd, CONFIG_FILE) if CONFIG_FILE in listing else None
            if INDEX_FILE in listing:
                index_file = root / INDEX_FILE
                try:
                    weight_map = json.loads(self._read_text(dir_fd, INDEX_FILE))["weight_map"]
                    if not isinstance(weight_map, dict):
                        raise TypeError("weight_map is not an object")
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{index_file}: unreadable index: {e!r}") from e
                files = sorted({_check_inside(index_file, f) for f in weight_map.values()})
            else:
                weight_map = {}
                files = sorted(n for n in listing if n.endswith(".safetensors"))
                if not files:
                    raise CheckpointError(f"{root}: no *.safetensors files (only safetensors checkpoints are read)")
            for f in files:
                self._open_shard(dir_fd, f, weight_map)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(dir_fd)

    def _read_text(self, dir_fd: int, name: str) -> str:
        try:
            fd = _open_regular(dir_fd, name, self.root)
        except OSError as e:
            raise CheckpointError(f"{self.root / name}: cannot open: {e}") from e
        try:
            with os.fdopen(fd, "rb") as f:
                return f.read().decode()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.root / name}: cannot read: {e}") from e

    def _open_shard(self, dir_fd: int, name: str, weight_map: dict) -> None:
        path = self.root / name
        try:
            fd = _open_regular(dir_fd, name, self.root)
        except FileNotFoundError:
            held = [n for n, fn in weight_map.items() if fn == name]
            what = f"listed in {INDEX_FILE} is missing (holds {len(held)} tensors, e.g. {held[:1]})" if held else \
                "vanished while the checkpoint was being opened"
            raise CheckpointError(f"{path}: shard {what}") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open checkpoint file: {e}") from e
        # Kept open: an unlinked or renamed-away file stays readable through it.
        self._files[path] = (fd, -1, -1)
        try:
            st = os.fstat(fd)
            self._files[path] = (fd, st.st_size, st.st_mtime_ns)
            entries = parse_safetensors_header(path, lambda n, off: os.pread(fd, n, off), st.st_size)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read checkpoint file: {e}") from e
        for tname, entry in entries.items():
            if tname in self.entries:
                raise CheckpointError(f"tensor {tname!r} appears in both {self.entries[tname].file} and {path}")
            self.entries[tname] = entry

    def read(self, name: str) -> torch.Tensor:
        """One tensor, read into its own buffer."""
        entry = self.entries[name]
        if self._closed:
            raise CheckpointError(f"{entry.file}: checkpoint was closed before tensor {name!r} was read")
        numel = math.prod(entry.shape)
        if numel == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        fd = self._check_file(entry.file)
        raw = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
        view, done = memoryview(raw.numpy()), 0
        try:
            while done < len(view):  # one read returns at most ~2 GiB on Linux
                n = os.preadv(fd, [view[done:]], entry.begin + done)
                if n == 0:
                    raise CheckpointError(f"{entry.file}: ended while tensor {name!r} was being read (the file "
                                          f"was truncated or rewritten during the load)")
                done += n
        except OSError as e:
            raise CheckpointError(f"{entry.file}: cannot read tensor {name!r}: {e}") from e
        return raw.view(entry.dtype).view(entry.shape)

    def _check_file(self, path: Path) -> int:
        fd, size, mtime_ns = self._files[path]
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot stat checkpoint file: {e}") from e
        if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
            raise CheckpointError(f"{path}: the file was rewritten in place while the checkpoint was being loaded "
                                  f"(size {size} -> {st.st_size} bytes): nothing of it is kept; write checkpoints "
                                  f"to a new file or directory and rename it into place")
        return fd

    def check_unchanged(self) -> None:
        """CheckpointError if any shard was written to since it was opened (see the module doc)."""
        for path in self._files:
            self._check_file(path)

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) file by file, in name order; each tensor is read when yielded."""
        wanted = set(self.entries) if names is None else set(names)
        for name in sorted(wanted, key=lambda n: (str(self.entries[n].file), n)):
            yield name, self.read(name)

    def close(self) -> None:
        files, self._files = getattr(self, "_files", {}), {}  # {} if __init__ failed before opening any
        self._closed = True
        for fd, _, _ in files.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:  # an index opened and never loaded (a refused update) still closes its files
        self.close()

    def __enter__(self) -> CheckpointIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
