"""BERT's WordPiece vocabulary read from a GGUF (`tokenizer.ggml.model = "bert"`), against
transformers' BERT tokenizer (uncased) over the same vocab.txt: the oracle.

The GGUF is luced.runtime.tiny.bert's, written in llama.cpp's phantom-space form ("▁word" starts
a word, a bare piece continues one), with [CLS] / [SEP] as BOS / EOS, both added.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_hf import hf_tokenizer

from luced.gguf_file import GGUFFile
from luced.runtime.tiny import make_tiny_gguf
from luced.runtime.tiny.bert import TinyEncoder
from luced.text.tokenizer import Tokenizer
from luced.text.vocab import TokenizerSpec, wordpiece_spelling

TEXTS = [
    "The small model reads the prompt, one token at a time.",
    "Hello WORLD! How are you today?",
    "",
    "   leading and trailing   ",
    "tabs\tand\nnewlines\r\nhere",
    "numbers 1, 22, 333 and 3.14159 -42 100%",
    "Ünïcödé façade naïve coöperate — “quotes” … e\u0301 combining",
    "CJK 你好，世界 and fullwidth Ａｂｃ, ﬁ ligature",
    "emoji 😀 and a control\x07char and zero\u200bwidth",
    "def forward(self, tokens): return {'key': [1, 2]}",
    "unknownwordsthatarelongerthananythingthevocabularyholds xyzzy",
    "[CLS] [SEP] [MASK] written in text stay text",
    "a" * 120 + " " + "the " * 30,
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyEncoder:
    return make_tiny_gguf("bert", tmp_path_factory.mktemp("wp") / "bert.gguf", seed=3)


@pytest.fixture(scope="module")
def ours(tiny) -> Tokenizer:
    return Tokenizer.from_gguf(tiny.path, use_cache=False)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers_bert_tokenizer(tiny, ours: Tokenizer, text: str) -> None:
    hf = hf_tokenizer(tiny)
    want = hf(text, split_special_tokens=True)["input_ids"]  # text never makes [CLS]
    assert ours.encode(text) == want
    assert ours.encode(text, add_bos=False, add_eos=False) == want[1:-1]


def test_specials_and_pieces(tiny, ours: Tokenizer) -> None:
    pieces = tiny.wordpieces
    assert ours.bos_id == pieces.index("[CLS]") and ours.eos_id == pieces.index("[SEP]")
    assert ours.unk_id == pieces.index("[UNK]") and ours.add_bos and ours.add_eos
    ids = ours.encode("[CLS] hello", allow_special=True)  # a special, when the caller allows
    assert ids[:2] == [ours.bos_id, ours.bos_id]
    # The GGUF's spelling back to vocab.txt's, for every kind of piece.
    assert [wordpiece_spelling(p) for p in ("\u2581the", "ing", "[SEP]", "")] == [
        "the",
        "##ing",
        "[SEP]",
        "##",
    ]


def test_decode_reads_the_phantom_spaces(ours: Tokenizer) -> None:
    ids = ours.encode("The small model reads the prompt")
    assert ours.decode(ids) == "the small model reads the prompt"
    assert ours.decode(ids, skip_special=False).startswith("[CLS] the small")


def test_older_files_name_only_the_separator(tiny, ours: Tokenizer) -> None:
    """Before the converter wrote BOS / EOS for BERT it wrote only the separator: [CLS]
    is then found by its text, [SEP] by tokenizer.ggml.seperator_token_id."""
    meta = dict(GGUFFile(Path(tiny.path)).metadata)
    for key in ("bos_token_id", "eos_token_id", "add_bos_token", "add_eos_token"):
        del meta[f"tokenizer.ggml.{key}"]
    spec = TokenizerSpec.from_metadata(meta)
    assert (spec.bos_id, spec.eos_id) == (ours.bos_id, ours.eos_id)
    assert spec.add_bos and spec.add_eos
    old = Tokenizer.from_metadata(meta)
    assert old.encode(TEXTS[0]) == ours.encode(TEXTS[0])
