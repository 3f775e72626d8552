"""Token ids -> text, in one place for the Python API, the CLI and the server: detokenising,
stop strings, incomplete UTF-8 characters.

Text is held back while it may be the start of a stop string or ends in an incomplete UTF-8
character, and nothing at or after a stop string is ever sent.
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

    def push(self, tokens: list[int]) -> str:
        """Add a chunk -> the text that is safe to send now."""
        for token in tokens:  # token by token, so no token past a stop string is kept
            self.token_ids.append(token)
            text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
            self.text = text[: min(cuts)] if cuts else text
            if cuts:
                self.stopped = True
                return self.flush()
        safe = len(self.text) - self.hold
        while safe > self.sent and self.text[safe - 1] == "\ufffd":
            safe -= 1
        return self._send(safe)

    def flush(self) -> str:
        """The rest of the text."""
        return self._send(len(self.text))

    def _send(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : end], end
        return delta
