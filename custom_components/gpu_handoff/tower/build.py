"""Build the tower agent into the one executable file a tower runs.

The agent is written as a package of Python sources (``gpu_handoff/`` beside
this file, one module per concern); a tower gets them as ONE file,
``gpu-handoff``: a zip archive of the sources behind a short text prefix, which
any Python >= 3.9 runs (``python3 gpu-handoff ...``, or as an executable
through its ``#!`` line), as yt-dlp and other programs that ship to a host's
own Python do. The prefix says what the archive is without running it::

    #!/usr/bin/env python3
    # gpu-handoff: the tower agent of GPU Handoff.
    VERSION = "0.3.7"
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

A built file compiles its modules as it imports them (about 60 ms in all)
unless they are compiled for the Python running it beside it
(``cache_path``): ``install`` and ``update`` write that, as ``--cache`` does.
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
# The agent's package, beside this file: every module of it goes in (but its
# __main__.py, which runs it from a checkout), and this file, which the agent
# reads from its archive to compile itself for the tower's Python at install
# and update (``compiled``).
PACKAGE = "gpu_handoff"
BUILDER = "build.py"
# The module whose VERSION line is the agent's version.
VERSION_MODULE = f"{PACKAGE}/wire.py"
INTERPRETER = "/usr/bin/env python3"
MARKER = "# gpu-handoff: the tower agent of GPU Handoff."
# Run by ``python3 ARCHIVE`` (its ``__loader__`` is the archive's zipimporter).
# It imports the agent's package through a finder of its own, placed first:
# an ``import`` through zipimport compiles a source twice (its find_spec asks
# get_filename, which compiles the module to learn its name, then
# exec_module compiles it again). And it need not compile at all: ``install``
# and ``update`` (and the NixOS package) write the modules compiled for the
# tower's Python beside the program (``cache_path``), which saves the 60 ms
# compile of every start. The compiled code is used only if it was made from
# these very sources (checked against their hash, as a hash-based pyc is,
# PEP 552) for this Python, and if only the program's owner can have written
# it. Each module's loader is this finder, which answers ``archive`` and
# ``get_data`` as the zipimporter does.
ENTRY = r'''"""gpu-handoff: run the tower agent of GPU Handoff from this archive."""
import importlib.machinery
import importlib.util
import marshal
import os
import stat
import sys

# The agent's modules in this archive, by name (written by the build).
MODULES = __MODULES__


def cached(program, key):
    """The modules compiled beside the program for this Python, by name, if
    they are those of the sources hashed in ``key`` and nobody but the
    program's owner can have written them."""
    tag = sys.implementation.cache_tag
    if tag is None:
        return {}
    directory, name = os.path.split(program)
    pyc = os.path.join(directory, "__pycache__", "%s.%s.pyc" % (name, tag))
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(pyc, flags)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as handle:
        found = (os.fstat(fd), os.stat(os.path.dirname(pyc)))
        owner = os.stat(program).st_uid
        if not stat.S_ISREG(found[0].st_mode) or any(
            item.st_uid != owner or item.st_mode & 0o022 for item in found
        ):
            return {}
        data = handle.read()
    header = importlib.util.MAGIC_NUMBER + b"\x03\x00\x00\x00"
    if data[:8] != header or data[8:16] != importlib.util.source_hash(key):
        return {}
    try:
        codes = marshal.loads(data[16:])
    except (EOFError, ValueError, TypeError):
        return {}
    return codes if isinstance(codes, dict) else {}


class Agent:
    """Finds and loads the agent's modules in this archive."""

    def __init__(self, archive):
        self.archive = os.path.realpath(archive.archive)
        self._zip = archive
        self.sources = dict(MODULES)
        # Each source read once: for the cache's key, and to compile it if
        # the cache is not this program's.
        self.texts = {name: self.get_data(entry) for name, entry in MODULES}
        key = b"".join(
            name.encode() + b"\0" + self.texts[name] + b"\0" for name, _ in MODULES
        )
        self.codes = cached(self.archive, key)

    def get_data(self, name):
        return self._zip.get_data(name)

    def find_spec(self, name, path=None, target=None):
        entry = self.sources.get(name)
        if entry is None:
            return None
        spec = importlib.machinery.ModuleSpec(
            name,
            self,
            origin=self.archive + "/" + entry,
            is_package=entry.endswith("/__init__.py"),
        )
        spec.has_location = True
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        code = self.codes.get(module.__name__)
        if code is None:
            source = self.texts[module.__name__]
            code = compile(source, module.__file__, "exec", dont_inherit=True)
        exec(code, module.__dict__)


