"""Generated token ids to a stream of text, cut at stop strings."""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # as vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET


class IncrementalDetokenizer:
    """vLLM's scheme: decode a short window, emit what the new ids add, hold back a trailing
    '\\ufffd'. ``prompt_ids`` give context only (a first token's leading space), never emitted."""

    def __init__(self, tokenizer, prompt_ids: list[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0           # start of the decoding window
        self.read_offset = len(self.ids)  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(REPLACEMENT_CHAR)):
            delta = new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""

    def add(self, token_ids: list[int]) -> str:
        """The text they complete (maybe "")."""
        self.ids.extend(token_ids)
        return self._step(final=False) if token_ids else ""

    def flush(self) -> str:
        """Text still held back (an incomplete character decodes as '\\ufffd')."""
        if self.read_offset == len(self.ids):
            return ""
        return self._step(final=True)


class StopMatcher:
    """Holds back a tail that may start a stop string; after a match nothing more is emitted, the
    text ending before it (after it with ``include_stop``: vLLM's ``include_stop_str_in_output``)."""

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.pending = ""  # text held back: it may be the start of a stop string
        self.stopped = False

    def feed(self, text: str) -> str:
        """What is safe to emit now."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.pending + text
        hits = [(i, -len(s)) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            i, minus_len = min(hits)  # the earliest match; the longest stop string there
            return buf[:i - minus_len if self.include_stop else i]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """At the end: the held-back text (it did not become a stop string)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class TextStream:
    """Once :attr:`stopped`, end the request with finish reason "stop"; :attr:`text`: all emitted."""

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str], include_stop: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.matcher = StopMatcher(stops, include_stop)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def add(self, token_ids: list[int]) -> str:
        out = self.matcher.feed(self.detok.add(token_ids))
        self.text += out
        return out

    def finish(self) -> str:
        out = self.matcher.feed(self.detok.flush()) if not self.stopped else ""
        out += self.matcher.flush()
        self.text += out
        return out
