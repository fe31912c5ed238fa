"""The engine's settings, one frozen group per concern; each component takes its group.

    ModelInfo          what is served: its name, context, encoder or not, pooling (Intake)
    SchedulingLimits   how many requests run at once and how many wait (Intake, the slots)
    KVConfig           the running requests' KV pool, finished prompts kept, block store
    SpeculationConfig  the draft window and how it is chosen (DraftWindows)

They hold resolved values, not options: `KVConfig.pool_tokens` counts positions where
``--kv-pool-tokens`` may say 0 (sized from the free memory), and its block store's bytes
are 0 where the model keeps snapshots. The daemon builds each group from its option group
(``for_engine`` in luced/serve/config.py) with what the model's GGUF resolved; this module
ranks below serve and imports nothing of it. The defaults are an engine's alone (one
running request, nothing kept, a fixed window of 16), for tests and tools.
"""

from __future__ import annotations

from dataclasses import dataclass

from luced.engine.pooling import POOLINGS


@dataclass(frozen=True)
class ModelInfo:
    """What the engine serves, as requests and the APIs see it."""

    name: str  # the model name replies carry
    context_length: int  # positions a request's prompt and output share
    encoder: bool = False  # bidirectional attention (BERT): embeddings only
    pooling: str = "mean"  # how the APIs pool embeddings (engine/pooling.py)

    def __post_init__(self) -> None:
        _at_least(1, context_length=self.context_length)
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling {self.pooling!r} is not one of {', '.join(POOLINGS)}")


@dataclass(frozen=True)
class SchedulingLimits:
    """How many requests run at once and how many may wait (more are answered 429)."""

    max_running: int = 1  # sequences in the steps at once (the workers' slots)
    max_queue: int = 16  # requests waiting
    max_queued_tokens: int = 32768  # prompt tokens waiting
    default_max_tokens: int | None = None  # a request's output without max_tokens; None: the room

    def __post_init__(self) -> None:
        _at_least(1, max_running=self.max_running, max_queued_tokens=self.max_queued_tokens)
        _at_least(0, max_queue=self.max_queue)
        if self.default_max_tokens is not None:
            _at_least(1, default_max_tokens=self.default_max_tokens)


@dataclass(frozen=True)
class KVConfig:
    """The K/V the running requests hold, and what finished ones and the prefix cache keep."""

    # Positions the running requests hold together (at least one context); None:
    # max_running whole contexts, so nothing is ever preempted.
    pool_tokens: int | None = None
    # The most positions finished requests' K/V may keep of that pool for later requests
    # to share (engine/kv/finished.py); 0: none is kept.
    keep_tokens: int = 0
    # Bytes of host records for the prefix cache's K/V blocks (engine/kv/block_store.py);
    # 0: the prefix cache keeps snapshots, or there is none.
    block_store: int = 0

    def __post_init__(self) -> None:
        if self.pool_tokens is not None:
            _at_least(1, pool_tokens=self.pool_tokens)
        _at_least(0, keep_tokens=self.keep_tokens, block_store=self.block_store)


@dataclass(frozen=True)
class SpeculationConfig:
    """How a speculating sequence drafts (engine/spec/windows.py)."""

    block_size: int = 16  # the draft window, or the most an adaptive one asks for
    lookup_drafts: bool = False  # --draft ngram: the prompt lookup, no draft model
    adaptive_blocks: bool = False  # each request sizes its window from its acceptance

    def __post_init__(self) -> None:
        _at_least(1, block_size=self.block_size)


def _at_least(low: int, **values: int) -> None:
    for name, value in values.items():
        if value < low:
            raise ValueError(f"{name} must be at least {low}, got {value}")
