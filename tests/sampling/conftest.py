"""Small tokenizers trained in-process (no download): byte-level BPE and SentencePiece-style."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. 0123456789",
    "Café, naïve, résumé, façade, jalapeño, Ærøskøbing, Straße, Ünïcödé, über.",
    "日本語のテキストです。東京と京都。中文字符和汉字。北京欢迎你。서울 한국어.",
    "Emoji: 😀 🎉 👍🏽 ❤️ 🚀 🙂 👩‍💻 🇫🇷 — and symbols: € £ ¥ © ™ ∑ ∞ ≤ ≥.",
    "Привет мир. Γειά σου κόσμε. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया.",
    "def main():\n    print('stop here ### END')\n    return 42\n",
]
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]


def build_tokenizer(vocab_size: int = 500) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


def build_byte_fallback_tokenizer(vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """Llama-2 style: Metaspace words, ``<0xNN>`` byte-fallback tokens, leading space stripped."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    # The 256 byte tokens are ordinary vocabulary entries (not special), as in Llama 2.
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(state))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="session")
def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    return build_byte_fallback_tokenizer()


@pytest.fixture(scope="session", params=["byte_level", "byte_fallback"])
def any_tokenizer(request, tokenizer, byte_fallback_tokenizer) -> PreTrainedTokenizerFast:
    return tokenizer if request.param == "byte_level" else byte_fallback_tokenizer
