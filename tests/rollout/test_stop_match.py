"""Stop strings and stop_regex in bounded time, and logit_bias that cannot break the sampler.

Windowed stop-string matching is checked against the naive reference (search the whole greedy text);
a catastrophically backtracking pattern finishes its request as abort within a time bound while a
request beside it is unaffected; the count and size limits are refused by name; a bias too big for
float32 is refused, and a large finite one still gives every sampled token a finite logprob.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

from rollout import stop_match
from rollout.request import Req
from rollout.sampling_params import MAX_LOGIT_BIAS, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def engine(tiny_llama, module_engines):
    return module_engines(tiny_llama)


def _token_of(engine, char: str) -> int:
    return engine.tokenizer.tokenizer.encode(char, add_special_tokens=False)[-1]


def test_stop_strings_match_the_naive_full_text_search(engine):
    """Stop strings found on new text only cut the output exactly where a search of the whole greedy text
    finds them first, for stops of 1 to 6 characters taken from the middle and the end of the text."""
    free = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=40))
    text = free["text"]
    assert len(text) > 20
    for start, length in [(12, 1), (9, 3), (15, 6), (len(text) - 4, 4)]:
        stop = text[start:start + length]
        out = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=40, stop=["\x00never", stop]))
        assert out["text"] == text[: text.find(stop)], (stop, out["text"])
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_a_matched_stop_token_is_trimmed_from_text_as_sglang(engine):
    """As SGLang's detokenizer: a stop_token_ids match (and eos with skip_special_tokens=False) is not in
    `text` (the tokenizer's decode of the ids before it), unless no_stop_trim; output_ids keep it."""
    tok = engine.tokenizer.tokenizer
    free = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=20))["output_ids"]
    stop_id = next(t for t in free[3:] if tok.decode([t]).strip())  # a token with visible text, not the first
    out = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=20, stop_token_ids=[stop_id], ignore_eos=False))
    cut = free.index(stop_id) + 1
    assert out["output_ids"] == free[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["text"] == tok.decode(free[: cut - 1], skip_special_tokens=True)
    kept = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=20, stop_token_ids=[stop_id], no_stop_trim=True,
                                        ignore_eos=False))
    assert kept["text"] == tok.decode(free[:cut], skip_special_tokens=True) != out["text"]
    eos = engine.eos_ids[0]
    raw = engine.generate(PROMPT, dict(temperature=0, max_new_tokens=20, skip_special_tokens=False,
                                       logit_bias={str(eos): 1e5}))  # eos at once
    assert raw["output_ids"] == [eos] and raw["text"] == ""


def test_a_stop_string_the_last_allowed_token_completes_is_a_stop(engine):
    """A stop string completed by token max_new_tokens finishes as stop with its text trimmed (as a stop
    token there does), not as length with the stop text kept; the same ids either way."""
    tok = engine.tokenizer.tokenizer
    ids = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=24))["output_ids"]
    for n in range(6, 24):  # a stop string that first appears with token n
        text_n, text_before = tok.decode(ids[:n]), tok.decode(ids[: n - 1])
        stop = next((text_n[-k:] for k in (2, 3, 1) if len(text_n) >= k and text_n[-k:].strip()
                     and text_n.find(text_n[-k:]) == len(text_n) - k and text_n[-k:] not in text_before), None)
        if stop is not None:
            break
    assert stop is not None, "the tiny checkpoint's greedy text has no stop string a single token completes"
    out = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=n, stop=[stop]))
    assert out["output_ids"] == ids[:n]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text_n[: text_n.find(stop)]


