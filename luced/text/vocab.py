"""The vocabulary a GGUF file describes, rebuilt as a `tokenizers` object (torch-free).

A GGUF carries no tokenizer.json. It stores the vocabulary, merges or scores, token types and
special ids as metadata under llama.cpp's key names. We rebuild the tokenizer with the Rust
`tokenizers` library the way transformers' GGUF loader does (our oracle in the tests):

    tokenizer.ggml.model = "gpt2"   byte-level BPE; merges from the file; text split by the
                                    regex named by tokenizer.ggml.pre (GPT-2's by default)
    tokenizer.ggml.model = "llama"  SentencePiece BPE with byte fallback (<0xNN> tokens); no
                                    merges in the file, so they are derived from the vocabulary:
                                    by score, or for Gemma by file order
    tokenizer.ggml.model = "gemma4" Gemma 4's SentencePiece BPE as llama.cpp's converter writes
                                    it: merges in the file, byte fallback, no pre-tokenizer
                                    key; text is one BPE word with " " read as "▁" (as Gemma)
    tokenizer.ggml.model = "bert"   BERT's WordPiece, stored in "phantom space" form: a piece
                                    that starts a word is "▁piece", one that continues a word
                                    is bare ("##piece" in BERT's own vocab.txt), [CLS]-style
                                    tokens as they are. Text is lowercased, accents stripped
                                    and split on whitespace and punctuation as uncased BERT
                                    does (llama.cpp lowercases every WordPiece vocabulary too);
                                    [CLS] and [SEP] are the file's BOS and EOS, added around it

Control tokens (type 3) become special added tokens: matched whole in text only when the caller
allows special tokens, and dropped by `decode(skip_special=True)`. User-defined tokens (type 4,
e.g. Gemma's runs of newlines) are always matched whole, as llama.cpp does.

Deriving merges for Gemma's 262k vocabulary takes seconds; `luced.text.tokenizer` caches the result.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

log = logging.getLogger(__name__)

# Bump whenever the builder's output would change, so stale cache entries are never loaded.
BUILD_VERSION = 1

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# Split regexes per tokenizer.ggml.pre (llama.cpp's names). Anything else uses GPT-2's split,
# built into the ByteLevel pre-tokenizer; SmolLM2 ("smollm") is one of those.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 differs from Llama 3 only in splitting digits one by one.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEX_BY_PRE: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
}
_GPT2_SPLIT_PRE = frozenset({"default", "gpt2", "smollm", "gpt-2"})

# Gemma files store runs of spaces as real spaces and list no merges; their merge order is the
# file order of the vocabulary, not the scores.
_GEMMA_ARCHES = frozenset({"gemma", "gemma2", "gemma3"})

# End-of-turn tokens that end generation besides the file's eos (as llama.cpp treats them),
# counted only when the file marks them special.


class TokenizerError(ValueError):
    """The file's tokenizer metadata is missing, malformed or of an unsupported kind."""


