"""The torch-free GGUF reader against gguf.GGUFReader, and its errors on bad files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf_samples import write_gguf

from luced.gguf_file import GGUFError, GGUFFile


def test_matches_gguf_reader(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    ours, ref = GGUFFile(path), GGUFReader(path)
    assert ours.arch == "llama"
    assert ours.metadata["test.note"] == "héllo ✓"
    assert ours.metadata["test.words"] == ["a", "bb", "", "ccc"]
    np.testing.assert_array_equal(ours.metadata["test.scores"], [0.5, -1.25, 3.0])
    for tensor in ref.tensors:
        info = ours.info(tensor.name)
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
        np.testing.assert_array_equal(
            ours.raw(tensor.name).reshape(-1), tensor.data.reshape(-1).view(np.uint8)
        )


def test_real_model_tables_match_gguf_reader(smollm2_gguf: Path) -> None:
    ours, ref = GGUFFile(smollm2_gguf), GGUFReader(smollm2_gguf)
    assert ours.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        assert ours.info(t.name).offset == ref.data_offset + int(t.data_offset - ref.data_offset)


def test_truncated_file_names_file_and_tensor(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "full.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFError, match=r"cut\.gguf: truncated file \(tensor 'token_embd"):
        GGUFFile(cut)
    cut.write_bytes(data[:60])
    with pytest.raises(GGUFError, match=r"cut\.gguf: truncated file \(ends inside"):
        GGUFFile(cut)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(GGUFError, match=r"junk\.gguf: not a GGUF file"):
        GGUFFile(path)
    with pytest.raises(GGUFError, match=r"missing\.gguf: cannot open"):
        GGUFFile(tmp_path / "missing.gguf")


def test_unknown_type_id(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    # Tensor info: name, u32 n_dims (2), u64 dims[2], u32 type id, u64 offset.
    type_at = data.index(b"token_embd.weight") + len("token_embd.weight") + 4 + 16
    data[type_at : type_at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(
        GGUFError, match=r"m\.gguf: tensor .token_embd\.weight. has unknown ggml type id 99"
    ):
        GGUFFile(path)


def _sharing_gguf(path: Path, n_layers: int, shared: int, pattern: list[bool] | int) -> Path:
    writer = GGUFWriter(str(path), "gemma4")
    writer.add_block_count(n_layers)
    writer.add_shared_kv_layers(shared)
    writer.add_sliding_window_pattern(pattern)  # type: ignore[arg-type] # an int is a period
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("n", "shared", "pattern", "want"),
    [
        # Gemma 4 E2B's shape, shrunk: 4 sliding then 1 full; the last 4 layers share.
        (10, 4, [(i + 1) % 5 != 0 for i in range(10)], {6: 5, 7: 5, 8: 5, 9: 4}),
        (6, 2, [True, True, False, True, True, False], {4: 3, 5: 2}),
        (6, 2, 3, {4: 3, 5: 2}),  # the same pattern as a period
        (6, 0, 3, {}),
    ],
)
def test_kv_sources(tmp_path: Path, n: int, shared: int, pattern, want: dict) -> None:
    assert GGUFFile(_sharing_gguf(tmp_path / "s.gguf", n, shared, pattern)).kv_sources() == want


def test_kv_sources_errors(tmp_path: Path) -> None:
    path = _sharing_gguf(tmp_path / "s.gguf", 4, 1, [True, True, True, False])
    with pytest.raises(GGUFError, match=r"s\.gguf: KV-shared layer 3 \(full\) has no earlier"):
        GGUFFile(path).kv_sources()
    path = _sharing_gguf(tmp_path / "s.gguf", 4, 1, [True, False])
    with pytest.raises(GGUFError, match="sliding_window_pattern has 2 entries for 4 layers"):
        GGUFFile(path).kv_sources()


def test_layer_counts_are_one_number_or_one_per_layer(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "c.gguf"), "laguna")
    writer.add_block_count(4)
    writer.add_head_count([4, 8, 8, 8])  # laguna's query heads
    writer.add_head_count_kv(2)
    writer.add_array("laguna.feed_forward_length", [64, 64])
    writer.add_array("laguna.note", ["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    gguf = GGUFFile(tmp_path / "c.gguf")
    assert gguf.layer_counts("attention.head_count") == (4, 8, 8, 8)
    assert gguf.layer_counts("attention.head_count_kv") == (2, 2, 2, 2)
    assert gguf.layer_counts("attention.key_length", (16,) * 4) == (16,) * 4
    with pytest.raises(GGUFError, match=r"c\.gguf: missing metadata key 'laguna\.expert_count'"):
        gguf.layer_counts("expert_count")
    with pytest.raises(GGUFError, match="feed_forward_length has 2 entries for 4 layers"):
        gguf.layer_counts("feed_forward_length")
    with pytest.raises(GGUFError, match=r"laguna\.note is not a count"):
        gguf.layer_counts("note")
