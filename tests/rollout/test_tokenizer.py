"""rollout/tokenizer.py's decode equals the HF tokenizer's own decode, whichever path it takes: the Rust
decoder directly for a plain fast tokenizer, transformers' decode otherwise."""

from __future__ import annotations

import random

import pytest

from rollout.request import Req
from rollout.sampling_params import SamplingParams
from rollout.tokenizer import TokenizerWrapper
from tests.checkpoints import make_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return path


def _req(**sp) -> Req:
    return Req("r", [1, 2], SamplingParams.from_dict({"max_new_tokens": 4, **sp}), seed=0)


@pytest.mark.parametrize("skip_special", [True, False])
def test_decode_equals_the_hf_tokenizers_decode(tok_dir, skip_special):
    """Random id lists (special tokens, multi-byte pieces split mid-character, empty) decode to exactly
    what the HF tokenizer's decode gives, with and without skip_special_tokens; the fast path is taken."""
    wrapper = TokenizerWrapper(str(tok_dir))
    assert wrapper._rust is not None  # a plain fast tokenizer: the direct path is the one under test
    hf = wrapper.tokenizer
    rng = random.Random(0)
    req = _req(skip_special_tokens=skip_special)
    vocab = len(hf)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        assert wrapper.decode(ids, req) == hf.decode(ids, skip_special_tokens=skip_special), ids
    text = "naïve café → 東京 ok"
    ids = hf.encode(text)
    assert wrapper.decode(ids, req) == hf.decode(ids, skip_special_tokens=skip_special)
    assert wrapper.decode([], None) == hf.decode([], skip_special_tokens=True) == ""


def test_tokenizers_with_clean_up_keep_transformers_decode(tok_dir):
    """A tokenizer that cleans up tokenization spaces (or any subclass with its own decode) is decoded by
    transformers: the direct path is off, and the text is still the tokenizer's."""
    wrapper = TokenizerWrapper(str(tok_dir))
    wrapper.tokenizer.clean_up_tokenization_spaces = True
    from rollout.tokenizer import _rust_decoder

    assert _rust_decoder(wrapper.tokenizer) is None
    wrapper._rust = _rust_decoder(wrapper.tokenizer)
    ids = wrapper.tokenizer.encode("a , b . c ' d")
    assert wrapper.decode(ids) == wrapper.tokenizer.decode(ids, skip_special_tokens=True)