def test_a_stream_never_sends_text_the_stop_cuts(engine):
    """A stop string spanning a token boundary: the chunk whose text ends with the stop's first character is
    held (SGLang's stop-prefix check), so every chunk's text is a prefix of the final text, which equals the
    non-streamed one; the naive search of the free text says where the stop starts."""
    tok = engine.tokenizer.tokenizer
    ids = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=30))["output_ids"]
    full = tok.decode(ids)
    for n in range(4, 28):
        head = tok.decode(ids[:n])
        stop = full[len(head) - 1: len(head) + 2]  # last char of token n's text + 2 after it
        if len(stop) == 3 and full.find(stop) == len(head) - 1 and tok.decode(ids[: n - 1]) != head:
            break
    else:
        raise AssertionError("the tiny checkpoint's greedy text has no 3-character stop across a boundary")
    sp = dict(GREEDY, max_new_tokens=30, stop=[stop])
    want = engine.generate(PROMPT, sp)["text"]
    assert want == full[: full.find(stop)]
    chunks = [c["text"] for c in engine.generate(PROMPT, sp, stream=True)]
    assert chunks[-1] == want
    assert all(want.startswith(c) for c in chunks), (stop, chunks[-4:])
    assert head not in chunks  # the chunk ending with the stop's first character was held back


def test_a_stream_never_sends_text_a_stop_regex_cuts(engine):
    """A stop_regex match spanning a token boundary: the chunk whose text ends with the match's first character
    is held (the pattern matches that tail partially), so every chunk's text is a prefix of the final text,
    which the naive `re` search of the free text cuts; the same request unstreamed gives that text too."""
    import re

    tok = engine.tokenizer.tokenizer
    ids = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=30))["output_ids"]
    full = tok.decode(ids)
    for n in range(4, 28):
        head = tok.decode(ids[:n])
        span = full[len(head) - 1: len(head) + 2]
        pattern = re.escape(span[:1]) + "." + re.escape(span[2:])
        first = re.search(pattern, full) if len(span) == 3 else None
        if first is not None and first.start() == len(head) - 1 and tok.decode(ids[: n - 1]) != head:
            break
    else:
        raise AssertionError("the tiny checkpoint's greedy text has no 3-character match across a boundary")
    sp = dict(GREEDY, max_new_tokens=30, stop_regex=[pattern])
    want = engine.generate(PROMPT, sp)["text"]
    assert want == full[: first.start()]
    chunks = [c["text"] for c in engine.generate(PROMPT, sp, stream=True)]
    assert chunks[-1] == want
    assert all(want.startswith(c) for c in chunks), (pattern, chunks[-4:])
    assert head not in chunks


def test_partial_regex_tail_matches_a_naive_check():
    """ends_in_partial_match equals the naive check on texts with no full match (those finish the request):
    some tail of the text followed by a completion of 1-4 letters is matched past the text's end."""
    import itertools
    import random
    import re

    rng = random.Random(1)
    patterns = ["ab", "a.b", "b+a", "aab|ba", "(ab)+b", "a[ab]?bb"]
    completions = ["".join(c) for k in range(1, 5) for c in itertools.product("ab", repeat=k)]
    checked = 0
    for _ in range(1500):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 8)))
        pats = rng.sample(patterns, rng.randrange(1, 3))
        if any(re.search(p, text) for p in pats):
            continue
        naive = any((m := re.match(p, text[i:] + c)) is not None and m.end() > len(text) - i
                    for p in pats for i in range(len(text)) for c in completions)
        assert stop_match.ends_in_partial_match(text, pats) == naive, (text, pats)
        checked += 1
    assert checked > 300


def test_a_stop_regex_prefix_is_pending():
    """find marks a request pending while its output ends inside a possible stop_regex match (and not when it
    cannot), as it does for stop strings."""
    def req(pattern):
        return Req("r", [5], SamplingParams.from_dict({"stop_regex": [pattern], "max_new_tokens": 8}), 0)

    r = req(r"\d+ apples")
    assert stop_match.find(r, "I have 12 ap") is None and r.stop_prefix_pending
    assert stop_match.find(r, "I have 12 apples") == r"\d+ apples" and r.stop_at == 7
    r = req(r"\d+ apples")
    assert stop_match.find(r, "I have some") is None and not r.stop_prefix_pending


