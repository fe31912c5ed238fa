"""Shared tensor pieces against their reference definitions."""

from __future__ import annotations

import pytest
import torch

from luced.runtime.layers import linear, matrix_rows, store_matrix, yarn_inv_freq, yarn_mscale


@pytest.mark.parametrize(
    ("dim", "base", "factor", "original"),
    [
        (16, 500000.0, 32.0, 128),
        (128, 500000.0, 32.0, 4096),
        (64, 10000.0, 4.0, 2048),
        (8, 1e6, 8, 64),
    ],
)
def test_yarn_matches_transformers(dim: int, base: float, factor: float, original: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="yarn", rope_theta=base, factor=factor)
    rope["original_max_position_embeddings"] = original
    cfg = LlamaConfig(
        hidden_size=dim * 2,
        num_attention_heads=2,
        head_dim=dim,
        max_position_embeddings=int(original * factor),
        rope_parameters=rope,
    )
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    torch.testing.assert_close(yarn_inv_freq(dim, base, factor, original), inv, rtol=0, atol=0)
    assert yarn_mscale(factor) == pytest.approx(scale)


def test_stacked_matrices_keep_the_per_matrix_layout() -> None:
    rows = torch.randn(3, 5, 4)  # [E, out, in]
    for dtype in (torch.float32, torch.bfloat16):
        stored = store_matrix(rows.to(dtype))
        assert torch.equal(matrix_rows(stored), rows.to(dtype))
        x = torch.randn(2, 4).to(dtype)
        torch.testing.assert_close(linear(x, stored[1]), x @ rows[1].to(dtype).T)
