"""The tiny model's tokenizer and chat templates, made offline and deterministically.

A byte-level BPE tokenizer trained with the ``tokenizers`` library on a synthetic corpus made
here: sentences drawn from a hand-written list of common English words, with punctuation,
numbers, accented Latin, Greek, Cyrillic, CJK, Hangul and emoji (multi-byte UTF-8), and chat
turns with the template's markers. A self-contained 64-bit PRNG (SplitMix64) draws it, so the
corpus, and so the tokenizer, depend on neither the Python version nor any library's (the
stdlib's docstrings and ``random``'s streams both change between versions). The special tokens
come first. The LLaVA chat template iterates over content parts (``image`` parts become
``<image>``), the text-only one renders ``message['content']`` as a string.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")  # ids 0..4
UNK_ID, BOS_ID, EOS_ID, PAD_ID, IMAGE_ID = range(5)
DEFAULT_VOCAB_SIZE = 1024

# Tools (Hermes / Qwen style): listed after the BOS token, an assistant's calls rendered as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, tool results as "TOOL: ..." turns.
# Without tools the templates render exactly what they did before tools existed.
_TOOLS = (
    "{% if tools %}{{ 'SYSTEM: You can call these functions:\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    '{{ \'</tools>\nTo call one, answer <tool_call>{"name": <name>, "arguments": '
    "<object>}</tool_call>\n' }}{% endif %}"
)
_TOOL_CALLS = (
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}"
    "{{ '}</tool_call>' }}{% endfor %}{% endif %}"
)
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}" + _TOOLS + "{% for message in messages %}"
    "{% if message['content'] is string %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for part in parts %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}" + _TOOL_CALLS + ""
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
TEXT_CHAT_TEMPLATE = (
    "{{ bos_token }}" + _TOOLS + "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{{ message['content'] or '' }}" + _TOOL_CALLS + ""
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# The corpus's word lists, by how often a sentence draws from them. They include every word of
# the engine tests' filler text (tests/engine/conftest.py::long_text), so it tokenizes to
# about one token a word. Changing any of this changes the tokenizer (a test pins it).
_FUNCTION_WORDS = """
the the the a a an and and or but if then so because of of to to in in on at by for with from
into over under about after before while when where why how what which who that this these
those there here it its he she they we you I me him her them us my your our their his is is
are was were be been has have had do does did not no yes all some any each every more most many
much few very just only also too again still never always often can could will would should
may might must as than up down out off through
"""
_CONTENT_WORDS = """
time day night year week morning evening home house room door window table chair book page
word name story song songs music picture image color light water river rivers sea lake rain
snow wind sun moon star stars sky tree trees forest garden flower flowers grass stone hill
mountain mountains road street city cities town village country world people person man woman
child children friend friends family mother father teacher student doctor farmer king queen
cat cats dog dogs fox bird birds fish horse cow mouse bear bee honey bread milk cheese apple
coffee tea soup rice food dinner lunch breakfast kitchen market shop school class lesson
question answer idea problem reason way place thing things part number hand head eye eyes face
heart voice car train boat ship plane rocket bridge map letter paper pen box bag key clock
computer phone game ball field team job work money price island beach cloud clouds fire ice mat
path corner photo camera model text token list test
go goes went come came see saw look looked find found make made take took give gave get got
know knew think thought say said tell told ask asked want need like love help try call keep
let put run ran walk walked sit sat stand stood read write wrote sing sang play played open
close begin start stop turn move live bring hold hear feel leave meet learn grow eat drink
sleep jump jumped fly swim carry build draw paint cook wash wait watch show describe explain
count follow shine fall rise shows
good bad new old big small little long short high low young great happy sad warm cold hot cool
quick slow fast lazy busy quiet loud bright dark soft hard easy simple clear early late free
full empty kind brave strong clean fresh sweet green blue red yellow white black brown gold
gray round tiny wide deep wild calm strange beautiful first last next other same different
important ready real true
now soon today tomorrow yesterday together slowly quickly really maybe almost perhaps well
"""
_CONTRACTIONS = "it's don't I'm can't we're you'll they've isn't that's let's didn't I'd"
_NAMES = "Anna Ben Clara David Emma Felix Grace Hugo Iris Jonas Kim Leo Maya Noah Olga Paul"
_FOREIGN = """
café naïve résumé façade jalapeño piñata über Zürich São Paulo Ångström crème brûlée déjà vu
fiancée Málaga Kraków Øresund smörgåsbord Straße señor garçon Ærø Łódź Dvořák
Αθήνα καλημέρα θάλασσα Москва привет спасибо
猫 狗 你好 世界 中文 日本語 東京 学生 山 川 月 星 水 火 天气很好 谢谢 こんにちは ありがとう ねこ
さくら カタカナ ラーメン 안녕하세요 한국어 서울 고양이
😀 😂 🙂 🐱 🐶 🦊 🐦 🌍 🌙 ⭐ ☀️ 🌧️ 🍞 🍯 ☕ 🎉 🎵 ❤️ 👍 🚀 📷 🏔️ 👋 🔥 👩‍💻 🇫🇷
"""
_PUNCTUATION = (",", ",", ",", ";", ":", " -", " —", "…")
_ENDINGS = (".", ".", ".", ".", ".", "?", "?", "!", "...")
_CORPUS_SEED = 0x10A4_A91E_C0DE_5EED
_NUM_PARAGRAPHS = 1500
_NUM_CHAT_TURNS = 400
_MASK64 = (1 << 64) - 1


class _SplitMix64:
    """SplitMix64 (Steele, Lea and Flood, 2014): a tiny PRNG with a fixed, portable stream."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next(self) -> int:
        """The next 64-bit output."""
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """An integer in ``[0, n)`` (the top 32 bits scaled, bias under ``n / 2**32``)."""
        return ((self.next() >> 32) * n) >> 32

    def chance(self, percent: int) -> bool:
        """True with probability ``percent / 100``."""
        return self.below(100) < percent

    def pick(self, items: Sequence[str]) -> str:
        """One of ``items``, uniformly."""
        return items[self.below(len(items))]


