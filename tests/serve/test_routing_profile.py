"""MoE routing profiles: a recorded profile counts every routed token, survives its file,
and is refused, with the reason, for any other model or when malformed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from luced.gguf_file import GGUFFile
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf
from luced.serve import routing_profile
from luced.serve.routing_profile import ProfileError, RoutingProfile
from tools import moe_profile

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 64], [11, 300, 2]]
DECODED = 3


def tiny(tmp: Path, family: str = "qwen3moe", seed: int = 5) -> Path:
    path = tmp / f"{family}-{seed}.gguf"
    if not path.exists():
        make_tiny_gguf(family, path, seed=seed, qtype="Q8_0")
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("profile")


@pytest.fixture(scope="module")
def recorded(models: Path) -> RoutingProfile:
    return moe_profile.record(Model.load(tiny(models)), PROMPTS, DECODED)


def test_recorded_counts_cover_every_routed_token(models: Path, recorded: RoutingProfile) -> None:
    gguf = GGUFFile(tiny(models))
    k = int(gguf.require("qwen3moe.expert_used_count"))
    assert recorded.tokens == sum(len(p) + DECODED for p in PROMPTS)
    assert sorted(recorded.counts) == list(gguf.moe_layers())
    for counts in recorded.counts.values():
        assert len(counts) == 8 and sum(counts) == recorded.tokens * k


def test_the_file_round_trips_and_matches_its_model(
    models: Path, recorded: RoutingProfile, tmp_path: Path
) -> None:
    path = tmp_path / "p.json"
    path.write_text(recorded.to_json())
    assert routing_profile.load(path, GGUFFile(tiny(models))) == recorded
    assert dict(recorded.to_wire()) == recorded.counts


def edit(doc: dict, what: str) -> None:
    layer = next(iter(doc["counts"]))
    if what == "a layer missing":
        del doc["counts"][layer]
    elif what == "a count missing":
        doc["counts"][layer].pop()
    elif what == "a negative count":
        doc["counts"][layer][0] = -1
    elif what == "another version":
        doc["version"] = 2


@pytest.mark.parametrize(
    ("what", "error"),
    [
        ("a layer missing", "counts for layers"),
        ("a count missing", "7 counts for 8 experts"),
        ("a negative count", "integers >= 0"),
        ("another version", "profile version 2"),
    ],
)
def test_malformed_profiles_are_refused(
    models: Path, recorded: RoutingProfile, tmp_path: Path, what: str, error: str
) -> None:
    doc = json.loads(recorded.to_json())
    edit(doc, what)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=error):
        routing_profile.load(path, GGUFFile(tiny(models)))


def test_files_that_are_no_profile_are_refused(models: Path, tmp_path: Path) -> None:
    gguf = GGUFFile(tiny(models))
    with pytest.raises(ProfileError, match="cannot read"):
        routing_profile.load(tmp_path / "absent.json", gguf)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read"):
        routing_profile.load(tmp_path / "x.json", gguf)
    (tmp_path / "y.json").write_text('{"counts": {}}')
    with pytest.raises(ProfileError, match="not a MoE routing profile"):
        routing_profile.load(tmp_path / "y.json", gguf)


@pytest.mark.parametrize(
    ("family", "seed", "error"),
    [("qwen3moe", 6, "its routers"), ("laguna", 5, "its arch"), ("qwen3", 5, "its arch")],
)
def test_a_profile_of_another_model_is_refused(
    models: Path, recorded: RoutingProfile, tmp_path: Path, family: str, seed: int, error: str
) -> None:
    """Same shapes but other router weights (another seed), another family, no experts."""
    path = tmp_path / "p.json"
    path.write_text(recorded.to_json())
    with pytest.raises(ProfileError, match=f"recorded for another model: {error}"):
        routing_profile.load(path, GGUFFile(tiny(models, family, seed)))
