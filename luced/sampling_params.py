"""Per-request sampling parameters.

Torch-free on purpose: the daemon builds and validates these from the HTTP request, sends them
to a worker in a frame, and the worker's sampler (`luced.runtime.sampler`) applies them.
Each field's "off" value is its default, so `SamplingParams()` is plain sampling from the
model distribution at temperature 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace

# torch.Generator.manual_seed accepts [-2**63, 2**64); OpenAI's `seed` is an int64.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
# OpenAI's bounds on logit_bias: at most 300 tokens, each biased by -100 to 100. The map
# travels in every step's frame, so its size stays bounded here too.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = (-100.0, 100.0)

# The frames' ``sampling`` map (``SamplingParams.to_wire``): scalars by field name, and
# logit_bias as {"token id": bias} (msgpack map keys are strings).
SamplingWire = dict[str, int | float | dict[str, float] | None]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token from a row of logits.

    Processing order (Hugging Face `generate` order, see `luced.runtime.sampler`):
    penalties -> temperature -> top_k -> top_p -> min_p -> draw.

    temperature: 0 = greedy (argmax of the penalized logits); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 = off.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 = off.
    min_p: drop tokens whose probability is below min_p * (probability of the top token); 0 = off.
    repetition_penalty: llama.cpp / HF semantics; a token seen in the window has a positive
        logit divided by it and a negative logit multiplied by it; 1.0 = off.
    frequency_penalty, presence_penalty: OpenAI semantics; subtract
        frequency_penalty * count + presence_penalty * (count > 0); 0 = off.
    penalty_window: the last N tokens of prompt + output that the three penalties count
        (llama.cpp `penalty_last_n`); -1 = all tokens, 0 = none.
    seed: seeds the request's own random generator (same seed -> same tokens);
        None = fresh randomness.
    logprobs: None = no logprobs; k >= 0 = the chosen token's logprob plus the k most likely
        (token, logprob) pairs (vLLM semantics, so OpenAI's `logprobs: true, top_logprobs: 0`
        maps to 0).
    logit_bias: (token id, bias) pairs, ids ascending: each bias (-100 to 100) is added to
        its token's logit after the penalties, greedy decoding included; () = off. Given as
        a mapping or pairs, stored as a sorted tuple (so the params stay hashable).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_window: int = 64
    seed: int | None = None
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if _integer("top_k", self.top_k) < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        top_p = _real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
        min_p = _real("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")
        repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {repetition_penalty}")
        _real("frequency_penalty", self.frequency_penalty)
        _real("presence_penalty", self.presence_penalty)
        if _integer("penalty_window", self.penalty_window) < -1:
            raise ValueError(
                f"penalty_window must be -1 (all tokens) or >= 0, got {self.penalty_window}"
            )
        if self.seed is not None and not _SEED_MIN <= _integer("seed", self.seed) <= _SEED_MAX:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.logprobs is not None and _integer("logprobs", self.logprobs) < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    def to_wire(self) -> SamplingWire:
        """The frames' ``sampling`` map: only the fields that differ from their defaults."""
        wire: SamplingWire = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != f.default
        }
        if self.logit_bias:
            wire["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, object]) -> SamplingParams:
        """The inverse of ``to_wire`` (a None value is the default); ValueError naming the
        first bad key."""
        unknown = sorted(set(wire) - WIRE_KEYS)
        if unknown:
            raise ValueError(f"unknown sampling key(s) {unknown}; known: {sorted(WIRE_KEYS)}")
        return cls(**{k: v for k, v in wire.items() if v is not None})  # type: ignore[arg-type]

    def without_penalties(self) -> SamplingParams:
        """The same draw with no penalties and no logprobs: a DFlash draft's proposal
        distribution q (any q keeps speculative sampling exact; the target applies the
        penalties to p)."""
        off = {f.name: f.default for f in fields(self) if f.name in PENALTY_FIELDS}
        return replace(self, logprobs=None, **off)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.penalty_window != 0 and (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


WIRE_KEYS = frozenset(f.name for f in fields(SamplingParams))
PENALTY_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "penalty_window")


def _real(name: str, value: object) -> float:
    # bool is an int subclass; `temperature=True` is a caller bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs from a mapping (ids as ints or decimal strings, as on the wire) or
    from pairs; sorted by id, each checked."""
    if isinstance(value, Mapping):
        items: Iterable[object] = value.items()
    elif isinstance(value, tuple | list):
        items = value
    else:
        raise ValueError(f"logit_bias must map token ids to biases, got {type(value).__name__}")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise ValueError(f"logit_bias entries are (token id, bias) pairs, got {item!r}")
        key, bias = item
        if isinstance(key, str) and key.isascii() and key.isdigit():
            key = int(key)
        token = _integer("logit_bias token id", key)
        if token < 0:
            raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
        if token in pairs:
            raise ValueError(f"logit_bias names token {token} twice")
        lo, hi = LOGIT_BIAS_RANGE
        pairs[token] = _real(f"logit_bias of token {token}", bias)
        if not lo <= pairs[token] <= hi:
            raise ValueError(f"logit_bias of token {token} must be in [{lo:g}, {hi:g}], got {bias}")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    return tuple(sorted(pairs.items()))
