"""Grammar-constrained decoding: the daemon's per-token mask cost against a decode step.

    python tools/bench_grammar.py [--model smollm2|gemma3|PATH] [--rounds 5] [--threads N]

A real Target (worker subprocess, shared memory, frames) and Engine. Each round, in this
order (interleaved, so machine load hits all alike):

    constrained  a chat request under a JSON schema, greedy, until the grammar is complete
    plain        the same prompt unconstrained, greedy, EOS ignored, as many tokens
    mask         the daemon's grammar work alone on the constrained output's tokens:
                 a fresh matcher, then per token `fill` (compute the next mask into a
                 buffer shaped like the shared region) and `advance` (consume the token)

Decode ms/token = decode time after the first token / (tokens - 1). Medians over rounds.
The mask cost runs on the event loop between steps, so it adds to every constrained step
(minus nothing: the next step needs the mask, so it cannot overlap the forward).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import numpy as np
from bench_dflash import generate

from luced.engine.config import ModelInfo
from luced.engine.constraint import Constraint
from luced.engine.core import Engine
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.serve.bundled import gemma3_path, smollm2_path
from luced.text.chat_template import ChatTemplate
from luced.text.grammar import GrammarTokenizer, json_schema_grammar
from luced.text.prompt import chat_ids
from luced.text.tokenizer import Tokenizer

MODELS = {"smollm2": smollm2_path, "gemma3": gemma3_path}
SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "country": {"type": "string", "maxLength": 30},
                    "population": {"type": "integer", "minimum": 0},
                },
                "required": ["name", "country", "population"],
            },
            "minItems": 4,
            "maxItems": 6,
        }
    },
    "required": ["cities"],
}
QUESTION = "List five large European cities with their country and population, as JSON."


async def decode(
    engine: Engine, prompt: list[int], n: int, grammar: str | None
) -> tuple[list[int], float]:
    """(tokens, decode seconds per token after the first)."""
    tokens, seconds, _ = await generate(engine, prompt, n, grammar)
    return tokens, seconds / max(1, len(tokens) - 1)


def mask_cost(vocab: GrammarTokenizer, grammar: str, tokens: list[int], stops: set[int]) -> float:
    """Seconds per token of the daemon's grammar work (fill + advance) along `tokens`."""
    masks = np.zeros((1, vocab.mask_words), dtype=np.int32)
    c = Constraint(vocab.matcher(grammar), vocab, stops, masks)
    t0 = time.perf_counter()
    for token in tokens:
        c.fill(0)
        c.advance(token)
    return (time.perf_counter() - t0) / len(tokens)


async def bench(args: argparse.Namespace) -> None:
    model = MODELS[args.model]() if args.model in MODELS else Path(args.model)
    gguf = GGUFFile(model)
    tokenizer = Tokenizer.from_gguf(gguf)
    template = ChatTemplate.from_gguf(gguf, gguf.arch)
    prompt = chat_ids(
        template, tokenizer, [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    grammar = json_schema_grammar(SCHEMA)
    t0 = time.perf_counter()
    vocab = GrammarTokenizer(tokenizer)
    vocab_s = time.perf_counter() - t0
    placement = TargetPlacement.one_cpu_worker(
        gguf, threads=args.threads, kv_capacity=2048, max_batch_tokens=256, dtype=args.dtype
    )
    rows: dict[str, list[float]] = {"plain": [], "constrained": [], "mask": []}
    with ShmOwner() as owner:
        target = Target(owner, placement)
        engine = Engine(target, tokenizer, template, model=ModelInfo("bench", 2048))
        await target.start()
        engine.start()
        try:
            await decode(engine, prompt, 8, None)  # warm-up (first-call costs)
            for _ in range(args.rounds):
                tokens, constrained = await decode(engine, prompt, 400, grammar)
                _, plain = await decode(engine, prompt, len(tokens), None)
                rows["constrained"].append(constrained)
                rows["plain"].append(plain)
                rows["mask"].append(mask_cost(vocab, grammar, tokens, set(tokenizer.eos_ids)))
        finally:
            await engine.stop()
            await target.close()
    print(
        f"\n{model.name} ({args.dtype}, {args.threads} threads, vocab {tokenizer.vocab_size}): "
        f"{len(tokens)} constrained tokens, medians of {args.rounds} rounds, "
        f"load average {os.getloadavg()[0]:.2f}; grammar vocabulary built in {vocab_s:.2f} s\n"
    )
    plain_ms = statistics.median(rows["plain"]) * 1e3
    print(f"{'':13s}{'per token':>12s}{'of plain':>10s}")
    for name, ts in rows.items():
        t = statistics.median(ts) * 1e3
        shown = f"{t * 1e3:9.1f} µs" if name == "mask" else f"{t:9.2f} ms"
        print(f"{name:13s}{shown:>12s}{t / plain_ms:10.1%}")
    print(f"\noutput: {tokenizer.decode(tokens)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    asyncio.run(bench(ap.parse_args()))


if __name__ == "__main__":
    main()
