"""Incremental detokenisation for streamed completions: O(1) decode work per token.

``StreamDecoder(tokenizer).step(token_id) -> new text`` returns what the token adds to the decoded output
(special tokens skipped). With a fast (Rust) tokenizer and a ``tokenizers`` that has it, this is
``tokenizers.decoders.DecodeStream``; otherwise the prefix-offset rule of vLLM and TGI: decode the window
``ids[prefix:]`` and the window ``ids[prefix:read]``, emit the difference once it no longer ends in an
incomplete UTF-8 sequence (U+FFFD), then slide the window. Either way each token decodes a bounded window
instead of the whole output, and the concatenated steps equal ``tokenizer.decode(ids,
skip_special_tokens=True)`` on byte-level BPE, multi-byte characters split across tokens and added tokens
(tests/inference/test_openai_api.py checks both the equality and the decode work).
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None  # type: ignore[assignment,misc]


class StreamDecoder:
    """Decode one sequence token by token; ``text`` is everything emitted so far."""

    def __init__(self, tokenizer: Any, *, native: bool = True) -> None:
        """``native=False`` forces the prefix-offset decoder (used for slow tokenizers; tested on its own)."""
        self.tok = tokenizer
        self.text = ""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = (
            DecodeStream(skip_special_tokens=True)
            if native and DecodeStream and backend is not None
            else None
        )
        self._backend = backend
        self._ids: list[int] = []
        self._prefix = self._read = 0

    def step(self, token_id: int) -> str:
        """The text ``token_id`` adds ('' while a multi-byte character is incomplete or for a skipped special)."""
        if self._stream is not None:
            new = self._stream.step(self._backend, int(token_id)) or ""
        else:
            self._ids.append(int(token_id))
            before = self.tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
            after = self.tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
            new = ""
            if len(after) > len(before) and not after.endswith("\ufffd"):
                new = after[len(before) :]
                self._prefix, self._read = self._read, len(self._ids)
        self.text += new
        return new


__all__ = ["StreamDecoder"]
