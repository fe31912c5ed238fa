"""The tiny models' vocabularies, with BPE merges learned from a small fixed corpus, and
their tokenizer.ggml.* keys as llama.cpp's converter writes them.

llama and qwen3 (and the MoE families, which borrow qwen3's) get a `gpt2` byte-level vocab
with a ChatML template (llama laid out like SmolLM2, pre `smollm`; qwen3 like Qwen3, pre
`qwen2`, <think> user-defined, [PAD] fill); gemma3 a SentencePiece `llama` vocab (Gemma's
control tokens and ids, user-defined newlines, <0x00>..<0xFF> byte fallback, "▁word" pieces
with scores falling in merge order, so score order and file order agree); gemma4 the same
pieces as `tokenizer.ggml.model = gemma4` with merges and Gemma's chat template.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import Counter
from dataclasses import dataclass, field

import gguf
from gguf import TokenType as TT

_TURNS = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
)
_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{THINK}{%- endif -%}"
# Qwen3-style: an empty think block when the caller turns thinking off.
_NO_THINK = (
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)
# Gemma's turns, for the tiny gemma4 vocabulary (which has Gemma 3's turn tokens).
GEMMA_TURNS = (
    "{{- bos_token -}}{%- for message in messages -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + message['content'] + '<end_of_turn>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
CHAT_TEMPLATES = {
    "llama": _TURNS + _PROMPT.replace("{THINK}", ""),
    "qwen3": _TURNS + _PROMPT.replace("{THINK}", _NO_THINK),
    "qwen35": _TURNS + _PROMPT.replace("{THINK}", _NO_THINK),
    "qwen35moe": _TURNS + _PROMPT.replace("{THINK}", _NO_THINK),
}

# Training text for the merges (ours); enough pairs for a few hundred merges.
CORPUS = """\
The small model reads the prompt, one token at a time, and writes the next token.
A token is a piece of text: a word, part of a word, a space and a word, or a single byte.
When the cache holds the keys and values of every earlier position, the next step is cheap.
Hello world! How are you today? I am fine, thank you. The weather is nice and the sun is warm.
We tested the sampler with a fixed seed: the same seed gave the same text, every single time.
There are three families here: llama, qwen and gemma. Each one has its own names for weights.
Numbers like 1, 22, 333 and 2024 are split into digits; so are 3.14 and 0.5 and 100%.
def forward(self, tokens, positions):
    hidden = self.embed(tokens)
    for layer in self.layers:
        hidden = layer(hidden, positions)
    return self.norm(hidden)

for i in range(10):
    print(i, i * i)  # the squares
if x > 0 and y < 0: return {"key": [1, 2, 3], 'other': None}
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran away.
Sliding window attention looks only at the last few tokens, while global layers see them all.
Please answer the question in one short sentence, and then stop writing any more words.
"""


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model: "gpt2", "llama" or "gemma4"
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    ids: dict[str, int]  # bos / eos / unk / pad -> token id
    add_bos: bool
    chat_template: str | None = None
    extra: dict[str, bool] = field(default_factory=dict)  # other tokenizer.ggml.* flags


@functools.cache
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's printable stand-in for every byte value, indexed by the byte."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(256, 512))  # the rest, in byte order, shifted past Latin-1
    return tuple(chr(b) if b in keep else chr(next(others)) for b in range(256))


def _learn_merges(words: Counter[tuple[str, ...]], count: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties broken by the pair),
    down to pairs seen once, until `count` distinct tokens or every word is one token."""
    words = Counter(words)
    merges: list[tuple[str, str]] = []
    made: set[str] = set()  # two merges can spell the same token; it is one token
    while len(made) < count:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        made.add(best[0] + best[1])
        merged: Counter[tuple[str, ...]] = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


@functools.cache  # learning the merges takes a moment; a vocabulary is never changed
def make_vocab(family: str, size: int) -> Vocab:
    """The vocabulary of `size` tokens of a family (the MoE families pass "qwen3")."""
    if family in ("gemma3", "gemma4"):
        return _spm_vocab(size, "gemma4" if family == "gemma4" else "llama")
    return _bpe_vocab(family, size)


