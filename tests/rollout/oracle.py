"""Helpers for the rollout tests: an engine pool that always shuts its engines down, and the
independent references — HF greedy `generate` on the same checkpoint, random token-id prompts."""

from __future__ import annotations

import pathlib

import torch
from transformers import GenerationConfig

from rollout import Engine

ENGINE_DEFAULTS = dict(show_progress=False, max_total_tokens=4096, max_running_requests=64)


class EnginePool:
    """Builds engines with test defaults and shuts every one of them down at close()."""

    def __init__(self) -> None:
        self.engines: list[Engine] = []

    def __call__(self, path: str | pathlib.Path, **kwargs) -> Engine:
        engine = Engine(str(path), **{**ENGINE_DEFAULTS, **kwargs})
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()


@torch.no_grad()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None,
                min_new_tokens: int = 0) -> tuple[list[int], list[float]]:
    """HF greedy `generate` on one unpadded prompt: (new token ids, log_softmax(raw logits) of each).

    eos_token_id None means no eos at all (ignore_eos); generation stops after an eos otherwise.
    """
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                              pad_token_id=2, bos_token_id=0, output_logits=True, return_dict_in_generate=True)
    # generate() fills unset fields from the model's own generation_config (eos 1 included): override it there.
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, eos_token_id
    try:
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def random_prompts(lengths: list[int], seed: int = 0, low: int = 3, high: int = 340) -> list[list[int]]:
    """Token-id prompts of the given lengths, drawn from [low, high) (ids the tokenizer knows)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=g).tolist() for n in lengths]


def pause_mid_stream(engine: Engine, num_chunks: int = 2, attempts: int = 10, mode: str = "in_place",
                     **generate_kwargs):
    """Start a streaming request, read `num_chunks` chunks, pause the engine (`mode`) with it still in flight.

    Returns (stream, chunks read). The engine does not wait for readers, so a starved reader can see its
    chunks only after the request ended; then this tries again. Needs an otherwise idle engine.
    """
    for _ in range(attempts):
        stream = engine.generate(stream=True, **generate_kwargs)
        chunks = [next(stream) for _ in range(num_chunks)]
        engine.pause_generation(mode=mode)
        if engine.get_server_info()["num_in_flight"] == 1:
            return stream, chunks
        engine.continue_generation()
        list(stream)
    raise AssertionError("the stream always finished before the pause landed")


def assert_same_outputs(outs: list[dict], refs: list[dict], atol: float = 1e-5) -> None:
    """Two schedules' outputs of one workload agree: tokens and finish reasons exactly, the sampled tokens'
    logprobs within `atol` (a row batched differently may round differently in the last bits), and as many
    top-logprob / token-id-logprob entries where the reference has them."""
    assert len(outs) == len(refs)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out["output_ids"] == ref["output_ids"], f"request {i}"
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"], f"request {i}"
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        ref_lps = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=atol, rtol=0, msg=f"request {i}")
        for key in ("output_top_logprobs", "output_token_ids_logprobs"):
            if ref["meta_info"].get(key) is not None:
                assert len(out["meta_info"][key]) == len(ref["meta_info"][key]), f"request {i}: {key}"
