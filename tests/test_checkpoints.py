"""The checkpoint factory writes what HF itself loads, with the features loaders must honour."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tests.checkpoints import ARCHS, VOCAB_SIZE, load_hf_model, make_checkpoint

TEXTS = ["Hello world 12+3", "  two  spaces\n\nand lines, it's", "naïve café 日本", "<s>a</s><pad>"]


def _file_keys(path) -> set[str]:
    keys: set[str] = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            keys.update(st.keys())
    return keys


def test_hf_loads_model_and_tokenizer(tiny_ckpt):
    """AutoModel/AutoTokenizer load the files; AutoTokenizer encodes exactly as tokenizer.json does
    (transformers 5 swaps in Qwen2Tokenizer for qwen2, so this guards the pipeline choice)."""
    model = load_hf_model(tiny_ckpt)
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    raw = Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json"))
    config = json.loads((tiny_ckpt / "config.json").read_text())
    assert len(tok) <= config["vocab_size"] == VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
    logits = model(torch.tensor([tok(TEXTS[0]).input_ids])).logits
    assert logits.shape[-1] == VOCAB_SIZE and torch.isfinite(logits).all()


def test_greedy_is_not_decided_by_ties(tiny_ckpt):
    """Top-1 and top-2 logits are rarely within 1e-3, so greedy comparisons are meaningful."""
    model = load_hf_model(tiny_ckpt)
    ids = torch.randint(4, 300, (8, 32), generator=torch.Generator().manual_seed(0))
    top2 = model(ids).logits.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1]) < 1e-3).float().mean() < 0.02


def test_llama3_rope_scaling_is_active(tiny_llama):
    """HF builds llama3-scaled inverse frequencies from the saved config (not the default rope)."""
    config = json.loads((tiny_llama / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"
    head_dim = config["head_dim"]
    assert head_dim != config["hidden_size"] // config["num_attention_heads"]
    default = 1.0 / config["rope_parameters"]["rope_theta"] ** (
        torch.arange(0, head_dim, 2).float() / head_dim
    )
    inv_freq = load_hf_model(tiny_llama).model.rotary_emb.inv_freq
    assert inv_freq.shape == default.shape
    assert torch.allclose(inv_freq[:2], default[:2])  # high frequencies are untouched
    assert torch.allclose(inv_freq[-2:], default[-2:] / 8.0)  # low frequencies are divided by `factor`


def test_norms_and_biases_are_random(tiny_qwen2, tiny_qwen3):
    """No norm weight is all ones and qwen2's q/k/v biases are non-zero, so dropping one is caught."""
    for path in (tiny_qwen2, tiny_qwen3):
        for name, p in load_hf_model(path).named_parameters():
            if "norm" in name:
                assert not torch.allclose(p, torch.ones_like(p)), name
            if name.endswith(".bias"):
                assert p.abs().min() > 0, name
    assert {n for n, _ in load_hf_model(tiny_qwen2).named_parameters() if n.endswith(".bias")}


def test_sharded_checkpoint_has_an_index(ckpt_factory):
    """shard=True writes >= 2 safetensors files named by model.safetensors.index.json."""
    path = ckpt_factory("llama", shard=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 2 and all((path / f).exists() for f in files)
    assert set(index["weight_map"]) == _file_keys(path)
    load_hf_model(path)


def test_tied_checkpoint_has_no_lm_head(tiny_tied_ckpt):
    """Tied checkpoints store only the embedding; HF ties lm_head to it on load."""
    assert not any("lm_head" in k for k in _file_keys(tiny_tied_ckpt))
    model = load_hf_model(tiny_tied_ckpt)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_same_bytes(tmp_path, arch):
    """make_checkpoint is deterministic per seed and leaves the global RNG alone."""
    state = torch.random.get_rng_state()
    a = make_checkpoint(tmp_path / "a", arch, seed=1, with_tokenizer=False)
    b = make_checkpoint(tmp_path / "b", arch, seed=1, with_tokenizer=False)
    c = make_checkpoint(tmp_path / "c", arch, seed=2, with_tokenizer=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
