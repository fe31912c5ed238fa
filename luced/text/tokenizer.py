"""Text <-> token ids for a GGUF model, without torch (it runs in the daemon).

`luced.text.vocab` rebuilds the file's tokenizer as a `tokenizers` object; that takes seconds for
Gemma's 262k vocabulary, so the result is cached as tokenizer JSON under
$LUCED_CACHE_DIR/tokenizers/ (default ~/.cache/luced), keyed by a hash of the tokenizer metadata
and written atomically.

Decoding does not use the `tokenizers` decoder: every id maps to its bytes once (`token_bytes`),
so `decode` and `luced.text.detokenize.IncrementalDetokenizer` share one definition of the text.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import pre_tokenizers

from luced.gguf_file import GGUFFile
from luced.text.vocab import (
    SPIECE_SPACE,
    TokenizerError,
    TokenizerSpec,
    build_backend,
    byte_to_char,
)

__all__ = [
    "Tokenizer",
    "TokenizerError",
    "TokenizerSpec",
    "default_cache_dir",
]

log = logging.getLogger(__name__)

# End-of-turn tokens that end generation besides the file's eos (as llama.cpp treats them),
# counted only when the file marks them special.
END_OF_TURN_PIECES = (
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
)


# --- cache ---------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    return Path(os.environ.get("LUCED_CACHE_DIR") or Path.home() / ".cache" / "luced")


def _write_atomic(path: Path, text: str) -> None:
    """Write beside the target and rename: readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_or_build_backend(
    spec: TokenizerSpec, cache_dir: Path | None
) -> tuple[tokenizers.Tokenizer, bool]:
    """(backend, loaded_from_cache). With cache_dir None nothing is read or written."""
    path = None if cache_dir is None else cache_dir / "tokenizers" / f"{spec.cache_key()}.json"
    if path is not None and path.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
            if backend.get_vocab_size(with_added_tokens=True) >= len(spec.tokens):
                return backend, True
            log.warning("ignoring tokenizer cache %s: wrong vocabulary size", path)
        except Exception as exc:  # corrupt or from an incompatible tokenizers version
            log.warning("ignoring unreadable tokenizer cache %s: %s", path, exc)
    start = time.perf_counter()
    backend = build_backend(spec)
    log.info("built tokenizer for %s in %.2f s", spec.source, time.perf_counter() - start)
    if path is not None:
        try:
            _write_atomic(path, backend.to_str())
        except OSError as exc:
            log.warning("cannot cache the tokenizer at %s: %s", path, exc)
    return backend, False


