"""Build the tower agent into the one executable file a tower runs.

The agent is written as Python sources (today the one module
``gpu_handoff.py`` beside this file); a tower gets them as ONE file,
``gpu-handoff``: a zip archive of the sources behind a short text prefix, which
any Python >= 3.9 runs (``python3 gpu-handoff ...``, or as an executable
through its ``#!`` line), as yt-dlp and other programs that ship to a host's
own Python do. The prefix says what the archive is without running it::

    #!/usr/bin/env python3
    # gpu-handoff: the tower agent of GPU Handoff.
    VERSION = "0.3.5"
    # sha256 of the archive below: 3f2a...

Its second line is the marker an ``update`` looks for in an installed file
(``AGENT_MARKER``, within the first ``AGENT_HEAD`` bytes), its third the line
``update`` reads the installed version from (``VERSION_LINE_RE``): both as in
a 0.3 agent, which was a single source file, so either release recognises the
other's install. The hash is over the zip bytes that follow the prefix
(``read_header`` checks it).

The build is deterministic: the same sources give the same bytes, on any
Python >= 3.9 (every entry stored uncompressed, in name order, dated
1980-01-01, with fixed permissions; nothing of the building machine goes in).

Standard library only, and importable without the agent: Home Assistant's
guided install builds the file it uploads with it. As a command::

    python3 build.py OUT                 # write the agent to OUT (mode 0755)
    python3 build.py --header FILE       # print a built file's version and hash
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import sys
from typing import List, Optional, Tuple
import zipfile

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
# The archive's modules, beside this file (the package split adds to these).
MODULES = ("gpu_handoff.py",)
INTERPRETER = "/usr/bin/env python3"
MARKER = "# gpu-handoff: the tower agent of GPU Handoff."
# Run by ``python3 ARCHIVE`` (its ``__loader__`` is the archive's zipimporter).
# It compiles the agent's module itself, once: an ``import`` through
# zipimport compiles a source twice (its find_spec asks get_filename, which
# compiles the module to learn its name, then exec_module compiles it again),
# which would add a second 60 ms compile of the agent to every start.
ENTRY = (
    '"""gpu-handoff: run the tower agent of GPU Handoff from this archive."""\n'
    "import sys\n"
    "import types\n"
    "\n"
    "\n"
    "def load(name):\n"
    "    path = __loader__.archive + '/' + name + '.py'\n"
    "    module = types.ModuleType(name)\n"
    "    module.__file__ = path\n"
    "    module.__loader__ = __loader__\n"
    "    sys.modules[name] = module\n"
    "    code = compile(__loader__.get_data(name + '.py'), path, 'exec', dont_inherit=True)\n"
    "    exec(code, module.__dict__)\n"
    "    return module\n"
    "\n"
    "\n"
    "sys.exit(load('gpu_handoff').main())\n"
)
VERSION_RE = re.compile(r'^VERSION = "([0-9A-Za-z.+-]{1,40})"$', re.MULTILINE)
HASH_LINE = "# sha256 of the archive below: "
HEADER_RE = re.compile(
    rb"\A#![^\n]*\n"
    + re.escape(MARKER.encode())
    + rb'\nVERSION = "([0-9A-Za-z.+-]{1,40})"\n'
    + re.escape(HASH_LINE.encode())
    + rb"([0-9a-f]{64})\n"
)
EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip entry can carry
ENTRY_MODE = 0o100644  # a regular file, rw-r--r--
PROGRAM_MODE = 0o755


class BuildError(Exception):
    """The sources cannot be built (a module missing, no version line)."""


def sources(source_dir: Optional[str] = None) -> List[Tuple[str, bytes]]:
    """The archive's entries, (name, bytes), in the order they are stored."""
    directory = source_dir or SOURCE_DIR
    entries = [("__main__.py", ENTRY.encode())]
    for name in MODULES:
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as handle:
                entries.append((name, handle.read()))
        except OSError as error:
            raise BuildError(f"cannot read {path}: {error.strerror}") from None
    return sorted(entries)


def source_version(entries: List[Tuple[str, bytes]]) -> str:
    """The agent's VERSION, read from its sources (not by running them)."""
    for name, data in entries:
        if name == "gpu_handoff.py":
            found = VERSION_RE.search(data.decode("utf-8"))
            if found:
                return found.group(1)
    raise BuildError("no VERSION line in gpu_handoff.py")


def archive(entries: List[Tuple[str, bytes]]) -> bytes:
    """The zip of ``entries``, byte for byte the same wherever it is built."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as zipped:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=EPOCH)
            info.create_system = 3  # Unix: external_attr holds the mode
            info.external_attr = ENTRY_MODE << 16
            info.compress_type = zipfile.ZIP_STORED
            zipped.writestr(info, data)
    return buffer.getvalue()


def archive_bytes(
    source_dir: Optional[str] = None,
    version: Optional[str] = None,
    interpreter: str = INTERPRETER,
) -> bytes:
    """The agent as one executable file's bytes. ``version`` only overrides
    the prefix's VERSION line (tests of ``update`` against other releases);
    ``interpreter`` is the ``#!`` line's program (a NixOS package names the
    store's Python)."""
    entries = sources(source_dir)
    payload = archive(entries)
    stated = version or source_version(entries)
    if not re.fullmatch(r"[0-9A-Za-z.+-]{1,40}", stated):
        raise BuildError(f"not a version: {stated!r}")
    if not interpreter or "\n" in interpreter:
        raise BuildError("the interpreter must be one line")
    prefix = (
        f"#!{interpreter}\n"
        f"{MARKER}\n"
        f'VERSION = "{stated}"\n'
        f"{HASH_LINE}{hashlib.sha256(payload).hexdigest()}\n"
    )
    return prefix.encode() + payload


def read_header(data: bytes) -> Tuple[str, str]:
    """(version, sha256) of a built agent, read from its prefix; BuildError
    if ``data`` is not one or its archive is not what the prefix says."""
    found = HEADER_RE.match(data)
    if not found:
        raise BuildError("not a built GPU Handoff agent")
    version, digest = found.group(1).decode(), found.group(2).decode()
    if hashlib.sha256(data[found.end() :]).hexdigest() != digest:
        raise BuildError("the archive does not match its stated sha256")
    return version, digest


def write(path: str, data: Optional[bytes] = None) -> None:
    """Write the built agent (or ``data``) to ``path``, mode 0755, replacing
    what is there at once."""
    built = archive_bytes() if data is None else data
    staged = f"{path}.building-{os.getpid()}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PROGRAM_MODE)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(built)
        os.chmod(staged, PROGRAM_MODE)
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
        raise


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) == 2 and args[0] == "--header":
            with open(args[1], "rb") as handle:
                version, digest = read_header(handle.read())
            print(f"{version} sha256={digest}")
            return 0
        if len(args) == 1 and not args[0].startswith("-"):
            write(args[0])
            with open(args[0], "rb") as handle:
                version, digest = read_header(handle.read())
            print(f"wrote {args[0]}: gpu-handoff {version} sha256={digest}")
            return 0
    except (BuildError, OSError) as error:
        print(f"build: {error}", file=sys.stderr)
        return 1
    print("usage: build.py OUT | build.py --header FILE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
