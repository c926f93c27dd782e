"""The LoRA endpoints over HTTP equal the Engine: /load_lora_adapter, /load_lora_adapter_from_tensors
(pickle-free blobs), /unload_lora_adapter, lora_path on /generate, OpenAI model="<adapter>" and
"<base>:<adapter>", and /v1/models listing the loaded adapters; refusals are 400 and change nothing."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from rollout.server.tensor_codec import encode_named_tensors
from tests.rollout.oracle import random_prompts
from tests.server.conftest import start_server

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
PROMPT = random_prompts([6], seed=7)[0]


@pytest.mark.parametrize("in_child", [False, True], ids=["engine-in-process", "engine-process"])
def test_lora_endpoints_equal_the_engine(tiny_llama, adapter_factory, make_engine, in_child):
    """Adapters loaded over HTTP generate what an Engine with lora_paths generates, on every route, whether
    the engine runs in the server's process or in its own (tensors decoded there)."""
    a, b = adapter_factory(tiny_llama, r=8, seed=21), adapter_factory(tiny_llama, r=4, seed=22)
    ref_engine = make_engine(tiny_llama, lora_paths={"a": str(a), "b": str(b)})
    ref = {n: ref_engine.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path=n)["output_ids"]
           for n in ("a", "b", None)}
    assert ref["a"] != ref[None]
    kw = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])
    with start_server(tiny_llama, engine_kw=kw, in_child=in_child) as s, s.client() as c:
        r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(a)})
        assert r.status_code == 200 and r.json() == {"success": True, "error_message": None,
                                                     "loaded_adapters": {"a": str(a)}}
        tensors = load_file(str(b / "adapter_model.safetensors"))
        config = json.loads((b / "adapter_config.json").read_text())
        r = c.post("/load_lora_adapter_from_tensors", json={"lora_name": "b", "config_dict": config,
                                                            "serialized_tensors": encode_named_tensors(tensors)})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a": str(a), "b": "__tensor__"}
        bad = c.post("/load_lora_adapter_from_tensors", json={"lora_name": "c", "config_dict": {**config, "r": 64},
                                                              "serialized_tensors": encode_named_tensors(tensors)})
        assert bad.status_code == 400 and "max_lora_rank" in bad.json()["error_message"]
        for name in ("a", "b", None):
            body = {"input_ids": PROMPT, "sampling_params": GREEDY, **({"lora_path": name} if name else {})}
            assert c.post("/generate", json=body).json()["output_ids"] == ref[name]
        models = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert models == ["tiny", "a", "b"]
        card = c.get("/v1/models/a").json()  # every listed id can be retrieved
        assert (card["id"], card["parent"]) == ("a", "tiny") and c.get("/v1/models/zzz").status_code == 404
        r = c.post("/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(a)})  # the served name
        assert r.status_code == 400 and "served model's name" in r.text
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "a", "b"]
        text = ref_engine.tokenizer.decode(PROMPT)
        want = ref_engine.generate(prompt=text, sampling_params=GREEDY, lora_path="a")["text"]
        for model in ("a", "tiny:a"):
            r = c.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 6, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
            assert r.json()["model"] == model  # the adapter that served it, as the request named it
        assert c.post("/v1/completions", json={"model": "tiny:zzz", "prompt": text, "max_tokens": 2}).status_code == 400
        assert c.post("/generate", json={"input_ids": PROMPT, "lora_path": "zzz"}).status_code == 400
        r = c.post("/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"b": "__tensor__"}
        assert c.post("/unload_lora_adapter", json={"lora_name": "a"}).status_code == 400
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "b"]


def test_adapter_ids_in_v1_models_reach_their_adapter(tiny_llama, adapter_factory, make_engine):
    """An adapter loaded as "tiny:y" is listed under that id, and that id serves it (it was read as adapter
    "y" of "tiny" and refused); an adapter given at start-up under the served model's name is refused there,
    as /load_lora_adapter refuses it (/v1/models listed "tiny" twice, the base model answering both)."""
    from rollout.server.app import create_app
    from rollout.server.args import ServerArgs

    a = adapter_factory(tiny_llama, r=8, seed=21)
    ref_engine = make_engine(tiny_llama, lora_paths={"a": str(a)})
    text = ref_engine.tokenizer.decode(PROMPT)
    want = ref_engine.generate(prompt=text, sampling_params=GREEDY, lora_path="a")["text"]
    base = ref_engine.generate(prompt=text, sampling_params=GREEDY)["text"]
    assert want != base
    kw = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])
    with start_server(tiny_llama, engine_kw=kw) as s, s.client() as c:
        assert c.post("/load_lora_adapter", json={"lora_name": "tiny:y", "lora_path": str(a)}).status_code == 200
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "tiny:y"]
        r = c.post("/v1/completions", json={"model": "tiny:y", "prompt": text, "max_tokens": 6, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    clash = make_engine(tiny_llama, lora_paths={"tiny": str(a)})
    with pytest.raises(ValueError, match="served model's name"):
        create_app(clash, ServerArgs(served_model_name="tiny"))
