"""verl's AsyncEngine, ported by changing its base class to rollout.Engine, runs: its async wrappers await
engine.tokenizer_manager with SGLang's request objects, and each call does what the Engine's own does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from rollout import Engine
from tests.checkpoints import load_hf_model
from tests.rollout.oracle import hf_generate, random_prompts
from weight_sync import iter_buckets
from weight_sync.wire import encode_bucket

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


class AsyncEngine(Engine):
    """The shape of verl's AsyncEngine (verl/workers/rollout/sglang_rollout): async overrides of the Engine's
    own method names that go through self.tokenizer_manager, as verl's do over SGLang's Engine."""

    async def release_memory_occupation(self, tags=None):
        return await self.tokenizer_manager.release_memory_occupation(SimpleNamespace(tags=tags), None)

    async def resume_memory_occupation(self, tags=None):
        return await self.tokenizer_manager.resume_memory_occupation(SimpleNamespace(tags=tags), None)

    async def update_weights_from_tensor(self, update_weights_request):
        return await self.tokenizer_manager.update_weights_from_tensor(update_weights_request, None)

    async def flush_cache(self):
        return await self.tokenizer_manager.flush_cache()

    async def abort_request(self, rid: str = "", abort_all: bool = False):
        return self.tokenizer_manager.abort_request(rid=rid, abort_all=abort_all)


@pytest.fixture
def engines(ckpt_factory):
    a, b = ckpt_factory("qwen2", seed=0), ckpt_factory("qwen2", seed=1)
    engine = AsyncEngine(model_path=str(a), device="cpu", enable_memory_saver=True, show_progress=False,
                         max_total_tokens=1024)
    yield engine, a, b
    Engine.shutdown(engine)


def test_verl_async_engine_releases_updates_resumes_flushes_and_aborts(engines):
    """Release, a flattened-bucket update (one encoded bucket per TP rank, SGLang's list), resume: the engine
    then generates what HF generates on the new weights; flush_cache and abort_request answer as the Engine's
    own; the tokenizer and server_args are there to read."""
    engine, a, b = engines
    loop = asyncio.new_event_loop()
    try:
        run = loop.run_until_complete
        prompt = random_prompts([7], seed=4)[0]
        assert Engine.generate(engine, input_ids=prompt, sampling_params=GREEDY)["output_ids"] == \
            hf_generate(load_hf_model(a), prompt, 8)[0]
        run(engine.release_memory_occupation(None))
        run(engine.resume_memory_occupation(["weights"]))
        new = load_hf_model(b)
        buckets = list(iter_buckets(new.state_dict(), bucket_bytes=1 << 30))
        assert len(buckets) == 1
        request = SimpleNamespace(serialized_named_tensors=[encode_bucket(buckets[0])], load_format="flattened_bucket",
                                  flush_cache=True)
        ok, msg = run(engine.update_weights_from_tensor(request))
        assert ok, msg
        run(engine.resume_memory_occupation(["kv_cache"]))
        assert Engine.generate(engine, input_ids=prompt, sampling_params=GREEDY)["output_ids"] == \
            hf_generate(new, prompt, 8)[0]
        assert run(engine.flush_cache()).success
        stream = Engine.generate(engine, input_ids=prompt, sampling_params=dict(GREEDY, max_new_tokens=500),
                                 stream=True)
        next(stream)
        assert run(engine.abort_request(abort_all=True)) == 1
        assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert engine.tokenizer_manager.tokenizer.encode("a b c") == AutoTokenizer.from_pretrained(a).encode("a b c")
        assert engine.server_args.model_path == engine.tokenizer_manager.server_args.model_path == str(a)
        bad = SimpleNamespace(serialized_named_tensors=None, load_format=None)
        ok, msg = run(engine.update_weights_from_tensor(bad))
        assert not ok and "serialized_named_tensors" in msg
    finally:
        loop.close()


def test_generate_request_yields_what_async_generate_returns(engines):
    """tokenizer_manager.generate_request (verl's server adapter awaits its first item, or iterates a stream) with
    a GenerateReqInput-shaped object: non-streamed, the Engine's output once (greedy tokens = HF's); streamed,
    its chunks, the last equal to that output; `text` reads as the Engine's `prompt`; model_path and
    is_generation are there."""
    engine, a, _ = engines
    hf = load_hf_model(a)
    prompt = random_prompts([6], seed=5)[0]
    tm = engine.tokenizer_manager

    async def collect(obj):
        return [o async for o in tm.generate_request(obj, None)]

    loop = asyncio.new_event_loop()
    try:
        run = loop.run_until_complete
        # SGLang's GenerateReqInput carries every field, most at their defaults
        obj = SimpleNamespace(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, stream=False, rid=None,
                              return_text_in_logprobs=False, image_data=None, return_hidden_states=False,
                              custom_logit_processor=None, lora_path=None, log_metrics=True, top_logprobs_num=None,
                              logprob_start_len=None, token_ids_logprob=None, modalities=None)
        outs = run(collect(obj))
        assert len(outs) == 1 and outs[0]["output_ids"] == hf_generate(hf, prompt, 8)[0]
        assert len(outs[0]["meta_info"]["output_token_logprobs"]) == 8
        chunks = run(collect({"input_ids": prompt, "sampling_params": GREEDY, "stream": True}))
        assert len(chunks) > 1 and chunks[-1]["output_ids"] == outs[0]["output_ids"]
        text = run(collect({"text": "a b c", "sampling_params": GREEDY}))[0]
        assert text == Engine.generate(engine, prompt="a b c", sampling_params=GREEDY) | {"meta_info": text["meta_info"]}
        batch = run(collect({"input_ids": [prompt, prompt[:3]], "sampling_params": GREEDY}))[0]
        assert [o["output_ids"] for o in batch] == [hf_generate(hf, p, 8)[0] for p in (prompt, prompt[:3])]
        assert tm.model_path == str(a) and tm.is_generation is True
    finally:
        loop.close()
