"""The DFlash draft: parity with the reference `dflash.DFlashDraftModel` on the same random
weights, both file layouts agreeing, capture layers, load errors, the bundled real models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from luced.gguf_file import GGUFFile
from luced.runtime.dflash.draft import Draft, project_with_target_head
from luced.runtime.dflash.loader import reference_capture_layers
from luced.runtime.dflash.writer import DraftSpec, random_weights, write_gguf, write_safetensors
from luced.runtime.layers import rms_norm
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf

HIDDEN, TARGET_LAYERS = 64, 12
CTX, BLOCK, CTX_START = 12, 16, 5


def _spec(**kw) -> DraftSpec:
    return DraftSpec(hidden=HIDDEN, target_layers=TARGET_LAYERS, vocab_size=300, **kw)


def _write(tmp: Path, spec: DraftSpec, **gguf_kw) -> tuple[Path, Path]:
    weights = random_weights(spec)
    return (
        write_gguf(spec, weights, tmp / "draft.gguf", **gguf_kw),
        write_safetensors(spec, weights, tmp / "draft"),
    )


def _load(path: Path, hidden: int = HIDDEN, n_layers: int = TARGET_LAYERS) -> Draft:
    return Draft.load(path, target_hidden=hidden, target_n_layers=n_layers)


def _inputs(spec: DraftSpec, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(CTX, spec.captures * spec.hidden, generator=g)
    return ctx, torch.randn(BLOCK, spec.hidden, generator=g)


def _reference(folder: Path):
    from dflash import DFlashDraftModel
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    cfg = Qwen3Config.from_pretrained(folder)  # our config.json, read the reference's way
    cfg._attn_implementation = "sdpa"
    model = DFlashDraftModel(cfg).eval()
    model.load_state_dict(load_file(folder / "model.safetensors"), strict=True)
    return model


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


SPECS = {
    "full": {},
    # window 6 < block 16: the window slides across the block; middle layer is global
    "sliding": {"layers": 3, "sliding_window": 6, "sliding_layers": "TFT"},
    # sliding layers without a window (use_sliding_window true, window larger than everything):
    # only causality inside the block differs from a full layer
    "causal-only": {"layers": 2, "sliding_window": 4096, "sliding_layers": "FT"},
}


@pytest.mark.parametrize("name", list(SPECS))
def test_forward_matches_reference(tmp_path: Path, name: str) -> None:
    spec = _spec(seed=11, **SPECS[name])
    _, folder = _write(tmp_path, spec)
    ref = _reference(folder)
    draft = _load(folder)
    assert list(draft.capture_layers) == list(ref.target_layer_ids)
    ctx, noise = _inputs(spec)
    with torch.no_grad():
        expected = ref(
            position_ids=torch.arange(CTX_START, CTX_START + CTX + BLOCK)[None],
            noise_embedding=noise[None],
            target_hidden=ctx[None],
        )[0]
    got = draft.forward(ctx, noise, CTX_START)
    assert got.shape == (BLOCK, HIDDEN)
    assert _rel_err(got, expected) <= 1e-4
    if name != "full":  # the masks matter: treating every layer as full attention is wrong
        full = Draft(
            dataclasses.replace(draft.cfg, sliding_layers=(False,) * spec.layers),
            draft.weights,
            draft.dtype,
            draft.device,
            draft.path,
        )
        assert _rel_err(full.forward(ctx, noise, CTX_START), expected) > 1e-3


def test_block_attention_is_not_causal(tmp_path: Path) -> None:
    # Changing the LAST block row changes the FIRST row's output on full layers.
    spec = _spec(seed=3)
    _, folder = _write(tmp_path, spec)
    draft = _load(folder)
    ctx, noise = _inputs(spec)
    other = noise.clone()
    other[-1] += 1.0
    a, b = draft.forward(ctx, noise, 0), draft.forward(ctx, other, 0)
    assert not torch.allclose(a[0], b[0])


@pytest.mark.parametrize("name", list(SPECS))
def test_blocks_in_one_forward_equal_one_block_each(tmp_path: Path, name: str) -> None:
    # Training's layout: N blocks over the whole sequence's features, each seeing the context
    # before its anchor and itself only, must give what inference computes block by block.
    spec = _spec(seed=12, **SPECS[name])
    _, folder = _write(tmp_path, spec)
    draft = _load(folder)
    g = torch.Generator().manual_seed(1)
    seq, block, anchors = 40, 8, torch.tensor([3, 9, 10, 31])
    ctx = torch.randn(seq, spec.captures * spec.hidden, generator=g)
    noise = torch.randn(len(anchors) * block, spec.hidden, generator=g)
    got = draft.hidden_states(ctx, noise, 0, anchors).view(len(anchors), block, -1)
    for j, a in enumerate(anchors.tolist()):
        alone = draft.forward(ctx[:a], noise[j * block : (j + 1) * block], 0)
        assert _rel_err(got[j], alone) <= 1e-5, j


def test_positions_only_matter_relative(tmp_path: Path) -> None:
    spec = _spec(seed=4, layers=3, sliding_window=6, sliding_layers="TFT")
    gguf_path, _ = _write(tmp_path, spec)
    draft = _load(gguf_path)
    ctx, noise = _inputs(spec)
    window_relative = draft.forward(ctx, noise, 0)
    absolute = draft.forward(ctx, noise, 300)
    assert _rel_err(absolute, window_relative) <= 1e-4


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"gguf": {"aliases": True}},
        {"spec": {"dtype": "f16", "layers": 3, "sliding_window": 6, "sliding_layers": "TFT"}},
    ],
    ids=["plain", "gguf-aliases", "f16-sliding"],
)
def test_gguf_and_safetensors_layouts_agree(tmp_path: Path, variant: dict) -> None:
    spec = _spec(seed=5, **variant.get("spec", {}))
    gguf_path, folder = _write(tmp_path, spec, **variant.get("gguf", {}))
    a, b = _load(gguf_path), _load(folder)
    assert a.cfg.capture_layers == b.cfg.capture_layers == tuple(spec.target_layer_ids)
    assert a.cfg.sliding_layers == b.cfg.sliding_layers
    assert (a.block_size, a.mask_token_id) == (b.block_size, b.mask_token_id) == (16, 299)
    ctx, noise = _inputs(spec)
    assert torch.equal(a.forward(ctx, noise, CTX_START), b.forward(ctx, noise, CTX_START))


def _lucebox_capture_layers(n_layers: int, n: int) -> tuple[int, ...]:
    step = (n_layers - 2) // (n - 1)
    return tuple(1 + k * step for k in range(n))


@pytest.mark.parametrize("n_layers", [64, 48, 40, 32])
def test_capture_layer_formula(n_layers: int) -> None:
    ours = reference_capture_layers(n_layers, 5)
    assert ours == _lucebox_capture_layers(n_layers, 5)
    assert ours[0] == 1 and ours[-1] == n_layers - 3
    assert reference_capture_layers(n_layers, 1) == (n_layers // 2,)


def test_capture_layer_formula_values() -> None:
    assert reference_capture_layers(64, 5) == (1, 16, 31, 46, 61)
    assert reference_capture_layers(32, 5) == (1, 8, 15, 22, 29)
    assert reference_capture_layers(36, 5) == (1, 9, 17, 25, 33)  # z-lab Qwen3-8B draft


def test_capture_layers_from_config_else_formula(tmp_path: Path) -> None:
    spec = _spec(seed=6, capture_layers=(2, 3, 7))
    gguf_path, folder = _write(tmp_path, spec)
    assert _load(gguf_path).capture_layers == _load(folder).capture_layers == (2, 3, 7)
    config = json.loads((folder / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (folder / "config.json").write_text(json.dumps(config))
    assert _load(folder, n_layers=40).capture_layers == reference_capture_layers(40, 3)


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    spec = _spec(seed=7)
    gguf_path, folder = _write(tmp_path, spec)
    for path in (gguf_path, folder):
        with pytest.raises(ValueError, match=rf"{path}.*hidden size 64 .* 128"):
            _load(path, hidden=128)
        with pytest.raises(ValueError, match=rf"{path}.*capture layers .* 4 layers"):
            _load(path, n_layers=4)

    # capture count: metadata / config disagree with the fc input width
    bad = write_gguf(spec, random_weights(spec), tmp_path / "n.gguf", n_target_layers=4)
    with pytest.raises(ValueError, match=rf"{bad}.*4 captured target layers .* 3"):
        _load(bad)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 5]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{folder}.*2 entries .* 3 captures"):
        _load(folder)

    weights = random_weights(spec)
    missing = write_gguf(spec, weights, tmp_path / "m.gguf", drop=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=rf"{missing}.*blk\.1\.ffn_down\.weight"):
        _load(missing)
    st = tmp_path / "missing"
    write_safetensors(spec, weights, st, drop=("layers.1.mlp.down_proj.weight",))
    with pytest.raises(ValueError, match=rf"{st}.*layers\.1\.mlp\.down_proj\.weight"):
        _load(st)


def test_target_gguf_is_not_a_draft(tmp_path: Path) -> None:
    target = make_tiny_gguf("qwen3", tmp_path / "t.gguf", seed=1).path
    with pytest.raises(ValueError, match=rf"{target}.*not a DFlash draft"):
        _load(target)


def test_projection_is_the_head_without_the_final_norm(tmp_path: Path) -> None:
    tiny = make_tiny_gguf("gemma3", tmp_path / "g.gguf", seed=2)
    target = Model.load(tiny.path)
    # Give the target a final softcap: the projection must apply it (gemma2-style configs).
    target.cfg = dataclasses.replace(target.cfg, final_softcap=3.0)
    h = torch.randn(4, target.cfg.hidden, generator=torch.Generator().manual_seed(0))
    normed = rms_norm(h, target.weights["out_norm"], target.cfg.rms_eps)
    projected = project_with_target_head(target, normed)
    assert torch.equal(projected, target.logits(h))
    assert projected.abs().max() <= 3.0
    assert not torch.allclose(project_with_target_head(target, h), target.logits(h))


def _bundled(target: Path, tmp: Path) -> tuple[DraftSpec, Draft, Draft]:
    spec, gguf_path, folder = make_tiny_draft(target, tmp, seed=1, layers=1, captures=3)
    g = GGUFFile(target)
    hidden = int(g.require(f"{g.arch}.embedding_length"))
    n_layers = int(g.require(f"{g.arch}.block_count"))
    return spec, _load(gguf_path, hidden, n_layers), _load(folder, hidden, n_layers)


def test_tiny_draft_for_smollm2(smollm2_gguf: Path, tmp_path: Path) -> None:
    spec, a, b = _bundled(smollm2_gguf, tmp_path)
    assert spec.hidden == 576 and a.capture_layers == reference_capture_layers(30, 3)
    n = GGUFFile(smollm2_gguf).get("llama.block_count")
    target = Model.load(smollm2_gguf, layers=(n - 1, n))  # only the head is needed
    ids = [5, *([a.mask_token_id] * 3)]
    noise = a.noise_embeddings(target, ids)
    ctx = torch.randn(6, 3 * 576, generator=torch.Generator().manual_seed(0))
    h = a.forward(ctx, noise, 0)
    assert torch.equal(h, b.forward(ctx, noise, 0))
    logits = project_with_target_head(target, h)
    assert logits.shape == (4, target.cfg.vocab) and torch.isfinite(logits).all()


def test_tiny_draft_for_gemma3(gemma3_gguf: Path, tmp_path: Path) -> None:
    spec, a, b = _bundled(gemma3_gguf, tmp_path)
    assert spec.hidden == 640 and a.capture_layers == reference_capture_layers(18, 3)
    ctx = torch.randn(6, 3 * 640, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(4, 640, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.forward(ctx, noise, 10), b.forward(ctx, noise, 10))
