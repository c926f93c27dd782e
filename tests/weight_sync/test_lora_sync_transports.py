"""Adapter-only sync (weight_sync/lora.py) into an engine in another process (RemoteEngine, shared memory)
and into a server (HttpEngine): the adapter served under its name generates what transformers + peft
generate with the same adapter (a PeftModel on an adapter peft itself wrote)."""

from __future__ import annotations

import pytest
import torch

from tests.lora_adapters import make_adapter, peft_model
from tests.server.conftest import start_server
from weight_sync.cross_process import RemoteEngine
from weight_sync.http import HttpEngine
from weight_sync.lora import sync_lora_adapter

LORA_KW = dict(device="cpu", max_total_tokens=1024, show_progress=False, enable_lora=True, max_lora_rank=8,
               lora_target_modules=["all"])
PROMPT = [5, 6, 7, 8, 9]


def _peft_greedy(model, n: int = 6) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(PROMPT):].tolist()


def _served(engine, name: str, n: int = 6) -> list[int]:
    out = engine.generate(input_ids=PROMPT, lora_path=name,
                          sampling_params=dict(temperature=0, max_new_tokens=n, ignore_eos=True))
    return out["output_ids"]


def test_adapter_sync_through_a_remote_engine_and_a_server(ckpt_factory, tmp_path):
    """sync_lora_adapter(peft_model, RemoteEngine) and (peft_model, HttpEngine): success, and greedy under the
    synced name equals the PeftModel's; a second version loads beside the first; unload works over HTTP."""
    ckpt = ckpt_factory("llama")
    model = peft_model(ckpt, make_adapter(ckpt, tmp_path / "a", r=8, seed=3))
    want = _peft_greedy(model)
    with RemoteEngine(model_path=str(ckpt), **LORA_KW) as remote:
        ok, msg = sync_lora_adapter(model, remote, "v1")
        assert ok, msg
        assert _served(remote, "v1") == want
    with start_server(ckpt, engine_kw=LORA_KW) as served:
        http = HttpEngine(served.url)
        try:
            for name in ("v1", "v2"):
                ok, msg = sync_lora_adapter(model, http, name)
                assert ok, msg
            assert _served(served.engine, "v2") == want
            assert http.unload_lora_adapter("v1")["success"]
            ok, msg = sync_lora_adapter(model, http, "v2")  # the name is taken: refused, by name
            assert not ok and "already loaded" in msg
        finally:
            http.close()


def test_the_trainers_lora_versions_publish_through_a_server(ckpt_factory, tmp_path):
    """trainers.lora.LoRAVersions over an HttpEngine (whose unload answers SGLang's dict, as a RemoteEngine's
    does): publishing a second version unloads the first, and the current one serves the PeftModel's greedy
    tokens (GRPO with --engine-process and LoRA crashed at its second step reading .success of that dict)."""
    from trainers.lora import LoRAVersions

    ckpt = ckpt_factory("llama")
    model = peft_model(ckpt, make_adapter(ckpt, tmp_path / "a", r=8, seed=3))
    want = _peft_greedy(model)
    with start_server(ckpt, engine_kw=LORA_KW) as served:
        http = HttpEngine(served.url)
        try:
            versions = LoRAVersions(http)
            for step in (1, 2):
                assert versions.publish(model, f"policy-step-{step}") > 0
            assert set(served.engine.runner.lora_adapters()) == {"policy-step-2"}
            assert _served(served.engine, "policy-step-2") == want
        finally:
            http.close()


def test_a_peft_model_into_no_engine_or_a_full_weight_transport_is_refused_by_name(ckpt_factory, tmp_path):
    """A PEFT model synced into an empty list is a ValueError (it answered success having loaded nothing, where a
    plain model's empty list is refused), into a DiskTarget a TypeError naming it (an AttributeError before), and
    into DeltaSync a TypeError pointing at the adapter sync (a refusal of 'base_model.model...' names before);
    the engine's adapters are unchanged, and the same model then loads and serves as peft generates."""
    from rollout import Engine
    from weight_sync import DeltaSync, DiskTarget, sync_weights

    ckpt = ckpt_factory("llama")
    model = peft_model(ckpt, make_adapter(ckpt, tmp_path / "a", r=8, seed=3))
    with Engine(str(ckpt), **LORA_KW) as engine:
        with pytest.raises(ValueError, match="empty list of targets"):
            sync_weights(torch.nn.Linear(2, 2), [])  # the plain model's answer, the oracle
        with pytest.raises(ValueError, match="empty list of targets"):
            sync_weights(model, [], lora_name="v1")
        with pytest.raises(TypeError, match="DiskTarget.*load_lora_adapter_from_tensors"):
            sync_weights(model, DiskTarget(engine, tmp_path / "out", ckpt / "config.json"), lora_name="v1")
        with pytest.raises(TypeError, match="lora_name"):
            DeltaSync(engine).sync(model)
        assert not engine.runner.lora_adapters()
        ok, msg = sync_weights(model, [engine], lora_name="v1")
        assert ok, msg
        assert _served(engine, "v1") == _peft_greedy(model)
