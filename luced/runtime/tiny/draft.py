"""Random-weight DFlash drafts for any target GGUF, in both published layouts.

`make_tiny_draft(target, out_dir, seed=...)` reads the target's hidden size, layer count and
vocabulary from its GGUF and writes the same deterministic (seeded) weights twice, with the
draft writers of `luced.runtime.dflash.writer` (its `random_weights`):

    out_dir/draft.gguf                       convert_dflash_to_gguf.py layout
    out_dir/draft/config.json                z-lab / Hugging Face Qwen3 layout
    out_dir/draft/model.safetensors

Both layouts hold identical values: they are rounded to the spec's dtype first. The
config.json is what transformers' Qwen3Config reads, so `dflash.DFlashDraftModel` can be
built from it as a test oracle.
"""

from __future__ import annotations

from pathlib import Path

from luced.runtime.dflash.writer import (
    DraftSpec,
    random_weights,
    spec_for_target,
    write_gguf,
    write_safetensors,
)


def make_tiny_draft(
    target: str | Path, out_dir: str | Path, **overrides: object
) -> tuple[DraftSpec, Path, Path]:
    """Write both layouts of one random draft for `target` (`overrides`: DraftSpec fields);
    returns (spec, gguf path, safetensors folder)."""
    spec = spec_for_target(target, **overrides)
    weights = random_weights(spec)
    out = Path(out_dir)
    return (
        spec,
        write_gguf(spec, weights, out / "draft.gguf"),
        write_safetensors(spec, weights, out / "draft"),
    )
