"""Progress of long-running commands: a line redrawn on a terminal, nothing when piped.

``import_session``, ``export_session``, ``release_idle --wait`` and the benchmarks draw
their progress on standard error while it is a terminal; when it is a file or a pipe (a
script, cron, a test) they print nothing of it, so their output stays what they print
on purpose (benchmarks' JSON lines on standard output are never touched). Django-free::

    with Progress("importing", total=size, unit="B", stream=command.stderr) as bar:
        for line in lines:
            bar.advance(len(line))

A ``manage.py`` command passes its ``self.stderr`` (Django's ``OutputWrapper``): its
terminal check and the underlying stream are used, never its line endings.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

# Erase from the cursor to the end of the line (a shorter redraw leaves nothing behind).
_ERASE = "\x1b[K"


def _raw(stream: Any) -> Any:
    """The stream to write to: a Django ``OutputWrapper``'s own stream, else ``stream``."""
    return getattr(stream, "_out", stream)


def is_terminal(stream: Any) -> bool:
    """True when ``stream`` (default standard error) is a terminal."""
    stream = _raw(sys.stderr if stream is None else stream)
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def note(message: str, *, stream: Any = None, prefix: str = "") -> None:
    """One line of news (``prefix: message``) on a terminal; nothing when piped."""
    target = _raw(sys.stderr if stream is None else stream)
    if is_terminal(target):
        target.write(f"{prefix}: {message}\n" if prefix else f"{message}\n")
        target.flush()


def _figure(value: float, unit: str) -> str:
    if unit == "B":
        for scale, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if value >= scale:
                return f"{value / scale:.1f} {suffix}"
        return f"{int(value)} B"
    text = f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"
    if unit == "s":
        return f"{text}s"
    return f"{text} {unit}" if unit else text


class Progress:
    """One progress line on ``stream`` (default standard error), redrawn in place with a
    carriage return while the stream is a terminal; every method does nothing otherwise.

    ``total`` (optional) adds a percentage; ``unit`` (``"B"`` shows bytes as KiB/MiB/GiB,
    ``"s"`` seconds, any other word is appended). Redraws come at most every
    ``min_interval`` seconds (the first and the last always); ``close`` (or leaving the
    ``with`` block) draws the final figure and ends the line. ``enabled=False`` silences
    it whatever the stream (a command writing its data to the same terminal).
    """

    def __init__(
        self,
        label: str,
        *,
        total: float | None = None,
        unit: str = "",
        stream: TextIO | Any = None,
        min_interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done: float = 0
        self.stream = _raw(sys.stderr if stream is None else stream)
        self.enabled = enabled and is_terminal(self.stream)
        self.min_interval = min_interval
        self.clock = clock
        self._drawn_at: float | None = None
        self._closed = False

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, amount: float = 1) -> None:
        self.update(self.done + amount)

    def track[T](self, items: Iterable[T], size: Callable[[T], float] | None = None) -> Iterator[T]:
        """Yield ``items``, advancing by ``size(item)`` each (1 without ``size``)."""
        for item in items:
            yield item
            self.advance(size(item) if size is not None else 1)

    def update(self, done: float, *, label: str | None = None) -> None:
        """Set the figure (and, optionally, a new label) and redraw when due."""
        self.done = done
        if label is not None:
            self.label = label
        self._draw()

    def text(self) -> str:
        """The line as drawn, without the carriage return and the erase."""
        figure = _figure(self.done, self.unit)
        if self.total:
            share = min(100.0, 100.0 * self.done / self.total)
            return f"{self.label} {figure} / {_figure(self.total, self.unit)} ({share:.0f}%)"
        return f"{self.label} {figure}"

    def _draw(self, *, force: bool = False) -> None:
        if not self.enabled or self._closed:
            return
        now = self.clock()
        if not force and self._drawn_at is not None and now - self._drawn_at < self.min_interval:
            return
        self._drawn_at = now
        self.stream.write(f"\r{self.text()}{_ERASE}")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final figure and end the line (once)."""
        if self.enabled and not self._closed:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True
