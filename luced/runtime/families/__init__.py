"""Model families by GGUF `general.architecture`; see `common` for the interface."""

from __future__ import annotations

from types import ModuleType

from luced.gguf_file import GGUFError, GGUFFile
from luced.runtime.families import (
    bert,
    gemma3,
    gemma4,
    laguna,
    llama,
    qwen3,
    qwen3moe,
    qwen35,
    qwen35moe,
)

FAMILIES: dict[str, ModuleType] = {
    m.ARCH: m for m in (llama, qwen3, gemma3, gemma4, qwen3moe, laguna, qwen35, qwen35moe, bert)
} | {bert.NOMIC: bert}


def family_for(gguf: GGUFFile) -> ModuleType:
    """The family module of a GGUF's architecture; GGUFError naming the file if unknown."""
    family = FAMILIES.get(gguf.arch)
    if family is None:
        raise GGUFError(
            f"{gguf.path}: unknown architecture {gguf.arch!r} "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    return family
