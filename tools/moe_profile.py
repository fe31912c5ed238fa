#!/usr/bin/env python3
"""Record a MoE routing profile for `--moe-routing-profile`: per MoE layer, how often the
router chose each expert over some prompts (their prefill, then greedy decoding).

    python tools/moe_profile.py MODEL.gguf PROMPTS.txt [MORE.txt ...] -o PROFILE.json
        [--tokens 32] [--dtype float32] [--threads N]

Each non-empty line of a prompts file is one prompt, encoded with the model's tokenizer
("-" reads stdin). Pick prompts like the traffic the daemon will serve: the hot experts
are the ones these route to most. The model is loaded whole (every expert local); the
file format and its checks are in `luced.serve.routing_profile`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from luced.gguf_file import GGUFFile
from luced.runtime import moe
from luced.runtime.model import Model
from luced.runtime.moe import StackedExperts
from luced.serve.routing_profile import RoutingProfile, model_identity
from luced.text.tokenizer import Tokenizer


class RoutingCounter:
    """`moe.ExpertSplit` that counts each layer's routed (global) ids, then mixes as the
    model did before: all its experts local, or through its own split."""

    def __init__(self, model: Model) -> None:
        self.inner = moe.model_split(model)
        self.n_experts = model.cfg.moe.n_experts  # type: ignore[attr-defined]
        self.counts: dict[int, Tensor] = {}

    def mix(self, layer: int, x: Tensor, ids: Tensor, w: Tensor, hot: StackedExperts) -> Tensor:
        counts = torch.bincount(ids.reshape(-1).cpu(), minlength=self.n_experts)
        self.counts[layer] = self.counts.get(layer, 0) + counts
        if self.inner is None:
            return moe.expert_mix(x, ids, w, hot)
        return self.inner.mix(layer, x, ids, w, hot)


def record(model: Model, prompts: Iterable[list[int]], tokens: int) -> RoutingProfile:
    """The routing counts of each prompt's prefill and `tokens` greedy decode steps."""
    counter = RoutingCounter(model)
    inner, model.expert_split = moe.model_split(model), counter  # type: ignore[attr-defined]
    routed = 0
    try:
        for ids in prompts:
            cache = model.new_cache(len(ids) + tokens)
            logits = model.forward(torch.tensor(ids), cache, 0)
            for step in range(tokens):
                token = int(logits[-1].argmax())
                logits = model.forward(torch.tensor([token]), cache, len(ids) + step)
            routed += len(ids) + tokens
    finally:
        model.expert_split = inner  # type: ignore[attr-defined]
    gguf = GGUFFile(model.path)
    zero = (0,) * counter.n_experts
    counts = {
        layer: tuple(counter.counts[layer].tolist()) if layer in counter.counts else zero
        for layer in gguf.moe_layers()
    }
    return RoutingProfile(model_identity(gguf), routed, counts)


def read_prompts(files: list[str]) -> list[str]:
    lines = []
    for name in files:
        text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
        lines += [line for line in text.splitlines() if line.strip()]
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", help="MoE GGUF file")
    p.add_argument("prompts", nargs="+", help="files of prompts, one per line ('-': stdin)")
    p.add_argument("-o", "--output", required=True, help="the profile to write (JSON)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens decoded per prompt")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = GGUFFile(args.model)
    if not gguf.moe_layers():
        p.error(f"{args.model} has no routed experts")
    tokenizer = Tokenizer.from_gguf(gguf)
    prompts = [tokenizer.encode(text) for text in read_prompts(args.prompts)]
    if not prompts:
        p.error("no prompts (every line was empty)")
    model = Model.load(args.model, dtype=args.dtype)
    profile = record(model, prompts, args.tokens)
    Path(args.output).write_text(profile.to_json() + "\n", encoding="utf-8")
    print(f"{args.output}: {profile.tokens} tokens over {len(prompts)} prompts")


if __name__ == "__main__":
    main()
