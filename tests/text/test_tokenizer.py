"""luced.text.vocab, .tokenizer and .detokenize against transformers' GGUF tokenizer (the oracle).

The real models cover both vocabulary types: SmolLM2 (byte-level BPE, pre "smollm") and Gemma 3
(SentencePiece with byte fallback, merges derived from file order). Small GGUFs written here
reuse those vocabularies to cover the other paths: the Llama 3 and Qwen2 split regexes and a
plain `llama`-architecture SentencePiece vocabulary (merges from scores, prefix space).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import luced.text.tokenizer as tokmod
from luced.gguf_file import GGUFFile
from luced.text.detokenize import IncrementalDetokenizer
from luced.text.tokenizer import Tokenizer
from luced.text.vocab import TokenizerError, TokenizerSpec, byte_to_char

pytestmark = pytest.mark.real_model

TEXTS = [
    "Hello world",
    "",
    " ",
    " leading space",
    "   three leading spaces and trailing   ",
    "\tTab\tseparated\tvalues\t",
    "line one\nline two\n\n\nafter three newlines\n",
    "windows\r\nline\r\nends",
    "   \n\t  \n \t",
    "mixed   runs\t\t\tof\n\n whitespace  \n",
    "Ünïcödé façade naïve coöperate — “quotes” ‘single’ … ß ∑ ∞",
    "emoji: 😀🎉 family 👩‍👩‍👧‍👦 flag 🇯🇵 heart ❤️ thumbs 👍🏽",
    "CJK: 你好，世界！日本語のテキスト。한국어 텍스트",
    "rare: 𓀀𓀁 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ \U0010fffd",
    "def f(x):\n    return x**2  # square\n\nif __name__ == '__main__':\n\tprint(f(3))\n",
    'fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!("{:?}", v); }',
    "numbers: 1234567890 3.14159 -42 1e-10 0x1F 12,345,678 ٣٤٥",
    "don't won't I'm you're they've HE'LL we'd",
    "Ａｂｃ fullwidth, ﬁ ligature, e\u0301 combining, zero\u200bwidth",
    "special in text: <|im_start|>user\nhi<|im_end|>\n<start_of_turn>model\n<end_of_turn>",
    "<bos>x<eos> <|im_end|>\n",
    "<|endoftext|><|im_start|><end_of_turn><start_of_turn>",
    "a" * 200 + " " + "ab" * 100,
]
SPECIAL_TEXTS = [t for t in TEXTS if "<|im_start|>" in t or "<end_of_turn>" in t]
MODELS = ["smol", "gemma"]


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("luced-cache")


@pytest.fixture(scope="session")
def smol(smollm2_gguf: Path, tokenizer_cache: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf, cache_dir=tokenizer_cache)


@pytest.fixture(scope="session")
def gemma(gemma3_gguf: Path, tokenizer_cache: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_gguf, cache_dir=tokenizer_cache)


@pytest.fixture(params=MODELS)
def pair(request: pytest.FixtureRequest):
    """(ours, transformers') for one real model."""
    name = request.param
    return request.getfixturevalue(name), request.getfixturevalue(f"hf_{name}")


# --- parity with transformers ---------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(pair, text: str) -> None:
    ours, hf = pair
    assert ours.encode(text, allow_special=True) == hf(text)["input_ids"]


@pytest.mark.parametrize("text", SPECIAL_TEXTS)
def test_special_tokens_only_when_allowed(pair, text: str) -> None:
    ours, hf = pair
    allowed = ours.encode(text, allow_special=True)
    plain = ours.encode(text)
    # Without permission, control tokens in text are plain text (user input cannot forge them).
    assert plain == hf(text, split_special_tokens=True)["input_ids"]
    assert set(allowed[1:]) & ours.special_ids
    assert not set(plain[1:]) & ours.special_ids


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special", [True, False])
def test_decode_matches_transformers(pair, text: str, skip_special: bool) -> None:
    ours, hf = pair
    ids = hf(text)["input_ids"]
    assert ours.decode(ids, skip_special=skip_special) == hf.decode(
        ids, skip_special_tokens=skip_special
    )


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(pair, text: str) -> None:
    ours, _ = pair
    # Control tokens written in text encode as plain text, so they survive skip_special=True.
    assert ours.decode(ours.encode(text)) == text
    ids = ours.encode(text, add_bos=False, allow_special=True)
    assert ours.decode(ids, skip_special=False) == text


_TEXT = st.text(
    st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from(list(" \t\n\r  'sdo1234567890éß😀👍🏽你好한<|>_▁\u200b")),
    ),
    max_size=40,
)


