"""Qwen3.5 beyond the shared family tests (test_families.py): decode after a long prefill
step by step against transformers' own cache, a prompt fed in pieces, the chunked delta rule
against its recurrence, layer split through decode, and every quant type.

Prompts run past the 64-token chunk of the delta rule and the conv window (kernel 4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_hf import hf_model

from luced.runtime.families import qwen35
from luced.runtime.model import Model
from luced.runtime.tiny import TinyModel, make_tiny_gguf

LONG = [(i * 37 + 11) % 500 + 3 for i in range(150)]  # > two chunks of 64
KV_HEADS_DIFFER = {"linear_v_heads": 4, "tied": True}


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module", params=["equal-heads", "kv-heads-differ"])
def tiny(request, tmp_path_factory) -> TinyModel:
    overrides = KV_HEADS_DIFFER if request.param == "kv-heads-differ" else {}
    path = tmp_path_factory.mktemp("qwen35") / f"{request.param}.gguf"
    return make_tiny_gguf("qwen35", path, seed=5, **overrides)


def test_layer_pattern_and_cache_kinds(tiny) -> None:
    model = Model.load(tiny.path)
    assert [model.cfg.is_recurrent(i) for i in range(4)] == [True, True, True, False]
    cache = model.new_cache(32)
    assert [cache.is_recurrent(i) for i in range(4)] == [True, True, True, False]
    assert cache.stored == (3,) and set(cache.k) == {3}
    conv, delta = cache.recurrent_state(0)
    assert conv.shape == (3, model.cfg.conv_channels)  # kernel 4: three inputs kept
    assert delta.shape == (tiny.spec.linear_v_heads, 16, 16) and delta.dtype == torch.float32


def test_prefill_then_decode_matches_transformers_cache(tiny) -> None:
    """130 tokens at once, then 20 one at a time; transformers runs the same with its cache
    (chunked rule for the prefill, recurrent rule per step)."""
    hf, ours = hf_model(tiny), Model.load(tiny.path)
    cache = ours.new_cache(160)
    prefill, steps = LONG[:130], LONG[130:]
    with torch.no_grad():
        out = hf(torch.tensor([prefill]), use_cache=True)
        got = ours.forward(torch.tensor(prefill), cache, 0)
        assert max_rel_err(got, out.logits[0]) <= 1e-4
        past = out.past_key_values
        for i, token in enumerate(steps):
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            got = ours.forward(torch.tensor([token]), cache, len(prefill) + i)
            assert max_rel_err(got, out.logits[0]) <= 1e-4, i
    assert cache.pos == len(LONG)


def test_prompt_in_pieces_equals_whole(tiny) -> None:
    ours = Model.load(tiny.path)
    ids = torch.tensor(LONG)
    whole = ours.forward(ids, ours.new_cache(160), 0)
    cache, pieces, start = ours.new_cache(160), [], 0
    for size in (1, 2, 64, 60, 3, 20):  # splits inside the conv window and across chunks
        pieces.append(ours.forward(ids[start : start + size], cache, start))
        start += size
    assert start == len(LONG)
    assert max_rel_err(torch.cat(pieces), whole) <= 5e-5  # float32 rounding, other chunking
    with torch.no_grad():
        ref = hf_model(tiny)(ids[None]).logits[0]
    assert max_rel_err(torch.cat(pieces), ref) <= 1e-4


@pytest.mark.parametrize(("n", "chunk"), [(1, 64), (5, 64), (64, 64), (130, 64), (37, 8)])
def test_chunked_delta_rule_equals_the_recurrence(n: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(n)
    heads, dk, dv = 3, 8, 5

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k = (torch.nn.functional.normalize(rand(n, heads, dk), dim=-1) for _ in range(2))
    v = rand(n, heads, dv)
    g = -torch.rand(n, heads, generator=gen) * 2  # decays exp(-2)..1
    beta = torch.rand(n, heads, generator=gen)
    state = rand(heads, dk, dv)
    before = state.clone()
    got, got_state = qwen35._delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)
    s, outs = state, []
    for t in range(n):
        o, s = qwen35._delta_rule_step(q[t], k[t], v[t], g[t], beta[t], s)
        outs.append(o)
    torch.testing.assert_close(got, torch.stack(outs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, s, rtol=1e-5, atol=1e-5)
    assert torch.equal(state, before)  # states are never written in place


@pytest.mark.parametrize("cut", [1, 3])
def test_split_equals_unsplit_through_decode(tiny, cut: int) -> None:
    """Shards [0, cut) and [cut, 4), each with its own cache, chain to the whole model,
    bitwise, over a prefill and decode steps."""
    whole = Model.load(tiny.path)
    first, second = Model.load(tiny.path, layers=(0, cut)), Model.load(tiny.path, layers=(cut, 4))
    c0, c1, c2 = whole.new_cache(96), first.new_cache(96), second.new_cache(96)
    assert set(c1.k) == set() and set(c2.k) == {3}
    start = 0
    for piece in (LONG[:70], LONG[70:71], LONG[71:72], LONG[72:75]):
        ids = torch.tensor(piece)
        h, _ = first.forward_layers(first.embed(ids), c1, start)
        h, _ = second.forward_layers(h, c2, start)
        torch.testing.assert_close(second.logits(h), whole.forward(ids, c0, start), rtol=0, atol=0)
        start += len(piece)


@pytest.mark.parametrize(
    "qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
)
def test_quant_types_match_transformers(qtype: str, tmp_path: Path) -> None:
    tiny = make_tiny_gguf(
        "qwen35", tmp_path / f"{qtype}.gguf", seed=1, qtype=qtype, **KV_HEADS_DIFFER
    )
    ids = LONG[:70]
    with torch.no_grad():
        ref = hf_model(tiny)(torch.tensor([ids])).logits[0]
    ours = Model.load(tiny.path)
    assert max_rel_err(ours.forward(torch.tensor(ids), ours.new_cache(80), 0), ref) <= 1e-4


def test_bfloat16_stays_close(tiny) -> None:
    ids = torch.tensor(LONG[:80])
    full, half = Model.load(tiny.path), Model.load(tiny.path, dtype="bfloat16")
    a = full.forward(ids, full.new_cache(96), 0)
    b = half.forward(ids, half.new_cache(96), 0)
    assert half.new_cache(8).recurrent_state(0)[1].dtype == torch.float32  # state stays f32
    # transformers' own bfloat16 strays 0.05-0.07 from its float32 on these models
    assert max_rel_err(b, a) < 0.12
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
