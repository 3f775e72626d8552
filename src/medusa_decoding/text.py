"""Token ids -> text, in one place for the Python API, the CLI and the server: detokenising,
stop strings, incomplete UTF-8 characters.

Text is held back while it may be the start of a stop string or ends in an incomplete UTF-8
character, and nothing at or after a stop string is ever sent. `pieces` splits what was sent
into each token's share (the page of `medusa serve` colours tokens by their provenance).
"""

from __future__ import annotations


class TextDecoder:
    """Token chunks in (`push`), safe text deltas out; `flush` at the end of the sequence."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []  # the tokens kept: none past a stop string
        self.text = ""  # the text so far, cut before the first stop string
        self.sent = 0
        self.stopped = False  # a stop string was found
        self.ends: list[int] = []  # per kept token: the length of the text once it was decoded
        self.described = 0  # tokens already handed out by `pieces`

    def push(self, tokens: list[int]) -> str:
        """Add a chunk -> the text that is safe to send now."""
        for token in tokens:  # token by token, so no token past a stop string is kept
            self.token_ids.append(token)
            text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
            self.text = text[: min(cuts)] if cuts else text
            self.ends.append(max(len(self.text.rstrip("\ufffd")), self.ends[-1] if self.ends else 0))
            if cuts:  # no token's text reaches past the cut
                self.ends = [min(e, len(self.text)) for e in self.ends]
                self.stopped = True
                return self.flush()
        safe = len(self.text) - self.hold
        while safe > self.sent and self.text[safe - 1] == "\ufffd":
            safe -= 1
        return self._send(safe)

    def flush(self) -> str:
        """The rest of the text (an incomplete character at the end stays U+FFFD, the last token's)."""
        if self.ends:
            self.ends[-1] = len(self.text)
        return self._send(len(self.text))

    def pieces(self) -> list[tuple[int, str]]:
        """(token index, its text) for each token whose text was wholly sent since the last call.
        All pieces so far join up to the text sent, up to its last whole token (a token with no
        text of its own, e.g. EOS or the first byte of a character, gets "")."""
        out = []
        while self.described < len(self.ends) and self.ends[self.described] <= self.sent:
            i = self.described
            start = self.ends[i - 1] if i else 0
            out.append((i, self.text[start : self.ends[i]]))
            self.described += 1
        return out

    def _send(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : end], end
        return delta