@pytest.mark.parametrize("model", MODELS)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(text=_TEXT)
def test_random_text_matches_transformers(request: pytest.FixtureRequest, model: str, text: str):
    ours = request.getfixturevalue(model)
    hf = request.getfixturevalue(f"hf_{model}")
    assert ours.encode(text, allow_special=True) == hf(text)["input_ids"]
    if _representable(ours, text):
        assert ours.decode(ours.encode(text)) == text


def _representable(tok: Tokenizer, text: str) -> bool:
    """Whether decode(encode(text)) can give text back in this vocabulary."""
    byte_ids = _byte_token_ids(tok)
    if tok.backend.token_to_id("<0x41>") is not None:
        return "▁" not in text  # SentencePiece reads "▁" as a space
    # SmolLM2's byte-level vocabulary lacks some bytes (0xF1-0xFF, a few controls), and BPE
    # without an unknown token drops them, in transformers too.
    return all(b in byte_ids for b in text.encode("utf-8"))


def test_smollm2_drops_bytes_its_vocabulary_lacks(smol: Tokenizer, hf_smol) -> None:
    assert 0xF1 not in _byte_token_ids(smol) and 0x41 in _byte_token_ids(smol)
    text = "a\U00040000b"  # UTF-8 F1 80 80 80
    assert smol.encode(text) == hf_smol(text)["input_ids"]
    assert not _representable(smol, text) and smol.decode(smol.encode(text)) != text


def test_named_tokens_match_transformers(pair) -> None:
    ours, hf = pair
    assert ours.bos_id == hf.bos_token_id
    assert ours.eos_id == hf.eos_token_id
    assert ours.unk_id == hf.unk_token_id
    assert ours.pad_id == hf.pad_token_id
    assert ours.vocab_size == len(hf)
    assert ours.special_ids == {hf.convert_tokens_to_ids(t) for t in hf.all_special_tokens} | {
        i for i, t in hf.added_tokens_decoder.items() if t.special
    }
    for i in (0, 1, 5, 300, 1000, ours.vocab_size - 1):
        assert ours.id_to_piece(i) == hf.convert_ids_to_tokens(i)


def _assert_same_model(ours: Tokenizer, hf) -> None:
    """Same BPE vocabulary, merges (in order) and added tokens as transformers built."""
    mine = json.loads(ours.backend.to_str())
    theirs = json.loads(hf.backend_tokenizer.to_str())
    for key in ("vocab", "merges", "byte_fallback", "fuse_unk"):
        assert mine["model"][key] == theirs["model"][key], key

    def added(doc: dict) -> dict:
        return {t["id"]: (t["content"], t["special"], t["normalized"]) for t in doc["added_tokens"]}

    assert added(mine) == added(theirs)


def test_model_matches_transformers(pair) -> None:
    _assert_same_model(*pair)


def test_model_facts(smol: Tokenizer, gemma: Tokenizer) -> None:
    assert smol.eos_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert (smol.bos_id, smol.add_bos, smol.vocab_size) == (1, False, 49152)
    assert smol.id_to_piece(905) == "Ġworld"
    assert smol.encode("a,\n\nb") == [81, 28, 198, 198, 82]  # GPT-2's split ("smollm")
    assert gemma.eos_ids == {1, 106}  # <eos>, <end_of_turn>
    assert (gemma.bos_id, gemma.add_bos, gemma.vocab_size) == (2, True, 262144)
    assert gemma.id_to_piece(105) == "<start_of_turn>"
    assert gemma.encode("hi")[0] == 2 and smol.encode("hi")[0] != 1
    assert gemma.encode("hi", add_bos=False, add_eos=True)[-1] == 1
    with pytest.raises(ValueError, match="out of range"):
        gemma.decode([262144])
    with pytest.raises(ValueError, match="out of range"):
        smol.id_to_piece(-1)


def test_encode_chat_adds_bos_once(smol: Tokenizer, gemma: Tokenizer) -> None:
    prompt = "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert gemma.encode_chat(prompt)[:2] == [2, 105]
    assert gemma.encode_chat("<bos>" + prompt)[:2] == [2, 105]
    assert smol.encode_chat("<|im_start|>user\nhi<|im_end|>\n")[0] == 1  # no BOS, special kept


