"""Chat-turn boundaries (the prefix cache's cut points) on the bundled models' real
tokenizers and templates."""

from __future__ import annotations

import pytest

from luced.gguf_file import GGUFFile
from luced.text.chat_template import ChatTemplate
from luced.text.tokenizer import Tokenizer
from luced.text.turns import TurnMarker

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]


@pytest.mark.parametrize(
    ("model", "marker"), [("smollm2", "<|im_start|>"), ("gemma3", "<start_of_turn>")]
)
def test_cuts_fall_where_each_message_opens(model, marker, request) -> None:
    gguf = GGUFFile(request.getfixturevalue(f"{model}_gguf"))
    tokenizer = Tokenizer.from_gguf(gguf)
    template = ChatTemplate.from_gguf(gguf, gguf.arch)
    found = TurnMarker.learn(template, tokenizer)
    assert found is not None and tokenizer.id_to_piece(found.token_id) == marker
    messages = CHAT if model == "smollm2" else CHAT[1:]  # Gemma's template has no system turn
    text = template.render(messages, add_generation_prompt=True)
    ids = tokenizer.encode_chat(text)
    cuts = found.cuts(ids)
    # One cut before every message after the first, and one before the generation prompt.
    assert len(cuts) == len(messages)
    for cut in cuts:
        assert ids[cut] == found.token_id
    # The prefix before a cut is exactly the earlier turns rendered on their own.
    earlier = template.render(messages[:2], add_generation_prompt=False)
    assert ids[: cuts[1]] == tokenizer.encode_chat(earlier)


def test_no_template_no_marker(smollm2_gguf) -> None:
    tokenizer = Tokenizer.from_gguf(GGUFFile(smollm2_gguf))
    assert TurnMarker.learn(None, tokenizer) is None
