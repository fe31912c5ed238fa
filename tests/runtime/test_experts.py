"""Expert placement: hot and cold sets partition every layer's experts with one index
convention on both sides, the fingerprint follows the hot ids, and a model with half its
experts cold (computed in process) gives the all-local logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from luced.gguf_file import GGUFFile
from luced.runtime import experts
from luced.runtime.model import Model
from luced.runtime.qlinear import PackedLinear
from luced.runtime.tiny import make_tiny_gguf

MOE_FAMILIES = ["qwen3moe", "qwen35moe", "laguna", "gemma4"]
# gemma4's MoE block is optional: on, with the other families' tiny expert sizes
OVERRIDES = {"gemma4": {"experts": 8, "experts_used": 2, "expert_ffn": 32}}
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2]
STACKS = ("ffn_gate_up_exps", "ffn_down_exps")  # a loaded MoE layer's (gate and up fused)


@st.composite
def placements(draw) -> tuple[experts.Placement, int, dict[int, list[int]]]:
    e = draw(st.integers(1, 40))
    layers = draw(st.lists(st.integers(0, 60), unique=True, max_size=6))
    hot = draw(st.integers(0, e))
    profile = {}
    for layer in layers:
        if draw(st.booleans()):
            profile[layer] = draw(st.lists(st.integers(0, 5), min_size=e, max_size=e))
    return experts.plan(e, layers, hot, profile), hot, profile


def highest_ids_most_routed(path: Path) -> dict[int, tuple[int, ...]]:
    """A routing profile whose most routed experts are the highest ids (the opposite of the
    default choice)."""
    gguf = GGUFFile(path)
    n = int(gguf.require(f"{gguf.arch}.expert_count"))
    return {layer: tuple(range(n)) for layer in gguf.moe_layers()}


@given(placements())
def test_hot_and_cold_partition_the_experts_with_one_index_convention(case) -> None:
    placement, hot, profile = case
    remote = placement.inverted()
    assert remote.inverted() == placement
    for layer in placement.layers:
        mine, cold = placement.hot[layer], placement.cold(layer)
        assert len(mine) == hot
        assert set(mine).isdisjoint(cold)
        assert sorted(mine + cold) == list(range(placement.n_experts))
        assert list(cold) == sorted(cold) and list(mine) == sorted(mine)
        # local index i on the cold side is the remote's hot index i: the same global expert
        assert remote.hot[layer] == cold
        table = experts.local_index(cold, placement.n_experts)
        for i, e in enumerate(cold):
            assert int(table[e]) == i and remote.hot[layer][i] == e
        assert all(int(table[e]) == -1 for e in mine)
        # the most routed are hot (an equal count: the lower id), else the lowest ids
        counts = profile.get(layer, [-e for e in range(placement.n_experts)])
        assert all((counts[h], -h) > (counts[c], -c) for h in mine for c in cold)
    assert experts.Placement.from_wire(placement.to_wire()) == placement


def test_profile_keeps_the_most_routed_experts() -> None:
    p = experts.plan(6, [0, 1], 2, {1: [0, 9, 1, 9, 5, 0]})
    assert p.hot == {0: (0, 1), 1: (1, 3)}  # layer 0 has no profile: lowest ids


def test_fingerprint_follows_layers_counts_and_every_hot_id() -> None:
    base = experts.plan(8, [1, 2, 3], 4)
    assert base.fingerprint() == experts.plan(8, [3, 2, 1], 4).fingerprint()
    changed = dict(base.hot)
    changed[2] = (0, 1, 2, 5)
    assert experts.Placement(8, changed).fingerprint() != base.fingerprint()
    assert experts.plan(8, [1, 2], 4).fingerprint() != base.fingerprint()
    assert experts.plan(9, [1, 2, 3], 4).fingerprint() != base.fingerprint()
    assert experts.plan(8, [1, 2, 3], 3).fingerprint() != base.fingerprint()


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="hot experts"):
        experts.plan(8, [0], 9)
    with pytest.raises(ValueError, match="ascending"):
        experts.Placement(8, {0: (3, 1)})
    with pytest.raises(ValueError, match="profile"):
        experts.plan(8, [0], 2, {0: [1, 2]})


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def tiny(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param) / "m.gguf"
    make_tiny_gguf(request.param, path, seed=5, qtype="Q8_0", **OVERRIDES.get(request.param, {}))
    return path


def greedy(model: Model, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits (one prefill call per layer) and n greedy decode steps."""
    cache = model.new_cache(len(ids) + n)
    logits = model.forward(torch.tensor(ids), cache, 0)
    first, out = logits, []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(torch.tensor(out[-1:]), cache, len(ids) + len(out) - 1)
    return first, out


def placed(
    path: Path,
    hot: int,
    *,
    layers: tuple[int, int] | None = None,
    profile: dict[int, list[int]] | None = None,
    weights: str = "dequant",
    **route: Any,
) -> tuple[Model, experts.Placement]:
    """A model (shard) loaded with only its `hot` experts per layer, the cold ones routed
    as `route` (`experts.place`'s cold, required) says; and the placement."""
    placement = experts.plan_for(path, hot, profile)
    assert placement is not None
    model = Model.load(path, layers=layers, experts=placement.hot, weights=weights)
    experts.place(model, placement, **route)
    return model, placement


