"""The smaller sglang.Engine methods RL code calls: get_model_info, freeze_gc, async_load_lora_adapter /
async_unload_lora_adapter.

Oracles: the checkpoint paths the test loads, gc's own freeze count, and the same engine's output from
the synchronous calls (and with no adapter) for the async ones.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from tests.lora_adapters import make_adapter, peft_model
from tests.server.conftest import start_server

PROMPT = [5, 6, 7, 8, 9]
GREEDY = dict(temperature=0, max_new_tokens=8, ignore_eos=True)


def test_get_model_info_follows_disk_updates_and_matches_http(make_engine, ckpt_factory):
    """get_model_info names the launch checkpoint, then the one update_weights_from_disk loaded, with the
    current weight version; /get_model_info answers the same dict."""
    a, b = ckpt_factory("llama", seed=0), ckpt_factory("llama", seed=1)
    engine = make_engine(a, weight_version="w0")
    info = engine.get_model_info()
    assert (info["model_path"], info["weight_version"], info["is_generation"]) == (str(a), "w0", True)
    assert engine.update_weights_from_disk(str(b), weight_version="w1")[0]
    info = engine.get_model_info()
    assert (info["model_path"], info["weight_version"]) == (str(b), "w1")
    with start_server(a, engine=engine) as s, s.client() as c:
        assert c.get("/get_model_info").json() == info


def test_freeze_gc_freezes_and_the_engine_keeps_serving(make_engine, tiny_llama):
    """After freeze_gc gc reports frozen objects, and greedy output is what it was."""
    engine = make_engine(tiny_llama)
    want = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    try:
        engine.freeze_gc()
        assert gc.get_freeze_count() > 0
        assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == want
    finally:
        gc.unfreeze()


def test_async_lora_load_and_unload_equal_the_sync_calls(make_engine, tiny_llama, tmp_path):
    """An adapter loaded with async_load_lora_adapter generates what the same adapter loaded synchronously
    does (and not what the base does); async_unload_lora_adapter frees the name for a sync reload."""
    adapter = make_adapter(tiny_llama, tmp_path / "ad", seed=3)
    engine = make_engine(tiny_llama, enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])
    base = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]

    async def load_generate_unload():
        out = await engine.async_load_lora_adapter("ad", str(adapter))
        assert out.success, out.error_message
        got = await engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="ad")
        out = await engine.async_unload_lora_adapter("ad")
        assert out.success, out.error_message
        return got["output_ids"]

    via_async = asyncio.run(load_generate_unload())
    assert engine.load_lora_adapter("ad", str(adapter)).success
    via_sync = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="ad")["output_ids"]
    assert via_async == via_sync != base


def test_unload_with_a_mistyped_argument_is_refused_and_the_adapter_keeps_serving(make_engine, tiny_llama, tmp_path):
    """unload_lora_adapter with a timeout_s or a name of the wrong type returns success=False naming it, and the
    adapter stays loaded and usable (a bad timeout_s raised TypeError after marking it as unloading, so every
    later request on it was refused); then a plain unload still works."""
    adapter = make_adapter(tiny_llama, tmp_path / "ad", r=8, seed=5)
    engine = make_engine(tiny_llama, enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])
    assert engine.load_lora_adapter("ad", str(adapter)).success
    with torch.no_grad():  # the oracle: transformers + peft on the same adapter
        n = GREEDY["max_new_tokens"]
        want = peft_model(tiny_llama, adapter).generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n,
                                                         do_sample=False)[0, len(PROMPT):].tolist()
    assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="ad")["output_ids"] == want
    for kwargs, field in [(dict(lora_name="ad", timeout_s="5"), "timeout_s"),
                          (dict(lora_name="ad", timeout_s=float("nan")), "timeout_s"),
                          (dict(lora_name=["ad"]), "lora_name")]:
        out = engine.unload_lora_adapter(**kwargs)
        assert not out.success and f"{field} must be" in out.error_message, out
        assert out.loaded_adapters == {"ad": str(adapter)}
        assert engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="ad")["output_ids"] == want
    assert engine.unload_lora_adapter("ad", timeout_s=5).success
    with pytest.raises(ValueError, match="'ad' is not loaded"):
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="ad")


def test_generate_takes_sglangs_positional_order(make_engine, tiny_llama):
    """generate / async_generate take sglang.Engine's positions: prompt, sampling_params, input_ids, image_data,
    audio_data, video_data, return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob, lora_path
    (return_logprob was 4th, so a call passing image_data positionally set it, and top_logprobs_num landed on
    stream); the results equal the keyword call's, and a non-neutral image_data is refused by name."""
    import pytest

    engine = make_engine(tiny_llama)
    ids, sp = [5, 6, 7, 8], {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    want = engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True, logprob_start_len=1,
                           top_logprobs_num=2, token_ids_logprob=[9])
    engine.flush_cache()  # a prefix-cache hit may move a logprob by an ulp
    got = engine.generate(None, sp, ids, None, None, None, True, 1, 2, [9], None)
    assert got["output_ids"] == want["output_ids"] and got["meta_info"]["output_top_logprobs"] == \
        want["meta_info"]["output_top_logprobs"]
    assert got["meta_info"]["input_token_ids_logprobs"] == want["meta_info"]["input_token_ids_logprobs"]
    engine.flush_cache()
    got = asyncio.run(engine.async_generate(None, sp, ids, None, None, None, True, 1, 2, [9], None))
    assert got["meta_info"]["output_top_logprobs"] == want["meta_info"]["output_top_logprobs"]
    with pytest.raises(ValueError, match="image_data"):
        engine.generate(None, sp, ids, "http://example.com/cat.png")
