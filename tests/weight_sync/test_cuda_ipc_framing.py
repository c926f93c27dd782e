"""The CUDA IPC descriptor schema, checked without CUDA: a well-formed descriptor survives a JSON round trip
and validates to the right fields; every malformed one (keys, types, schema, dtype, handles, bounds) is
refused with an IpcDescriptorError naming the field, before any CUDA call; host tensors and a missing
CUDA are clear errors. Mapping real memory across processes runs in tests/gpu/."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from weight_sync.cuda_ipc import (
    SCHEMA,
    IpcDescriptorError,
    decode_bucket,
    decode_tensor,
    encode_tensor,
    validate_bucket_descriptor,
    validate_tensor_descriptor,
)


def _descriptor(**over):
    """A hand-built descriptor of a [4, 8] bf16 tensor at element offset 16 of a 128-byte storage."""
    d = {
        "schema": SCHEMA, "device": 0, "handle": base64.b64encode(b"\x01" * 64).decode(),
        "storage_size_bytes": 128, "storage_offset_bytes": 512,
        "ref_counter_handle": base64.b64encode(b"/torch_123_ref").decode(), "ref_counter_offset": 3,
        "event_handle": base64.b64encode(b"\x02" * 64).decode(), "event_sync_required": True,
        "dtype": "bfloat16", "shape": [4, 8], "stride": [8, 1], "offset": 32,
    }  # fmt: skip
    d.update(over)
    return d


def test_valid_descriptor_round_trips_through_json():
    """JSON in, JSON out: the validated fields are the bytes, dtype and ints that were put in."""
    f = validate_tensor_descriptor(json.loads(json.dumps(_descriptor())))
    assert f["handle"] == b"\x01" * 64 and f["ref_counter_handle"] == b"/torch_123_ref"
    assert f["dtype"] is torch.bfloat16 and f["shape"] == [4, 8] and f["offset"] == 32
    assert f["event_sync_required"] is True and f["storage_offset_bytes"] == 512
    # Exactly at the end of the storage: 32 + 31 = element 63 -> byte 128.
    validate_tensor_descriptor(_descriptor(offset=32))
    validate_tensor_descriptor(_descriptor(shape=[0, 8]))  # empty tensors reach nothing


@pytest.mark.parametrize("over, message", [
    ({"schema": "rollout.cuda_ipc.v0"}, "schema"),
    ({"dtype": "complex64"}, "field 'dtype'"),
    ({"dtype": "torch.float32"}, "field 'dtype'"),
    ({"device": -1}, "field 'device'"),
    ({"device": True}, "field 'device'"),
    ({"handle": ""}, "field 'handle' is empty"),
    ({"handle": "not base64!"}, "field 'handle' is not valid base64"),
    ({"handle": 12}, "field 'handle' must be a base64 string"),
    ({"handle": "A" * 4096}, "field 'handle' is 4096 characters"),
    ({"event_sync_required": "yes"}, "event_sync_required"),
    ({"shape": [4, -8]}, "field 'shape'"),
    ({"shape": "4,8"}, "field 'shape'"),
    ({"shape": [1] * 9, "stride": [1] * 9}, "at most 8"),
    ({"stride": [8]}, "differ in rank"),
    ({"offset": 33}, "past its storage of 128 bytes"),
    ({"stride": [16, 1]}, "past its storage"),
    ({"storage_size_bytes": 127}, "whole number"),
    ({"storage_offset_bytes": 1.5}, "storage_offset_bytes"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_malformed_descriptors_are_refused_naming_the_field(over, message):
    """Each defect alone makes validation fail with the field in the message."""
    with pytest.raises(IpcDescriptorError, match=message):
        validate_tensor_descriptor(_descriptor(**over))


def test_missing_or_extra_keys_and_non_dicts_are_refused():
    """A descriptor must have exactly the schema's keys; nothing else is accepted (no pickles, no lists)."""
    d = _descriptor()
    del d["stride"]
    with pytest.raises(IpcDescriptorError, match=r"missing \['stride'\], unexpected \[\]"):
        validate_tensor_descriptor(d)
    with pytest.raises(IpcDescriptorError, match=r"unexpected \['__reduce__'\]"):
        validate_tensor_descriptor(_descriptor(__reduce__="os.system"))
    with pytest.raises(IpcDescriptorError, match="must be a dict, got bytes"):
        validate_tensor_descriptor(b"\x80\x04pickle")


def test_bucket_descriptor_checks_the_flat_tensor():
    """A bucket's flat tensor must be 1-D and contiguous; the bucket needs exactly its three keys."""
    meta = [{"name": "w", "shape": [8], "dtype": "bfloat16", "start": 0, "end": 8}]
    ok = {"schema": SCHEMA, "metadata": meta,
          "flattened_tensor": _descriptor(shape=[64], stride=[1], offset=0)}
    validate_bucket_descriptor(ok)
    with pytest.raises(IpcDescriptorError, match="1-D and contiguous"):
        validate_bucket_descriptor({**ok, "flattened_tensor": _descriptor()})
    with pytest.raises(IpcDescriptorError, match="needs exactly keys"):
        validate_bucket_descriptor({**ok, "extra": 1})
    with pytest.raises(IpcDescriptorError, match="past its storage"):
        decode_bucket({**ok, "flattened_tensor": _descriptor(shape=[65], stride=[1], offset=0)})


def test_host_tensors_and_missing_cuda_are_clear_errors():
    """encode refuses a CPU tensor (wrong transport); decode of a valid descriptor without CUDA says so."""
    with pytest.raises(ValueError, match="this one is on cpu"):
        encode_tensor(torch.zeros(3))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        encode_tensor([1, 2])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="decode_tensor needs CUDA"):
            decode_tensor(_descriptor())


UUIDS = ["1f3c2a4b-0000-4000-8000-00000000000a", "GPU-2b4d6f80-1111-4111-8111-00000000000b"]


class _NoMapIpc:
    """A stand-in IPC backend (named as such) that sees UUIDS and refuses to map anything."""

    name = "stand-in"

    def device_uuids(self, what="CUDA IPC"):
        return list(UUIDS)

    def open(self, f, ordinal):
        raise AssertionError("must not map memory")


def test_device_uuid_maps_to_the_local_ordinal():
    """A UUID names the same GPU whatever ordinal each process gives it (per-process CUDA_VISIBLE_DEVICES): it
    resolves to this process's ordinal, with or without the GPU- prefix, any case; an unseen UUID, a
    malformed one and an ordinal past the visible devices are refused by name."""
    from weight_sync.cuda_ipc import resolve_device, use_ipc_backend

    b = UUIDS[1].removeprefix("GPU-")
    assert validate_tensor_descriptor(_descriptor(device=UUIDS[1].upper()))["device"] == b
    assert resolve_device(b, UUIDS) == 1 and resolve_device(b, [UUIDS[1], UUIDS[0]]) == 0
    assert resolve_device(1, UUIDS) == 1
    with pytest.raises(IpcDescriptorError, match="does not see"):
        resolve_device(b, [UUIDS[0]])
    with pytest.raises(IpcDescriptorError, match="sees 2 devices"):
        resolve_device(2, UUIDS)
    with pytest.raises(IpcDescriptorError, match="neither a CUDA device UUID"):
        validate_tensor_descriptor(_descriptor(device="cuda:0"))
    with use_ipc_backend(_NoMapIpc()):
        with pytest.raises(IpcDescriptorError, match="names cuda:1 \\(here\\), this receiver expects cuda:0"):
            decode_tensor(_descriptor(device=UUIDS[1]), device=0)
