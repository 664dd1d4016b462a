"""Stop-string matching whose cost per token does not grow with the number of stop strings.

One Aho-Corasick automaton (pyahocorasick, C) per request holds every stop string. The
matcher keeps ``hold_from``: where the longest suffix of the text that is still the start
of some stop string begins. No stop string can begin before it (that start would itself
be a longer such suffix), so each new token scans only ``text[hold_from:]`` -- at most
the longest stop string plus the token's own text -- and the same position is what a
stream must hold back: text before it can never become part of a stop string.
"""

from __future__ import annotations

import ahocorasick


class StopMatcher:
    """The earliest stop string in a text that grows at its end."""

    def __init__(self, stops: list[str]) -> None:
        self._automaton = ahocorasick.Automaton()
        for order, stop in enumerate(stops):
            if stop and stop not in self._automaton:
                self._automaton.add_word(stop, (order, len(stop)))
        self.active = len(self._automaton) > 0
        if self.active:
            self._automaton.make_automaton()
        self.hold_from = 0  # text before this index can no longer start a stop string

    def feed(self, text: str, min_end: int = 0) -> tuple[int, int] | None:
        """``text``: everything so far (the previous call's text plus new characters).
        Returns (start, end) of the stop string that starts first (on a tie, the one
        listed first) among those ending after ``min_end``, or None and advances
        ``hold_from``."""
        if not self.active:
            self.hold_from = len(text)
            return None
        automaton = self._automaton
        start = self.hold_from
        best: tuple[int, int, int] | None = None  # (start, order, length)
        for last, (order, length) in automaton.iter(text, start):
            if last < min_end:
                continue
            found = (last - length + 1, order, length)
            if best is None or found < best:
                best = found
        if best is not None:
            return best[0], best[0] + best[2]
        end = len(text)
        while start < end and not automaton.match(text[start:]):
            start += 1
        self.hold_from = start
        return None
