"""Running virsh (real or simulated) in the tests."""

from __future__ import annotations

from dataclasses import dataclass
import os
from pathlib import Path
import subprocess

from tests.towersim import Tower


@dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str


def run(argv: list[str], timeout: float = 60) -> Result:
    proc = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def sim(tower: Tower, *args: str) -> Result:
    return run([str(tower.virsh), "-c", tower.uri, *args])


def real(uri: str, *args: str) -> Result:
    return run(["virsh", "-c", uri, *args])


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, after checking its signature and IHDR."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


class LineReader:
    """Lines of a child's stdout, read with a deadline (no threads)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.buffer = b""
        self.lines: list[str] = []
        self.closed = False

    def poll(self, timeout: float = 0.05) -> list[str]:
        """Read what is there (waiting up to ``timeout``); all lines so far."""
        import select

        if not self.closed:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if ready:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    self.closed = True
                self.buffer += chunk
                *done, self.buffer = self.buffer.split(b"\n")
                self.lines += [line.decode("utf-8") for line in done]
        return self.lines
