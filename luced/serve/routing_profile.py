"""MoE routing profiles: how often each routed expert was chosen, per MoE layer, over some
prompts (`tools/moe_profile.py` records one). Given `--moe-routing-profile FILE`,
`--moe-hot-experts N` keeps each layer's N most-routed experts (ties: the lower id) instead
of the lowest ids, so that fewer of a token's experts are cold.

The file, JSON::

    {"format": "luced-moe-routing-profile", "version": 1,
     "model": {"arch": "qwen3moe", "expert_count": 8, "moe_layers": [0, 1, 2, 3],
               "routers": "<sha256 of the router tensors' stored bytes, layer order>"},
     "tokens": 1234,                                 # routed tokens counted
     "counts": {"0": [c_0, ..., c_E-1], ...}}        # per MoE layer: selections per expert

`model` ties the counts to one model: the same architecture, expert count and MoE layers,
and routers with the very same weights (a fine-tune of the same shape routes differently).
The daemon reads and checks the file at start-up (torch-free) and sends the counts to the
target's workers and the expert worker in their load frames; both plan from them
(`runtime.experts.plan`), so their placements, and fingerprints, agree.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from luced.gguf_file import GGUFFile
from luced.ipc.frames import MoeCounts

FORMAT = "luced-moe-routing-profile"
VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be read or belongs to another model."""


def model_identity(gguf: GGUFFile) -> dict[str, Any]:
    """What a profile must match: architecture, expert count, MoE layers, router weights."""
    layers = gguf.moe_layers()
    digest = hashlib.sha256()
    for layer in layers:
        digest.update(gguf.raw(f"blk.{layer}.ffn_gate_inp.weight").tobytes())
    return {
        "arch": gguf.arch,
        "expert_count": int(gguf.get(f"{gguf.arch}.expert_count", 0)),
        "moe_layers": list(layers),
        "routers": digest.hexdigest(),
    }


@dataclass(frozen=True)
class RoutingProfile:
    model: Mapping[str, Any]  # model_identity of the model it was recorded on
    tokens: int
    counts: Mapping[int, tuple[int, ...]]  # MoE layer -> selections per expert

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "model": dict(self.model),
                "tokens": self.tokens,
                "counts": {str(layer): list(c) for layer, c in sorted(self.counts.items())},
            },
            indent=1,
        )

    def to_wire(self) -> MoeCounts:
        return tuple((layer, tuple(c)) for layer, c in sorted(self.counts.items()))

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> RoutingProfile:
        """The file's profile, its own consistency checked (not yet against a model)."""
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProfileError(f"cannot read {path}: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ProfileError(f"{path} is not a MoE routing profile (no format {FORMAT!r})")
        if doc.get("version") != VERSION:
            raise ProfileError(f"{path}: profile version {doc.get('version')!r}, not {VERSION}")
        try:
            model, tokens = dict(doc["model"]), int(doc["tokens"])
            counts = {int(k): tuple(v) for k, v in dict(doc["counts"]).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{path}: malformed profile ({exc!r})") from None
        for layer, c in counts.items():
            if not all(type(n) is int and n >= 0 for n in c):
                raise ProfileError(f"{path}: layer {layer}: counts must be integers >= 0")
        return cls(model, tokens, counts)

    def check(self, gguf: GGUFFile) -> None:
        """ProfileError unless this profile was recorded on the model in `gguf`."""
        want = model_identity(gguf)
        for key in ("arch", "expert_count", "moe_layers", "routers"):
            if self.model.get(key) != want[key]:
                raise ProfileError(
                    f"recorded for another model: its {key} is {self.model.get(key)!r}, "
                    f"{gguf.path.name}'s is {want[key]!r}"
                )
        layers, n = sorted(self.counts), want["expert_count"]
        if layers != want["moe_layers"]:
            raise ProfileError(
                f"counts for layers {layers}, the MoE layers are {want['moe_layers']}"
            )
        for layer, c in self.counts.items():
            if len(c) != n:
                raise ProfileError(f"layer {layer}: {len(c)} counts for {n} experts")


def load(path: str | os.PathLike[str], gguf: GGUFFile) -> RoutingProfile:
    """The profile at `path`, checked against the model in `gguf`; else ProfileError."""
    profile = RoutingProfile.read(path)
    profile.check(gguf)
    return profile
