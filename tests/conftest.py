"""Shared test setup: offline Hugging Face, cached model paths."""

import os
from pathlib import Path

import pytest

# No network here: transformers must never try a hub download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Imported here, once, on the main thread before any test runs: a first import deep inside
# a test (one that builds a tiny model's twin, say) can be re-entered by a finalizer that
# imports in the middle of it, which Python 3.11's import locks turn into a KeyError (seen
# in CI as "KeyError" from importlib._bootstrap while importing regex).
import transformers  # noqa: F401
from cuda_support import device_under_test


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and device_under_test() is None:
        pytest.skip("needs a CUDA GPU (LUCED_CUDA_TESTS_ON=cpu runs it against the CPU)")


@pytest.fixture(scope="session", autouse=True)
def _one_gguf_reader_per_real_model():
    """transformers opens a GGUF with gguf-py's reader once for the config, once for the
    weights and once for the tokenizer, and each parse of Gemma 3's 262k-token vocabulary
    takes ~15 s. A real model's file (over 64 MB; the tiny ones are far smaller) is parsed
    once per version (path, size, mtime) and its reader, a read-only memory map, shared."""
    import gguf

    plain = gguf.GGUFReader
    shared: dict[tuple[str, int, int], object] = {}

    def reader(path, mode="r"):
        stat = os.stat(path)
        if mode != "r" or stat.st_size < 64 << 20:
            return plain(path, mode)
        key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in shared:
            shared[key] = plain(path, mode)
        return shared[key]

    gguf.GGUFReader = reader
    yield
    gguf.GGUFReader = plain


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from luced.serve.bundled import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    from luced.serve.bundled import gemma3_path

    return gemma3_path()


@pytest.fixture(scope="module")
def host():
    """Host B for workers on other hosts (tests/remote_harness.py): a network namespace,
    else loopback; one per test module."""
    from remote_harness import two_hosts

    with two_hosts() as h:
        yield h


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> Path:
    """A worker key file (mode 0600) for workers on other hosts."""
    from remote_harness import key_file

    return key_file(tmp_path_factory.mktemp("key"))


def load_hf_tokenizer(path: Path):
    """transformers' tokenizer read from the GGUF itself: the oracle for ours."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_tokenizer():
    """The loader of transformers' tokenizer for any GGUF (tests build their own)."""
    return load_hf_tokenizer


# Session-wide, because transformers derives them slowly (Gemma 3: 515k merges, ~15 s).
@pytest.fixture(scope="session")
def hf_smol(smollm2_gguf: Path):
    return load_hf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_gemma(gemma3_gguf: Path):
    return load_hf_tokenizer(gemma3_gguf)
