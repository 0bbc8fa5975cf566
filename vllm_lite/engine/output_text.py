"""One request's generated text on the client: the detokenizer's pieces, joined only when text
is handed out, with vLLM's stop-string rules.

* A stop string may span pieces: each new piece is searched together with the last
  `longest stop - 1` characters before it (`tail`), so the cost per piece is bounded by the
  piece and the stop strings, never by the text so far.
* On a hit the text ends before the stop string, or after it with `include_stop_str_in_output`.
* Streaming (DELTA) holds back the last `longest stop - 1` characters while the request runs
  (they could still be the start of a stop string that must not be shown); `unsent` holds the
  pieces not handed out yet, so a delta costs what it returns.

Invariant: `"".join(pieces)` is the text so far, `length` its length, and with `delta`,
`"".join(unsent)` is its suffix after the first `sent` characters.
"""

from __future__ import annotations


class OutputText:
    __slots__ = ("stop", "include_stop", "hold_back", "delta", "pieces", "length", "unsent", "sent", "tail")

    def __init__(self, stop: list[str] | None, include_stop: bool, delta: bool) -> None:
        self.stop = tuple(stop or ())
        self.include_stop = include_stop
        longest = max((len(s) for s in self.stop), default=0)
        # Characters before a new piece where a stop string it completes may start.
        self.hold_back = max(longest - 1, 0)
        self.delta = delta
        self.pieces: list[str] = []
        self.length = 0
        self.unsent: list[str] = []
        self.sent = 0
        self.tail = ""

    def append(self, piece: str, check_stop: bool) -> str | None:
        """Add a piece of text. With `check_stop`, returns the stop string the text now
        contains, if any (the text is then cut as vLLM cuts it); None otherwise."""
        if not piece:
            return None
        before = self.length
        self.pieces.append(piece)
        self.length += len(piece)
        if self.delta:
            self.unsent.append(piece)
        if not self.stop:
            return None
        window = self.tail + piece
        window_start = before - len(self.tail)
        self.tail = window[max(len(window) - self.hold_back, 0):]
        hit = self._earliest_stop(window) if check_stop else None
        if hit is None:
            return None
        index, stop = hit
        start = window_start + index
        self._truncate(start + len(stop) if self.include_stop else start)
        return stop

    def text(self, finished: bool) -> str:
        """The whole text that may be shown now (cumulative outputs)."""
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        text = self.pieces[0] if self.pieces else ""
        end = self._shown_end(finished)
        self.sent = end
        return text if end == len(text) else text[:end]

    def take_delta(self, finished: bool) -> str:
        """The text not handed out yet that may be shown now (DELTA outputs)."""
        count = self._shown_end(finished) - self.sent
        if count == 0:
            return ""
        unsent = self.unsent
        joined = unsent[0] if len(unsent) == 1 else "".join(unsent)
        rest = joined[count:]
        self.unsent = [rest] if rest else []
        self.sent += count
        return joined if not rest else joined[:count]

    def _shown_end(self, finished: bool) -> int:
        if finished or self.include_stop or not self.hold_back:
            return self.length
        return max(self.sent, self.length - self.hold_back)

    def _earliest_stop(self, window: str) -> tuple[int, str] | None:
        hit = None
        for stop in self.stop:
            index = window.find(stop)
            if index != -1 and (hit is None or index < hit[0]):
                hit = (index, stop)
        return hit

    def _truncate(self, end: int) -> None:
        """Cut the text to its first `end` characters (never before what was handed out)."""
        text = "".join(self.pieces)[:end]
        self.pieces = [text] if text else []
        self.length = end
        if self.delta:
            self.unsent = [text[self.sent:]] if end > self.sent else []
