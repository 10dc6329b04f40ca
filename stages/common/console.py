"""What the stages tell the user while they run: one-line messages and progress.

* `Console.say(message)`: a status line on stdout, as written (no markup); nothing when quiet.
* `Console.result(message)`: what a stage produced (a summary), on stdout even when quiet.
* `Console.progress(label, total, done, unit=...)`: a context manager yielding a `Progress`, which
  the stage calls with the count done so far and a short figure text (``loss 1.234 lr 1.0e-04``);
  a count whose total is known only once the work starts (a rank's share of a rollout) passes
  the total with an update. On a terminal it is a rich bar on stderr. Without one (a run under
  ``nohup``, a CI log, a pipe) it writes one plain line per update on stderr instead: the first
  update at once, then at most one every `LOG_EVERY_S` seconds, and the last as the display
  closes, with the elapsed time and an ETA::

      sft: 12/40 steps (30%) loss 1.234 lr 1.0e-04; 1m05s elapsed, ETA 2m32s

  so a background run's log shows how far it is. ``quiet`` silences both. Both displays show
  the same ETA (`Progress.eta_seconds`): from the rate since the bar opened, or, where the count
  is only a bound on the work (a rollout's turns), the estimate of whoever drives the bar
  (`Progress.estimate`), which may be none yet.

Progress goes to stderr and messages to stdout, so a command whose product is printed (a report
table, JSON) can be redirected without the bars.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

#: Without a terminal, the shortest interval between two progress lines.
LOG_EVERY_S = 10.0


class Console:
    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def say(self, message: str) -> None:
        if not self.quiet:
            print(message, flush=True)

    def result(self, message: str) -> None:
        print(message, flush=True)

    @contextmanager
    def progress(self, label: str, total: int, done: int = 0, transient: bool = False,
                 unit: str = "") -> Iterator[Progress]:
        """A progress display of `total` units (named `unit`: "steps", "turns") of which `done` are
        already done (a resumed run)."""
        stream = sys.stderr
        if self.quiet:
            bar: Progress = Progress(label, total, done, unit)
        elif stream.isatty():
            bar = _RichProgress(label, total, done, unit, transient)
        else:
            bar = _LineProgress(label, total, done, unit, stream)
        try:
            yield bar
        finally:
            bar.close()


class Progress:
    """The silent progress (quiet); the others draw what `update` is told."""

    def __init__(self, label: str, total: int, done: int, unit: str = ""):
        self.label, self.total, self.start_done, self.unit = label, total, done, unit
        self.done = done
        self.started = time.monotonic()
        #: Seconds left by the bar's driver, when its count bounds the work rather than measures it
        #: (`stages.agent.proxy.RolloutMeter`); None: an ETA from the count's rate.
        self.estimate: Callable[[], float | None] | None = None

    def update(self, done: int, figures: str = "", total: int | None = None) -> None:
        """`done` units so far, `figures` to show beside them, and the `total` if it changed."""
        self.done = done
        if total is not None:
            self.total = total

    def advance(self, count: int = 1, figures: str = "") -> None:
        self.update(self.done + count, figures)

    def close(self) -> None:
        pass

    def eta_seconds(self) -> float | None:
        """Seconds left: the driver's `estimate`, or at the rate since the bar opened; None while
        unknown (before the first unit is done)."""
        if self.estimate is not None:
            return self.estimate()
        progressed = self.done - self.start_done
        if progressed <= 0:
            return None
        return (time.monotonic() - self.started) / progressed * max(0, self.total - self.done)


class _LineProgress(Progress):
    def __init__(self, label: str, total: int, done: int, unit: str, stream: TextIO):
        super().__init__(label, total, done, unit)
        self.stream = stream
        self.last_line = float("-inf")
        self.pending = False

    def update(self, done: int, figures: str = "", total: int | None = None) -> None:
        super().update(done, figures, total)
        self.figures = figures
        self.pending = True
        now = time.monotonic()
        if now - self.last_line >= LOG_EVERY_S:
            self._write(now)

    def close(self) -> None:
        if self.pending:
            self._write(time.monotonic())

    def _write(self, now: float) -> None:
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        figures = f" {self.figures}" if self.figures else ""
        eta = self.eta_seconds()
        timing = f"{duration(now - self.started)} elapsed" + (f", ETA {duration(eta)}" if eta is not None else "")
        unit = f" {self.unit}" if self.unit else ""
        self.stream.write(f"{self.label}: {self.done}/{self.total}{unit}{share}{figures}; {timing}\n")
        self.stream.flush()
        self.last_line, self.pending = now, False


class _RichProgress(Progress):
    def __init__(self, label: str, total: int, done: int, unit: str, transient: bool):
        super().__init__(label, total, done, unit)
        from rich.console import Console as RichConsole
        from rich.progress import BarColumn, MofNCompleteColumn, RenderableColumn, TextColumn
        from rich.progress import Progress as RichBar

        self.bar = RichBar(TextColumn(label, markup=False), BarColumn(bar_width=20), MofNCompleteColumn(),
                           TextColumn(unit, markup=False), TextColumn("{task.fields[figures]}", markup=False),
                           RenderableColumn(_EtaText(self)),
                           console=RichConsole(stderr=True), transient=transient)
        self.bar.start()
        self.task = self.bar.add_task(label, total=total, completed=done, figures="")

    def update(self, done: int, figures: str = "", total: int | None = None) -> None:
        super().update(done, figures, total)
        self.bar.update(self.task, completed=done, figures=figures, total=self.total)

    def close(self) -> None:
        self.bar.stop()


class _EtaText:
    """The bar's ETA as rich draws it, computed at each refresh: the line progress's figure."""

    def __init__(self, progress: Progress):
        self.progress = progress

    def __rich__(self):
        from rich.text import Text

        eta = self.progress.eta_seconds()
        return Text(f"ETA {duration(eta)}" if eta is not None else "")


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h01m``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
