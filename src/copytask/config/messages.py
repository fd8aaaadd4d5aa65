"""TODO docstring (config.messages)."""

from __future__ import annotations

# imports from store
import logging
import sys
import warnings
from contextlib import contextmanager
from typing import Iterator

class CopytaskWarning(UserWarning):
    """A run or file that copytask skipped or could not read; the message names its folder."""


def warn(message: str) -> None:
    """A CopytaskWarning, shown where the caller's filters say (the command line prints it as one
    `copytask: warning: ...` line); callers name the offending run (its folder) in `message`."""
    warnings.warn(message, CopytaskWarning, stacklevel=3)


def format_warning(message, category, *args, **kwargs) -> str:
    """A warning as one line: `copytask: warning: ...` for copytask's own, `Category: ...` for others'."""
    return f"copytask: warning: {message}\n" if issubclass(category, CopytaskWarning) else f"{category.__name__}: {message}\n"


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


class Lines(logging.Handler):
    """Log records as bare lines, as the command line prints: below WARNING on stdout, the rest on
    stderr (the streams looked up at each line, so a redirected stdout is followed)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: a handler never raises
            self.handleError(record)


# What a sweep and its jobs say as they go (each job's summary line, the analysis, report and sweep
# lines at the end; errors for failed jobs). The library adds no handler: a caller sees them once it
# configures logging, and errors only (Python's last-resort handler, on stderr) where it has not. The
# command line prints them as `Lines` does, and so does each job through Hydra's job logging
# (configs/hydra/job_logging/copytask.yaml), in every launcher's worker too.
log = logging.getLogger("copytask")
