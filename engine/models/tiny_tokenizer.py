"""The tiny model's tokenizer and chat templates, made offline and deterministically.

A byte-level BPE tokenizer trained with the ``tokenizers`` library on text from the Python
standard library (the Zen of Python and module docstrings); the special tokens come first.
The LLaVA chat template iterates over content parts (``image`` parts become ``<image>``), the
text-only one renders ``message['content']`` as a string.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import importlib
import inspect
import io

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")  # ids 0..4
UNK_ID, BOS_ID, EOS_ID, PAD_ID, IMAGE_ID = range(5)
DEFAULT_VOCAB_SIZE = 1024

LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for part in parts %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
TEXT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
_CORPUS_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fnmatch",
    "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "html", "inspect", "io",
    "itertools", "json", "logging", "operator", "os", "pathlib", "pprint", "queue", "random",
    "re", "shutil", "statistics", "string", "tarfile", "tempfile", "textwrap", "threading",
    "tokenize", "traceback", "types", "unittest", "urllib.parse", "warnings",
    "weakref", "zipfile",
)  # fmt: skip


def corpus() -> list[str]:
    """The tokenizer's training text: the Zen of Python, chat markers and stdlib docstrings."""
    with contextlib.redirect_stdout(io.StringIO()):
        this = importlib.import_module("this")
    # Repeated so the chat markers become single tokens.
    chat = "USER: <image>\nDescribe the image.\nASSISTANT: It shows a cat.</s>\n" * 50
    parts = [codecs.decode(this.s, "rot13"), chat]
    for module_name in _CORPUS_MODULES:
        module = importlib.import_module(module_name)
        parts.append(inspect.getdoc(module) or "")
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            public = not name.startswith("_") and getattr(obj, "__module__", None) == module_name
            if public and (inspect.isfunction(obj) or inspect.isclass(obj)):
                parts.append(inspect.getdoc(obj) or "")
    return [p for p in parts if p]


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> str:
    """Train the byte-level BPE tokenizer; returns its ``tokenizer.json`` text.

    Raises:
        ValueError: the corpus cannot fill ``vocab_size`` entries.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the corpus gives {tokenizer.get_vocab_size()} tokens, not vocab_size={vocab_size}"
        )
    return tokenizer.to_str()