@pytest.mark.parametrize("kind", ["stop", "stop_regex"])
def test_min_new_tokens_counts_only_stops_its_own_tokens_complete(engine, kind):
    """With min_new_tokens=m, a stop string the model wrote before token m is text it had to go on past:
    the request stops at the first occurrence that token m or a later one completes (vLLM's min_tokens),
    and text is the decoded output_ids cut there, so text and output_ids agree."""
    tok = engine.tokenizer.tokenizer
    m = 6
    ids = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=40))["output_ids"]
    full, before = tok.decode(ids), tok.decode(ids[: m - 1])
    # a letter in the text of the first m - 1 tokens that comes again later
    stop = next((c for c in before if c.isascii() and c.isalpha() and full.find(c, len(before)) >= 0), None)
    assert stop is not None, "the tiny checkpoint's greedy text repeats no letter of its first tokens"
    at = full.find(stop, len(before))
    cut = next(n for n in range(m, len(ids) + 1) if len(tok.decode(ids[:n])) > at)  # the token completing it
    sp = dict(GREEDY, max_new_tokens=40, min_new_tokens=m, **{kind: [stop]})
    out = engine.generate(PROMPT, sp)
    assert out["output_ids"] == ids[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[:at] and tok.decode(out["output_ids"]).startswith(out["text"])
    chunks = [c["text"] for c in engine.generate(PROMPT, sp, stream=True)]
    assert chunks[-1] == out["text"] and all(out["text"].startswith(c) for c in chunks)
    early = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=40, **{kind: [stop]}))  # no minimum: the first
    assert early["text"] == full[: full.find(stop)] and len(early["output_ids"]) < m