# --- the tokenizer -------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one GGUF model. Thread-safe."""

    def __init__(self, backend: tokenizers.Tokenizer, spec: TokenizerSpec) -> None:
        self._backend = backend
        self._spec = spec
        # encode_special_tokens is state on the shared backend; set and use it under one lock.
        self._lock = threading.Lock()
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.bos_id = spec.bos_id
        self.eos_id = spec.eos_id
        self.unk_id = spec.unk_id
        self.pad_id = spec.pad_id
        self.add_bos = spec.add_bos
        self.add_eos = spec.add_eos
        self.strip_leading_space = spec.strips_leading_space
        self.bos_token = None if spec.bos_id is None else spec.tokens[spec.bos_id]
        self.eos_token = None if spec.eos_id is None else spec.tokens[spec.eos_id]
        eos = {i for i in (spec.eos_id, *spec.extra_eos_ids) if i is not None}
        for piece in END_OF_TURN_PIECES:
            i = backend.token_to_id(piece)
            if i is not None and i in self.special_ids:
                eos.add(i)
        self.eos_ids: frozenset[int] = frozenset(eos)
        self._token_bytes = _token_bytes_table(backend, spec, self.vocab_size)

    @classmethod
    def from_gguf(
        cls,
        source: str | os.PathLike[str] | GGUFFile,
        cache_dir: str | os.PathLike[str] | None = None,
        use_cache: bool = True,
    ) -> Tokenizer:
        """The tokenizer of a GGUF file, built once and then loaded from cache_dir/tokenizers/
        (default $LUCED_CACHE_DIR or ~/.cache/luced; use_cache=False neither reads nor writes)."""
        gguf = source if isinstance(source, GGUFFile) else GGUFFile(source)
        if not use_cache:
            cache = None
        else:
            cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return cls.from_metadata(gguf.metadata, source=str(gguf.path), cache_dir=cache)

    @classmethod
    def from_metadata(
        cls,
        metadata: Mapping[str, Any],
        source: str = "<metadata>",
        cache_dir: Path | None = None,
    ) -> Tokenizer:
        spec = TokenizerSpec.from_metadata(metadata, source)
        backend, _ = load_or_build_backend(spec, cache_dir)
        return cls(backend, spec)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers` object (do not change its state)."""
        return self._backend

    def encode(
        self,
        text: str,
        add_bos: bool | None = None,
        allow_special: bool = False,
        add_eos: bool | None = None,
    ) -> list[int]:
        """Token ids of text. add_bos/add_eos default to the file's flags.

        allow_special=True matches control tokens written in the text (e.g. "<|im_start|>" in a
        rendered chat prompt); otherwise they are tokenized as plain text, so user input cannot
        forge them. User-defined tokens are matched either way.
        """
        with self._lock:
            if self._backend.encode_special_tokens == allow_special:
                self._backend.encode_special_tokens = not allow_special
            ids = _encode(self._backend, text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_chat(self, prompt: str) -> list[int]:
        """Ids of a rendered chat prompt: special tokens allowed, and BOS added only when the
        file asks for it and the template did not already write it (no double BOS)."""
        wrote_bos = self.bos_token is not None and prompt.startswith(self.bos_token)
        return self.encode(prompt, add_bos=self.add_bos and not wrote_bos, allow_special=True)

    def encode_markup(self, text: str, literal: Callable[[str], str] = str) -> list[int]:
        """Ids of a rendered chat prompt whose control tokens all come from the template.

        Every special-token string in text becomes its token; every stretch between them
        goes through `literal` (which puts back what was escaped before rendering, see
        `luced.text.prompt`) and is tokenized with special-token parsing off, exactly as
        the tokenizer treats a stretch between two control tokens. No BOS is added (the
        template writes its own). With `literal` the identity this equals
        `encode(text, add_bos=False, allow_special=True)`.
        """
        ids: list[int] = []
        at = 0
        for match in self.special_pattern.finditer(text):
            if match.start() > at:
                ids += self._encode_literal(literal(text[at : match.start()]), first=at == 0)
            ids.append(self._special_by_text[match.group()])
            at = match.end()
        if at < len(text):
            ids += self._encode_literal(literal(text[at:]), first=at == 0)
        return ids

    def _encode_literal(self, text: str, first: bool) -> list[int]:
        twin = None if first else self._inner_backend
        if twin is None:  # the tokenizer's own rules, specials off
            return self.encode(text, add_bos=False, add_eos=False)
        # After a control token the tokenizer does not prepend SentencePiece's space
        # ("first" scheme), but a stretch encoded alone would get one: encode it with a
        # twin that never prepends. Other backends treat every stretch alike (twin None).
        with self._lock:
            return _encode(twin, text)

    @property
    def special_strings(self) -> list[str]:
        """The text of every special token (what `allow_special=True` matches)."""
        return list(self._special_by_text)

    @functools.cached_property
    def _special_by_text(self) -> dict[str, int]:
        out = {}
        for i in sorted(self.special_ids):
            piece = self._backend.id_to_token(i)
            if piece:
                out.setdefault(piece, i)
        return out

    @functools.cached_property
    def special_pattern(self) -> re.Pattern[str]:
        """A regex matching special-token strings leftmost-longest, as the tokenizer does."""
        return re.compile(_trie_regex(list(self._special_by_text)) or "(?!)")

    @functools.cached_property
    def _inner_backend(self) -> tokenizers.Tokenizer | None:
        pre = self._backend.pre_tokenizer
        if not (isinstance(pre, pre_tokenizers.Metaspace) and pre.prepend_scheme == "first"):
            return None
        twin = tokenizers.Tokenizer.from_str(self._backend.to_str())
        twin.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=pre.replacement, prepend_scheme="never", split=pre.split
        )
        twin.encode_special_tokens = True  # the twin only ever sees literal text
        return twin

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ids; bytes that do not form UTF-8 become U+FFFD."""
        skip = self.special_ids if skip_special else frozenset()
        data = b"".join(self.token_bytes(i) for i in ids if i not in skip)
        if self.strip_leading_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for in decoded text (a special token: its own text)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is out of range [0, {self.vocab_size})")
        return self._token_bytes[token_id]

    def id_to_piece(self, token_id: int) -> str:
        """The token as the GGUF spells it (e.g. "Ġworld", "▁world", "<0x0A>")."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is out of range [0, {self.vocab_size})")
        if token_id < len(self._spec.tokens):
            return self._spec.tokens[token_id]
        return self._backend.id_to_token(token_id) or ""

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self._spec.source!r}, {self._spec.model}, vocab={self.vocab_size}, "
            f"bos={self.bos_id}, eos={sorted(self.eos_ids)})"
        )


def _encode(backend: tokenizers.Tokenizer, text: str) -> list[int]:
    # The batch call lets go of the GIL while it works (`encode` holds it throughout: half a
    # second for a megabyte of text, in which the daemon's event loop could not run), and
    # without offsets it is also about three times faster. The ids are the same.
    return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids


def _trie_regex(words: list[str]) -> str:
    """One regex for many literal strings, as a trie: a plain alternation of Gemma's 6k
    control tokens tries each at every position (slower than the tokenizing). Greedy
    optional tails give the longest match first."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = True

    def walk(node: dict) -> str:
        end = "" in node
        alts = [re.escape(ch) + walk(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        if end:
            return f"(?:{body})?" if len(alts) > 1 or len(body) > 1 else body + "?"
        return body

    return walk(trie)


def _token_bytes_table(
    backend: tokenizers.Tokenizer, spec: TokenizerSpec, vocab_size: int
) -> list[bytes]:
    """id -> bytes, as the tokenizers decoder would produce them (see the module docstring)."""
    pieces = [backend.id_to_token(i) or "" for i in range(vocab_size)]
    if spec.model == "bert":  # the file's own spelling: "▁word" starts a word, "ing" goes on
        pieces = spec.tokens + pieces[len(spec.tokens) :]
    if spec.model == "gpt2":
        # The byte alphabet back to bytes: translate to Latin-1 code points, then encode. Pieces
        # with other characters (raw added tokens) keep those as UTF-8, like the ByteLevel decoder.
        to_byte = {ord(c): b for b, c in byte_to_char().items()}

        def unspell(piece: str) -> bytes:
            try:
                return piece.translate(to_byte).encode("latin-1")
            except UnicodeEncodeError:
                return b"".join(
                    bytes([to_byte[ord(c)]]) if ord(c) in to_byte else c.encode("utf-8")
                    for c in piece
                )

        return [unspell(piece) for piece in pieces]
    table = []
    for piece in pieces:
        # ByteFallback: "<0xNN>" is the byte NN; everything else is text with "▁" as space.
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                table.append(bytes([int(piece[3:5], 16)]))
                continue
            except ValueError:
                pass
        table.append(piece.replace(SPIECE_SPACE, " ").encode("utf-8"))
    return table
