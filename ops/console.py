"""Consoles whose output fits where it goes.

On a terminal, rich measures the window: tables fit it and progress bars redraw in place. Piped
to a file or another program, rich would assume 80 columns and wrap every wide table into an
unreadable column of fragments; there the width is the one `COLUMNS` sets or else wide enough
for any table (a table takes only the width it needs), and progress bars are off, since a
redrawn line turns into noise in a log.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

PIPED_WIDTH = 400


def make_console(*, stderr: bool = False) -> Console:
    """A console for `stdout` (or `stderr`): the terminal's width there, wide when piped."""
    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return probe
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdigit() and int(columns) > 0 else PIPED_WIDTH
    return Console(stderr=stderr, width=width)


def make_progress(console: Console) -> Progress:
    """A progress bar on a terminal; on anything else a silent one (same calls, no output)."""
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, disable=not console.is_terminal, transient=False)