def test_hot_only_load_equals_a_full_load_cut_to_the_hot_experts(tiny: Path) -> None:
    """The oracle: every expert loaded, then the stacks cut to the hot rows (index_select);
    loading only the hot rows gives the same tensors and so the very same logits."""
    first = GGUFFile(tiny).moe_layers()[0]
    split, placement = placed(tiny, 3, profile={first: [5, 0, 9, 1, 7, 7, 0, 2]})
    assert placement.hot[first] == (2, 4, 5)  # the profile's, not the lowest ids
    cut = Model.load(tiny)
    assert split.weights.keys() == cut.weights.keys()
    stacks = {f"{layer}.{s}": layer for layer in placement.layers for s in STACKS}
    for key, tensor in cut.weights.items():
        if key in stacks:
            keep = torch.tensor(placement.hot[stacks[key]])
            cut.weights[key] = tensor = tensor.index_select(0, keep).contiguous()
        assert torch.equal(split.weights[key], tensor), key  # routers and the rest: whole
    experts.place(cut, placement)
    want_logits, want = greedy(cut, PROMPT, 4)
    got_logits, got = greedy(split, PROMPT, 4)
    assert torch.equal(got_logits, want_logits) and got == want


def test_place_refuses_a_model_loaded_with_every_expert(tiny: Path) -> None:
    placement = experts.plan_for(tiny, 4)
    assert placement is not None
    with pytest.raises(ValueError, match=r"experts=placement\.hot"):
        experts.place(Model.load(tiny), placement)


def test_read_experts_touches_only_the_named_rows(tiny: Path) -> None:
    model = Model.load(tiny)
    gguf = GGUFFile(tiny)
    layer = gguf.moe_layers()[-1]
    ids = [1, 4, 6]
    got = experts.read_experts(gguf, layer, ids, model.cfg.moe, torch.float32)
    torch.testing.assert_close(got.gate_up, model.weights[f"{layer}.ffn_gate_up_exps"][ids])
    torch.testing.assert_close(got.down, model.weights[f"{layer}.ffn_down_exps"][ids])


@pytest.mark.parametrize(("hot", "weights"), [(4, "dequant"), (0, "dequant"), (4, "int8")])
def test_cold_experts_in_process_equal_all_local(tiny: Path, hot: int, weights: str) -> None:
    """Packed (int8) too: every expert packed alike on both sides, so hot + cold is the
    packed all-local model's mix."""
    local = Model.load(tiny, weights=weights)
    split, placement = placed(tiny, hot, weights=weights)
    n = local.cfg.moe.n_experts
    assert not placement.all_hot and placement.layers
    assert len(split.weights[f"{placement.layers[0]}.ffn_gate_up_exps"]) == hot
    want_logits, want = greedy(local, PROMPT, 8)
    got_logits, got = greedy(split, PROMPT, 8)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert got == want
    assert split.expert_split.stats["cold_calls"] > 0 and n > hot


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_packed_experts_stay_close_to_dequantized(tmp_path: Path, weights: str) -> None:
    """Each expert's matrices packed for the weight-only kernels (Q4_0 blocks are int4 block
    for block; int8 requantizes them) against the exact float experts."""
    path = make_tiny_gguf("qwen3moe", tmp_path / "m.gguf", seed=5, qtype="Q4_0").path
    gguf, cfg = GGUFFile(path), Model.load(path).cfg
    layer, ids = gguf.moe_layers()[-1], [1, 4, 6]
    exact = experts.read_experts(gguf, layer, ids, cfg.moe, torch.float32)
    packed = experts.read_experts(gguf, layer, ids, cfg.moe, torch.float32, weights=weights)
    assert all(isinstance(m, PackedLinear) for m in [*packed.gate_up, *packed.down])
    x = torch.randn(5, cfg.hidden, generator=torch.Generator().manual_seed(0))
    for e in range(len(ids)):
        want, got = exact(e, x), packed(e, x)
        assert (got - want).norm() / want.norm() < 0.03, (weights, e)


def test_load_frame_places_the_experts(tiny: Path) -> None:
    from luced.ipc import frames as F
    from luced.runtime.backend import Backend

    gguf = GGUFFile(tiny)
    n_layers = int(gguf.require(f"{gguf.arch}.block_count"))
    backend = Backend("cpu", ("cpu",))
    backend.hello(F.Hello(instance="t0"))
    req = dict(model=str(tiny), layers=(0, n_layers), dtype="float32", devices=("cpu",))
    req |= dict(kv_capacity=64, owns_embed=True, owns_head=True)
    assert backend.load(F.Load(**req)).moe_fingerprint == ""  # default: all experts local
    reply = backend.load(F.Load(**req, moe_hot=4))
    layers = gguf.moe_layers()
    assert reply.moe_fingerprint == experts.plan(8, layers, 4).fingerprint()
    model = backend.loaded.shards[0].model
    assert model.weights[f"{layers[0]}.ffn_down_exps"].shape[0] == 4
    assert backend.stats(F.Stats()).stats["moe_cold_calls"] == 0
    backend.close()
