"""The demo's progress lines, and its one error type.

Lines go to standard output and to ``demo.log`` in the run's directory. When
the demo runs as ``scripts/demo | tee log``, Ctrl-C stops ``tee`` too, at the
same moment, while the demo still has its stop lines to print: before them
the demo gives a reader that is going away a moment to go, and from then on
(or from any write that finds the pipe gone) its standard output is the
terminal, standard error.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
import select
import stat
import sys


class DemoError(Exception):
    """A step of the demo failed; the message says which and why."""


_transcript: list[Path] = []


def keep_transcript(path: Path) -> None:
    """Also append every line to ``path`` from now on."""
    _transcript[:] = [path]


def _to_stderr() -> None:
    """Point standard output at standard error (what is still buffered goes
    there with the next flush)."""
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    with contextlib.suppress(OSError):
        sys.stdout.flush()


def before_stop_lines(grace: float = 0.5) -> None:
    """If standard output is a pipe whose reader is going away (Ctrl-C reaches
    every process of the pipeline), wait up to ``grace`` seconds for it to go,
    and write to standard error once it has."""
    with contextlib.suppress(OSError, ValueError):
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        poller = select.poll()
        poller.register(fd, 0)  # the write end of a pipe with no reader: POLLERR
        if poller.poll(grace * 1000):
            _to_stderr()


def say(line: str) -> None:
    """One line of output."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        _to_stderr()
    for path in _transcript:
        with contextlib.suppress(OSError), path.open("a", encoding="utf-8") as out:
            out.write(line + "\n")


def log(message: str) -> None:
    """One progress line."""
    say(f"demo: {message}")
