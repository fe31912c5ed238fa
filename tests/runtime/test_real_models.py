"""Both bundled real models against Hugging Face transformers loading the same GGUF.

transformers dequantizes the GGUF itself and undoes llama.cpp's conventions, so it
is an independent oracle for our loader and families. Greedy equality is checked by
teacher forcing: one oracle forward over prompt + our greedy tokens (64; Gemma 3: 32)
must pick each of our tokens as its argmax, which is exactly the condition for its own
greedy decode to produce the same continuation. Logits are compared where the tokens are
generated (the prompt's last position on): each of those attends over the whole prompt,
and a full [positions, vocab] table of Gemma 3's 262k-token head would be ~0.8 GB.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from luced.runtime.model import Model

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
]
N_NEW = 64


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def greedy(model: Model, ids: torch.Tensor, n_new: int) -> list[int]:
    cache = model.new_cache(len(ids) + n_new)
    logits = model.forward(ids, cache, 0)
    out: list[int] = []
    pos = len(ids)
    for _ in range(n_new):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = model.forward(torch.tensor([token]), cache, pos)
        pos += 1
    return out


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def check_against_oracle(path: Path, tok, prompts: list[str], n_new: int = N_NEW) -> None:
    hf = hf_model(path)
    ours = Model.load(path)
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids[0]
        generated = greedy(ours, ids, n_new)
        full = torch.cat([ids, torch.tensor(generated)])
        with torch.no_grad():
            ref = hf(full[None], logits_to_keep=n_new + 1).logits[0].float()
        # The oracle's argmax after each prefix is our next token: same greedy text.
        assert ref[:-1].argmax(-1).tolist() == generated, prompt
        # The same positions' logits from one prefill of the whole sequence, vs the oracle.
        hidden, _ = ours.forward_layers(ours.embed(full), ours.new_cache(len(full)), 0, ids=full)
        logits = ours.logits(hidden[-(n_new + 1) :])
        assert max_rel_err(logits, ref) <= 1e-3, prompt


def test_smollm2_matches_transformers(smollm2_gguf: Path, hf_smol) -> None:
    check_against_oracle(smollm2_gguf, hf_smol, PROMPTS)


def test_gemma3_matches_transformers(gemma3_gguf: Path, hf_gemma) -> None:
    # One prompt runs past the 512-token sliding window of the local layers.
    long_prompt = " ".join(f"Item {i} is a small red box." for i in range(80))
    # Half the tokens: each decode step reads Gemma's 262k-row float32 head (0.7 GB).
    check_against_oracle(gemma3_gguf, hf_gemma, [*PROMPTS, long_prompt], n_new=N_NEW // 2)


def test_smollm2_answers_a_chat_question(smollm2_gguf: Path) -> None:
    from luced.runtime.generate import generate
    from luced.sampling_params import SamplingParams
    from luced.text.chat_template import ChatTemplate
    from luced.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_gguf)
    template = ChatTemplate.from_gguf(smollm2_gguf, "llama")
    text = template.render([{"role": "user", "content": "What is the capital of France?"}])
    prompt = tokenizer.encode(text, add_bos=False, allow_special=True)
    result = generate(
        Model.load(smollm2_gguf), prompt, SamplingParams(temperature=0), 32, tokenizer.eos_ids
    )
    answer = tokenizer.decode(result.tokens)
    assert "Paris" in answer, answer
    assert result.finish_reason == "stop"  # the instruction-tuned model ends its turn
