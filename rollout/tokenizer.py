"""The checkpoint's HF tokenizer (or none): prompt encoding, output decoding, stop-string checks.

A checkpoint without tokenizer files, or `skip_tokenizer_init=True`, gives a TokenizerWrapper whose
`tokenizer` is None: requests must then come as input_ids and outputs have no `text` key (as SGLang's).

Output text is decoded after the prompt's last CONTEXT_TOKENS tokens and cut after their text, as SGLang's
detokenizer and vLLM's do: a decoder that drops the leading space of the first token it sees (SentencePiece's
Metaspace: Llama-2, Mistral) would otherwise lose the space before the first output word, so prompt + text
would not read as the model wrote it. Where the prompt's tail decodes to a partial character, or the joint
decoding does not start with it, the output is decoded alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rollout import stop_match
from rollout.request import Req

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output (SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET)


def _rust_decoder(tokenizer):
    """The `tokenizers.Tokenizer` whose decode is exactly `tokenizer.decode` (a transformers fast tokenizer
    whose _decode is the library's own and applies no clean-up of tokenization spaces), else None."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its own decode is used
        return None
    if (tokenizer is None or not isinstance(tokenizer, TokenizersBackend)
            or type(tokenizer)._decode is not TokenizersBackend._decode
            or type(tokenizer).decode is not TokenizersBackend.decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    return getattr(tokenizer, "_tokenizer", None)


def _decoder_json(tokenizer) -> str:
    """The tokenizer's decoder (tokenizers' pipeline) as JSON text, "" where there is none to read: which steps
    it has says how a token's text relates to its bytes (_byte_fallback_ids, TokenizerWrapper.token_bytes).
    Read once per tokenizer: serializing the pipeline writes out the whole vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    try:
        return json.dumps(json.loads(backend.to_str()).get("decoder"))
    except (ValueError, TypeError, AttributeError):  # not a serializable tokenizers pipeline
        return ""


def _byte_fallback_ids(tokenizer, decoder: str) -> frozenset[int]:
    """The ids of the "<0xNN>" byte pieces when the tokenizer's decoder (`decoder`, _decoder_json's) has
    ByteFallback (Llama-2, Mistral). HF decodes a run of them as one UTF-8 sequence, and a run that is not valid
    UTF-8 (yet: a character's first bytes) as one U+FFFD per byte, the ASCII ones too: the text of a run may
    change until a token that is not a byte piece closes it."""
    if '"ByteFallback"' not in decoder:
        return frozenset()
    return frozenset(i for t, i in tokenizer.get_vocab().items() if _BYTE_PIECE.fullmatch(t))


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable Latin-1 bytes stand for themselves, every other
    byte b for chr(256 + its rank among those others)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


class TokenizerWrapper:
    def __init__(self, model_path: str, skip_init: bool = False) -> None:
        self.tokenizer = None
        root = Path(model_path)
        if not skip_init and any((root / f).is_file() for f in _TOKENIZER_FILES):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(root))
        self._rust = _rust_decoder(self.tokenizer)
        decoder = _decoder_json(self.tokenizer)
        self._byte_ids = _byte_fallback_ids(self.tokenizer, decoder)
        # Byte-level BPE (GPT-2, Llama-3, Qwen): each vocabulary entry spells its bytes in GPT-2's printable
        # alphabet. SentencePiece's Metaspace: "▁" is a space the first token of a decode loses.
        self._byte_alphabet = _unicode_to_byte() if '"ByteLevel"' in decoder else None
        self._metaspace = '"Metaspace"' in decoder
        self.special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", None) or ())
        # token id -> its text alone: a logprob entry's text, looked up per top logprob of every position of
        # a final output (a tokenizer decode each was seconds for a long output with many top logprobs).
        # At most one entry per vocabulary id.
        self._token_texts: dict[int, str] = {}

    @property
    def cleans_up_spaces(self) -> bool:
        """Whether decoding applies the tokenizer's clean-up of tokenization spaces (" ," -> ","), which
        rewrites a text's tail once the next token comes (the Rust decoder is used only where it does not)."""
        return (self.tokenizer is not None and self._rust is None
                and bool(getattr(self.tokenizer, "clean_up_tokenization_spaces", False)))

    def stable_len(self, ids: list[int]) -> int:
        """How many of `ids` a stream chunk shows: all but a trailing run of byte pieces, whose text a later
        byte may still rewrite (see _byte_fallback_ids), so every chunk stays a prefix of the final text."""
        n = len(ids)
        if self._byte_ids:
            while n and ids[n - 1] in self._byte_ids:
                n -= 1
        return n

    def eos_token_ids(self, config_eos: list[int], model_path: str) -> list[int]:
        ids = set(config_eos)
        gen_cfg = Path(model_path) / "generation_config.json"
        if gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids |= set([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (none in the checkpoint, or skip_tokenizer_init=True): "
                             "pass input_ids instead of prompt")
        if not isinstance(text, str):  # else the tokenizer's own "TextEncodeInput must be Union[...]"
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        try:  # JSON's "\\ud800" decodes to a lone surrogate, which the tokenizer refuses with a TypeError
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"prompt is not valid Unicode text: lone surrogate U+{ord(text[e.start]):04X} at "
                             f"character {e.start} (encode the text as UTF-8, or pass input_ids)") from None
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], req: Req | None = None, skip_special_tokens: bool = True) -> str | None:
        """`ids` as text, with `req`'s decoding options if given, else skipping special tokens as asked."""
        if self.tokenizer is None:
            return None
        sp = req.sampling_params if req is not None else None
        return self._decode(ids, sp.skip_special_tokens if sp else skip_special_tokens,
                            sp.spaces_between_special_tokens if sp else True)

    def _decode(self, ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool = True) -> str:
        if self._rust is not None and type(ids) is list:
            # What transformers' decode reaches for a fast tokenizer without clean-up (spaces_between_special_
            # tokens is a slow-tokenizer option it ignores): the Rust decoder, without ~4 us of argument
            # conversion per call. Every stream chunk is decoded, so that is most of a chunk's detokenizing.
            return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                     spaces_between_special_tokens=spaces_between_special_tokens)

    def token_pieces(self, ids: list[int], context: list[int], final: bool,
                     skip_special_tokens: bool = True) -> list[str]:
        """Each of `ids`' share of their text as read after `context` (the tokens before them): the characters
        that token completes, so the pieces join into the decoded text and a character spread over several
        tokens (UTF-8 bytes) comes whole with the token that completes it, '' with the others (vLLM's
        incremental pieces; OpenAI's completion logprobs `tokens` / `text_offset`). With `final`, a partial
        character at the very end stays (U+FFFD), as the final text keeps it. Each piece decodes a window of
        CONTEXT_TOKENS + 1 tokens, so the cost is linear in len(ids). `skip_special_tokens` as the request's
        text was decoded: a special token it skips has the piece "" there, one it keeps its own text."""
        if self.tokenizer is None:
            return [""] * len(ids)
        seq = [*context[-CONTEXT_TOKENS:], *ids]

        def decode(window: list[int]) -> str:
            return self._decode(window, skip_special_tokens)

        pieces = []
        for i in range(len(seq) - len(ids), len(seq)):
            j = max(0, i - CONTEXT_TOKENS)
            before = decode(seq[j:i]).rstrip("\ufffd")
            now = decode(seq[j:i + 1])
            if not (final and i == len(seq) - 1):
                now = now.rstrip("\ufffd")
            pieces.append(now[len(before):] if now.startswith(before) else decode([seq[i]]))
        return pieces

    def output_text(self, ids: list[int], req: Req) -> str | None:
        """The text of `ids`, output tokens of `req`, as they read after its prompt (see the module doc)."""
        if self.tokenizer is None:
            return None
        context = req.prompt_ids[-CONTEXT_TOKENS:]
        if not context or not ids:
            return self.decode(ids, req)
        head = req.detok_head
        if head is None:  # once per request: the prompt does not change
            head = req.detok_head = self.decode(context, req)
        if head and not head.endswith("\ufffd"):
            full = self.decode([*context, *ids], req)
            if full.startswith(head):
                return full[len(head):]
        return self.decode(ids, req)

    def token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:  # a decode of one id depends on nothing else: the same text every time
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (OpenAI's chat logprobs `bytes`), also for a token holding part of a character,
        whose text alone is U+FFFD: a byte-fallback piece "<0xNN>" is that byte, a byte-level BPE entry the bytes
        its letters spell, a SentencePiece entry its text with "▁" as the space it stands for (which the
        token's text alone drops); anything else, its text's UTF-8."""
        text = self.token_text(token_id)
        if text is None:
            return []
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not piece or token_id in self.special_ids:
            return list(text.encode())
        if _BYTE_PIECE.fullmatch(piece):
            return [int(piece[3:5], 16)]
        alphabet = self._byte_alphabet
        if alphabet is not None and all(c in alphabet for c in piece):
            return [alphabet[c] for c in piece]
        if self._metaspace:
            return list(piece.replace("▁", " ").encode())
        return list(text.encode())

    def find_stop(self, req: Req):
        """The first stop string or stop_regex pattern found in req's new decoded output, if any (checked
        on text, as SGLang; a regex is reported by its pattern), or an abort FinishReason when a pattern
        ran out of time (rollout.stop_match)."""
        sp = req.sampling_params
        if len(req.output_ids) < sp.min_new_tokens:
            # No stop counts yet, but one that token min_new_tokens completes will be cut from the final text: a
            # stream chunk ending in its start must wait (stop_match.find marks the same from then on).
            if sp.stop or sp.stop_regex:  # decoded only when there is a stop to hold for
                text = self.output_text(req.output_ids, req)
                if text is not None:
                    stop_match.mark_stop_prefix(req, text)
            return None
        text = self.output_text(req.output_ids, req)
        if text is None:
            return None
        if sp.min_new_tokens and req.stop_min_end is None:
            # Only a match that the min_new_tokens-th token or a later one completes counts (vLLM's min_tokens):
            # one the model wrote earlier is text it was made to go on past, never a cut in it.
            # (a partial character at its end is not text yet: the next token may complete it)
            head = (self.output_text(req.output_ids[: sp.min_new_tokens - 1], req) or "").rstrip("\ufffd")
            req.stop_min_end = len(head) if text.startswith(head) else 0
        return stop_match.find(req, text)

    def final_text(self, req: Req) -> str | None:
        """The output text as SGLang's detokenizer returns it: without a matched stop string, and without a
        matched stop token (a stop_token_ids entry or eos, the last id) unless no_stop_trim; output_ids keep it."""
        ids = req.output_ids
        reason = req.finished_reason
        if (reason is not None and reason.type == "stop" and isinstance(reason.matched, int)
                and not isinstance(reason.matched, bool) and not req.sampling_params.no_stop_trim
                and ids and ids[-1] == reason.matched):
            ids = ids[:-1]
        text = self.output_text(ids, req)
        return None if text is None else stop_match.trimmed(req, text)
