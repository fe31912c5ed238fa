"""The MoE block on small tensors: routers, expert compute over only the chosen experts, a
hot/cold split that adds up to the whole, the shared expert and its gate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from luced.runtime import moe
from luced.runtime.layers import store_matrix
from luced.runtime.moe import MoeConfig, StackedExperts, expert_mix, route

E, H, FF = 8, 16, 12


def _experts(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """gate, up [E, FF, H] and down [E, H, FF] as [out, in] rows."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((E, FF, H), (E, FF, H), (E, H, FF))
    return tuple((torch.randn(s, generator=g) * 0.3).to(dtype) for s in shapes)


def _reference(x: torch.Tensor, e: int, gate, up, down) -> torch.Tensor:
    return (F.silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e].T


def _stacked(gate, up, down) -> StackedExperts:
    weights = {"0.ffn_gate_exps": store_matrix(gate), "0.ffn_up_exps": store_matrix(up)}
    moe.prepare_layers(weights, [0])
    return StackedExperts(weights["0.ffn_gate_up_exps"], store_matrix(down))


def test_softmax_router_top_k_renormalised_or_not() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.3, 0.0, -0.5, 1.0]])
    probs = logits.softmax(-1)
    ids, w = route(logits, MoeConfig(E, 3, FF, "softmax", normalize=False))
    assert ids.tolist() == [[1, 3, 7]]  # best first
    torch.testing.assert_close(w, probs[:, [1, 3, 7]])
    ids, w = route(logits, MoeConfig(E, 3, FF, "softmax", normalize=True))
    torch.testing.assert_close(w, probs[:, [1, 3, 7]] / probs[:, [1, 3, 7]].sum())
    assert float(w.sum()) == pytest.approx(1.0)
    _, scaled = route(logits, MoeConfig(E, 3, FF, "softmax", normalize=True, scale=2.5))
    torch.testing.assert_close(scaled, 2.5 * w)


def test_sigmoid_bias_changes_the_choice_not_the_weights() -> None:
    logits = torch.tensor([[2.0, 1.8, 1.7, -1.0, 0.0, -2.0, 0.5, 0.1]])
    cfg = MoeConfig(E, 2, FF, "sigmoid", normalize=True, scale=2.0, selection_bias=True)
    ids, w = route(logits, cfg)
    assert ids.tolist() == [[0, 1]]
    bias = torch.zeros(E)
    bias[5] = 1.5  # sigmoid(-2) + 1.5 = 1.62 beats sigmoid(2) = 0.88 and sigmoid(1.8) = 0.86
    ids_b, w_b = route(logits, cfg, bias)
    assert ids_b.tolist() == [[5, 0]]
    scores = logits.sigmoid()[0, [5, 0]]
    torch.testing.assert_close(w_b[0], 2.0 * scores / scores.sum())  # unbiased scores weigh
    assert not torch.equal(w_b, w)


def test_expert_mix_equals_the_dense_sum_and_runs_only_chosen_experts() -> None:
    gate, up, down = _experts()
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[3, 1], [1, 3], [6, 1], [3, 6], [1, 0]])
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(2))
    calls: list[tuple[int, int]] = []
    stacked = _stacked(gate, up, down)

    def recording(expert: int, rows: torch.Tensor) -> torch.Tensor:
        calls.append((expert, rows.shape[0]))
        return stacked(expert, rows)

    class Recording:
        def __len__(self) -> int:
            return E

        __call__ = staticmethod(recording)

    got = expert_mix(x, ids, w, Recording())
    want = torch.stack(
        [
            sum(w[t, i] * _reference(x[t], int(ids[t, i]), gate, up, down) for i in range(2))
            for t in range(5)
        ]
    )
    torch.testing.assert_close(got, want)
    # each chosen expert once, on exactly the rows that chose it; the others never
    assert calls == [(0, 1), (1, 4), (3, 3), (6, 2)]


@pytest.mark.parametrize("n", [1, 7])  # one token (decode's unsorted path) or several
def test_hot_and_cold_sets_add_up_to_all_experts(n: int) -> None:
    """The seam for expert placement: local ids with -1 for the other set's experts."""
    gate, up, down = _experts(seed=3)
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(4))
    logits = torch.randn(n, E, generator=torch.Generator().manual_seed(5))
    ids, w = route(logits, MoeConfig(E, 3, FF, "softmax"))
    hot = [0, 2, 3, 7]
    cold = [e for e in range(E) if e not in hot]
    all_ = _stacked(gate, up, down)
    whole = expert_mix(x, ids, w, all_)
    parts = torch.zeros_like(whole)
    for held in (hot, cold):
        local = torch.full((E,), -1, dtype=torch.long)
        local[held] = torch.arange(len(held))
        subset = _stacked(gate[held], up[held], down[held])
        parts += expert_mix(x, local[ids], w, subset)
    torch.testing.assert_close(parts, whole)
    one_by_one = torch.cat(
        [expert_mix(x[t : t + 1], ids[t : t + 1], w[t : t + 1], all_) for t in range(n)]
    )
    torch.testing.assert_close(one_by_one, whole)
    nothing = expert_mix(x, torch.full_like(ids, -1), w, all_)
    assert torch.equal(nothing, torch.zeros_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gate_up_in_either_matrix_layout(dtype: torch.dtype) -> None:
    gate, up, down = _experts(dtype)
    x = torch.randn(3, H).to(dtype)
    stacked = _stacked(gate, up, down)
    assert len(stacked) == E
    for e in (0, 5):
        torch.testing.assert_close(stacked(e, x), _reference(x, e, gate, up, down))


def test_moe_ffn_with_bias_shared_expert_and_its_gate() -> None:
    gate, up, down = _experts(seed=6)
    g = torch.Generator().manual_seed(7)
    router, bias = torch.randn(E, H, generator=g), torch.randn(E, generator=g) * 0.1
    sh = [torch.randn(s, generator=g) * 0.3 for s in ((FF, H), (FF, H), (H, FF))]
    sh_gate = torch.randn(H, generator=g)
    x = torch.randn(4, H, generator=g)
    weights = {"2.ffn_gate_inp": store_matrix(router), "2.exp_probs_b": bias}
    weights |= {"2.ffn_gate_exps": store_matrix(gate), "2.ffn_up_exps": store_matrix(up)}
    weights |= {"2.ffn_down_exps": store_matrix(down), "2.ffn_gate_inp_shexp": sh_gate}
    weights |= {
        f"2.ffn_{n}_shexp": store_matrix(t) for n, t in zip(("gate", "up", "down"), sh, strict=True)
    }
    moe.prepare_layers(weights, [2])
    cfg = MoeConfig(E, 2, FF, "sigmoid", True, 1.5, True, FF, True)
    ids, w = route(x @ router.T, cfg, bias)
    routed = torch.stack(
        [
            sum(w[t, i] * _reference(x[t], int(ids[t, i]), gate, up, down) for i in range(2))
            for t in range(4)
        ]
    )
    shared = (F.silu(x @ sh[0].T) * (x @ sh[1].T)) @ sh[2].T
    want = routed + shared * torch.sigmoid(x @ sh_gate)[:, None]
    torch.testing.assert_close(moe.moe_ffn(x, weights, 2, cfg), want)


def test_config_rejects_impossible_routing() -> None:
    with pytest.raises(ValueError, match="9 experts used per token of 8"):
        MoeConfig(8, 9, FF)
    with pytest.raises(ValueError, match="unknown expert gating"):
        MoeConfig(8, 2, FF, "softplus")
