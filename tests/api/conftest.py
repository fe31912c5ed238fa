"""The default model's real tokenizer and chat template, and an engine over them that never
starts (what preparing a request reads; state "loading"), shared by the API tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from luced.engine.config import ModelInfo
from luced.engine.core import Engine
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.text.chat_template import ChatTemplate
from luced.text.tokenizer import Tokenizer

UNSTARTED_CONTEXT = 256  # tests/api/test_ollama.py relies on it


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smol_template(smollm2_gguf: Path) -> ChatTemplate:
    return ChatTemplate.from_gguf(smollm2_gguf, "llama")


@pytest.fixture(scope="module")
def unstarted_engine(
    smollm2_gguf: Path, smol_tokenizer: Tokenizer, smol_template: ChatTemplate
) -> Engine:
    """An engine named "smol" of UNSTARTED_CONTEXT tokens whose target never starts."""
    placement = TargetPlacement.one_cpu_worker(
        GGUFFile(smollm2_gguf), threads=1, kv_capacity=UNSTARTED_CONTEXT, max_batch_tokens=128
    )
    return Engine(
        Target(ShmOwner(), placement),
        smol_tokenizer,
        smol_template,
        model=ModelInfo("smol", UNSTARTED_CONTEXT),
    )
