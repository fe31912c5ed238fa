"""KV Flash through the real daemon: a prompt six times the pool, over HTTP and lucectl,
under `lru` and under `qk` (the default policy, which recalls paged-out blocks)."""

from __future__ import annotations

import pytest
from daemon_proc import DaemonProcess
from test_daemon import client

FILLER = (
    "The museum opened a new wing for maritime history, with models of sailing ships, "
    "old charts of the northern coast and the logbook of a whaling captain. "
)


@pytest.mark.real_model
@pytest.mark.parametrize("policy", ["lru", "qk"])
def test_long_prompt_over_a_small_pool(smollm2_gguf, tmp_path, policy: str) -> None:
    # lru: sinks + recency, nothing recalled; qk (the default): the prompt's last query
    # reselects the blocks it ranks first, recalling paged-out ones from the host tier.
    d = DaemonProcess(
        smollm2_gguf, tmp_path, "--kv-flash", "512", "--kv-flash-policy", policy,
        env={"LUCED_LOG_LEVEL": "debug"},
    ).start()  # fmt: skip
    try:
        oa = client(d)
        question = "\n\nQuestion: What is the capital of France? Answer in one word."
        content = FILLER * 100 + question
        reply = oa.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            messages=[{"role": "user", "content": content}],
            temperature=0,
            max_tokens=16,
        )
        assert reply.usage.prompt_tokens >= 3000
        text = reply.choices[0].message.content
        assert "paris" in text.lower(), text

        status = d.lucectl_json("status")
        flash = status["kv_flash"]
        assert flash["pool_tokens"] == 512 and flash["policy"] == policy
        assert flash["evictions"] >= 3000 // 64 - 8
        assert (flash["recalls"] > 0) == (policy == "qk")
        # The request ran in a lane of its own (continuous batching), which it gave back
        # when it finished: what is left is its kept prompt's lane, within the kept limit
        # resident, the rest paged out to host records (counted by the status).
        assert flash["sequences"] >= 1 and flash["kept_lanes"] == 1
        assert flash["paged_out_blocks"] > 0 and flash["host_bytes"] > 0
        assert flash["resident_blocks"] + flash["paged_out_blocks"] > 8
        assert "evictions" in d.lucectl("status").stdout
        assert d.metric("luced:kv_flash_evictions_total") == flash["evictions"]
        assert d.metric("luced:kv_flash_recalls_total") == flash["recalls"]
        # The prefix cache keeps the prompt's whole blocks, those paged out included (held
        # as their host records are), not a snapshot.
        listed = d.lucectl_json("snapshot", "list")
        assert listed["snapshots"] == []
        assert listed["blocks"]["memory"] == reply.usage.prompt_tokens // 64
    finally:
        assert d.stop() == 0
    assert d.segments() == []  # no /dev/shm leftovers
