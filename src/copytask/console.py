"""What copytask says to the person running it: a refusal of bad input (`ConfigError`, which a
command prints with `refuse`), warnings (`warn`, one line each), log lines (`log`, printed by the
command line as bare lines) and where progress bars go (`bar_stream`). Every layer refuses, warns
or logs, so this sits below them all and imports nothing of copytask's."""

from __future__ import annotations

import io
import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

TERMINAL_WIDTH = 100  # columns a table or paragraph copytask prints fits in


class ConfigError(ValueError):
    """A config value that cannot be run; the message names the value and what is allowed."""


def refuse(error: Exception | str) -> int:
    """A command's refusal of bad input: one line on stderr, `copytask: error: ...`; -> exit status 2."""
    print(f"copytask: error: {error}", file=sys.stderr)
    return 2


class CopytaskWarning(UserWarning):
    """A run or file that copytask skipped or could not read; the message names its folder."""


def warn(message: str) -> None:
    """A CopytaskWarning, shown where the caller's filters say (the command line prints it as one
    `copytask: warning: ...` line); callers name the offending run (its folder) in `message`."""
    warnings.warn(message, CopytaskWarning, stacklevel=3)


def format_warning(message, category, *args, **kwargs) -> str:
    """A warning as one line: `copytask: warning: ...` for copytask's own, `Category: ...` for others'."""
    return (
        f"copytask: warning: {message}\n"
        if issubclass(category, CopytaskWarning)
        else f"{category.__name__}: {message}\n"
    )


@contextmanager
def one_line_warnings() -> Iterator[None]:
    """Inside: warnings shown as `format_warning`'s one line; after: shown as before. What a job
    does, in whichever process its launcher runs it (a worker has none of the command's settings)."""
    previous = warnings.formatwarning
    warnings.formatwarning = format_warning
    try:
        yield
    finally:
        warnings.formatwarning = previous


# On a terminal a line starts by erasing the line the cursor is on: a sweep's progress bar, drawn
# there without a newline, would otherwise run into it (the bar is drawn again at its next update).
ERASE_LINE = "\r\x1b[K"


class Lines(logging.Handler):
    """Log records as bare lines, as the command line prints: below WARNING on stdout, the rest on
    stderr (the streams looked up at each line, so a redirected stdout is followed)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            isatty = getattr(stream, "isatty", None)
            erase = ERASE_LINE if isatty and isatty() else ""
            stream.write(erase + self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: a handler never raises
            self.handleError(record)


# What a sweep and its jobs say as they go (each job's summary line, the analysis, report and sweep
# lines at the end; errors for failed jobs). The library adds no handler: a caller sees them once it
# configures logging, and errors only (Python's last-resort handler, on stderr) where it has not. The
# command line prints them as `Lines` does, and so does each job through Hydra's job logging
# (configs/hydra/job_logging/copytask.yaml), in every launcher's worker too.
log = logging.getLogger("copytask")


class LineStream(io.TextIOBase):
    """A progress bar's stream where it is not a terminal (a log file, a pipe): each redraw on a
    line of its own. tqdm redraws one line with carriage returns and no newline, so a line written
    meanwhile (a job's result) would be glued onto the end of the bar's in a log that gets both
    streams."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.last = stream, ""

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip()  # tqdm pads a redraw with spaces, and clears with blanks
        if line and line != self.last:  # closing, a bar draws its last state again
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last = line
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def bar_stream() -> TextIO:
    """Where a progress bar goes: stderr, redrawn in place on a terminal (and as a notebook's widget),
    else (a log file, a pipe) one line per redraw."""
    from tqdm import autonotebook, std

    in_notebook = autonotebook.tqdm is not std.tqdm
    return sys.stderr if sys.stderr.isatty() or in_notebook else LineStream(sys.stderr)
