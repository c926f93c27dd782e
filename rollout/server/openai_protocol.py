"""The request bodies of the OpenAI-compatible routes (rollout/server/openai_api.py), validated by pydantic.

Bodies are strict and refuse unknown keys (422 naming the field). `SamplingFields` holds what
/v1/completions and /v1/chat/completions share: the OpenAI sampling fields, SGLang's extra keys (accepted
as SGLang accepts them) and the extras sglang-router adds, and maps them to the Engine's sampling
params; penalties and `logit_bias` are forwarded only when set, so the Engine's refusal names exactly
what was asked for.

What it does not do: call the engine, or check what depends on the server (n limits, prompt sizes,
chat templates): the routes do.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout.server.common import Body

MAX_TOP_LOGPROBS = 20
_ROUTING_FIELDS = ("data_parallel_rank", "routed_dp_rank", "disagg_prefill_dp_rank", "bootstrap_host",
                   "bootstrap_port", "bootstrap_room")


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):  # SGLang and vLLM type both "bool or null"
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class SamplingFields(Body):
    # OpenAI types these "... or null": a client that passes None (the openai client sends it as null) gets the
    # default, as it would by leaving the field out; so do the extras vLLM types so (top_k, min_p,
    # repetition_penalty), which vLLM clients send as null.
    null_means_default: ClassVar[frozenset[str]] = frozenset(
        {"temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "echo", "logprobs",
         "top_k", "min_p", "repetition_penalty"})

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.null_means_default}
        return data

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # OpenAI bookkeeping a client may send: nothing is stored or billed here, so they change no output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # SGLang's extra keys
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    custom_params: dict | None = None  # SGLang's: handed to a custom logit processor (none is run here)
    rid: str | list[str] | None = None  # SGLang's: a list names each prompt's request (rid_j for choice j of n > 1)
    # sglang-router re-serialises OpenAI bodies with SGLang's extras; unset (false/null) they change nothing.
    return_hidden_states: Literal[False] = False
    lora_path: None = None
    session_params: None = None
    regex: None = None
    json_schema: None = None
    ebnf: None = None
    # SGLang's routing fields, as on /generate: sglang-router --dp-aware adds data_parallel_rank to every body.
    # Taken at their neutral value (rank 0 or null: this server is one data-parallel rank, no PD split),
    # refused naming the field otherwise (rollout/sglang_generate_args.py).
    data_parallel_rank: Any = None
    routed_dp_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        # As SGLang's and vLLM's protocols: the options only shape a stream, so asking for them without one is a
        # client's mistake (an empty or null stream_options is no ask).
        if self.stream_options is not None and not self.stream and self.stream_options.model_fields_set:
            raise ValueError("stream_options can only be defined when stream=true")
        return self

    @field_validator(*_ROUTING_FIELDS)
    @classmethod
    def _routing_field_neutral(cls, value, info):
        from rollout.sglang_generate_args import check_generate_args

        check_generate_args({info.field_name: value}, "this server")
        return value

    def sampling_params(self, max_new_tokens: int | None) -> dict:
        """The engine's sampling params; max_new_tokens None: up to the context length (chat's default, as
        OpenAI's and vLLM's; not the engine's own default of 128)."""
        sp: dict[str, Any] = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  min_p=self.min_p, n=self.n, stop=self.stop, seed=self.seed,
                                  min_new_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                                  skip_special_tokens=self.skip_special_tokens, no_stop_trim=self.no_stop_trim)
        if self.stop_token_ids:
            sp["stop_token_ids"] = self.stop_token_ids
        if self.stop_regex:
            sp["stop_regex"] = self.stop_regex
        if self.custom_params is not None:
            sp["custom_params"] = self.custom_params
        # Forwarded only when set, so the Engine's refusal names exactly what was asked for.
        for key, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, key) != default:
                sp[key] = getattr(self, key)
        if self.logit_bias:
            sp["logit_bias"] = self.logit_bias
        return {**{k: v for k, v in sp.items() if v is not None}, "max_new_tokens": max_new_tokens}


class CompletionRequest(SamplingFields):
    # OpenAI: max_tokens "integer or null, defaults to 16": null is the default, not "no limit".
    null_means_default: ClassVar[frozenset[str]] = SamplingFields.null_means_default | {"max_tokens"}
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    # OpenAI's roles, the deprecated "function" (a function call's result) included, as SGLang and vLLM take it
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    # SGLang's chat extras: variables for the template (Qwen3's enable_thinking), and rendering the last
    # (assistant) message open, so the model continues it instead of starting a new turn.
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    # Tool calls and reasoning are not parsed here (the text comes back whole), so these are neutral at any
    # value but reasoning_effort, which reasoning models' templates read: only unset is served.
    parallel_tool_calls: bool | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    reasoning_effort: None = None


class ScoreRequest(Body):
    """/v1/score (SGLang's): the next-token probabilities of label_token_ids after query + item, per item."""
    model: str | None = None
    query: str | list[int] | None = None
    items: str | list[str] | list[int] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False