def _bpe_vocab(family: str, size: int) -> Vocab:
    bc = _byte_chars()
    # Digits alone, without a leading space, as the `smollm` and `qwen2` pre-tokenizers cut them
    # (transformers reads `smollm` as plain GPT-2 splitting; no digit merges keeps them agreeing).
    chunks = re.findall(r"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+|\s+", CORPUS)
    words = Counter(tuple(bc[b] for b in c.encode()) for c in chunks)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    head: list[tuple[str, TT]] = [(t, TT.CONTROL) for t in specials]
    tail: list[tuple[str, TT]] = [(t, TT.USER_DEFINED) for t in ("<think>", "</think>")]
    if family == "llama":  # SmolLM2 layout: specials first
        tail, pads = [], 0
    else:  # Qwen layout: specials after the merges, then [PAD] fill up to the embedding size
        head, tail, pads = [], head + tail, 8
    n_merges = size - len(head) - 256 - len(tail) - pads
    if n_merges < 16:
        raise ValueError(f"vocab_size {size} is too small for the {family} vocabulary")
    merges = _learn_merges(words, n_merges)
    merged = list(dict.fromkeys(a + b for a, b in merges))
    pads += n_merges - len(merged)  # a corpus that runs out of pairs pads instead
    tokens = head + [(c, TT.NORMAL) for c in bc] + [(t, TT.NORMAL) for t in merged] + tail
    tokens += [(f"[PAD{len(tokens) + i}]", TT.UNUSED) for i in range(pads)]
    index = {t: i for i, (t, _) in enumerate(tokens)}
    if family == "llama":  # as SmolLM2's GGUF: bos <|im_start|>, eos = pad <|im_end|>
        roles = dict(bos="<|im_start|>", eos="<|im_end|>", unk="<|endoftext|>", pad="<|im_end|>")
        pre, extra = "smollm", {"add_space_prefix": False}
    else:  # as Qwen3's: bos = pad <|endoftext|>, eos <|im_end|>, no unk
        roles = dict(bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>")
        pre, extra = "qwen2", {}
    ids = {role: index[token] for role, token in roles.items()}
    return Vocab(
        model="gpt2",
        pre=pre,
        tokens=[t for t, _ in tokens],
        types=[int(k) for _, k in tokens],
        scores=None,
        merges=[f"{a} {b}" for a, b in merges],
        ids=ids,
        add_bos=False,
        chat_template=CHAT_TEMPLATES[family],
        extra=extra,
    )


def _spm_vocab(size: int, model: str = "llama") -> Vocab:
    """Gemma's SentencePiece vocabulary. `model` "gemma4" is how llama.cpp's converter writes
    Gemma 4's (the same pieces from tokenizer.json): with its merges, and no pre-tokenizer."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n"]  # Gemma stores newline runs as user-defined tokens, matched whole
    chars = ["▁", *(chr(c) for c in range(0x21, 0x7F))]
    text = CORPUS.replace(" ", "▁")
    words = Counter(tuple(w) for line in text.splitlines() for w in re.findall(r"▁*[^▁]+|▁+", line))
    n_merges = size - len(control) - len(user) - 256 - len(chars)
    if n_merges < 16:
        raise ValueError(f"vocab_size {size} is too small for the gemma3 vocabulary")
    merges = _learn_merges(words, n_merges)
    tokens = [(t, TT.CONTROL, -1000.0) for t in control]
    tokens += [(t, TT.USER_DEFINED, -1000.0) for t in user]
    tokens += [(f"<0x{b:02X}>", TT.BYTE, 0.0) for b in range(256)]
    # Scores fall with merge order: llama.cpp merges by score, transformers by file position.
    pieces = chars + list(dict.fromkeys(a + b for a, b in merges))
    tokens += [(p, TT.NORMAL, -float(i)) for i, p in enumerate(pieces)]
    tokens += [(f"[PAD{len(tokens) + i}]", TT.UNUSED, -1000.0) for i in range(size - len(tokens))]
    return Vocab(
        model=model,
        pre="default" if model == "llama" else None,
        tokens=[t[0] for t in tokens],
        types=[int(t[1]) for t in tokens],
        scores=[t[2] for t in tokens],
        merges=[f"{a} {b}" for a, b in merges] if model == "gemma4" else None,
        ids=dict(bos=2, eos=1, unk=3, pad=0),
        add_bos=True,
        chat_template=GEMMA_TURNS if model == "gemma4" else None,
        extra={"add_space_prefix": False},
    )


def write_vocab(w: gguf.GGUFWriter, vocab: Vocab) -> None:
    # TextModel._set_vocab_gpt2 / _set_vocab_sentencepiece (Gemma4Model.set_vocab) + SpecialVocab.
    w.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    for role, token_id in vocab.ids.items():  # add_bos_token_id, add_eos_token_id, ...
        getattr(w, f"add_{role}_token_id")(token_id)
    w.add_add_bos_token(vocab.add_bos)
    if vocab.model in ("llama", "gemma4"):
        w.add_add_eos_token(False)
    if "add_space_prefix" in vocab.extra:
        w.add_add_space_prefix(vocab.extra["add_space_prefix"])
    if vocab.chat_template is not None:
        w.add_chat_template(vocab.chat_template)
