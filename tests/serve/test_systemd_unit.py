"""systemd/luced.service: the hardening it promises, read from the unit file itself and,
where this machine has it, scored by `systemd-analyze security`."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "luced.service"

# Settings that cost the daemon nothing: it runs unprivileged and talks through POSIX
# shared memory, unix sockets and loopback TCP.
CHEAP = {
    "RemoveIPC": "yes",
    "CapabilityBoundingSet": "",
    "SystemCallArchitectures": "native",
    "ProtectKernelLogs": "yes",
    "ProtectHostname": "yes",
    "UMask": "0077",
}
# Each of these installs a device allow-list or forbids JIT code: GPU workers would break.
ABSENT = ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock", "MemoryDenyWriteExecute")


def service_section() -> tuple[dict[str, list[str]], list[str]]:
    """The [Service] settings (a key may repeat) and the section's lines."""
    settings: dict[str, list[str]] = {}
    lines: list[str] = []
    section = None
    for line in UNIT.read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service":
            lines.append(line)
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                settings.setdefault(key, []).append(value)
    return settings, lines


def test_cheap_hardening_is_set() -> None:
    settings, _ = service_section()
    for key, value in CHEAP.items():
        assert settings.get(key) == [value], f"{key}={value} missing from {UNIT}"
    for key in ABSENT:
        assert key not in settings, f"{key}= would hide GPU devices or forbid JIT code"


def test_remove_ipc_says_what_else_it_removes() -> None:
    # RemoveIPC= deletes every segment the user owns, not only the unit's: the unit must
    # say so where an admin reads it.
    _, lines = service_section()
    at = lines.index("RemoveIPC=yes")
    comment = []
    for line in reversed(lines[:at]):
        if not line.startswith("#"):
            break
        comment.insert(0, line)
    text = " ".join(comment)
    assert "/dev/shm" in text and "nothing else" in text, text


def analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["systemd-analyze", *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_counts_each_setting() -> None:
    done = analyze("security", "--offline=true", "--json=short", str(UNIT))
    if done.returncode != 0 and "--offline" in done.stderr + done.stdout:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    assert done.returncode == 0, done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    for key in CHEAP:
        found = [c for name, c in checks.items() if name.startswith(f"{key}=")]
        assert found, f"systemd-analyze does not score {key}="
        assert all(c["set"] for c in found), [c for c in found if not c["set"]]
