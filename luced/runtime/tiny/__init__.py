"""Tiny random-weight GGUF models, written as llama.cpp's converter would, with the Hugging
Face twin each one converts: the models of the parity tests, the benchmarks and the GPU
check (`tools/make_tiny_gguf.py`), built from the runtime's own dependencies.

    tiny = make_tiny_gguf("gemma3", tmp_path / "g.gguf", seed=1, qtype="Q8_0")
    tiny.path, tiny.spec                  # the file and every hyperparameter (spec.TinySpec)
    tiny.hf_config, tiny.state_dict       # the twin: its config.json and float32 weights
    _, draft, _ = make_tiny_draft(tiny.path, tmp_path / "draft", seed=3)   # draft.py

Families: `llama`, `qwen3`, `gemma3` (build.py), the hybrids `qwen35` and `qwen35moe`
(qwen35.py), the MoE families `qwen3moe` and `laguna` (moe.py), `gemma4` (gemma4.py) and
the encoders `bert` and `nomic-bert` (bert.py: their twin is an encoder, not a
*ForCausalLM, and they serve embeddings only; DECODERS are the rest). The tests build
transformers' model from the twin (tests/tiny_hf.py) and compare.

The file follows llama.cpp's `convert_hf_to_gguf.py` for the same HF model: gguf-py's tensor
names, the metadata keys its TextModel / family classes write, and its tensor conventions:
llama Q/K rows permuted per head to the interleaved RoPE layout, `rope_freqs.weight` for Llama-3
rope scaling (and no other key), no `output.weight` when tied; gemma3 `*norm.weight` stored as
1 + w; 1-D tensors in F32, every 2-D weight (embeddings and head too) in `qtype`. The state dict
is derived from the stored bytes (dequantize, undo the conventions), so it is exactly what a GGUF
reader gets, for every qtype.

Row sizes (hidden, ffn, heads * head_dim) must be multiples of 32 for Q8_0/Q4_0/Q4_1/Q5_0 and of
256 for Q4_K/Q5_K/Q6_K; with a K-quant the defaults become hidden 256, ffn 512, head_dim 64
(qwen3: 128). Vocabularies: vocab.py. For gemma3, llama.cpp scales scores by 1/sqrt(head_dim),
so query_pre_attn_scalar = head_dim here, and the local RoPE base is 10000 (hard-coded in
llama.cpp).
"""

from luced.runtime.tiny.build import make_tiny_gguf
from luced.runtime.tiny.draft import make_tiny_draft
from luced.runtime.tiny.spec import DECODERS, ENCODERS, FAMILIES, QTYPES, TinyModel, TinySpec

__all__ = [
    "DECODERS",
    "ENCODERS",
    "FAMILIES",
    "QTYPES",
    "TinyModel",
    "TinySpec",
    "make_tiny_draft",
    "make_tiny_gguf",
]
