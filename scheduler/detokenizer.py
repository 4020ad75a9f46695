"""Streaming token ids -> text for one request, with stop strings.

Each `push` decodes only a short window of recent tokens and sends the difference, so the cost per
token does not grow with the length of the output.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# What a byte-level decoder makes of bytes that are not (yet) a whole UTF-8 character.
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated ids into text chunks that are safe to send.

    Invariant: the concatenation of everything `push` and `flush` return equals the decoded output
    cut at the first stop string, where "first" is the occurrence that ends earliest (the point where
    generation stops), ties going to the longer stop string. Stop strings are never sent.
    """

    __slots__ = (
        "_flushed",
        "_ids",
        "_max_hold",
        "_pending",
        "_read",
        "_skip_special",
        "_special_ids",
        "_stop_prefixes",
        "_stops",
        "_tokenizer",
        "_window_text",
        "matched_stop",
        "stopped",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prefix_token_ids: Sequence[int] = (),
    ) -> None:
        """`prefix_token_ids` (e.g. the prompt's last few ids) give the first output token context."""
        for index, stop_string in enumerate(stop):
            if not stop_string:
                raise ValueError(f"stop[{index}] is empty; stop strings must have at least one character")
        self._tokenizer = tokenizer
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stop))
        # Every proper prefix of a stop string: the tails of text that must be held back.
        self._stop_prefixes: frozenset[str] = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._skip_special = skip_special_tokens
        self._special_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # The window: `_ids[:_read]` are tokens already turned into text, kept only as decoding
        # context; `_window_text` is their text. `_ids[_read:]` are not yet turned into text.
        self._ids: list[int] = list(prefix_token_ids)
        self._read = len(self._ids)
        self._window_text = self._decode(self._ids)
        # Text decoded but not yet returned, because it may be the start of a stop string.
        self._pending = ""
        self._flushed = False
        self.stopped: bool = False
        self.matched_stop: str | None = None

    def push(self, token_id: int) -> str:
        """Add one generated token; return the new text that is safe to send now (maybe "")."""
        if self.stopped:
            return ""
        assert not self._flushed, "push after flush"
        if token_id in self._special_ids:
            # A skipped special token decodes to nothing, so it adds nothing to the window either.
            return ""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) <= len(self._window_text) or text.endswith(_REPLACEMENT):
            # Nothing new yet, or the last character is still missing bytes: wait for more tokens.
            return ""
        new_text = text[len(self._window_text) :]
        # The tokens just turned into text become the context window for the next ones.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._window_text = self._decode(self._ids)
        return self._release(new_text)

    def flush(self) -> str:
        """End of generation: return everything still held back (up to a stop string)."""
        if self.stopped or self._flushed:
            return ""
        self._flushed = True
        text = self._decode(self._ids)
        # Bytes that never completed a character are sent as U+FFFD, as a full decode shows them.
        tail = text[len(self._window_text) :]
        self._ids.clear()
        text = self._pending + tail
        self._pending = ""
        return self._cut_at_stop(text)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _release(self, new_text: str) -> str:
        """Add decoded text to the held text; return the part that cannot begin a stop string."""
        if not self._stops:
            return new_text
        text = self._pending + new_text
        found = self._find_stop(text)
        if found is not None:
            return self._stop_at(text, *found)
        hold = self._held_length(text)
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold]

    def _cut_at_stop(self, text: str) -> str:
        found = self._find_stop(text)
        return text if found is None else self._stop_at(text, *found)

    def _stop_at(self, text: str, start: int, stop_string: str) -> str:
        self.stopped = True
        self.matched_stop = stop_string
        self._pending = ""
        self._ids.clear()
        return text[:start]

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence in `text` that ends first; longer wins a tie."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for stop_string in self._stops:
            start = text.find(stop_string)
            if start >= 0:
                candidate = (start + len(stop_string), -len(stop_string), stop_string)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return None
        end, _, stop_string = best
        return end - len(stop_string), stop_string

    def _held_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._max_hold), 0, -1):
            if text[-length:] in self._stop_prefixes:
                return length
        return 0