def byte_to_char() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters, used by every byte-level vocabulary.

    Printable non-space Latin-1 bytes stand for themselves; the other 68 bytes (controls, space,
    0x7F-0xA0, 0xAD) get U+0100, U+0101, ... in byte order.
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(0x100 + extra)
            extra += 1
    return spelling


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer metadata of one GGUF, checked and typed."""

    source: str  # the file, for error messages
    model: str  # "gpt2" | "llama" | "gemma4" | "bert"
    pre: str | None
    arch: str
    tokens: list[str]
    token_types: np.ndarray  # [vocab] int32; NORMAL where the file has none
    scores: np.ndarray | None  # [vocab] float32
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    extra_eos_ids: tuple[int, ...]  # tokenizer.ggml.eot_token_id / eom_token_id
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], source: str = "<metadata>"
    ) -> TokenizerSpec:
        def get(key: str, default: Any = None) -> Any:
            return metadata.get(f"tokenizer.ggml.{key}", default)

        model = get("model")
        if model is None:
            raise TokenizerError(f"{source}: no tokenizer.ggml.model in metadata")
        if model not in ("gpt2", "llama", "gemma4", "bert"):
            raise TokenizerError(
                f"{source}: unsupported tokenizer type {model!r} "
                "(supported: gpt2, llama, gemma4, bert)"
            )
        tokens = get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerError(f"{source}: no tokenizer.ggml.tokens in metadata")
        n = len(tokens)
        types = get("token_type")
        types = np.full(n, NORMAL, np.int32) if types is None else np.asarray(types, np.int32)
        scores = get("scores")
        scores = None if scores is None else np.asarray(scores, np.float32)
        merges = get("merges")
        if len(types) != n or (scores is not None and len(scores) != n):
            raise TokenizerError(f"{source}: token_type/scores length differs from tokens ({n})")
        if model in ("gpt2", "gemma4") and not merges:
            raise TokenizerError(f"{source}: {model} BPE vocabulary without merges")
        if model == "llama" and not merges and scores is None:
            raise TokenizerError(
                f"{source}: SentencePiece vocabulary with neither merges nor scores"
            )

        def token_id(key: str) -> int | None:
            value = get(key)
            if value is None:
                return None
            if not 0 <= int(value) < n:
                raise TokenizerError(f"{source}: tokenizer.ggml.{key}={value} is out of range")
            return int(value)

        extra = tuple(i for k in ("eot_token_id", "eom_token_id") if (i := token_id(k)) is not None)
        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        if model == "bert":  # older converters name only [SEP]; [CLS] opens every input
            bos = bos if bos is not None else _find(tokens, "[CLS]")
            eos = eos if eos is not None else token_id("seperator_token_id")  # (sic)
        wordpiece = model == "bert"
        return cls(
            source=source,
            model=model,
            pre=get("pre"),
            arch=str(metadata.get("general.architecture", "")),
            tokens=tokens,
            token_types=types,
            scores=scores,
            merges=list(merges) if merges else None,
            bos_id=bos,
            eos_id=eos,
            unk_id=token_id("unknown_token_id"),
            pad_id=token_id("padding_token_id"),
            extra_eos_ids=extra,
            # llama.cpp (and transformers) add BOS to SentencePiece vocabularies that do not say,
            # and [CLS] ... [SEP] around a WordPiece input.
            add_bos=bool(get("add_bos_token", model == "llama" or wordpiece)),
            add_eos=bool(get("add_eos_token", get("add_sep_token", wordpiece))),
            add_space_prefix=bool(get("add_space_prefix", True)),
        )

    @property
    def is_gemma(self) -> bool:
        return self.model == "llama" and self.arch in _GEMMA_ARCHES

    @property
    def whole_text_word(self) -> bool:
        """Gemma's SentencePiece: no pre-split, spaces read as "▁" by a normalizer."""
        return self.is_gemma or self.model == "gemma4"

    @property
    def strips_leading_space(self) -> bool:
        """SentencePiece with a prefix space: encode adds "▁" in front, decode drops one space
        (a WordPiece text's first word is "▁word" too)."""
        return (self.model == "llama" and not self.is_gemma and self.add_space_prefix) or (
            self.model == "bert"
        )

    def cache_key(self) -> str:
        """A hash of everything the built tokenizer depends on."""
        h = hashlib.sha256()

        def put(data: bytes) -> None:
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)

        put(
            f"{BUILD_VERSION}|{tokenizers.__version__}|{self.model}|{self.pre}|{self.is_gemma}|"
            f"{self.add_space_prefix}|{self.bos_id}|{self.eos_id}|{self.unk_id}|{self.pad_id}".encode()
        )
        for strings in (self.tokens, self.merges or []):
            put("\0".join(strings).encode("utf-8", "surrogatepass"))
            put(np.fromiter(map(len, strings), np.int64, len(strings)).tobytes())
        put(self.token_types.tobytes())
        put(b"" if self.scores is None else self.scores.tobytes())
        return h.hexdigest()[:40]


# --- building ------------------------------------------------------------------------------


def build_backend(spec: TokenizerSpec) -> tokenizers.Tokenizer:
    """The `tokenizers` object for a spec (slow for big SentencePiece vocabularies)."""
    build = {"gpt2": _byte_level, "bert": _wordpiece}.get(spec.model, _sentencepiece)
    try:
        backend = build(spec)
        _add_added_tokens(backend, spec)
    except TokenizerError:
        raise
    except Exception as exc:  # tokenizers reports bad vocab/merges as plain exceptions
        raise TokenizerError(f"{spec.source}: cannot build the tokenizer: {exc}") from exc
    return backend


def _split_merges(spec: TokenizerSpec) -> list[tuple[str, str]]:
    pairs = []
    for merge in spec.merges or ():
        parts = merge.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"{spec.source}: malformed merge {merge!r}")
        pairs.append((parts[0], parts[1]))
    return pairs


