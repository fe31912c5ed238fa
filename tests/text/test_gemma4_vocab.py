"""The `gemma4` tokenizer type (tokenizer.ggml.model = "gemma4": SentencePiece BPE with its merges
in the file, no pre-tokenizer key) against transformers' GGUF tokenizer, on the tiny gemma4
GGUF's vocabulary (tools/make_tiny_gguf.py); tests/e2e/test_gemma4_daemon.py serves that file.

transformers turns BOS off for gemma4 files (the reference chat template writes <bos>); we
keep the file's add_bos_token as llama.cpp does, so ids are compared without BOS.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from luced.gguf_file import GGUFFile
from luced.runtime.tiny import make_tiny_gguf
from luced.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "",
    " ",
    "   three leading spaces and trailing   ",
    "The small model reads the prompt, one token at a time.",
    "line one\nline two\n\n\nafter three newlines\n",
    "\tTab\tseparated\t",
    "def forward(self, tokens):\n    return self.norm(hidden)  # 3.14 and 100%",
    "Ünïcödé façade — “quotes” 😀 你好 𓀀",  # none in the vocabulary: byte fallback
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>x<eos>",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # k_eq_v off: transformers' tokenizer loader also reads the config, and it refuses the
    # per-layer head_count_kv that K = V writes. The vocabulary is the same either way.
    path = tmp_path_factory.mktemp("g4") / "tiny-gemma4.gguf"
    return make_tiny_gguf("gemma4", path, k_eq_v=False).path


def test_ids_and_text_match_transformers(tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    assert GGUFFile(tiny).metadata["tokenizer.ggml.model"] == "gemma4"
    hf = AutoTokenizer.from_pretrained(str(tiny.parent), gguf_file=tiny.name)
    ours = Tokenizer.from_gguf(tiny, cache_dir=tmp_path)
    assert ours.vocab_size == len(hf)
    for text in TEXTS:
        ids = ours.encode(text, allow_special=True, add_bos=False)
        assert ids == hf(text)["input_ids"], text
        assert ours.encode(text, add_bos=False) == hf(text, split_special_tokens=True)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.encode("hi")[0] == ours.bos_id == 2  # the file's add_bos_token
    assert len(ours.encode("The small model")) < len("The small model")  # merges apply