# --- incremental detokenization -------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_equals_decode(pair, text: str, skip_special: bool) -> None:
    ours, _ = pair
    ids = ours.encode(text, allow_special=True)
    chunks = _stream(ours, ids, skip_special=skip_special)
    assert "".join(chunks) == ours.decode(ids, skip_special=skip_special)
    assert not any("\ufffd" in c for c in chunks if "\ufffd" not in text)


@pytest.mark.parametrize("text", ["emoji 😀🎉👍🏽", "CJK 你好世界", "rare 𓀀𓀁 𝔘𝔫"])
def test_characters_split_across_tokens(pair, text: str) -> None:
    ours, _ = pair
    ids = ours.encode(text, add_bos=False)
    partial = [i for i in ids if _is_partial(ours.token_bytes(i))]
    chunks = _stream(ours, ids)
    assert "".join(chunks) == text
    assert "\ufffd" not in "".join(chunks)
    # A token holding the start of a character emits nothing until the character completes
    # (test_some_character_spans_tokens checks that this case occurs in both vocabularies).
    assert chunks.count("") >= (1 if partial else 0) + 1  # +1: flush() has nothing left


def test_some_character_spans_tokens(smol: Tokenizer, gemma: Tokenizer) -> None:
    """The test above must not skip everywhere: both vocabularies split some character."""
    for tok in (smol, gemma):
        ids = tok.encode("𓀀 你好 😀", add_bos=False)
        assert any(_is_partial(tok.token_bytes(i)) for i in ids)


def _is_partial(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _byte_token_ids(tok: Tokenizer) -> dict[int, int]:
    """byte -> id of its one-byte token (<0xNN>, or GPT-2's byte alphabet) where one exists."""
    if tok.backend.token_to_id("<0x41>") is not None:
        pieces = {b: f"<0x{b:02X}>" for b in range(256)}
    else:
        pieces = byte_to_char()
    ids = {b: tok.backend.token_to_id(p) for b, p in pieces.items()}
    return {b: i for b, i in ids.items() if i is not None}


@pytest.mark.parametrize("model", MODELS)
def test_bytewise_stream_never_breaks_a_character(request, model: str) -> None:
    tok: Tokenizer = request.getfixturevalue(model)
    byte_ids = _byte_token_ids(tok)
    assert len(byte_ids) == (256 if model == "gemma" else 235)
    assert all(tok.token_bytes(i) == bytes([b]) for b, i in byte_ids.items())
    text = "héllo 😀 你好 𓀀 👩‍👧 ∑x"
    ids = [byte_ids[b] for b in text.encode("utf-8")]
    detok = IncrementalDetokenizer(tok)
    out, pos = [], 0
    for i in ids:
        chunk = detok.push(i)
        out.append(chunk)
        assert "\ufffd" not in chunk
        # Each chunk is exactly the next whole characters of the text.
        assert text.startswith(chunk, pos)
        pos += len(chunk)
    assert detok.flush() == "" and "".join(out) == text == tok.decode(ids)
    assert out.count("") == len(text.encode("utf-8")) - len(text)


@pytest.mark.parametrize("model", MODELS)
def test_invalid_bytes_become_replacement_like_decode(request, model: str) -> None:
    tok: Tokenizer = request.getfixturevalue(model)
    byte_ids = _byte_token_ids(tok)
    a = tok.encode("a", add_bos=False)
    cases = [
        [byte_ids[0xF0], byte_ids[0x9F], *a],  # unfinished 4-byte sequence, then text
        [byte_ids[0x80], *a],  # a stray continuation byte
        [*a, byte_ids[0xE4], byte_ids[0xBD]],  # unfinished at the end: flush says so
    ]
    for ids in cases:
        detok = IncrementalDetokenizer(tok)
        chunks = [detok.push(i) for i in ids]
        assert "".join(chunks) + detok.flush() == tok.decode(ids)
        assert "\ufffd" in tok.decode(ids)
    detok = IncrementalDetokenizer(tok)
    assert detok.push(byte_ids[0xE4]) == "" and detok.pending_bytes == 1
    assert detok.flush() == "\ufffd" and detok.pending_bytes == 0


# --- other vocabulary paths, on small GGUFs written here ------------------------------------


def _write_tokenizer_gguf(path: Path, metadata: dict, arch: str = "llama") -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    # transformers reads a model config from the file even for the tokenizer alone.
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(metadata["tokenizer.ggml.tokens"]))
    for key, value in metadata.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        if isinstance(value, np.ndarray):
            writer.add_array(key, value.tolist())
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SYNTH_TEXTS = [
    "Hello world, 12345678 and 3.14159!",
    " leading and  double  spaces\t\ttabs\n\n\nnewlines  ",
    "don't I'M you'LL",
    "😀 你好 𓀀 ñ",
    "<|im_start|>user\nhi<|im_end|> <start_of_turn>",
    "",
    " ",
    "x=1;\r\n  y = [a,b]\n",
]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, smollm2_gguf: Path, gemma3_gguf: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tok-gguf")
    smol_md = dict(GGUFFile(smollm2_gguf).metadata)
    files = {}
    # SmolLM2 has only single digits; a "12" token shows how each regex groups digits.
    smol_md["tokenizer.ggml.tokens"] = [*smol_md["tokenizer.ggml.tokens"], "12"]
    smol_md["tokenizer.ggml.token_type"] = np.append(smol_md["tokenizer.ggml.token_type"], 1)
    smol_md["tokenizer.ggml.merges"] = [*smol_md["tokenizer.ggml.merges"], "1 2"]
    for pre in ("llama-bpe", "qwen2"):
        md = {**smol_md, "tokenizer.ggml.pre": pre}
        files[pre] = _write_tokenizer_gguf(folder / f"{pre}.gguf", md)
    # A SentencePiece vocabulary under the plain llama architecture: Gemma's first 20k tokens
    # plus its single characters (any subset is self-consistent: merges only join tokens that
    # exist). Ids are renumbered; the named special tokens are all in the first 20k.
    gemma_md = GGUFFile(gemma3_gguf).metadata
    tokens = gemma_md["tokenizer.ggml.tokens"]
    keep = np.array([i for i, t in enumerate(tokens) if i < 20000 or len(t) == 1])
    sp_md = {k: v for k, v in gemma_md.items() if k.startswith("tokenizer.ggml.")}
    sp_md["tokenizer.ggml.tokens"] = [tokens[i] for i in keep]
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        sp_md[key] = gemma_md[key][keep]
    sp_md["tokenizer.ggml.add_space_prefix"] = True
    files["spm"] = _write_tokenizer_gguf(folder / "spm.gguf", sp_md)
    return files


