"""torch.distributed weight sync: the trainer (rank 0) broadcasts weights to the engines' ranks.

Both ends build the same standalone process group with `create_weight_update_group` (a TCPStore and a
Gloo or NCCL group of their own, so neither side needs a default process group) and free it with
`destroy_weight_update_group`, after which the same name and port can be joined again. Its store keys
are those of SGLang's `init_custom_process_group`, so a trainer built for SGLang joins the engine.

Per update the engine is told `names, dtypes, shapes` and receives with `receive_named_tensors` in one
of three wire formats (`load_format`), all received before anything is checked or loaded:

- `None`: SGLang's default. One broadcast per tensor, each in its own dtype (slime, verl).
- `"flattened_bucket"`: SGLang's bucketed mode. One broadcast of the tensors' bytes back to back, in
  order, without padding (the sender's `FlattenedTensorBucket.get_flattened_tensor()`).
- `"checked_bucket"`: ours, when both ends are ours. A fixed header (magic, byte count, tensor count,
  a hash of names/dtypes/shapes), the payload, then a trailer with a CRC-32 per tensor. The receiver
  takes exactly what the header announces (so the two sides never fall out of step), then refuses a
  wrong byte count, layout or checksum, naming the tensor.

What gloo does with a size mismatch (measured on torch 2.13, tests/weight_sync/test_hardening.py):
a broadcast carries raw bytes (dtypes need not match, only byte counts matter), and
- a sender that sends FEWER bytes than the receiver's buffer: accepted, no error on either side; the
  tail of the receiver's buffer keeps whatever it held;
- a sender that sends MORE bytes than the receiver's buffer: gloo's `enforce` fails on a background
  thread and the whole receiving process aborts (std::terminate), no exception to catch.
So the SGLang formats, which carry no byte count, are received defensively: buffers are pre-filled with
a sentinel (NaN in every floating-point tensor, random bytes in integer ones); with gloo each receive
window also extends past the tensor (over the tensors still to come, plus a slack of up to
MAX_SLACK_BYTES after the last), so a longer transfer lands in memory we own and is refused instead
of aborting the engine. A short transfer leaves a suffix of the buffer unwritten, so after the receive
a floating-point tensor whose last element is still the NaN sentinel, an integer tensor whose last
(up to) 8 bytes still equal the random sentinel, or a sentinel overwritten past a window's end, is
refused with the tensor's name; all checks are O(1) per tensor and end in one host read. Limits, by
construction: a transfer longer than its window still aborts the process under gloo; an integer
tensor short by fewer than 8 bytes, or any tensor short by part of one element, is not caught (use
"checked_bucket"); NCCL needs equal byte counts on all ranks, so windows there are exact and a size
mismatch is NCCL's undefined behaviour (a hang until the timeout, or garbage the sentinel catches).
NaN values the sender really sent are the loader's finiteness check's to refuse.

Dead senders: gloo reports a SIGKILLed peer at once ("Connection closed by peer"), whether it died
before or during the receive; a live but silent sender is caught by the per-operation timeout
(`timeout_s`, default the group's). After either, the group is unusable: destroy it and join again.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weight_sync.bucket import FlattenedTensorBucket, as_dtype, dtype_to_str, iter_buckets
from weight_sync.rendezvous import bounded, wait_for_master

DEFAULT_TIMEOUT_S = 120.0
LOAD_FORMATS = (None, "flattened_bucket", "checked_bucket")
MAX_SLACK_BYTES = 16 << 20  # gloo receive slack after the last tensor: longer transfers are refused, not fatal
_MAGIC = 0x524C_5753_594E_43  # "RLWSYNC"
_VERSION = 1
_HEADER_LEN = 6  # [magic, version, payload bytes, tensors, layout hash, reserved]
_CRC_CHUNK = 64 << 20  # bytes per host copy when checksumming device memory


@dataclass
class WeightUpdateGroup:
    process_group: object
    store: object  # the group needs its store alive
    rank: int
    world_size: int
    name: str
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S
    destroyed: bool = False


def parse_master_port(master_port) -> int:
    """`master_port` as an int: SGLang's tests and many HTTP bodies send a numeric string ("29500")."""
    if isinstance(master_port, str) and master_port.strip().isdigit():
        master_port = int(master_port.strip())
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise ValueError(f"master_port={master_port!r}: give a TCP port number (an int or a numeric string, "
                         f"1-65535)")
    return master_port


