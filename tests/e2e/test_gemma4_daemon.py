"""`luced serve` on a tiny gemma4 GGUF (tokenizer type gemma4, Gemma turns) answers a chat."""

from __future__ import annotations

from pathlib import Path

import openai
from daemon_proc import DaemonProcess

from luced.runtime.tiny import make_tiny_gguf


def test_serve_answers_a_chat_completion(tmp_path: Path) -> None:
    tiny = make_tiny_gguf("gemma4", tmp_path / "tiny-gemma4.gguf").path
    daemon = DaemonProcess(tiny, tmp_path).start()
    try:
        client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(
            model=daemon.model_name,
            messages=[{"role": "user", "content": "Hello world!"}],
            max_tokens=8,
            temperature=0,
        )
        assert out.choices[0].finish_reason in ("length", "stop")
        assert out.usage.completion_tokens >= 1 and out.usage.prompt_tokens > 5
    finally:
        assert daemon.stop() == 0
