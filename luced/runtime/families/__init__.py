"""Model families by GGUF `general.architecture`; see `common` for the interface."""

from __future__ import annotations

from types import ModuleType

from luced.runtime.families import gemma3, llama, qwen3

FAMILIES: dict[str, ModuleType] = {m.ARCH: m for m in (llama, qwen3, gemma3)}


def family_for(arch: str) -> ModuleType | None:
    return FAMILIES.get(arch)
