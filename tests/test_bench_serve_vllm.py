"""bench/serve_vllm.py's pieces that run without vLLM: the word-level tokenizer it gives a preset covers every
model row both ways, and its streaming client counts exactly the tokens a server generated."""

import asyncio

from transformers import AutoTokenizer

from bench import serve_vllm
from bench.throughput import write_preset
from tests.server.conftest import start_server


def test_word_tokenizer_maps_every_id_to_one_word_and_back(tmp_path):
    """"<i>" is id i for every model row (0 and the last included), both ways, and the tokenizer's size is the
    model's vocabulary. (transformers 5 loads a qwen2 directory's tokenizer as Qwen2Tokenizer, whose
    decoder joins the words without spaces; vLLM's and this server's detokenizers load it alike.)"""
    model = write_preset("tiny", "float32", tmp_path / "ckpt")
    serve_vllm.write_word_tokenizer(model)
    tok = AutoTokenizer.from_pretrained(model)
    vocab = serve_vllm.vocab_size_of(model)
    assert len(tok) == vocab
    ids = [0, 5, 77, vocab - 1]
    words = [f"<{i}>" for i in ids]
    assert tok.convert_ids_to_tokens(ids) == words
    assert tok.convert_tokens_to_ids(words) == ids
    assert tok.decode(ids).replace(" ", "") == "".join(words)


def test_client_counts_every_streamed_token_and_times_the_first(tiny_llama):
    """Against this server: each of 6 streams over 2 connections reports its usage (4 tokens with ignore_eos),
    a first-token time no later than its latency, and the run ends with every request done."""
    with start_server(tiny_llama, in_child=True) as s:
        reqs = [dict(model="tiny", prompt=[5, 6, 7 + i], max_tokens=4, temperature=1.0, ignore_eos=True, stream=True,
                     stream_options={"include_usage": True}) for i in range(6)]
        wall, results = asyncio.run(serve_vllm.run_client(s.url, reqs, concurrency=2, timeout_s=60))
    assert len(results) == 6 and wall > 0
    for latency, ttft, tokens in results:
        assert tokens == 4
        assert 0 < ttft <= latency