def test_ends_with_stop_prefix_matches_a_naive_check():
    """The bounded prefix check equals the naive one (any proper prefix of any stop ends the text) for stops
    up to PREFIX_CHARS long."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        naive = any(text.endswith(s[:k]) for s in stops for k in range(1, len(s)) if k <= len(text))
        assert stop_match.ends_with_stop_prefix(text, stops) == naive, (text, stops)


def test_backtracking_stop_regex_is_bounded(engine):
    """'(a|aa)+b' over an all-'a' output (exponential in `re`) finishes that request as abort naming the
    pattern within seconds, and a greedy request running beside it gives its usual output."""
    a = _token_of(engine, "a")
    reference = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=12))
    side: dict = {}
    t = threading.Thread(target=lambda: side.update(engine.generate(PROMPT, dict(GREEDY, max_new_tokens=12))))
    t0 = time.perf_counter()
    t.start()
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=dict(
        GREEDY, max_new_tokens=80, logit_bias={a: 100.0}, stop_regex="(a|aa)+b"))
    elapsed = time.perf_counter() - t0
    t.join(30)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "(a|aa)+b" in reason["message"], reason
    assert elapsed < 10, elapsed  # `re` needs ~2^40 steps here; the bound is a behaviour bound, not a speed claim
    assert side["output_ids"] == reference["output_ids"]


def test_stop_regex_matches_only_in_the_tail_window():
    """A pattern is searched in the last REGEX_WINDOW_CHARS characters with anchors kept: a match there is
    found (and its start recorded), one only before the window is not, and '^' still means the text start."""
    def req(**sp):
        return Req("r", [1], SamplingParams.from_dict(dict(max_new_tokens=10, **sp)), seed=0)

    w = stop_match.REGEX_WINDOW_CHARS
    text = "x" * (w + 10) + "END"
    r = req(stop_regex="E.D")
    assert stop_match.find(r, text) == "E.D" and r.stop_at == w + 10
    assert stop_match.find(req(stop_regex="^x"), text) is None  # position 0 lies before the window
    assert stop_match.find(req(stop_regex="y"), "y" + "x" * (w + 5)) is None
    r = req(stop="END")
    assert stop_match.find(r, text) == "END" and stop_match.find(r, text + "more") == "END"


@pytest.mark.parametrize("sp,needle", [
    (dict(stop_regex=[f"p{i}" for i in range(stop_match.MAX_STOP_REGEXES + 1)]), "at most 16"),
    (dict(stop_regex="a" * (stop_match.MAX_STOP_REGEX_CHARS + 1)), "characters"),
    (dict(stop=[f"s{i}" for i in range(stop_match.MAX_STOP_STRINGS + 1)]), "at most 64"),
    (dict(stop="s" * (stop_match.MAX_STOP_STRING_CHARS + 1)), "characters"),
    (dict(stop_regex="(unclosed"), "not a valid regular expression"),
])
def test_stop_limits_are_refused_by_name(engine, sp, needle):
    """Too many or too long stop strings / patterns: ValueError naming the field and the limit."""
    with pytest.raises(ValueError, match="stop") as e:
        engine.generate(PROMPT, dict(max_new_tokens=2, **sp))
    assert needle in str(e.value)


def test_logit_bias_limits(engine):
    """A bias over MAX_LOGIT_BIAS (1e308 is inf in float32) is refused naming the key; a non-ASCII digit key is
    refused by name; a bias under -MAX_LOGIT_BIAS bans the token; MAX_LOGIT_BIAS itself at temperature 0.7
    samples the biased token every time, each with a finite logprob."""
    with pytest.raises(ValueError, match=r"logit_bias\[5\]"):
        engine.generate(PROMPT, dict(max_new_tokens=2, logit_bias={5: 1e308}))
    with pytest.raises(ValueError, match="ASCII digits"):
        engine.generate(PROMPT, dict(max_new_tokens=2, logit_bias={"\u00b2": 1.0}))
    plain = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=4))["output_ids"]
    banned = engine.generate(PROMPT, dict(GREEDY, max_new_tokens=4, logit_bias={plain[0]: -1e308}))["output_ids"]
    assert plain[0] not in banned
    target = 17
    out = engine.generate(PROMPT, dict(temperature=0.7, ignore_eos=True, max_new_tokens=6, seed=1,
                                       logit_bias={str(target): MAX_LOGIT_BIAS}), return_logprob=True)
    assert out["output_ids"] == [target] * 6
    logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert all(lp is not None and math.isfinite(lp) and lp <= 0 for lp in logprobs), logprobs


def test_a_stream_holds_back_a_stop_prefix_before_min_new_tokens(engine):
    """With min_new_tokens = m and a stop string that token m completes (its first character from token m-1),
    the stream holds back the chunk after token m-1 as it does without min_new_tokens: every chunk is a prefix
    of the final text, which the stop cuts (a chunk used to carry the stop's first character)."""
    from tests.rollout.test_control import _straddling_stop

    tok = engine.tokenizer.tokenizer
    found = 0
    for prompt in ("Once upon a time", "Hello, world! How are you today?", "The quick brown fox"):
        base = engine.generate(prompt, dict(GREEDY, max_new_tokens=24))["output_ids"]
        pick = _straddling_stop(tok, base)
        if pick is None:
            continue
        s, k = pick
        if s in tok.decode(base[:k + 1])[:-1]:  # the stop must be new at token k (completed by it, not before)
            continue
        sp = dict(GREEDY, max_new_tokens=24, stop=[s], min_new_tokens=k + 1)
        final = engine.generate(prompt, sp)
        assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": s}
        chunks = [c["text"] for c in engine.generate(prompt, sp, stream=True)]
        assert chunks[-1] == final["text"]
        assert all(final["text"].startswith(c) for c in chunks), (s, chunks, final["text"])
        found += 1
    assert found >= 1, "no printable straddling stop in the greedy outputs"


def test_a_stop_prefix_before_a_partial_character_is_pending():
    """The decoded output ends with a stop string's first character and then a partial character (U+FFFD, which
    a chunk drops): the stop may still complete with that character, so the request is marked pending (a chunk
    ending in the prefix used to go out, and the final text then cut it)."""
    req = Req("r", [5], SamplingParams.from_dict({"stop": ["@Ã"], "max_new_tokens": 8}), 0)
    assert stop_match.find(req, "ab?@\ufffd") is None
    assert req.stop_prefix_pending
    assert stop_match.find(req, "ab?@Ãx") == "@Ã"
    other = Req("r2", [5], SamplingParams.from_dict({"stop": ["zz"], "max_new_tokens": 8}), 0)
    stop_match.find(other, "ab?@\ufffd")
    assert not other.stop_prefix_pending
