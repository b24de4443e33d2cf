"""Build the tower agent into the one executable file a tower runs.

The agent is written as Python sources (today the one module
``gpu_handoff.py`` beside this file); a tower gets them as ONE file,
``gpu-handoff``: a zip archive of the sources behind a short text prefix, which
any Python >= 3.9 runs (``python3 gpu-handoff ...``, or as an executable
through its ``#!`` line), as yt-dlp and other programs that ship to a host's
own Python do. The prefix says what the archive is without running it::

    #!/usr/bin/env python3
    # gpu-handoff: the tower agent of GPU Handoff.
    VERSION = "0.3.6"
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
    python3 build.py --cache FILE        # compile a built file for this Python

A built file compiles its module at each start (about 60 ms) unless the
module compiled for the Python running it is beside it (``cache_path``):
``install`` and ``update`` write it, as ``--cache`` does.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import marshal
import os
import re
import sys
from typing import List, Optional, Tuple
import zipfile

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
# The archive's modules, beside this file (the package split adds to these);
# the agent reads this one from its archive to compile itself for the
# tower's Python at install and update (``compiled``).
MODULES = ("build.py", "gpu_handoff.py")
INTERPRETER = "/usr/bin/env python3"
MARKER = "# gpu-handoff: the tower agent of GPU Handoff."
# Run by ``python3 ARCHIVE`` (its ``__loader__`` is the archive's zipimporter).
# It loads the agent's module itself, compiled once: an ``import`` through
# zipimport compiles a source twice (its find_spec asks get_filename, which
# compiles the module to learn its name, then exec_module compiles it again).
# And it need not compile it at all: ``install`` and ``update`` (and the
# NixOS package) write the module compiled for the tower's Python beside the
# program (``cache_path``), which saves the 60 ms compile of every start.
# The compiled code is used only if it was made from these very sources (a
# hash-based pyc, PEP 552, checked against the source's hash) for this
# Python, and if only the program's owner can have written it.
ENTRY = r'''"""gpu-handoff: run the tower agent of GPU Handoff from this archive."""
import os
import stat
import sys
import types


def cached(program, source):
    """The module compiled beside the program for this Python, if it is that
    of ``source`` and nobody but the program's owner can have written it."""
    tag = sys.implementation.cache_tag
    if tag is None:
        return None
    directory, name = os.path.split(program)
    pyc = os.path.join(directory, "__pycache__", "%s.%s.pyc" % (name, tag))
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(pyc, flags)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        found = (os.fstat(fd), os.stat(os.path.dirname(pyc)))
        owner = os.stat(program).st_uid
        if not stat.S_ISREG(found[0].st_mode) or any(
            item.st_uid != owner or item.st_mode & 0o022 for item in found
        ):
            return None
        data = handle.read()
    import importlib.util

    header = importlib.util.MAGIC_NUMBER + b"\x03\x00\x00\x00"
    if data[:8] != header or data[8:16] != importlib.util.source_hash(source):
        return None
    import marshal

    try:
        return marshal.loads(data[16:])
    except (EOFError, ValueError, TypeError):
        return None


def load(name):
    program = os.path.realpath(__loader__.archive)
    path = program + "/" + name + ".py"
    source = __loader__.get_data(name + ".py")
    module = types.ModuleType(name)
    module.__file__ = path
    module.__loader__ = __loader__
    sys.modules[name] = module
    code = cached(program, source)
    if code is None:
        code = compile(source, path, "exec", dont_inherit=True)
    exec(code, module.__dict__)
    return module


sys.exit(load("gpu_handoff").main())
'''
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
CACHE_MODE = 0o644
# A checked hash-based pyc (PEP 552): flags, then the source's hash.
PYC_FLAGS = b"\x03\x00\x00\x00"


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
    _replace(path, archive_bytes() if data is None else data, PROGRAM_MODE)


def cache_path(program: str) -> str:
    """Where the entry of the built file ``program`` looks for its module
    compiled for this Python: ``__pycache__/<name>.<tag>.pyc`` beside it, as
    Python keeps a module's own."""
    tag = sys.implementation.cache_tag
    if tag is None:
        raise BuildError("this Python keeps no compiled modules")
    directory, name = os.path.split(program)
    return os.path.join(directory, "__pycache__", f"{name}.{tag}.pyc")


def compiled(data: bytes, program: str) -> bytes:
    """The agent's module in the built file ``data`` compiled for this
    Python, as the file's entry takes it when run as ``program`` (its real
    path): a hash-based pyc of the module's source."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zipped:
            source = zipped.read("gpu_handoff.py")
    except (zipfile.BadZipFile, KeyError):
        raise BuildError("not a built GPU Handoff agent") from None
    code = compile(source, f"{program}/gpu_handoff.py", "exec", dont_inherit=True)
    return (
        importlib.util.MAGIC_NUMBER
        + PYC_FLAGS
        + importlib.util.source_hash(source)
        + marshal.dumps(code)
    )


def write_cache(program: str) -> str:
    """Compile the built file ``program`` for this Python beside it
    (``cache_path``; the directory made 0755 if missing, the file 0644,
    replaced at once); its path."""
    real = os.path.realpath(program)
    with open(real, "rb") as handle:
        data = compiled(handle.read(), real)
    path = cache_path(real)
    with contextlib.suppress(FileExistsError):
        os.mkdir(os.path.dirname(path), PROGRAM_MODE)
    _replace(path, data, CACHE_MODE)
    return path


def _replace(path: str, data: bytes, mode: int) -> None:
    staged = f"{path}.building-{os.getpid()}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(staged, mode)
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
        if len(args) == 2 and args[0] == "--cache":
            print(f"wrote {write_cache(args[1])}")
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
    print(
        "usage: build.py OUT | build.py --header FILE | build.py --cache FILE",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
