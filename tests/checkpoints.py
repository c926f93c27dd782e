"""Tiny random-weight Hugging Face checkpoints for tests.

`make_checkpoint` writes a real HF directory (config.json, *.safetensors, generation_config.json and,
by default, tokenizer files) for one of the supported architectures, using transformers'
`save_pretrained`, so loaders are tested against the exact files HF produces. Weights are re-drawn
from a seeded normal with a larger scale than HF's default init, so greedy decoding is not decided
by near-ties, and every norm weight and bias is random so a loader that drops one gets caught.

It does not download anything, does not cache across processes (the `ckpt_factory` fixture in
conftest.py caches within a session) and makes no attempt at a model that says anything sensible.
"""

from __future__ import annotations

import pathlib

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

VOCAB_SIZE = 384  # model rows; the tokenizer uses fewer, the ids above it never decode
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = (BOS, EOS, PAD, UNK)  # ids 0, 1, 2, 3; byte-level BPE never emits UNK
# Qwen2's split regex. transformers 5 ignores tokenizer_config's class for model_type "qwen2" and rebuilds
# the tokenizer as Qwen2Tokenizer (this regex + NFC, unk "<|endoftext|>" added unless unk is set), so
# every arch uses exactly that pipeline to make AutoTokenizer agree with tokenizer.json everywhere.
_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Projections get std 1/sqrt(fan_in), so each layer adds O(1) to an O(1) residual stream. The lm_head gets
# LOGIT_GAIN/sqrt(hidden): logits std ~2.4, mean top-1 prob ~0.2, so greedy is rarely a near-tie (top-1
# minus top-2 < 1e-3 at < 0.5% of positions) and sampling still varies. A tied embedding is the lm_head.
LOGIT_GAIN = 2.4
EMBED_STD = 1.0
QK_GAIN = 2.0  # sharper attention, so a wrong position (rope, KV slot) moves the logits visibly
NORM_STD = 0.1  # norm weights ~ 1 + N(0, NORM_STD)
BIAS_STD = 0.1

_CORPUS = """
The quick brown fox jumps over the lazy dog. A small model is trained to answer simple questions.
Once upon a time there was a little robot who liked to count numbers: one, two, three, four, five,
six, seven, eight, nine, ten. Every morning the robot walked to the river and looked at the water.
The sun was bright and the sky was blue. Birds were singing in the trees, and the wind moved the
leaves. What is 2 + 3? The answer is 5. What is 7 * 8? The answer is 56. What is 12 - 4? It is 8.
Please write a short story about a cat, a dog and a bird who become friends in the city.
The engine generates many samples, computes rewards, and the trainer updates the policy weights.
Reinforcement learning from human feedback uses a reward model to score each response.
Hello, world! How are you today? I am fine, thank you. Let us think step by step.
She said that the book on the table was hers, but he did not believe her at first.
In the beginning the house was quiet; then the children came home from school and it was loud.
Numbers like 0, 1, 10, 100, 1000 and 3.14 appear in text, as do symbols: ( ) [ ] { } < > = + - / %.
Good questions lead to good answers. Bad inputs should give clear errors and lose nothing.
The weather will be cold tomorrow, so remember to bring a warm coat, a hat and gloves.
Water boils at one hundred degrees, and ice melts when it gets warmer than zero degrees.
"""


def make_tokenizer(path: str | pathlib.Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (any text encodes, no unknowns) in memory and save it into `path`."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=340,  # 256 bytes + 4 specials + 80 merges
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.strip().splitlines() * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=512,
    )
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(path)
    return wrapped


def make_metaspace_tokenizer(path: str | pathlib.Path) -> PreTrainedTokenizerFast:
    """Train a SentencePiece-style BPE (Llama-2 / Mistral: words start with "▁", byte fallback, a decoder that
    drops the leading space of the first token it decodes) and save it into `path`, over any tokenizer there."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="\u2581",
                                                                                 prepend_scheme="first")])
    trainer = trainers.BpeTrainer(
        vocab_size=340,  # 4 specials + 256 byte tokens + the corpus's characters and merges
        special_tokens=list(SPECIAL_TOKENS) + [f"<0x{i:02X}>" for i in range(256)],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.strip().splitlines() * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                      unk_token=UNK, model_max_length=512, clean_up_tokenization_spaces=False)
    path = pathlib.Path(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    wrapped.save_pretrained(path)
    return wrapped


def base_config_fields(num_hidden_layers: int, hidden_size: int, tie_word_embeddings: bool) -> dict:
    """The config fields every tiny checkpoint shares (dense here, MoE in moe_checkpoints.py): the
    tokenizer's vocabulary and special ids, 4 query heads over 2 KV heads, 512 positions."""
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=tie_word_embeddings,
    )


def _config(arch: str, tie_word_embeddings: bool, num_hidden_layers: int, hidden_size: int, **overrides):
    common = base_config_fields(num_hidden_layers, hidden_size, tie_word_embeddings)
    common["intermediate_size"] = 2 * hidden_size
    if arch == "llama":
        common.update(
            head_dim=32,  # != hidden_size / num_heads (16): loaders must read head_dim
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = LlamaConfig
    elif arch == "mistral":
        common.update(sliding_window=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = MistralConfig
    elif arch == "qwen2":
        common.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = Qwen2Config
    elif arch == "qwen3":
        common.update(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = Qwen3Config
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    common.update(overrides)
    return cls(**common)


@torch.no_grad()
def _randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Redraw every parameter from a seeded normal; norms are 1 + noise, biases small noise."""
    tied = model.config.tie_word_embeddings
    for name, p in model.named_parameters():  # a tied lm_head is the embedding: visited once
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
        if name.endswith("lm_head.weight") or (tied and name.endswith("embed_tokens.weight")):
            value = noise * (LOGIT_GAIN / p.shape[-1] ** 0.5)  # [vocab, hidden]
        elif name.endswith("embed_tokens.weight"):
            value = noise * EMBED_STD
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            value = noise * (QK_GAIN / p.shape[-1] ** 0.5)  # [out, in]
        elif p.ndim >= 2:
            value = noise / p.shape[-1] ** 0.5
        elif name.endswith(".bias"):
            value = noise * BIAS_STD
        elif name.endswith(("q_norm.weight", "k_norm.weight")):  # qwen3: scale after the projection
            value = QK_GAIN * (1.0 + noise * NORM_STD)
        else:  # RMSNorm weights
            value = 1.0 + noise * NORM_STD
        p.copy_(value)


def make_checkpoint(
    path: str | pathlib.Path,
    arch: str,
    *,
    tie_word_embeddings: bool = False,
    with_tokenizer: bool = True,
    seed: int = 0,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    shard: bool = False,
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> pathlib.Path:
    """Write a tiny random `arch` checkpoint into `path` and return it. Same arguments, same bytes."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = _config(arch, tie_word_embeddings, num_hidden_layers, hidden_size, **config_overrides)
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model, torch.Generator().manual_seed(seed))
    model = model.to(dtype)
    model.config.dtype = dtype
    # a few hundred KB in total, so this gives several shards and an index
    model.save_pretrained(path, max_shard_size="100KB" if shard else "50GB")
    if with_tokenizer:
        make_tokenizer(path)
    return path


def load_hf_model(path: str | pathlib.Path) -> torch.nn.Module:
    """The HF reference model for `path`: fp32, eager attention, eval mode, on the CPU."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()