sys.meta_path.insert(0, Agent(__loader__))
from gpu_handoff.cli import main

sys.exit(main())
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


def package_modules(source_dir: Optional[str] = None) -> List[str]:
    """The archive's entries of the agent's package, in name order."""
    directory = os.path.join(source_dir or SOURCE_DIR, PACKAGE)
    try:
        names = os.listdir(directory)
    except OSError as error:
        raise BuildError(f"cannot read {directory}: {error.strerror}") from None
    found = sorted(
        f"{PACKAGE}/{name}"
        for name in names
        if name.endswith(".py") and name != "__main__.py"
    )
    if f"{PACKAGE}/__init__.py" not in found:
        raise BuildError(f"{directory} is not the agent's package")
    return found


def module_name(entry: str) -> str:
    """The module an entry of the package holds (``gpu_handoff/jobs.py``:
    ``gpu_handoff.jobs``; its ``__init__.py``: ``gpu_handoff``)."""
    name = entry[: -len(".py")].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def entry_source(modules: List[str]) -> bytes:
    """The archive's ``__main__.py``: ENTRY, with the package's modules."""
    table = tuple(sorted((module_name(entry), entry) for entry in modules))
    return ENTRY.replace("__MODULES__", repr(table), 1).encode()


def sources(source_dir: Optional[str] = None) -> List[Tuple[str, bytes]]:
    """The archive's entries, (name, bytes), in the order they are stored."""
    directory = source_dir or SOURCE_DIR
    modules = package_modules(directory)
    entries = [("__main__.py", entry_source(modules))]
    for name in [BUILDER, *modules]:
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
        if name == VERSION_MODULE:
            found = VERSION_RE.search(data.decode("utf-8"))
            if found:
                return found.group(1)
    raise BuildError(f"no VERSION line in {VERSION_MODULE}")


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
    """Where the entry of the built file ``program`` looks for its modules
    compiled for this Python: ``__pycache__/<name>.<tag>.pyc`` beside it, as
    Python keeps a module's own."""
    tag = sys.implementation.cache_tag
    if tag is None:
        raise BuildError("this Python keeps no compiled modules")
    directory, name = os.path.split(program)
    return os.path.join(directory, "__pycache__", f"{name}.{tag}.pyc")


def compiled(data: bytes, program: str) -> bytes:
    """The agent's modules in the built file ``data`` compiled for this
    Python, as the file's entry takes them when run as ``program`` (its real
    path): the code of each module by its name (marshal), behind a checked
    hash-based pyc's header whose hash is that of all their sources."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zipped:
            modules = [
                name
                for name in sorted(zipped.namelist())
                if name.startswith(f"{PACKAGE}/") and name.endswith(".py")
            ]
            texts = [(entry, zipped.read(entry)) for entry in modules]
    except zipfile.BadZipFile:
        raise BuildError("not a built GPU Handoff agent") from None
    if f"{PACKAGE}/__init__.py" not in modules:
        raise BuildError("not a built GPU Handoff agent")
    named = sorted((module_name(entry), entry, text) for entry, text in texts)
    # The key ENTRY computes as it starts (it cannot import this module).
    key = b"".join(name.encode() + b"\0" + text + b"\0" for name, _, text in named)
    codes = {
        name: compile(text, f"{program}/{entry}", "exec", dont_inherit=True)
        for name, entry, text in named
    }
    return (
        importlib.util.MAGIC_NUMBER
        + PYC_FLAGS
        + importlib.util.source_hash(key)
        + marshal.dumps(codes)
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
