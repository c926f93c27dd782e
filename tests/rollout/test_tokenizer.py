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


@pytest.fixture(scope="module")
def metaspace_ckpt(ckpt_factory, tmp_path_factory):
    """A tiny llama whose tokenizer is SentencePiece-style (Llama-2 / Mistral's Metaspace decoder)."""
    import shutil

    from tests.checkpoints import make_metaspace_tokenizer

    path = tmp_path_factory.mktemp("metaspace") / "ckpt"
    shutil.copytree(ckpt_factory("llama"), path)
    make_metaspace_tokenizer(path)
    return path


def test_output_text_keeps_the_first_words_space_after_the_prompt(metaspace_ckpt):
    """With a decoder that drops the leading space of the first token it decodes, an output's text still reads
    on from its prompt: decode(prompt) + text == decode(prompt + output) (the HF tokenizer as oracle), for the
    final output and every stream chunk, forced "▁word" tokens and sampled ones alike."""
    from rollout import Engine

    with Engine(str(metaspace_ckpt), device="cpu", show_progress=False, max_total_tokens=2048) as engine:
        hf = engine.tokenizer.tokenizer
        prompt = hf.encode("The answer")
        word = next(t for t in range(len(hf)) if hf.convert_ids_to_tokens(t).startswith("\u2581")
                    and hf.convert_ids_to_tokens(t)[1:].isalpha())
        head = hf.decode(prompt, skip_special_tokens=True)
        forced = dict(temperature=0, max_new_tokens=3, ignore_eos=True, logit_bias={str(word): 100.0})
        out = engine.generate(input_ids=prompt, sampling_params=forced)
        assert out["output_ids"] == [word] * 3
        assert out["text"].startswith(" ") and head + out["text"] == hf.decode(prompt + out["output_ids"],
                                                                              skip_special_tokens=True)
        for seed in range(4):
            sp = dict(temperature=1.0, seed=seed, max_new_tokens=12, ignore_eos=True)
            chunks = list(engine.generate(input_ids=prompt, sampling_params=sp, stream=True))
            whole = hf.decode(prompt + chunks[-1]["output_ids"], skip_special_tokens=True)
            assert head + chunks[-1]["text"] == whole
            assert all(whole.startswith(head + c["text"]) for c in chunks)