def _number(rng: _SplitMix64) -> str:
    kind = rng.below(6)
    if kind == 0:
        return str(rng.below(10))
    if kind == 1:
        return str(1900 + rng.below(150))
    if kind == 2:
        return f"{rng.below(100)}%"
    if kind == 3:
        return f"${rng.below(50)}.{rng.below(100):02d}"
    if kind == 4:
        return f"{1 + rng.below(12)}:{rng.below(60):02d}"
    return str(rng.below(100_000))


def _word(rng: _SplitMix64, words: tuple[Sequence[str], ...]) -> str:
    function_words, content_words, contractions, names, foreign = words
    roll = rng.below(100)
    if roll < 38:
        return rng.pick(function_words)
    if roll < 90:
        return rng.pick(content_words)
    if roll < 93:
        return rng.pick(contractions)
    if roll < 95:
        return rng.pick(names)
    if roll < 98:
        return rng.pick(foreign)
    return _number(rng)


def _sentence(rng: _SplitMix64, words: tuple[Sequence[str], ...]) -> str:
    # Half the sentences open with a function word ("The", "It", "What"), as English does.
    first = rng.pick(words[0]) if rng.chance(50) else _word(rng, words)
    out = [first[:1].upper() + first[1:] if first[:1].isascii() else first]
    for _ in range(2 + rng.below(14)):
        word = _word(rng, words)
        if rng.chance(3):
            word = f'"{word}"' if rng.chance(50) else f"({word})"
        if rng.chance(8):
            word += rng.pick(_PUNCTUATION)
        out.append(word)
    return " ".join(out).rstrip(",;:-— ") + rng.pick(_ENDINGS)


def corpus() -> list[str]:
    """The tokenizer's training text: synthetic paragraphs and chat turns, the same everywhere.

    Only this module's word lists and integer arithmetic go into it: no stdlib docstrings, no
    ``random`` (whose streams may change between versions), no hash-ordered collections.
    """
    rng = _SplitMix64(_CORPUS_SEED)
    words = tuple(
        tuple(text.split())
        for text in (_FUNCTION_WORDS, _CONTENT_WORDS, _CONTRACTIONS, _NAMES, _FOREIGN)
    )
    parts = [
        " ".join(_sentence(rng, words) for _ in range(2 + rng.below(7))) + "\n"
        for _ in range(_NUM_PARAGRAPHS)
    ]
    # Chat turns in the templates' format, so the markers become single tokens.
    for _ in range(_NUM_CHAT_TURNS):
        image = "<image>\n" * rng.below(3)
        parts.append(
            f"USER: {image}{_sentence(rng, words)}\nASSISTANT: {_sentence(rng, words)}</s>\n"
        )
    return parts


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
