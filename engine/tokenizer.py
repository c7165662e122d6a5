"""Tokenizers. The default is byte-level (no vocabulary file, any UTF-8 text round-trips); a local
Hugging Face `tokenizer.json` is used instead when a checkpoint ships one and `tokenizers` is installed."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int
    eos_token_id: int

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def stream_decoder(self) -> StreamDecoder: ...


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str: ...


class ByteTokenizer:
    """ids 0..255 are bytes; 256 BOS, 257 EOS, 258 PAD."""

    vocab_size = 259
    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> _ByteStream:
        return _ByteStream()


class _ByteStream:
    """Incremental UTF-8: a multi-byte character is emitted once all its bytes have arrived."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(bytes([token_id])) if token_id < 256 else ""


class HFTokenizer:
    def __init__(self, path: Path, bos_token_id: int, eos_token_id: int) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def stream_decoder(self) -> _HFStream:
        return _HFStream(self)


class _HFStream:
    """Decode the growing sequence and emit the new suffix (handles merges across tokens)."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._text = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._text = text[len(self._text) :], text
        return new
