"""SamplingParams: SGLang's sampling keys, validated with errors that name the field.

Validation covers every field the scheduler step reads (types, bools included, and finite ranges), so a
request that passes here cannot make a step raise; what needs the model (vocabulary) is in `verify`.

Penalties follow the reference definitions: `repetition_penalty` is Hugging Face's
RepetitionPenaltyLogitsProcessor over every token seen so far (prompt and output: a positive logit is
divided by it, a negative one multiplied); `frequency_penalty` / `presence_penalty` are OpenAI's (and
SGLang's), over the output tokens only: logit -= frequency_penalty * count + presence_penalty * (count > 0).
`logit_bias` ({token id: bias}, keys as ints or decimal strings as JSON sends them) is added to the logits;
a bias may be at most MAX_LOGIT_BIAS, and one below -MAX_LOGIT_BIAS (or -inf) bans the token.
All of them act on the logits before temperature and truncation. `max_new_tokens=None` means "up to the
context length". `stop_regex` patterns are searched in the decoded output, like `stop` strings.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace

from rollout import stop_match

_GREEDY_BELOW = 1e-6  # temperatures under this are greedy
# |bias| / temperature stays below 1e12 (float32's max is 3.4e38): finite however many tokens are biased.
MAX_LOGIT_BIAS = 1e6
# The sampler divides float32 logits by these: a temperature over this bound (finite as a Python float, but
# inf in float32 past 3.4e38) turns a banned token's -inf into NaN, and a repetition penalty under this one
# overflows a positive logit. Within both bounds (and the bias's) every scaled logit stays under 1e18.
MAX_TEMPERATURE = 1e6
MIN_REPETITION_PENALTY = 1e-6
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
# SGLang sampling params not implemented here. None (their default, what a client dumping every field sends)
# is dropped, as SGLang ignores it; any other value is refused naming what it asks for.
_CONSTRAINED = "constrained decoding (json_schema, regex, ebnf, structural_tag) is not supported"
_UNIMPLEMENTED = {"json_schema": _CONSTRAINED, "regex": _CONSTRAINED, "ebnf": _CONSTRAINED,
                  "structural_tag": _CONSTRAINED}


def as_int(x) -> int | None:
    """x as an int when it is int-like (see `_is_int_like`), else None. The server's size limits read n
    and max_new_tokens through this, so 1e6 as a float is counted, not skipped."""
    return int(x) if _is_int_like(x) else None


def is_integer(x) -> bool:
    """An int or a numpy integer scalar, not a bool (numpy's bool is no numbers.Integral) and not a float: the
    options that take no integral float (top_logprobs_num, logprob_start_len, truncate_size)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A real number, numpy scalars included; not a bool (numpy's bool is not a numbers.Real either)."""
    t = type(x)
    if t is int or t is float:  # what JSON and Python callers send: no ABC check (~1 us each, ~20 a request)
        return True
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int_like(x) -> bool:
    """An int, a numpy integer scalar, or an integral float such as 16.0 (JSON clients and arithmetic
    on configs produce these; SGLang accepts them). Not a bool, not 16.5, not nan or inf."""
    t = type(x)
    if t is int:
        return True
    if t is float:
        return math.isfinite(x) and x.is_integer()
    return _is_number(x) and (isinstance(x, numbers.Integral) or (math.isfinite(x) and float(x).is_integer()))


# Fields SGLang's SamplingParams reads None as its default for (what /generate's null and a client copying
# OpenAI fields, nulls included, send).
NONE_MEANS_DEFAULT = frozenset({"temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                                "repetition_penalty", "min_new_tokens", "n", "ignore_eos", "skip_special_tokens",
                                "spaces_between_special_tokens", "no_stop_trim"})


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128  # None: up to the context length
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    repetition_penalty: float = 1.0  # 1 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop_regex: str | list[str] | None = None
    # A streaming request's chunks every N tokens (the first token at once, then tokens N+1, 2N+1, ...,
    # and the final output always), as SGLang's; None: the engine's stream_interval.
    stream_interval: int | None = None
    # SGLang hands these to a request's custom logit processor and nothing else reads them. A processor is
    # refused here (rollout/sglang_generate_args.py), so they have no effect; a dict is taken as SGLang
    # takes it (slime sends {"return_top_p_token_ids": True} with every top-p request).
    custom_params: dict | None = None

    @classmethod
    def from_dict(cls, params: dict | None) -> SamplingParams:
        if params is None:
            params = {}
        if isinstance(params, SamplingParams):
            sp = replace(params)  # normalized like a dict, without touching the caller's object
        elif not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}")
        else:
            known = _FIELD_NAMES
            if "sampling_seed" in params:  # SGLang's newer name for seed
                if params.get("seed") is not None:
                    raise ValueError("sampling params seed and sampling_seed are the same field: pass one")
                params = {k: v for k, v in params.items() if k != "sampling_seed"} | {"seed": params["sampling_seed"]}
            for name in sorted(set(params) & set(_UNIMPLEMENTED)):
                if params[name] is not None:
                    raise ValueError(f"sampling param {name}={params[name]!r} is refused: {_UNIMPLEMENTED[name]}")
            params = {k: v for k, v in params.items() if k not in _UNIMPLEMENTED}
            unknown = sorted(set(params) - known)
            if unknown:
                raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
            sp = cls(**params)
        sp.normalize()
        return sp

    def normalize(self) -> None:
        """Type and range checks that do not need the model; raises ValueError naming the field."""
        for name, default in _NONE_DEFAULTS.items():  # SGLang: None here means "the default" (a client's null)
            if getattr(self, name) is None:
                setattr(self, name, default)
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            if name == "max_new_tokens" and self.max_new_tokens is None:
                continue
            if not _is_int_like(getattr(self, name)):
                raise ValueError(f"sampling param {name} must be an int, got {getattr(self, name)!r}")
            setattr(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_number(v):
                raise ValueError(f"sampling param {name} must be a number, got {v!r}")
            if not math.isfinite(v):  # nan passes every comparison below; inf breaks the sampler's scaling
                raise ValueError(f"sampling param {name} must be finite, got {v!r}")
            setattr(self, name, float(v))  # a numpy float32 and friends become a plain float
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sampling param {name} must be a bool, got {getattr(self, name)!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"sampling param max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens:
            raise ValueError(f"sampling param min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"sampling param min_new_tokens={self.min_new_tokens} exceeds "
                             f"max_new_tokens={self.max_new_tokens} (it must be in [0, max_new_tokens])")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"sampling param temperature must be in [0, {MAX_TEMPERATURE:g}] (a larger one "
                             f"overflows the sampler's float32 logits), got {self.temperature}")
        if self.temperature < _GREEDY_BELOW:  # as SGLang: dividing by ~0 would overflow the logits
            self.temperature = 0.0
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling param top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling param top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"sampling param min_p must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"sampling param n must be >= 1, got {self.n}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"sampling param stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids  # an array has no truth value
        if not isinstance(ids, list | tuple | set) or not all(_is_int_like(t) for t in ids):
            hint = " (convert it with .tolist())" if hasattr(ids, "tolist") else ""
            raise ValueError(f"sampling param stop_token_ids must be a list of ints, got {self.stop_token_ids!r}{hint}")
        self.stop_token_ids = [int(t) for t in ids]
        if self.seed is not None:
            if not _is_int_like(self.seed):
                raise ValueError(f"sampling param seed must be an int or None, got {self.seed!r}")
            self.seed = int(self.seed)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2:  # SGLang's bound above; 0 divides by 0
            raise ValueError(f"sampling param repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2] "
                             f"(1 = off; a smaller one overflows the sampler's float32 logits), "
                             f"got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):  # OpenAI's and SGLang's range
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"sampling param {name} must be in [-2, 2], got {getattr(self, name)}")
        self.logit_bias = self._normalized_bias(self.logit_bias)
        regexes = [] if self.stop_regex is None else self.stop_regex
        regexes = [regexes] if isinstance(regexes, str) else regexes
        if not isinstance(regexes, list | tuple) or not all(isinstance(r, str) and r for r in regexes):
            raise ValueError(f"sampling param stop_regex must be a string or a list of non-empty strings, "
                             f"got {self.stop_regex!r}")
        stop_match.validate(self.stop, list(regexes))  # counts, lengths, compiles (bounded matching)
        self.stop_regex = list(regexes)
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise ValueError(f"sampling param custom_params must be a dict (or None), got {self.custom_params!r}")
        if self.stream_interval is not None:
            if not _is_int_like(self.stream_interval) or int(self.stream_interval) < 1:
                raise ValueError(f"sampling param stream_interval must be an int >= 1 (or None: the engine's), "
                                 f"got {self.stream_interval!r}")
            self.stream_interval = int(self.stream_interval)

    @staticmethod
    def _normalized_bias(bias) -> dict[int, float]:
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise ValueError(f"sampling param logit_bias must be a dict {{token id: bias}}, got {bias!r}")
        out = {}
        for k, v in bias.items():
            digits = k.strip().removeprefix("-") if isinstance(k, str) else ""
            # ASCII digits only: str.isdigit() also accepts '²' or '٣', which int() then refuses or reads
            tid = int(k) if digits and digits.isascii() and digits.isdigit() else k
            if not isinstance(tid, numbers.Integral) or isinstance(tid, bool):  # numpy integers are Integral
                raise ValueError(f"sampling param logit_bias key {str(k)[:50]!r} must be a token id (an int or a "
                                 f"string of ASCII digits)")
            tid = int(tid)
            if not _is_number(v) or math.isnan(v):  # numpy floats too; not a bool
                raise ValueError(f"sampling param logit_bias[{tid}] must be a number, got {v!r}")
            if v > MAX_LOGIT_BIAS:
                # Logits are float32: a bigger bias (1e308 is inf there) turns the row into inf - inf = nan
                # after temperature, and the sampled token would have no logprob.
                raise ValueError(f"sampling param logit_bias[{tid}] = {v!r} is over the largest bias, "
                                 f"{MAX_LOGIT_BIAS:g} (it must stay finite in float32 after temperature)")
            # Any bias below -MAX_LOGIT_BIAS already gives the token probability 0: it is a ban (-inf).
            out[tid] = float(v) if v >= -MAX_LOGIT_BIAS else -math.inf
        return out

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    def verify(self, vocab_size: int, eos_ids=()) -> None:
        """Checks that need the vocabulary (and the model's eos ids, which min_new_tokens holds back)."""
        # stop_token_ids outside the vocabulary are taken, as SGLang takes them: they never match (a client may
        # send one stop list for a model family); min_new_tokens' ban skips them (rollout/batch.py).
        bad = sorted(t for t in self.logit_bias if not 0 <= t < vocab_size)
        if bad:
            raise ValueError(f"sampling param logit_bias has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if len(self.logit_bias) == vocab_size and all(v == -math.inf for v in self.logit_bias.values()):
            # Every logit -inf: nothing can be sampled, and the token drawn would come with a nan logprob.
            raise ValueError(f"sampling param logit_bias bans all {vocab_size} tokens of the vocabulary (each bias "
                             f"<= -{MAX_LOGIT_BIAS:g}): at least one token must stay possible")
        if self.min_new_tokens > 0 and self.max_new_tokens != 0:
            # Until min_new_tokens are out, the stop ids (and eos, unless ignore_eos) cannot be sampled either.
            held = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))
            banned = {t for t, v in self.logit_bias.items() if v == -math.inf}
            if len({t for t in held | banned if 0 <= t < vocab_size}) >= vocab_size:
                raise ValueError(f"sampling params min_new_tokens={self.min_new_tokens} holds back the stop ids "
                                 f"(stop_token_ids{'' if self.ignore_eos else ' and eos'}: {len(held)} ids) and "
                                 f"logit_bias bans {len(banned)}: together all {vocab_size} tokens of the vocabulary, "
                                 f"so no token could be sampled before min_new_tokens; allow at least one")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


# Each None-means-default field's default, and every field's name, read once (from_dict and normalize run for
# every request).
_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
_NONE_DEFAULTS = {f.name: f.default for f in fields(SamplingParams) if f.name in NONE_MEANS_DEFAULT}
