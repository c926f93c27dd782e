"""The HTTP tensor codec encodes every name of a state_dict, tied ones included.

A tied model's `state_dict()` (embedding and lm_head on one storage, every small Qwen) is what a
trainer sends; safetensors itself refuses tensors that share storage. The oracle: the HF model's own
tensors (bitwise per name) and a fresh engine loaded from the checkpoint the trainer holds.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rollout import Engine
from rollout.server.tensor_codec import decode_named_tensors, encode_named_tensors

ENGINE_KW = dict(device="cpu", max_total_tokens=1024, show_progress=False)


def test_tied_state_dict_round_trips_per_name(ckpt_factory):
    """Every name of a tied HF state_dict (shared embedding/lm_head storage, and a view of a larger
    storage) decodes to its own tensor, bitwise equal; an engine loaded with it equals a fresh one."""
    a, b = (ckpt_factory("qwen2", tie_word_embeddings=True, seed=s) for s in (0, 1))
    hf = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    sd = hf.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()  # really tied
    named = list(sd.items()) + [("extra.row_view", sd["model.norm.weight"][1:3])]
    decoded = dict(decode_named_tensors(encode_named_tensors(named)))
    assert sorted(decoded) == sorted(n for n, _ in named)
    for name, t in named:
        assert decoded[name].dtype == t.dtype and torch.equal(decoded[name], t), name
    with Engine(str(a), **ENGINE_KW) as engine, Engine(str(b), **ENGINE_KW) as fresh:
        ok, msg = engine.update_weights_from_tensor(list(decode_named_tensors(encode_named_tensors(sd))))
        assert ok, msg
        assert engine.get_weights_checksum()["checksum"] == fresh.get_weights_checksum()["checksum"]
        sp = dict(temperature=0, max_new_tokens=6, ignore_eos=True)
        assert engine.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"] == \
            fresh.generate(input_ids=[5, 6, 7], sampling_params=sp)["output_ids"]


def test_a_safetensors_blob_whose_header_length_reads_like_a_pickle_decodes():
    """A safetensors blob starts with its header length (u64, little-endian): one of 640 bytes starts with
    0x80 0x02, a pickle's PROTO opcode. It decodes as the tensors it holds, not refused as a pickle."""
    import base64
    import struct

    from safetensors.torch import save

    for pad in range(200):  # a name length that makes the header 640, 896, 1152 or 1408 bytes
        named = {f"model.layers.{i}.mlp.down_proj.weight" + "x" * (pad if i == 0 else 0): torch.full((2,), float(i))
                 for i in range(7)}
        blob = save(named)
        if blob[0] == 0x80 and 2 <= blob[1] <= 5:
            break
    else:
        raise AssertionError("no padding gave a header length starting 0x80 0x02-0x05")
    assert struct.unpack("<Q", blob[:8])[0] in (640, 896, 1152, 1408)
    decoded = dict(decode_named_tensors(base64.b64encode(blob).decode()))
    assert decoded.keys() == named.keys() and all(torch.equal(decoded[k], v) for k, v in named.items())
