"""The default model's real tokenizer and chat template, shared by the API tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from luced.text.chat_template import ChatTemplate
from luced.text.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smol_template(smollm2_gguf: Path) -> ChatTemplate:
    return ChatTemplate.from_gguf(smollm2_gguf, "llama")
