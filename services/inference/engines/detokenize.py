"""Incremental detokenization with stop strings, for one sampled sequence.

Text is decoded with special tokens kept (so `<tool_call>` reaches the tool parser) and
without the final eos token. Streaming uses the prefix/read-offset method (decode a short
window, emit what it added, wait while the window ends in an incomplete UTF-8 character);
the final text is always one full decode, so it is exactly `decode(token_ids)`.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"  # what a partial UTF-8 byte sequence decodes to


def decoder_of(tokenizer: Any) -> Any:
    """A fast `ids -> str` keeping special tokens (the Rust tokenizer when there is one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class Detokenizer:
    """Turns one sequence's tokens into text deltas, cutting at the first stop string."""

    def __init__(self, decode: Any, stop: tuple[str, ...], *, incremental: bool) -> None:
        self.decode, self.stop, self.incremental = decode, stop, incremental or bool(stop)
        self.ids: list[int] = []
        self.text = ""  # decoded so far (cut at a stop string once one is found)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found
        self._prefix = self._read = 0
        # Text that could be the start of a stop string is held back until it cannot be.
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def push(self, token_id: int) -> bool:
        """Add a text token (never eos); True when a stop string now ends the text."""
        self.ids.append(token_id)
        if not self.incremental or self.stopped:
            return False
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return False
        searched_to = len(self.text)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        return self._cut_at_stop(max(0, searched_to - self._holdback))

    def _cut_at_stop(self, start: int) -> bool:
        hits = [p for p in (self.text.find(s, start) for s in self.stop) if p >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def take(self, final: bool) -> str:
        """Text not handed out yet; before the end, minus what could begin a stop string."""
        if final and not self.stopped:
            full = self.decode(self.ids)
            if full.startswith(self.text[: self.emitted]):
                self.text = full
                self._cut_at_stop(max(0, self.emitted - self._holdback))
        end = len(self.text) if final else max(self.emitted, len(self.text) - self._holdback)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta
