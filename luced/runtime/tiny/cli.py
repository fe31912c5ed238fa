"""The command lines of tools/make_tiny_gguf.py and tools/make_tiny_draft.py.

python tools/make_tiny_gguf.py FAMILY OUT.gguf [--seed S] [--qtype T] [--hf-dir DIR]
                               [--set KEY=VALUE ...]
python tools/make_tiny_draft.py TARGET.gguf OUT_DIR [--seed S] [--layers N]
    [--captures N] [--block-size B] [--sliding-window W --sliding-layers TF..] [--dtype f16]
"""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from luced.runtime.dflash.writer import NP_DTYPES
from luced.runtime.tiny.build import make_tiny_gguf
from luced.runtime.tiny.draft import make_tiny_draft
from luced.runtime.tiny.spec import FAMILIES, QTYPES


def _parse_value(text: str) -> Any:
    """`--set` values: Python literals (8, 1e6, None, True), true/false, else the bare string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"true": True, "false": False}.get(text.lower(), text)


def gguf_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write a tiny random-weight GGUF of a model family, as llama.cpp's "
        "converter would write it."
    )
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--qtype", default="F32", choices=tuple(QTYPES))
    parser.add_argument(
        "--hf-dir", type=Path, help="also write the Hugging Face twin: config.json + safetensors"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a hyperparameter, e.g. --set layers=3 --set rope_scaling=llama3",
    )
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set wants KEY=VALUE, got {item!r}")
        overrides[key.replace("-", "_")] = _parse_value(value)
    try:
        tiny = make_tiny_gguf(args.family, args.out, seed=args.seed, qtype=args.qtype, **overrides)
    except ValueError as exc:  # a bad override: checked before the file is opened
        parser.error(str(exc))
    if args.hf_dir is not None:
        tiny.save_hf(args.hf_dir)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes): {tiny.spec}")


def draft_main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Write a random-weight DFlash draft for a target GGUF, in both layouts "
        "(OUT_DIR/draft.gguf and OUT_DIR/draft/)."
    )
    ap.add_argument("target", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--captures", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--sliding-window", type=int)
    ap.add_argument("--sliding-layers", default="", help="per layer T/F, e.g. TF")
    ap.add_argument("--dtype", choices=sorted(NP_DTYPES), default="f32")
    args = ap.parse_args(argv)
    spec, gguf_path, st_dir = make_tiny_draft(
        args.target,
        args.out_dir,
        seed=args.seed,
        layers=args.layers,
        captures=args.captures,
        block_size=args.block_size,
        sliding_window=args.sliding_window,
        sliding_layers=args.sliding_layers,
        dtype=args.dtype,
    )
    print(json.dumps(asdict(spec) | {"gguf": str(gguf_path), "safetensors": str(st_dir)}))
