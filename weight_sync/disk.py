"""Atomic Hugging Face checkpoints: the disk path from trainer to engine.

`save_hf_checkpoint` writes safetensors shards (plus `model.safetensors.index.json` when there is more
than one), `config.json` and any extra files (tokenizer, generation config) into a temp dir beside
`out_dir`, fsyncs them, and renames the dir into place. A reader (`update_weights_from_disk`) therefore
sees either the old checkpoint or the complete new one, never a half-written one; between the two renames
that swap an existing `out_dir` aside there is a brief moment with no `out_dir` at all.

What it does not do: write optimizer state, convert fused trainer weights (use `name_map` for renames
only), or notify an engine; the caller calls `engine.update_weights_from_disk(out_dir)` afterwards.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor, nn

from weight_sync.bucket import NamedTensors, NameMap, iter_named_tensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def save_hf_checkpoint(
    model_or_named_tensors: nn.Module | Mapping[str, Tensor] | NamedTensors,
    out_dir: str | os.PathLike,
    *,
    config: dict | str | os.PathLike | None = None,
    name_map: NameMap | None = None,
    max_shard_bytes: int = 2 << 30,
    extra_files: Iterable[str | os.PathLike] = (),
) -> Path:
    """Writes an HF-loadable checkpoint to `out_dir` atomically and returns `out_dir` as a Path.

    A module contributes its `state_dict()` (parameters and persistent buffers, as `save_pretrained`
    does); tied weights are saved once per name, each as its own copy. `config` is a dict (dumped as
    JSON) or the path of a config.json to copy; without it the dir holds weights only. Tensors are
    moved to CPU, made contiguous and un-aliased shard by shard, so host memory peaks near one shard.
    On any error the temp dir is removed and an existing `out_dir` is left untouched.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    # is_file, not "exists and not is_dir": a directory another writer is swapping is briefly absent.
    if out_dir.is_file():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    extra_files = [Path(f) for f in extra_files]
    for f in extra_files:
        if not f.is_file():
            raise FileNotFoundError(f"extra file {f} does not exist")
        if f.name in (CONFIG_FILE, INDEX_FILE) or (f.name.startswith("model") and f.suffix == ".safetensors"):
            raise ValueError(f"extra file {f.name!r} would overwrite a file this function writes")
    if isinstance(model_or_named_tensors, nn.Module):
        model_or_named_tensors = model_or_named_tensors.state_dict()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_shards(iter_named_tensors(model_or_named_tensors, name_map), tmp_dir, max_shard_bytes)
        if config is not None:
            _write_config(config, tmp_dir / CONFIG_FILE)
        for f in extra_files:
            shutil.copyfile(f, tmp_dir / f.name)
        for f in tmp_dir.iterdir():
            _fsync(f)
        _fsync(tmp_dir)
        _swap_into_place(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _write_shards(named_tensors: NamedTensors, tmp_dir: Path, max_shard_bytes: int) -> None:
    """Greedy sharding in input order; shards get their final `-of-N` names once N is known."""
    shard: dict[str, Tensor] = {}
    shard_ptrs: set[int] = set()  # storages already in this shard
    shard_bytes = 0
    shard_files: list[Path] = []
    weight_map: dict[str, int] = {}  # name -> shard index
    total_bytes = 0

    def flush() -> None:
        path = tmp_dir / f"shard-{len(shard_files):05d}.tmp"
        save_file(shard, str(path), metadata={"format": "pt"})  # "format" is required by transformers
        shard_files.append(path)

    for name, tensor in named_tensors:
        if name in weight_map or name in shard:
            raise ValueError(f"duplicate tensor name {name!r} (after name_map)")
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
            shard, shard_ptrs, shard_bytes = {}, set(), 0
        shard[name] = _to_saveable(tensor, shard_ptrs)
        weight_map[name] = len(shard_files)
        shard_bytes += nbytes
        total_bytes += nbytes
    if not weight_map:
        raise ValueError("no tensors to save")
    flush()

    num_shards = len(shard_files)
    if num_shards == 1:
        shard_files[0].rename(tmp_dir / SINGLE_FILE)
        return
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    for path, final in zip(shard_files, names):
        path.rename(tmp_dir / final)
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": {name: names[i] for name, i in sorted(weight_map.items())},
    }
    (tmp_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _to_saveable(tensor: Tensor, shard_ptrs: set[int]) -> Tensor:
    """Detached, contiguous CPU tensor that owns its storage outright.

    safetensors refuses tensors that share storage (tied weights, views of one bucket), so any tensor
    that is a view of a larger storage, or whose storage is already in this shard, is cloned.
    """
    t = tensor.detach().to("cpu").contiguous()
    storage = t.untyped_storage()
    if storage.nbytes() != t.numel() * t.element_size() or storage.data_ptr() in shard_ptrs:
        t = t.clone()
    shard_ptrs.add(t.untyped_storage().data_ptr())
    return t


def _write_config(config: dict | str | os.PathLike, dest: Path) -> None:
    if isinstance(config, Mapping):
        dest.write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    else:
        shutil.copyfile(config, dest)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(tmp_dir: Path, out_dir: Path) -> None:
    """Renames tmp_dir to out_dir; an existing out_dir is renamed aside first and deleted after. Writers of
    the same out_dir (processes too) take turns on a lock of the parent directory (flock on its own fd:
    no lock file is left beside the checkpoint), so concurrent saves each land whole, the last one wins,
    and no renamed-aside copy is left behind."""
    fd = os.open(out_dir.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the fd is closed
        _swap_locked(tmp_dir, out_dir)
    finally:
        os.close(fd)


def _swap_locked(tmp_dir: Path, out_dir: Path) -> None:
    aside = None
    if out_dir.exists():
        aside = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, aside)
    try:
        os.rename(tmp_dir, out_dir)
    except BaseException:
        if aside is not None:
            os.rename(aside, out_dir)  # put the old checkpoint back
        raise
    _fsync(out_dir.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


class DiskTarget:
    """`sync_weights(model, DiskTarget(engine, out_dir, config))`: save atomically, then
    `engine.update_weights_from_disk(out_dir)`. The slowest transport, and the one that also leaves a
    checkpoint behind; `engine` may be in-process or a RemoteEngine."""

    def __init__(self, engine, out_dir: str | os.PathLike, config: dict | str | os.PathLike) -> None:
        self.engine = engine
        self.out_dir = Path(out_dir)
        self.config = config

    def sync_from(self, source, bucket_bytes: int = 0, name_map=None, weight_version: str | None = None):
        save_hf_checkpoint(source, self.out_dir, config=self.config, name_map=name_map)
        self._clear_deltas()  # a new full checkpoint starts a new chain
        # (success, message[, num_paused_requests]): an Engine answers SGLang's three, a group two.
        res = self.engine.update_weights_from_disk(model_path=str(self.out_dir), weight_version=weight_version)
        return bool(res[0]), res[1]

    # ---- sparse deltas (weight_sync/delta.py DeltaSync) ---------------------------------------
    def delta_path(self, seq: int) -> Path:
        """The seq-th delta after the full checkpoint: `<out_dir>.delta-000001.safetensors`, beside it (not in
        it, so a checkpoint reader never mistakes it for a shard). Each applies on top of the one before."""
        return self.out_dir.parent / f"{self.out_dir.name}.delta-{seq:06d}.safetensors"

    def _deltas(self) -> list[Path]:
        # the directory's name escaped: "[", "*" or "?" in it would match other files (another checkpoint's)
        return sorted(self.out_dir.parent.glob(f"{glob.escape(self.out_dir.name)}.delta-*.safetensors"))

    def _clear_deltas(self) -> None:
        for p in self._deltas():
            p.unlink(missing_ok=True)

    def sync_delta(self, updates, weight_version: str | None = None) -> tuple[bool, str, int]:
        """Write each delta atomically (temp file, fsync, rename) beside the checkpoint, then
        `engine.update_weights_from_disk(<file>, load_format="delta")`. -> (ok, message, parts applied)."""
        seq = len(self._deltas())
        for k, update in enumerate(updates):
            seq += 1
            path = self.delta_path(seq)
            tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
            tmp.write_bytes(update.to_bytes())
            _fsync(tmp)
            os.rename(tmp, path)
            res = self.engine.update_weights_from_disk(model_path=str(path), load_format="delta",
                                                       weight_version=weight_version)
            if not res[0]:
                path.unlink(missing_ok=True)  # never leave a delta the engine did not take in the chain
                return False, res[1], k
        return True, f"{len(updates)} delta file(s), last {self.delta_path(seq).name}", len(updates)
