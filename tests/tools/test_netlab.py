"""tools/netlab.py: a lab killed before its close leaves namespaces, which the next lab
clears; a live process's are kept."""

from __future__ import annotations

import os
import subprocess

import pytest

from tools import netlab


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_namespaces_of_a_dead_creator_are_cleared_and_a_live_ones_kept() -> None:
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"]).returncode != 0:
        pytest.skip("network namespaces need root and iproute2")
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free now (reuse within this test is vanishingly unlikely)
    stale, live = f"luced-{dead.pid}-0a0b0c-b", f"luced-{os.getpid()}-0a0b0c-wire"
    try:
        for ns in (stale, live):
            if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode:
                pytest.skip("network namespaces are not permitted here")
        netlab.clear_stale_namespaces()
        left = _namespaces()
        assert stale not in left
        assert live in left
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