@pytest.mark.parametrize("kind", ["llama-bpe", "qwen2", "spm"])
def test_other_vocabularies_match_transformers(
    synthetic, kind: str, tmp_path: Path, hf_tokenizer
) -> None:
    hf = hf_tokenizer(synthetic[kind])
    ours = Tokenizer.from_gguf(synthetic[kind], cache_dir=tmp_path)
    _assert_same_model(ours, hf)
    for text in SYNTH_TEXTS:
        ids = ours.encode(text, allow_special=True)
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert "".join(_stream(ours, ids)) == ours.decode(ids)
    if kind != "spm":
        # Llama 3 splits digits in threes ("123" -> "12" "3"), Qwen2 one by one.
        assert len(ours.encode("12345")) == {"llama-bpe": 4, "qwen2": 5}[kind]
        # Unlike GPT-2's split (SmolLM2's), both keep a newline run after punctuation whole.
        assert ours.encode("a,\n\nb") == [81, 28, 1116, 82]
    if kind == "spm":
        # "hi" is encoded as "▁hi"; decode drops that one prefix space again.
        assert ours.strip_leading_space and ours.encode("hi", add_bos=False) == [
            ours.backend.token_to_id("▁hi")
        ]
        assert ours.decode(ours.encode("hi there")) == "hi there"


