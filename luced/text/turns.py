"""Chat-turn boundaries in a tokenized prompt: the prefix cache's cut points.

A chat template opens every message with the same control token (ChatML's
``<|im_start|>``, Gemma's ``<start_of_turn>``, Llama 3's ``<|start_header_id|>``). We learn
that token once by rendering a one-message chat: its first token when that is special (a
BOS the template writes before the marker is skipped). A turn boundary is then every later
position where the marker opens a message (the cut sits just before it, so the tokens
before the cut are whole earlier turns).

    marker = TurnMarker.learn(template, tokenizer)     # None: no usable marker
    marker.cuts(prompt_ids)                             # [12, 40, ...] ascending
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from luced.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class TurnMarker:
    token_id: int

    @classmethod
    def learn(cls, template: Any, tokenizer: Tokenizer) -> TurnMarker | None:
        """The token that opens a message, or None (no template, or it writes none)."""
        if template is None:
            return None
        try:
            text = template.render([{"role": "user", "content": "x"}], add_generation_prompt=False)
        except Exception:  # a template that cannot render one message has no usable marker
            return None
        ids = tokenizer.encode(text, add_bos=False, allow_special=True)
        if len(ids) > 1 and ids[0] == tokenizer.bos_id and ids[1] in tokenizer.special_ids:
            ids = ids[1:]  # the template writes BOS, then the marker (Gemma)
        # (SmolLM2's BOS *is* its marker, <|im_start|>: then it stays.)
        return cls(ids[0]) if ids and ids[0] in tokenizer.special_ids else None

    def cuts(self, prompt: Sequence[int]) -> list[int]:
        """Positions where a message after the first opens (or the generation prompt):
        each prefix before one is whole turns."""
        at = np.flatnonzero(np.asarray(prompt, dtype=np.int64) == self.token_id)
        return [int(i) for i in at[1:]]
