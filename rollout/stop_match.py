"""Stop strings and stop_regex patterns: validated with named limits, matched in bounded time.

Both are matched on the request's decoded output (as SGLang), but never on all of it each step:
- a stop string is searched only in the text added since the last check, plus the len(stop) - 1
  characters before it (a match straddling the boundary) and a few more (the decoded tail can change
  when a multi-byte character completes);
- a stop_regex is searched in the last REGEX_WINDOW_CHARS characters only (anchors and lookbehinds
  keep their meaning on the whole text: the search starts at a position, the text is not cut), with the
  `regex` package's timeout: a pattern that backtracks for longer than REGEX_TIMEOUT_S on that window
  finishes its request as abort, with a message naming the pattern, instead of stalling the step that
  every other request shares.
Counts and lengths are capped (MAX_*), so one request cannot make a step do unbounded work.

Where a match is found is kept on the request (`stop_at`), so the output is cut exactly there. What
this module does not do: decode (rollout.tokenizer does) or decide when stops apply (min_new_tokens is
the scheduler's).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import regex

if TYPE_CHECKING:  # rollout.request imports sampling_params, which imports this module
    from rollout.request import FinishReason, Req

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_REGEXES = 16
MAX_STOP_REGEX_CHARS = 1024
REGEX_WINDOW_CHARS = 2048  # a stop_regex match must end in, and is looked for in, this much of the tail
REGEX_TIMEOUT_S = 0.02  # per pattern and step; ordinary patterns take microseconds on the window
_UNSTABLE_TAIL_CHARS = 8  # decoded characters at the end that a later token may still rewrite
PREFIX_CHARS = 64  # a stream chunk is held while the output ends with up to this much of a stop string


def validate(stop: list[str], stop_regex: list[str]) -> None:
    """ValueError naming the limit or the pattern; called by SamplingParams.normalize."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"sampling param stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    long = [s for s in stop if len(s) > MAX_STOP_STRING_CHARS]
    if long:
        raise ValueError(f"sampling param stop has a string of {len(long[0])} characters; at most "
                         f"{MAX_STOP_STRING_CHARS} are allowed")
    if len(stop_regex) > MAX_STOP_REGEXES:
        raise ValueError(f"sampling param stop_regex has {len(stop_regex)} patterns; at most {MAX_STOP_REGEXES} "
                         f"are allowed")
    for r in stop_regex:
        if len(r) > MAX_STOP_REGEX_CHARS:
            raise ValueError(f"sampling param stop_regex has a pattern of {len(r)} characters; at most "
                             f"{MAX_STOP_REGEX_CHARS} are allowed")
        try:
            compiled(r)
        except (regex.error, OverflowError, RecursionError) as e:
            raise ValueError(f"sampling param stop_regex {r[:200]!r} is not a valid regular expression: {e}") from None


@functools.lru_cache(maxsize=4096)
def compiled(pattern: str) -> regex.Pattern:
    # VERSION0: the `re`-compatible dialect, so patterns mean what they mean to SGLang's `re`.
    return regex.compile(pattern, flags=regex.VERSION0)


def ends_with_stop_prefix(text: str, stops: list[str]) -> bool:
    """Whether `text` ends with a proper prefix of a stop string (its first PREFIX_CHARS characters at most:
    a bound on the work per step, which longer stop strings do not need to be held for)."""
    last = text[-1:]
    for s in stops:
        for k in range(min(len(s) - 1, len(text), PREFIX_CHARS), 0, -1):
            if s[k - 1] == last and text.endswith(s[:k]):
                return True
    return False


def ends_in_partial_match(text: str, patterns: list[str]) -> bool:
    """Whether a stop_regex pattern matches a non-empty tail of `text` partially (`regex`'s partial
    matching: the text ends inside a possible match), the match starting in the last PREFIX_CHARS
    characters (the same bound as a stop string's prefix). A pattern that runs out of time counts as
    pending: holding a chunk back delays it, sending one the final output cuts could not be undone."""
    start = max(0, len(text) - PREFIX_CHARS)
    for r in patterns:
        try:
            for m in compiled(r).finditer(text, start, partial=True, overlapped=True, timeout=REGEX_TIMEOUT_S):
                if m.partial and m.start() < len(text):
                    return True
        except TimeoutError:
            return True
    return False


def mark_stop_prefix(req: Req, text: str) -> None:
    """Set req.stop_prefix_pending: the decoded output ends with the start of a stop string or of a stop_regex
    match, so a stream chunk must wait. A trailing partial character is not text yet (a chunk drops it): the
    prefix may end before it."""
    sp = req.sampling_params
    text = text.rstrip("\ufffd")
    req.stop_prefix_pending = bool((sp.stop and ends_with_stop_prefix(text, sp.stop))
                                   or (sp.stop_regex and ends_in_partial_match(text, sp.stop_regex)))


def find(req: Req, text: str) -> str | FinishReason | None:
    """The earliest stop string or pattern matched in the new part of `text` (the request's decoded
    output), recording where it starts in `req.stop_at`; a FinishReason (abort) if a pattern timed out."""
    sp = req.sampling_params
    hits: list[tuple[int, str]] = []
    min_end = req.stop_min_end or 0  # min_new_tokens: a match must end past this character
    if sp.stop:
        longest = max(map(len, sp.stop))
        start = max(0, req.stop_scan_from - longest + 1 - _UNSTABLE_TAIL_CHARS)
        for s in sp.stop:
            at = text.find(s, max(start, min_end - len(s) + 1))
            if at >= 0:
                hits.append((at, s))
    if sp.stop_regex:
        window_start = max(0, len(text) - REGEX_WINDOW_CHARS)
        for r in sp.stop_regex:
            try:
                m = _first_ending_past(compiled(r), text, window_start, min_end)
            except TimeoutError:
                from rollout.request import FinishReason

                return FinishReason("abort", message=(
                    f"stop_regex {r[:200]!r} took longer than {REGEX_TIMEOUT_S * 1000:.0f} ms on the last "
                    f"{len(text) - window_start} characters of output (catastrophic backtracking?); the request "
                    f"was stopped: simplify the pattern"))
            if m is not None:
                hits.append((m.start(), r))
    req.stop_scan_from = len(text)
    mark_stop_prefix(req, text)
    if not hits:
        return None
    at, matched = min(hits)
    req.stop_at = at
    return matched


def _first_ending_past(pattern: regex.Pattern, text: str, start: int, min_end: int):
    """The first match of `pattern` in text[start:] (anchors seeing the whole text) that ends past `min_end`,
    or None; one deadline of REGEX_TIMEOUT_S for the whole search (TimeoutError past it)."""
    if min_end <= start:
        return pattern.search(text, start, timeout=REGEX_TIMEOUT_S)
    for m in pattern.finditer(text, start, overlapped=True, timeout=REGEX_TIMEOUT_S):
        if m.end() > min_end:
            return m
    return None


def trimmed(req: Req, text: str) -> str:
    """The output text without the stop match (and what follows it), unless no_stop_trim."""
    reason = req.finished_reason
    if req.sampling_params.no_stop_trim or reason is None or not isinstance(reason.matched, str):
        return text
    if req.stop_at is not None:
        return text[: req.stop_at]
    at = text.find(reason.matched)  # a reason set elsewhere: cut at the string if it is one
    return text[:at] if at >= 0 else text