def test_byte_level_control_token_outside_the_alphabet(smollm2_gguf: Path) -> None:
    """A control token stored raw (DeepSeek-style "<｜end▁of▁sentence｜>") keeps its own id.

    transformers respells such a token and then appends a duplicate for a named EOS, growing the
    vocabulary past the model's; we deliberately differ (no oracle here).
    """
    md = dict(GGUFFile(smollm2_gguf).metadata)
    eos = "<｜end▁of▁sentence｜>"
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"], eos]
    md["tokenizer.ggml.token_type"] = np.append(md["tokenizer.ggml.token_type"], 3)
    md["tokenizer.ggml.eos_token_id"] = 49152
    tok = Tokenizer.from_metadata(md)
    assert tok.vocab_size == 49153 and tok.eos_id == 49152 and 49152 in tok.eos_ids
    ids = tok.encode(f"Hi{eos}", allow_special=True)
    assert ids == [tok.encode("Hi")[0], 49152]
    assert tok.decode(ids, skip_special=False) == f"Hi{eos}" and tok.decode(ids) == "Hi"
    assert 49152 not in tok.encode(f"Hi{eos}")


def test_encode_is_thread_safe(smol: Tokenizer) -> None:
    """allow_special flips state on the shared backend; concurrent callers must not mix."""
    from concurrent.futures import ThreadPoolExecutor

    text = "x <|im_start|> y " * 200
    with_special, without = smol.encode(text, allow_special=True), smol.encode(text)
    assert with_special != without

    def work(k: int) -> bool:
        allow = k % 2 == 0
        return smol.encode(text, allow_special=allow) == (with_special if allow else without)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(400)))


# --- the cache ------------------------------------------------------------------------------


def test_cache_is_written_once_and_reused(smollm2_gguf: Path, tmp_path: Path, monkeypatch):
    first = Tokenizer.from_gguf(smollm2_gguf, cache_dir=tmp_path)
    files = list((tmp_path / "tokenizers").iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"  # no temp files left behind

    def no_build(spec):
        raise AssertionError("rebuilt despite a cache entry")

    monkeypatch.setattr(tokmod, "build_backend", no_build)
    again = Tokenizer.from_gguf(smollm2_gguf, cache_dir=tmp_path)
    text = TEXTS[11] + TEXTS[14]
    assert again.encode(text, allow_special=True) == first.encode(text, allow_special=True)


def test_corrupt_cache_is_rebuilt(smollm2_gguf: Path, tmp_path: Path) -> None:
    Tokenizer.from_gguf(smollm2_gguf, cache_dir=tmp_path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    entry.write_text('{"truncated": ')
    tok = Tokenizer.from_gguf(smollm2_gguf, cache_dir=tmp_path)
    assert tok.encode("Hello world") == [19556, 905]
    assert entry.read_text().startswith("{") and len(entry.read_text()) > 1_000_000


def test_cache_key_follows_tokenizer_metadata(smollm2_gguf: Path) -> None:
    md = dict(GGUFFile(smollm2_gguf).metadata)
    key = TokenizerSpec.from_metadata(md).cache_key()
    assert TokenizerSpec.from_metadata(dict(md)).cache_key() == key
    md2 = {**md, "tokenizer.ggml.tokens": [*md["tokenizer.ggml.tokens"][:-1], "other"]}
    assert TokenizerSpec.from_metadata(md2).cache_key() != key
    md3 = {**md, "tokenizer.ggml.pre": "qwen2"}
    assert TokenizerSpec.from_metadata(md3).cache_key() != key
    md4 = {**md, "general.name": "renamed"}  # unrelated metadata does not matter
    assert TokenizerSpec.from_metadata(md4).cache_key() == key


def test_bad_metadata_is_a_clear_error(smollm2_gguf: Path) -> None:
    md = dict(GGUFFile(smollm2_gguf).metadata)
    with pytest.raises(TokenizerError, match=r"x\.gguf: unsupported tokenizer type 'rwkv'"):
        TokenizerSpec.from_metadata({**md, "tokenizer.ggml.model": "rwkv"}, "x.gguf")
    with pytest.raises(TokenizerError, match=r"no tokenizer\.ggml\.tokens"):
        TokenizerSpec.from_metadata({"tokenizer.ggml.model": "gpt2"}, "x.gguf")
    with pytest.raises(TokenizerError, match="out of range"):
        TokenizerSpec.from_metadata({**md, "tokenizer.ggml.eos_token_id": 10**6}, "x.gguf")
    with pytest.raises(TokenizerError, match="without merges"):
        TokenizerSpec.from_metadata({**md, "tokenizer.ggml.merges": []}, "x.gguf")


def test_daemon_modules_do_not_import_torch() -> None:
    code = (
        "import sys, luced.text.vocab, luced.text.tokenizer, luced.text.detokenize\n"
        "import luced.text.chat_template\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