def _byte_level(spec: TokenizerSpec) -> tokenizers.Tokenizer:
    spelling = byte_to_char()
    alphabet = frozenset(spelling.values())
    vocab: dict[str, int] = {}
    for i, (token, ttype) in enumerate(zip(spec.tokens, spec.token_types.tolist(), strict=True)):
        if not set(token) <= alphabet and ttype not in (CONTROL, USER_DEFINED):
            # A normal token stored in plain UTF-8: respell it in the byte alphabet.
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        # Control/user tokens outside the alphabet (e.g. DeepSeek's "<｜begin▁of▁sentence｜>")
        # keep their raw spelling so the added token below finds its own id. transformers
        # respells and skips them instead, and then appends a duplicate for a named BOS/EOS.
        vocab[token] = i
    bpe = models.BPE(
        vocab=vocab,
        merges=_split_merges(spec),
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = tokenizers.Tokenizer(bpe)
    split = SPLIT_REGEX_BY_PRE.get(spec.pre or "")
    if split is None:
        if spec.pre not in _GPT2_SPLIT_PRE and spec.pre is not None:
            log.warning("%s: unknown pre-tokenizer %r, splitting like GPT-2", spec.source, spec.pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(spec: TokenizerSpec) -> tokenizers.Tokenizer:
    tokens = spec.tokens
    if spec.is_gemma:
        # Gemma stores a token of spaces as spaces, but text is looked up after " " -> "▁".
        tokens = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: i for i, token in enumerate(tokens)}
    if spec.merges:
        merges = _split_merges(spec)
    else:
        if spec.is_gemma:
            # Gemma's scores do not follow its merge order; the file order does.
            rank: Mapping[str, float] = {token: -i for i, token in enumerate(tokens)}
        else:
            assert spec.scores is not None  # checked in from_metadata
            rank = dict(zip(tokens, spec.scores.tolist(), strict=True))
        merges = derive_merges(vocab, rank)
    unk = tokens[spec.unk_id] if spec.unk_id is not None else None
    bpe = models.BPE(
        vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None
    )
    backend = tokenizers.Tokenizer(bpe)
    steps: list[Any] = [
        decoders.Replace(SPIECE_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if spec.whole_text_word:
        # No prefix space, no pre-split: the whole text is one BPE word, as in SentencePiece.
        backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    else:
        # transformers ignores add_space_prefix (always "first"); we honour it as llama.cpp does.
        scheme = "first" if spec.add_space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPIECE_SPACE, prepend_scheme=scheme, split=False
        )
        if spec.add_space_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _wordpiece(spec: TokenizerSpec) -> tokenizers.Tokenizer:
    """BERT's WordPiece from the file's phantom-space pieces (see the module docstring)."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(spec.tokens):
        vocab.setdefault(wordpiece_spelling(token), i)
    unk = spec.tokens[spec.unk_id] if spec.unk_id is not None else "[UNK]"
    backend = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token=unk))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return backend


def wordpiece_spelling(piece: str) -> str:
    """A GGUF WordPiece piece as BERT's vocab.txt spells it: "▁word" -> "word", "ing" ->
    "##ing"; bracketed tokens ([CLS], [unused0]) stay as they are."""
    if piece.startswith("[") and piece.endswith("]"):
        return piece
    return piece[1:] if piece.startswith(SPIECE_SPACE) else "##" + piece


def _find(tokens: list[str], piece: str) -> int | None:
    try:
        return tokens.index(piece)
    except ValueError:
        return None


def derive_merges(vocab: Mapping[str, int], rank: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary that lists none.

    Every way a token splits into two vocabulary tokens is a merge producing it. Higher-ranked
    tokens merge first, and among one token's splits the longer left piece first; equal ranks
    keep `rank`'s order. This is the order transformers derives (the merges must match exactly).
    """
    found: list[tuple[float, int, int, str, str]] = []
    for token, score in rank.items():
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in vocab and right in vocab:
                found.append((score, k, len(token) - k, left, right))
    # sort(reverse=True) is still stable: equal keys keep their order.
    found.sort(key=lambda m: m[:3], reverse=True)
    return [(m[3], m[4]) for m in found]


def _add_added_tokens(backend: tokenizers.Tokenizer, spec: TokenizerSpec) -> None:
    types = spec.token_types.tolist()
    control = [t for t, ty in zip(spec.tokens, types, strict=True) if ty == CONTROL]
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = backend.get_vocab(with_added_tokens=True)
    user = [
        t for t, ty in zip(spec.tokens, types, strict=True) if ty == USER_DEFINED and t in vocab
    ]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    # The named special tokens are special even when the file types them as normal.
    added = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    named = [spec.bos_id, spec.eos_id, spec.unk_id, spec.pad_id]
    missing = list(dict.fromkeys(spec.tokens[i] for i in named if i is not None))
    missing = [t for t in missing if t not in added]
    if missing:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in missing])
