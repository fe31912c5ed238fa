"""The served model as Ollama's `/api/tags`, `/api/ps` and `/api/show` describe it: pure
functions over `ModelFacts`, read from the GGUF once when the daemon starts.

    /api/tags  each model luced serves, as "name:latest" with the file's size and time
    /api/ps    the loaded ones: size_vram is the share of its layers on accelerators,
               expires_at when it unloads if still idle, or a century ahead for a model
               kept until the daemon stops (Ollama's clients show "Forever")
    /api/show  details, model_info (the GGUF's metadata; arrays as [] as Ollama shows them
               unless verbose, which luced does not fill), the chat template (Jinja, not
               Ollama's Go template), the sampling defaults Ollama clients get, and a
               Modelfile that names the GGUF

The digest is a SHA-256 of the file's path, size and modification time (hashing gigabytes
at start would delay it): it names the served file, it is not its content's hash.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
from gguf.constants import LlamaFileType

from luced.api.ollama import DEFAULTS, served_name
from luced.gguf_file import GGUFFile

FOREVER = timedelta(days=100 * 365)
CAPABILITIES = ["completion", "tools"]  # every template gets tools (luced.text.tool_calls)
ENCODER_CAPABILITIES = ["embedding"]  # bidirectional attention: it cannot generate


@dataclass(frozen=True)
class ModelFacts:
    """What the listings say about the served GGUF; empty for an app built without one."""

    path: str = ""
    size: int = 0  # bytes
    modified: float = 0.0  # unix time of the file
    arch: str = ""
    parameter_count: int = 0
    quantization: str = ""  # "Q4_K_M", "F16", ...
    metadata: Mapping[str, Any] = field(default_factory=dict)  # scalars; arrays as []

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelFacts:
        meta = {
            k: [] if isinstance(v, list | np.ndarray) else v
            for k, v in gguf.metadata.items()
            if k != "tokenizer.chat_template"  # /api/show has it as `template`
        }
        count = sum(int(np.prod(t.shape)) for t in gguf.tensors.values())
        meta.setdefault("general.parameter_count", count)
        return cls(
            path=str(gguf.path),
            size=gguf.size,
            modified=gguf.path.stat().st_mtime,
            arch=gguf.arch,
            parameter_count=int(meta["general.parameter_count"]),
            quantization=_quantization(gguf),
            metadata=meta,
        )

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.path}\0{self.size}\0{self.modified}".encode()).hexdigest()


def _quantization(gguf: GGUFFile) -> str:
    """general.file_type's name, else the type holding most of the matrices' bytes."""
    file_type = gguf.get("general.file_type")
    try:
        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        pass
    weights: Counter[str] = Counter()
    for t in gguf.tensors.values():
        if len(t.shape) >= 2:
            weights[t.type_name] += t.nbytes
    return weights.most_common(1)[0][0] if weights else ""


def parameter_size(n: int) -> str:
    """A parameter count as Ollama writes it: 135M, 1.24B, 7.6B."""
    for unit, scale in (("B", 10**9), ("M", 10**6)):
        if n >= scale:
            x = n / scale
            if x == int(x):
                return f"{int(x)}{unit}"
            return f"{x:.1f}{unit}" if unit == "B" else f"{x:.2f}{unit}"
    return f"{round(n / 1000)}K" if n >= 1000 else str(n)


def _time(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).isoformat().replace("+00:00", "Z")


def details(facts: ModelFacts) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": facts.arch,
        "families": [facts.arch] if facts.arch else None,
        "parameter_size": parameter_size(facts.parameter_count) if facts.parameter_count else "",
        "quantization_level": facts.quantization,
    }


def _entry(facts: ModelFacts, model_name: str) -> dict[str, Any]:
    name = served_name(model_name)
    return {
        "name": name,
        "model": name,
        "size": facts.size,
        "digest": facts.digest,
        "details": details(facts),
    }


def tags(facts: ModelFacts, model_name: str) -> dict[str, Any]:
    return {"models": [{**_entry(facts, model_name), "modified_at": _time(facts.modified)}]}


def ps(
    facts: ModelFacts,
    model_name: str,
    context_length: int,
    placement: Sequence[Mapping],
    expires_at: float | None = None,
) -> dict[str, Any]:
    """The loaded model; `placement`: the engine's shards (devices, layers); `expires_at`:
    the unix time it is unloaded if still idle (None: kept until the daemon stops)."""
    if expires_at is None:
        expires = datetime.now(UTC) + FOREVER
    else:
        expires = datetime.fromtimestamp(expires_at, UTC)
    entry = {
        **_entry(facts, model_name),
        "expires_at": expires.isoformat().replace("+00:00", "Z"),
        "size_vram": round(facts.size * accelerated_share(placement)),
        "context_length": context_length,
    }
    return {"models": [entry]}


def accelerated_share(placement: Sequence[Mapping]) -> float:
    """The share of the pipeline's layers on devices other than the CPU."""
    total = fast = 0
    for shard in placement:
        layers, devices = shard.get("layers"), shard.get("devices") or []
        if not isinstance(layers, list) or len(layers) != 2:
            continue  # the draft's or the experts' worker
        n = layers[1] - layers[0]
        total += n
        if not all(str(d).startswith("cpu") for d in devices):
            fast += n
    return fast / total if total else 0.0


def capabilities(facts: ModelFacts) -> list[str]:
    """What the model serves, as Ollama names it: an encoder (`attention.causal` false)
    embeds only; a decoder generates and calls tools (and embeds, unlisted, as Ollama's do)."""
    if not facts.metadata.get(f"{facts.arch}.attention.causal", True):
        return ENCODER_CAPABILITIES
    return CAPABILITIES


def show(facts: ModelFacts, template: str, context_length: int) -> dict[str, Any]:
    parameters = {"num_ctx": context_length, **DEFAULTS}
    lines = "\n".join(f"{k:<30} {v}" for k, v in parameters.items())
    modelfile = "\n".join(
        [
            "# Modelfile generated by luced: TEMPLATE is the GGUF's Jinja chat template",
            f"FROM {facts.path}",
            f'TEMPLATE """{template}"""',
            *(f"PARAMETER {k} {v}" for k, v in parameters.items()),
        ]
    )
    return {
        "license": str(facts.metadata.get("general.license", "")),
        "modelfile": modelfile + "\n",
        "parameters": lines,
        "template": template,
        "details": details(facts),
        "model_info": dict(facts.metadata),
        "capabilities": capabilities(facts),
        "modified_at": _time(facts.modified),
    }
