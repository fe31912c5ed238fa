"""A real `luced serve --target-devices cpu,cpu:1`: SmolLM2 split over two worker processes.

One daemon for the whole story (start-up is the slow part): placement shown by lucectl,
greedy text equal to the unsplit in-process run, then kill -9 of the second worker in
the middle of a decode: that request fails, the worker comes back with the same layer
range while the first keeps its weights (same pid), the next request is right again,
and no shared-memory segment survives the daemon.
"""

from __future__ import annotations

import json
import os
import signal

import openai
import pytest
from daemon_proc import DaemonProcess
from test_daemon import client, generate_tool, long_stream, raw_post

pytestmark = pytest.mark.real_model


def shards(d: DaemonProcess) -> list[dict]:
    return d.lucectl_json("status")["placement"]


def test_split_daemon_end_to_end(smollm2_gguf, tmp_path) -> None:
    d = DaemonProcess(smollm2_gguf, tmp_path, "--target-devices", "cpu,cpu:1").start()
    try:
        before = shards(d)
        assert [(s["group"], s["devices"], s["layers"]) for s in before] == [
            ("cpu", ["cpu"], [0, 15]),
            ("cpu:1", ["cpu:1"], [15, 30]),
        ]
        assert before[0]["pid"] != before[1]["pid"]
        text = d.lucectl("status").stdout
        assert "cpu [cpu]: [0, 15); cpu:1 [cpu:1]: [15, 30)" in text
        assert str(before[1]["pid"]) in text

        prompt = "The capital of France is"
        expect = generate_tool(smollm2_gguf, prompt)["text"]  # unsplit, in-process
        out = client(d).completions.create(
            model=d.model_name, prompt=prompt, max_tokens=24, temperature=0
        )
        assert out.choices[0].text == expect

        stream = long_stream(d)
        it = iter(stream)
        next(it)
        os.kill(before[1]["pid"], signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in it:
                pass
        d.wait_health(503, 10)
        d.wait_health(200, 60)
        after = shards(d)
        assert after[0]["pid"] == before[0]["pid"]  # the survivor kept its weights
        assert after[1]["pid"] != before[1]["pid"] and after[1]["layers"] == [15, 30]
        assert after[1]["restarts"] == 1
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        status, _, reply = raw_post(d, "/v1/completions", json.dumps(body).encode())
        assert status == 200 and reply["choices"][0]["text"] == expect
    finally:
        assert d.stop() == 0
    assert d.segments() == []