def _group_store(store, group_name: str, device: str):
    """The store a group's backend talks through, nested the way SGLang's `init_custom_process_group`
    nests it (so a trainer that built its side with that helper meets ours on the same keys): the
    helper wraps the rendezvous store in `PrefixStore(group_name)`, torch's process-group factory
    adds `PrefixStore(group_name + "/")` and then one per device type ("cpu/" for gloo, "cuda/"
    for nccl; one backend only, since all devices map to the same one)."""
    outer = dist.PrefixStore(group_name, store)
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", outer))


def create_weight_update_group(master_address: str, master_port: int | str, rank: int, world_size: int,
                               group_name: str, backend: str = "gloo",
                               timeout_s: float = DEFAULT_TIMEOUT_S) -> WeightUpdateGroup:
    """Join (rank 0: host) a standalone broadcast group; blocks until all `world_size` ranks joined or
    `timeout_s` passed.

    Wire-compatible with SGLang's `init_custom_process_group` (TCP rendezvous store, then
    `PrefixStore(group_name, store)`, then a new process group on it), which slime, verl and OpenRLHF
    use on the trainer side: the same store keys (`_group_store`) and the same sequence-number
    handshake, so either side may use either helper. Unlike it, nothing is registered in
    torch.distributed's global group table, so no default process group is needed or touched."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: choose 'gloo' (CPU) or 'nccl' (GPU)")
    if not isinstance(group_name, str) or not group_name:
        raise ValueError(f"group_name={group_name!r}: give a non-empty string")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    master_port = parse_master_port(master_port)
    timeout = datetime.timedelta(seconds=timeout_s)  # also every later collective's
    store_timeout = timeout
    if rank != 0:  # torch's connect overshoots its timeout and waits on the resolver: reach rank 0 first
        store_timeout = datetime.timedelta(seconds=wait_for_master(master_address, master_port, timeout_s))
    # What torch's tcp:// rendezvous builds for SGLang's helper: rank 0 hosts, all wait for world_size.
    # Bounded by the same deadline (plus a grace for torch's own overshoot): a peer that accepts but never
    # answers the handshake would otherwise hold this call forever.
    store = bounded(lambda: dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                          timeout=store_timeout),
                    store_timeout.total_seconds() + min(5.0, max(1.0, 0.25 * store_timeout.total_seconds())),
                    f"joining the rendezvous store at {master_address}:{master_port} (a peer that accepts the "
                    f"connection but never answers the store's handshake: is the trainer's rank 0 what listens "
                    f"on that port?)")
    if backend == "gloo":
        group = dist.ProcessGroupGloo(_group_store(store, group_name, "cpu"), rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        group = dist.ProcessGroupNCCL(_group_store(store, group_name, "cuda"), rank, world_size, opts)
    # torch's factory does this handshake on every new group (rank 0 publishes, the others read);
    # doing it too keeps both sides' store traffic paired.
    group._set_sequence_number_for_group()
    return WeightUpdateGroup(group, store, rank, world_size, group_name, backend, timeout_s)


def destroy_weight_update_group(group: WeightUpdateGroup) -> None:
    """Shut the group down and drop its store (rank 0's frees the port), so the same group name and
    port can be joined again. Idempotent; a broken group (dead peer, timed out) is destroyed too."""
    if group.destroyed:
        return
    group.destroyed = True
    pg, group.process_group, group.store = group.process_group, None, None
    shutdown_process_group(pg)


def shutdown_process_group(pg) -> None:
    """Shut a standalone process group down (`shutdown`, else `abort`, whichever this torch has)."""
    for method in ("shutdown", "abort"):
        fn = getattr(pg, method, None)
        if fn is not None:
            try:
                fn()
                break
            except RuntimeError:  # already broken; dropping the last reference still frees it
                continue


def _require_live(group: WeightUpdateGroup) -> None:
    if group.destroyed or group.process_group is None:
        raise RuntimeError(f"weight update group {group.name!r} was destroyed")


def broadcast(group: WeightUpdateGroup, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> None:
    """One broadcast of `tensor`'s bytes from `src`, bounded by `timeout_s` (default: the group's)."""
    _require_live(group)
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.timeout = datetime.timedelta(seconds=timeout_s or group.timeout_s)
    group.process_group.broadcast([tensor], opts).wait()


# ---------------------------------------------------------------------------------------------
# receiving


@dataclass(frozen=True)
class _Spec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the bucket layout
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


def _specs(names, dtypes, shapes) -> list[_Spec]:
    if not isinstance(names, (list, tuple)) or not isinstance(dtypes, (list, tuple)) \
            or not isinstance(shapes, (list, tuple)):
        raise ValueError("names, dtypes and shapes must be lists")  # noqa: TRY004
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) must be "
                         f"non-empty lists of the same length")
    out, seen, offset = [], set(), 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not name or name in seen:
            raise ValueError(f"tensor name {name!r} is empty, not a string, or repeated")
        seen.add(name)
        try:
            dtype = as_dtype(dtype)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None
        if not isinstance(shape, (list, tuple)) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(_Spec(name, dtype, tuple(shape), offset, nbytes))
        offset += nbytes
    return out


def _fill(region: torch.Tensor, dtype: torch.dtype, pattern: bytes) -> None:
    """Sentinel for a uint8 `region` holding `dtype` elements: NaN for floating point, else the 8
    random bytes of `pattern` repeated from the region's first byte. Any alignment; memset speed."""
    n = region.numel()
    if n == 0:
        return
    if dtype.is_floating_point:
        if region.storage_offset() % dtype.itemsize == 0:
            region.view(dtype).fill_(float("nan"))
        else:  # misaligned (after an odd-sized tensor): element by element through a byte view
            nan = torch.full((1,), float("nan"), dtype=dtype, device=region.device).view(torch.uint8)
            region.view(-1, dtype.itemsize).copy_(nan.expand(n // dtype.itemsize, -1))
        return

    def repeat(start: int, count: int) -> torch.Tensor:
        return torch.tensor([pattern[(start + k) % 8] for k in range(count)], dtype=torch.uint8, device=region.device)

    head = min(-region.storage_offset() % 8, n)  # bytes before the first 8-byte aligned one
    region[:head].copy_(repeat(0, head))
    words = (n - head) // 8
    if words:
        word = bytes(pattern[(head + k) % 8] for k in range(8))
        region[head : head + 8 * words].view(torch.int64).fill_(int.from_bytes(word, "little", signed=True))
    rest = head + 8 * words
    region[rest:].copy_(repeat(rest, n - rest))


def _view(buf: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """`spec`'s bytes of a uint8 buffer as its dtype and shape (a copy only when misaligned)."""
    region = buf[spec.start : spec.end]
    if (buf.storage_offset() + spec.start) % spec.dtype.itemsize:
        region = region.clone()
    return region.view(spec.dtype).view(spec.shape)


def receive_named_tensors(group: WeightUpdateGroup, names: list[str], dtypes: list, shapes: list[list[int]],
                          device: torch.device | str, *, load_format: str | None = None,
                          timeout_s: float | None = None) -> list[tuple[str, torch.Tensor]]:
    """Engine side: receive what rank 0 broadcasts for `names` in `load_format` (see the module
    docstring), as `(name, tensor)` pairs in `device` memory. Raises ValueError naming the tensor when
    the transfer was short, long or corrupt, RuntimeError when the group failed (dead peer, timeout);
    either way nothing has been loaded anywhere. Tensors may mix dtypes in every format."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: choose one of {LOAD_FORMATS}")
    specs = _specs(names, dtypes, shapes)
    _require_live(group)
    device = torch.device(device)
    if load_format == "checked_bucket":
        return _receive_checked(group, specs, device, timeout_s)
    return _receive_sentinel(group, specs, device, timeout_s, per_tensor=load_format is None)


def _receive_sentinel(group, specs: list[_Spec], device, timeout_s, per_tensor: bool):
    total = specs[-1].end
    slack = min(max(total, 64), MAX_SLACK_BYTES) if group.backend == "gloo" else 0
    buf = torch.empty(total + slack, dtype=torch.uint8, device=device)  # [total + slack] bytes
    pattern = os.urandom(8)
    for s in specs:
        _fill(buf[s.start : s.end], s.dtype, pattern)
    _fill(buf[total:], torch.uint8, pattern)
    # The 8 bytes after each window's end: a longer transfer overwrites them. Kept before any receive,
    # and (per tensor) read back right after that tensor's receive, before the next one lands there.
    ends = [s.end for s in specs] if per_tensor else [total]
    probe = [buf[e : e + 8].clone() for e in ends]
    got = []
    if per_tensor:
        for s in specs:
            window = buf[s.start :] if slack else buf[s.start : s.end]
            broadcast(group, window, src=0, timeout_s=timeout_s)
            got.append(buf[s.end : s.end + 8].clone())
    else:
        broadcast(group, buf if slack else buf[:total], src=0, timeout_s=timeout_s)
        got.append(buf[total : total + 8].clone())
    named = [(s.name, _view(buf, s)) for s in specs]

    # All checks on the device, one host read.
    flags = []
    for s in specs:
        if s.nbytes == 0:
            flags.append(torch.zeros((), dtype=torch.bool, device=device))
        elif s.dtype.is_floating_point:
            # A short transfer leaves a suffix unwritten, so the last element decides (NaN the sender
            # sent elsewhere is the loader's finiteness check's business). Compared as bytes: float8
            # has no isnan everywhere.
            nan = torch.full((1,), float("nan"), dtype=s.dtype, device=device).view(torch.uint8)
            last = buf[s.end - s.dtype.itemsize : s.end]
            flags.append((last == nan).all())
        else:
            tail = buf[max(s.start, s.end - 8) : s.end]
            flags.append((tail == _tail_sentinel(s, pattern, device)).all())
    long_flags = [(a != b).any() if a.numel() else torch.zeros((), dtype=torch.bool, device=device)
                  for a, b in zip(probe, got)]
    short, long = torch.stack(flags).tolist(), torch.stack(long_flags).tolist()
    for i, is_long in enumerate(long):
        if is_long:
            what = f"tensor {specs[i].name!r}" if per_tensor else f"the bucket ({len(specs)} tensors)"
            need = specs[i].nbytes if per_tensor else total
            raise ValueError(f"{what}: the sender broadcast more than the {need} bytes that names/dtypes/shapes "
                             f"announce; refused")
    for s, is_short in zip(specs, short):
        if is_short:
            seen = "last element" if s.dtype.is_floating_point else "last bytes"
            raise ValueError(f"tensor {s.name!r} ({s.dtype}, {list(s.shape)}): its {seen} still hold the sentinel "
                             f"after the receive: the sender broadcast fewer bytes than announced; refused")
    return named


def _tail_sentinel(s: _Spec, pattern: bytes, device) -> torch.Tensor:
    """The sentinel bytes `_fill` wrote over the last min(8, nbytes) bytes of an integer tensor."""
    tail = [pattern[k % 8] for k in range(max(0, s.nbytes - 8), s.nbytes)]
    return torch.tensor(tail, dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------------------
# checked_bucket: header, payload, per-tensor checksums


def _layout_hash(specs: list[_Spec]) -> int:
    """63 bits of a hash of names, dtypes and shapes in order: both ends must agree on the layout."""
    text = json.dumps([[s.name, dtype_to_str(s.dtype), list(s.shape)] for s in specs])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _checksums(buf: torch.Tensor, specs: list[_Spec]) -> list[int]:
    """CRC-32 of each tensor's bytes (zlib's, ~1 GB/s on one core; catches lost, extra, changed and
    reordered bytes). Device memory is read through host copies of at most _CRC_CHUNK bytes."""
    out = []
    for s in specs:
        region, crc = buf[s.start : s.end], 0
        for i in range(0, s.nbytes, _CRC_CHUNK):
            chunk = region[i : i + _CRC_CHUNK]
            crc = zlib.crc32((chunk if chunk.device.type == "cpu" else chunk.cpu()).numpy(), crc)
        out.append(crc)
    return out


def _receive_checked(group, specs: list[_Spec], device, timeout_s):
    total = specs[-1].end
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=device)
    broadcast(group, header, src=0, timeout_s=timeout_s)
    magic, version, nbytes, count, layout, _ = header.tolist()
    if magic != _MAGIC or version != _VERSION:
        raise RuntimeError(f"checked_bucket: the first broadcast is not this protocol's header (magic {magic:#x}, "
                           f"version {version}); the sender speaks another load_format, and the group is now out "
                           f"of step: destroy it and join again")
    # Take exactly what the header announces, so both ends stay in step, unless that is absurd.
    if not (0 <= nbytes <= 2 * total + (1 << 20) and 0 < count <= 2 * len(specs) + 64):
        raise RuntimeError(f"checked_bucket: the header announces {nbytes} bytes in {count} tensors, but "
                           f"names/dtypes/shapes describe {total} bytes in {len(specs)}; not received, the group "
                           f"is now out of step: destroy it and join again")
    buf = torch.empty(max(nbytes, total), dtype=torch.uint8, device=device)
    broadcast(group, buf[:nbytes], src=0, timeout_s=timeout_s)
    trailer = torch.zeros(count, dtype=torch.int64, device=device)
    broadcast(group, trailer, src=0, timeout_s=timeout_s)
    if nbytes != total or count != len(specs):
        raise ValueError(f"checked_bucket: the sender sent {nbytes} bytes in {count} tensors, but names/dtypes/"
                         f"shapes describe {total} bytes in {len(specs)} (first tensor {specs[0].name!r}); refused")
    if layout != _layout_hash(specs):
        raise ValueError("checked_bucket: the sender's names/dtypes/shapes differ from the ones this engine was "
                         f"given (same byte count; first tensor {specs[0].name!r}); refused")
    for s, crc, want in zip(specs, _checksums(buf, specs), trailer.tolist()):
        if crc != want:
            raise ValueError(f"checked_bucket: tensor {s.name!r} ({s.dtype}, {list(s.shape)}) fails its checksum: "
                             f"its bytes were changed or lost in transit; refused")
    return [(s.name, _view(buf, s)) for s in specs]


# ---------------------------------------------------------------------------------------------
# sending


def broadcast_named_tensors(group: WeightUpdateGroup, named_tensors: Iterable[tuple[str, torch.Tensor]],
                            load_format: str | None = None, timeout_s: float | None = None) -> int:
    """Trainer side (rank 0): broadcast `named_tensors` in `load_format`, the counterpart of
    `receive_named_tensors` on every other rank (with the same names, dtypes and shapes, in order).
    Returns the number of payload bytes sent."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: choose one of {LOAD_FORMATS}")
    pairs = [(n, t.detach()) for n, t in named_tensors]
    if not pairs:
        raise ValueError("nothing to broadcast: named_tensors is empty")
    if load_format is None:
        for _, t in pairs:
            broadcast(group, t.contiguous(), src=0, timeout_s=timeout_s)
        return sum(t.numel() * t.element_size() for _, t in pairs)
    flat = FlattenedTensorBucket(pairs).flattened_tensor
    payload = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat  # [total bytes]
    if load_format == "flattened_bucket":
        broadcast(group, payload, src=0, timeout_s=timeout_s)
        return payload.numel()
    specs = _specs([n for n, _ in pairs], [t.dtype for _, t in pairs], [list(t.shape) for _, t in pairs])
    header = torch.tensor([_MAGIC, _VERSION, payload.numel(), len(specs), _layout_hash(specs), 0],
                          dtype=torch.int64, device=payload.device)
    trailer = torch.tensor(_checksums(payload, specs), dtype=torch.int64, device=payload.device)
    for t in (header, payload, trailer):
        broadcast(group, t, src=0, timeout_s=timeout_s)
    return payload.numel()


class DistributedTarget:
    """Trainer side: `sync_weights(model, DistributedTarget(engine_handle, group, group_name))`.

    `engine_handle` must accept `call_async("update_weights_from_distributed", ...)` and `result()`
    (a `cross_process.RemoteEngine`), because the engine's receive and our broadcast run together.
    `load_format` picks the wire format (module docstring); None, SGLang's default, works with any
    SGLang-compatible engine; the others are passed to the engine, which must accept them.
    """

    def __init__(self, engine_handle, group, group_name: str, load_format: str | None = None,
                 timeout_s: float | None = None) -> None:
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r}: choose one of {LOAD_FORMATS}")
        self.engine = engine_handle
        self.group = group
        self.group_name = group_name
        self.load_format = load_format
        self.timeout_s = timeout_s

    def sync_delta(self, updates, weight_version: str | None = None) -> tuple[bool, str, int]:
        """Sparse deltas (weight_sync/delta.py): each one's blob broadcast as a checked bucket of one uint8
        tensor, applied by the engine with load_format="delta". -> (ok, message, parts applied)."""
        for k, update in enumerate(updates):
            blob = update.to_tensor()
            self.engine.call_async("update_weights_from_distributed", names=["delta_blob"], dtypes=["uint8"],
                                   shapes=[[blob.numel()]], group_name=self.group_name,
                                   weight_version=weight_version, load_format="delta")
            try:
                broadcast_named_tensors(self.group, [("delta_blob", blob)], "checked_bucket", self.timeout_s)
            except RuntimeError as e:
                try:
                    ok, msg = self.engine.result()
                except RuntimeError as err:
                    msg = str(err)
                return False, f"delta part {k}: broadcast failed ({e}); engine said: {msg}", k
            ok, msg = self.engine.result()
            if not ok:
                return False, msg, k
        return True, f"broadcast {len(updates)} delta part(s)", len(updates)

    def sync_from(self, source, bucket_bytes: int, name_map=None, weight_version: str | None = None):
        num_buckets = num_tensors = 0
        extra = {"load_format": self.load_format} if self.load_format is not None else {}
        with torch.no_grad():
            for bucket in iter_buckets(source, bucket_bytes=bucket_bytes, name_map=name_map):
                metas = bucket.to_dict()["metadata"]
                self.engine.call_async(
                    "update_weights_from_distributed", names=[m["name"] for m in metas],
                    dtypes=[m["dtype"] for m in metas], shapes=[m["shape"] for m in metas],
                    group_name=self.group_name, weight_version=weight_version, **extra)
                try:
                    broadcast_named_tensors(self.group, bucket.named_tensors(), self.load_format, self.timeout_s)
                except RuntimeError as e:  # e.g. the engine refused before receiving: collect its reason
                    try:
                        ok, msg = self.engine.result()
                    except RuntimeError as err:
                        msg = str(err)
                    return False, f"bucket {num_buckets}: broadcast failed ({e}); engine said: {msg}"
                ok, msg = self.engine.result()
                if not ok:
                    return False, f"bucket {num_buckets}: {msg}"
                num_buckets += 1
                num_tensors += len(bucket)
        return True, f"broadcast {num_tensors} tensors in {num_buckets} bucket(s)"