@pytest.fixture(scope="module")
def llama2_like_ckpt(metaspace_ckpt, tmp_path_factory):
    """metaspace_ckpt with its "<0xNN>" byte pieces as ordinary vocabulary, as in Llama-2's and Mistral's
    tokenizer.json (not added special tokens, which skip_special_tokens would hide)."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("llama2like") / "ckpt"
    shutil.copytree(metaspace_ckpt, path)
    tj = json.loads((path / "tokenizer.json").read_text())
    tj["added_tokens"] = [t for t in tj["added_tokens"] if not t["content"].startswith("<0x")]
    (path / "tokenizer.json").write_text(json.dumps(tj))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {k: v for k, v in cfg.get("added_tokens_decoder", {}).items()
                                   if not v["content"].startswith("<0x")}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_stream_chunks_hold_back_a_run_of_byte_pieces(llama2_like_ckpt):
    """Byte-fallback tokenizers (Llama-2's newline is the byte piece <0x0A>): HF decodes an unfinished run of byte
    pieces as U+FFFD each, the ASCII ones too, so "\n" after <0x0A> becomes U+FFFD once <0xE4> follows. Stream
    chunks hold a trailing run back until a piece that is not a byte closes it: every chunk is a prefix of the
    final text, which is HF's decode (a chunk had sent "\n", and OpenAI deltas then lost the rest)."""
    from rollout import Engine

    with Engine(str(llama2_like_ckpt), device="cpu", show_progress=False, max_total_tokens=2048) as engine:
        hf = engine.tokenizer.tokenizer
        nl, e4, a = hf.convert_tokens_to_ids(["<0x0A>", "<0xE4>", "a"])
        assert hf.decode([nl]) == "\n" and not hf.decode([nl, e4, a]).startswith("\n")  # the case itself
        prompt = hf.encode("Hello")
        bias = {str(nl): 100.0, str(e4): 100.0, str(a): 100.0}
        seen = False
        for seed in range(300):
            sp = dict(temperature=1.0, seed=seed, max_new_tokens=4, ignore_eos=True, logit_bias=bias)
            chunks = list(engine.generate(input_ids=prompt, sampling_params=sp, stream=True))
            ids, final = chunks[-1]["output_ids"], chunks[-1]["text"]
            assert final == hf.decode(ids, skip_special_tokens=True)
            assert all(final.startswith(c["text"]) for c in chunks), (ids, [c["text"] for c in chunks])
            seen |= ids[:3] == [nl, e4, a]
            if seen:
                break
        assert seen, "the byte sequence under test was never sampled"


def test_stream_chunks_never_end_in_a_partial_character(tiny_llama, module_engines):
    """A chunk whose tokens end inside a multi-byte UTF-8 character holds that character back (SGLang's and
    vLLM's detokenizers do too), so every chunk's text is a prefix of the final text; the streams here do
    split characters (checked with the HF decode of the chunks' ids)."""
    engine = module_engines(tiny_llama)
    hf = engine.tokenizer.tokenizer
    split = 0
    for seed in range(12):
        sp = dict(temperature=1.0, seed=seed, max_new_tokens=24, ignore_eos=True)
        chunks = list(engine.generate(prompt="Once upon a time", sampling_params=sp, stream=True))
        final = chunks[-1]["text"]
        assert final == engine.generate(prompt="Once upon a time", sampling_params=sp)["text"]
        for c in chunks[:-1]:
            assert final.startswith(c["text"]) and not c["text"].endswith("\ufffd"), (seed, c["text"][-4:])
            split += hf.decode(c["output_ids"]).endswith("\ufffd")
    assert split > 0  # the case under test happened


def test_min_new_tokens_floor_ignores_a_partial_character_at_its_end(tok_dir):
    """The text before token min_new_tokens ends in a partial UTF-8 character that the next token completes:
    a stop string inside that text still does not count (the floor is the text without the partial end)."""
    wrapper = TokenizerWrapper(str(tok_dir))
    hf = wrapper.tokenizer
    # "x", "a", and the byte-level tokens of the two bytes of "é" (0xC3 0xA9: "Ã" and "©" in GPT-2's alphabet)
    x, a, c3, a9 = hf.convert_tokens_to_ids(["x", "a", "\u00c3", "\u00a9"])
    assert hf.decode([x, a, c3]).endswith("\ufffd") and hf.decode([x, a, c3, a9]) == "xaé"
    req = _req(stop=["a"], min_new_tokens=4)
    req.output_ids = [x, a, c3, a9]
    assert wrapper.find_stop(req) is None  # the "a" was written before token 4: no stop
    req.output_ids = [x, a, c3, a9, a]
    assert wrapper.find_stop(req) == "a" and req.stop_at == 3  # a later one is


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_token_bytes_join_into_the_texts_utf8(kind, tok_dir, llama2_like_ckpt):
    """Each token's bytes (OpenAI's chat logprobs `bytes`) joined over a text whose characters span several
    tokens give exactly the text's UTF-8 (byte-level BPE and "<0xNN>" byte-fallback tokenizers; the latter's
    word-initial "▁" is the space the text has there), though those tokens' own texts are U+FFFD; with
    byte-level BPE a whole-character token's bytes are its text's UTF-8."""
    path = tok_dir if kind == "byte_level" else llama2_like_ckpt
    w = TokenizerWrapper(str(path), False)
    for text in ("a\u00e9\u20acb", "\u4e2d\u6587 ok", "plain ascii"):
        ids = w.tokenizer.encode(text, add_special_tokens=False)
        joined = bytes(b for t in ids for b in w.token_bytes(t))
        assert joined.decode("utf-8").lstrip() == text, (text, ids)
        for t in ids if kind == "byte_level" else ():
            if "\ufffd" not in w.token_text(t):
                assert w.token_bytes(t) == list(w.token_text(t).encode())
    assert any("\ufffd" in w.token_text(t) for t in w.tokenizer.encode("\u20ac", add_special_tokens=False))


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_token_text_is_the_tokenizers_decode_of_the_id_decoded_once(kind, tok_dir, llama2_like_ckpt, monkeypatch):
    """token_text(id) (a logprob entry's text) is HF's decode([id]) for every id of the vocabulary, and a second
    look-up of an id calls no decode (a final output's top logprobs asked for it per entry)."""
    path = tok_dir if kind == "byte_level" else llama2_like_ckpt
    w = TokenizerWrapper(str(path), False)
    vocab = range(len(w.tokenizer))
    assert [w.token_text(t) for t in vocab] == [w.tokenizer.decode([t]) for t in vocab]
    calls = []
    real = w.tokenizer.decode
    monkeypatch.setattr(w.tokenizer, "decode", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert [w.token_text(t) for t in vocab] == [real([t]) for t in vocab] and not calls
