"""Incremental detokenization with stop strings.

With a fast (Rust) tokenizer, text comes from its ``DecodeStream``: each token costs a
couple of microseconds, and the bytes of a character whose last byte has not come yet
are held inside it. Otherwise text is decoded over a sliding window (``prefix_offset``
… end), so each step costs a few tokens and tokenizers that drop a leading space at the
start of a decode still yield the right text. A tail that could be the start of a stop
string is held back until it is known not to be one. Without stop strings (the common
case) a fast tokenizer's pieces go out as they come, with no bookkeeping beyond a list of
them. When the request finishes,
``flush`` gives the rest: the whole text then equals the tokenizer's decode of the
token ids (up to a stop string), with U+FFFD for a character left unfinished, as
``decode`` gives it.
"""

from __future__ import annotations

from hydrad.sampling_params import SamplingParams

# Tokens of context decoded before the new ones (enough for any merge to settle).
_WINDOW = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self._text = ""  # decoded output (truncated at a stop string), but for ``_pieces``
        self._pieces: list[str] = []  # the fast path's pieces, not yet joined into ``_text``
        self._emitted = 0  # characters of text already returned
        self.stopped = False
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        # Whether the stream may hold bytes of an unfinished character (or skipped a token):
        # only then does ``flush`` need a full decode to find what is left.
        self._held = False
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            self._step = self._stream.step
        else:
            self._prefix_offset = 0
            self._read_offset = 0

    @property
    def text(self) -> str:
        """All the decoded output so far (truncated at a stop string)."""
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces = []
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Take one new token; return the text that can be shown now."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        if self._backend is not None:
            piece = self._step(self._backend, token_id)
            self._held = not piece
            if not self.stop:
                # Nothing to search or hold back: the piece is shown as it comes.
                if piece:
                    self._pieces.append(piece)
                    self._emitted += len(piece)
                    return piece
                return ""
            if piece:
                self._append(piece)
        else:
            self._decode_window(final=False)
        if not self.stop:
            return self._take(len(self.text))
        end = len(self.text) if self.stopped else max(self._emitted, len(self.text) - self._hold)
        return self._take(end)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Take new tokens; return the text that can be shown now."""
        return "".join([self.add_token(t) for t in token_ids])

    def _append(self, piece: str) -> None:
        search_from = max(0, len(self.text) - self._hold)
        self._text = self.text + piece
        if self.stop:
            self._check_stop(search_from)

    def _decode_window(self, final: bool) -> None:
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the rest of it, unless no
        # more tokens will come; then the text is what a full decode gives, U+FFFD included.
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self._append(full[len(prefix) :])
            self._prefix_offset = max(0, len(self.token_ids) - _WINDOW)
            self._read_offset = len(self.token_ids)

    def _check_stop(self, search_from: int) -> None:
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        index, stop = min(hits)
        self._text = self.text[: index + len(stop) if self.include_stop else index]
        self.stopped = True

    def _take(self, end: int) -> str:
        if self._emitted >= end:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return out

    def flush(self) -> str:
        """The rest of the text once the request has finished: the tail held back for stop
        strings and the bytes of an unfinished character. Then ``text`` is the decode of
        all the tokens (up to a stop string)."""
        if not self.stopped:
            if self._backend is not None:
                if not self._held:  # the stream gave out everything it took
                    return self._take(len(self.text))
                # What the stream still holds is an unfinished character: a full decode
                # gives it as U+FFFD, and the stream's text is a prefix of that decode.
                full = self._decode(self.token_ids)
                if len(full) > len(self.text) and full.startswith(self.text):
                    self._append(full[len(self.text):])
            else:
                self._decode_window(final=True)
        return self._take(len(self.text))
