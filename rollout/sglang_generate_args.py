"""The `sglang.Engine.generate` arguments this engine does not implement: accepted at their neutral value.

Code written for SGLang often passes every argument it knows, most at their defaults (verl's rollout
passes `image_data=None` for text-only prompts; wrappers forward `custom_logit_processor=None`,
`return_hidden_states=False`, `data_parallel_rank=None`). Such a call must port unchanged, so each
argument below is taken when its value means "not used" (or is a per-prompt list of such values) and
refused with a ValueError naming the argument, the value and why, when it asks for something this
engine does not do. A name SGLang does not have either is a TypeError, as Python would raise.

It only checks arguments; the ones the engine implements (sampling, logprobs, LoRA, routed experts...)
are Engine.generate's own parameters. The HTTP server's /generate takes the same names as JSON fields.
"""

from __future__ import annotations

from typing import Any

_MULTIMODAL = "multimodal inputs are not supported: the engine serves text-only causal LMs"
_DISAGG = "prefill/decode disaggregation is not supported"
_SESSION = "sessions are not supported (SGLang's open_session/close_session)"

# name -> (values meaning "not used", why another value is refused)
UNIMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "image_data": ((None,), _MULTIMODAL),
    "audio_data": ((None,), _MULTIMODAL),
    "video_data": ((None,), _MULTIMODAL),
    "mm_hashes": ((None,), _MULTIMODAL),
    "mm_content_hashes": ((None,), _MULTIMODAL),
    "input_embeds": ((None,), "input_embeds are not supported: pass prompt or input_ids"),
    "custom_logit_processor": ((None,), "custom logit processors are not supported (SGLang's "
                                        "--enable-custom-logit-processor); logit_bias, penalties and "
                                        "min_new_tokens are sampling_params"),
    "require_reasoning": ((None, False), "reasoning parsers are not supported"),
    "return_hidden_states": ((None, False), "returning hidden states is not supported"),
    "routed_experts_start_len": ((None, 0), "routed experts are returned from the first prompt position only"),
    "bootstrap_host": ((None,), _DISAGG),
    "bootstrap_port": ((None,), _DISAGG),
    "bootstrap_room": ((None,), _DISAGG),
    "disagg_prefill_dp_rank": ((None,), _DISAGG),
    # dp_size is 1 here; SGLang ignores rank 0 when dp_size <= 1 and refuses any other rank.
    "routed_dp_rank": ((None, 0), "it is out of range [0, 1): this engine has dp_size=1"),
    "data_parallel_rank": ((None, 0), "it is out of range [0, 1): this engine has dp_size=1"),
    "session_params": ((None,), _SESSION),
    "session_id": ((None,), _SESSION),
    "priority": ((None,), "priority scheduling is not supported (SGLang's --enable-priority-scheduling)"),
    "cache_salt": ((None,), "per-request prefix-cache salts are not supported"),
    "kv_router_hint": ((None,), "KV router hints (SGLang's HiCache storage backends) are not supported"),
    # GenerateReqInput's (the /generate body; SGLang's weight-version tests post it as null)
    "extra_key": ((None,), "per-request prefix-cache namespaces are not supported"),
    "return_bytes": ((None, False), "returning output bytes is not supported"),
    "return_entropy": ((None, False), "returning entropies is not supported"),
    # The rest of SGLang's GenerateReqInput (its multimodal, disaggregation and debugging extras)
    **{name: ((None, False), _MULTIMODAL) for name in (
        "modalities", "use_audio_in_video", "video_config", "images_config", "need_wait_for_mm_inputs",
        "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
        "video_max_dynamic_patch", "positional_embed_overrides")},
    "bootstrap_pair_key": ((None,), _DISAGG),
    "decode_tp_size": ((None,), _DISAGG),
    "lora_id": ((None,), "lora_id is SGLang's internal adapter id: name the adapter with lora_path"),
    "max_thinking_tokens": ((None,), "thinking budgets are not supported"),
    "return_sampling_mask": ((None, False), "returning sampling masks is not supported"),
    "return_flat_raw_top_logprobs": ((None, False), "flat raw top logprobs are not supported: use top_logprobs_num"),
    "return_flat_raw_top_logprobs_b64": ((None, False), "flat raw top logprobs are not supported: use "
                                                        "top_logprobs_num"),
    "return_indexer_topk": ((None, False), "returning indexer top-k (sparse attention) is not supported"),
    "return_prompt_token_ids": ((None, False), "returning prompt token ids is not supported (meta_info's "
                                               "prompt_tokens counts them; input_token_logprobs lists them)"),
    "multi_item_delimiter_indices": ((None,), "multi-item scoring is served by /v1/score"),
}
# Accepted with any value and ignored: they only label or route the request (tracing, logging, a router's
# affinity keys) or are SGLang's own plumbing between its processes.
IGNORED = ("external_trace_header", "log_metrics", "routing_key", "conversation_id", "custom_labels",
           "http_worker_ipc", "received_time")


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if isinstance(value, list | tuple):  # one value per prompt
        return all(_neutral(v, neutral) for v in value)
    if value is None:
        return None in neutral
    # False and 0 both mean "off" where either is the neutral value (SGLang tests truthiness).
    return isinstance(value, bool | int) and not value and any(n is not None for n in neutral)


def check_generate_args(kwargs: dict[str, Any], method: str = "generate") -> None:
    """Raise for an argument of `kwargs` (the extra keyword arguments of a generate call) that this engine
    cannot honour: TypeError for a name SGLang does not have either, ValueError naming the argument,
    its value and the reason for a value that asks for an unimplemented feature."""
    unknown = sorted(k for k in kwargs if k not in UNIMPLEMENTED and k not in IGNORED)
    if unknown:
        raise TypeError(f"{method} got unexpected keyword argument(s) {unknown}")
    for name, value in kwargs.items():
        if name in IGNORED:
            continue
        neutral, why = UNIMPLEMENTED[name]
        if not _neutral(value, neutral):
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ValueError(f"{method}: {name}={shown} is refused: {why}")
