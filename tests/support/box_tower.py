"""A fresh tower in a box: the guided install's tower, with systemd as init.

The guided install logs in to a tower with an administrator's login, uploads
the agent and runs ``sudo python3 .../gpu-handoff install
[--restart-libvirt]``. ``BoxFreshTower`` is that tower as a Debian host is
right after its set-up, booted in a box (tests/support/box.py: the test root
under its own systemd as PID 1, in private namespaces, on an overlay thrown
away with it), so that what a tower's systemd does is done for real:

- the fresh tower's accounts (tests/support/fresh_tower.py), made with
  the real tools: ``gh-admin`` (sudo without a password),
  ``gh-admin-pw`` (in the ``sudo`` group: sudo asks the password),
  ``gh-plain`` (no sudo) and ``root``, each with a random password and an
  ed25519 key in its ``~/.ssh/authorized_keys``;
- ``/usr/bin/python3`` (the symlink Debian's python3 package makes) and the
  host name in /etc/hosts, as Debian's installer writes it;
- ``sshd`` is the box's ``ssh.service``: a drop-in in
  /etc/ssh/sshd_config.d/ (passwords and keys, ``PermitRootLogin yes``,
  ``StrictModes yes``, this tower's own host key) and a restart of the unit;
  it listens on 127.0.0.1 at ``port``; its log is the unit's journal
  (``log``). ``UsePAM no`` by default: with PAM (on a Debian tower it is
  on; ``pam=True``) every login is a logind session with a user manager
  started for it, and a wrong password costs pam_unix's two-second delay,
  which made the guided-install tests twice as slow; sudo uses PAM either
  way;
- libvirt is the box's real, socket-activated ``libvirtd.service`` (the
  monolithic daemon Debian enables; ``virtqemud.service`` is not installed,
  so ``systemctl is-active`` calls it inactive). Its domains are those of
  libvirt's test driver opened from a file, through the daemon's system
  socket (``uri``: ``test+unix:///var/lib/libvirt/tower/node.xml?socket=
  /run/libvirt/libvirt-sock``), which root and, by Debian's polkit rule, the
  ``libvirt`` group's members may use: ``gpu-node`` (cards 01 and 02),
  ``win-1`` and ``win-2`` (one card each), as tests/tower/nodes.py defines
  them. The socket is named: without it, virsh run by another user than
  root starts a session daemon of that user's and asks it instead.

  Why the test driver: the QEMU driver cannot run these domains here (a
  PCI host device needs the device, and KVM), and the test driver's
  ``test:///default`` lives in the daemon's memory, lost with its last
  connection and at every restart. Opened from a file, the driver reads the
  file again for each connection, so the domains (the GPU node running,
  with its host devices) are the same before and after a real ``systemctl
  restart libvirtd.service``. What a connection changes (a start, a stop)
  is that connection's only: this tower is for the set-up, not for handing
  cards off.

Knobs: ``libvirt=False`` masks libvirt's units (a host that is no libvirt
host: ``uri`` is then ``qemu:///system``, which fails); ``running``: the
domains that run; ``python="missing"`` removes ``/usr/bin/python3*``,
``python="old"`` makes ``python3`` report 3.7; ``virsh=False`` removes
``/usr/bin/virsh``; ``read_only_usr_local=True`` mounts /usr/local
read-only; ``port``: sshd's port (a free one by default); ``pam``: sshd's
``UsePAM``.

Not made: the agent's own SSH user (the install's ``--create-user`` makes
it). The tower's /tmp is its own (not the tests'); ``shared`` is a
directory at the same path inside and outside.

    with BoxFreshTower(tmp_path / "tower") as tower:
        before = tower.main_pid("libvirtd.service")
        ...  # log in to 127.0.0.1:tower.port, run the install
        assert tower.main_pid("libvirtd.service") != before
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
import shutil
import subprocess
import time
from typing import Self

from tests.support.box import MASKED, Box, BoxError, box_unavailable, require_box
from tests.support.fresh_tower import (
    ROOT,
    ROOT_PATH,
    SSHD_SETTINGS,
    USER_PATH,
    Admin,
    Python,
    make_accounts,
    make_logins,
    prepare_files,
)
from tests.support.sshd import generate_key, key_fingerprint
from tests.tower import nodes

HOSTNAME = "tower"
NODE_FILE = "/var/lib/libvirt/tower/node.xml"
# The system daemon's socket, named: without it, a client that is not root
# would start a session daemon of its own (as its user) instead.
SYSTEM_SOCKET = "/run/libvirt/libvirt-sock"
URI = f"test+unix://{NODE_FILE}?socket={SYSTEM_SOCKET}"
NO_LIBVIRT_URI = "qemu:///system"
HOST_KEY = "/etc/ssh/ssh_host_tower_ed25519_key"  # in the box
SSHD_DROP_IN = "/etc/ssh/sshd_config.d/20-tower.conf"
SSH_UNIT = "ssh.service"
LIBVIRTD = "libvirtd.service"
# What libvirt=False masks: the daemon and every socket that would start it.
LIBVIRT_UNITS = (
    LIBVIRTD,
    "libvirtd.socket",
    "libvirtd-ro.socket",
    "libvirtd-admin.socket",
)


class BoxTowerError(RuntimeError):
    """The box tower could not be set up (the message says which step)."""


def box_tower_unavailable() -> str | None:
    """Why no box tower can run here, or None when one can."""
    reason = box_unavailable()
    if reason is None and shutil.which("openssl") is None:
        reason = "the box tower needs openssl (the passwords' hashes)"
    return reason


def require_box_tower() -> None:
    """Skip the test without a box tower; fail when the system must have one
    (``GPU_HANDOFF_REQUIRE_SYSTEM``), as ``require_box`` does."""
    import pytest  # only the tests that want a tower need it

    require_box()
    reason = box_tower_unavailable()
    if reason is None:
        return
    if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM"):
        pytest.fail(f"{reason} (GPU_HANDOFF_REQUIRE_SYSTEM)")
    pytest.skip(reason)


def node_xml(running: tuple[str, ...]) -> str:
    """The test driver's node file: the tower's domains, ``running`` running."""
    body = "".join(
        nodes.domain_xml(name, devices, running=name in running)
        for name, devices in nodes.domains().items()
    )
    return f"<node>{body}</node>\n"


class BoxFreshTower:
    """A freshly set-up Debian tower booted in a box (see the module's
    docstring); a context manager."""

    def __init__(
        self,
        directory: Path,
        *,
        libvirt: bool = True,
        running: tuple[str, ...] = ("gpu-node",),
        python: Python = "present",
        virsh: bool = True,
        read_only_usr_local: bool = False,
        port: int = 0,
        pam: bool = False,
    ) -> None:
        self.directory = directory
        self.pam = pam
        self.with_libvirt = libvirt
        self.running = running
        self.python = python
        self.with_virsh = virsh
        self.read_only_usr_local = read_only_usr_local
        self.port = port
        self.admins: dict[str, Admin] = {}
        self.box: Box | None = None
        self.startup_seconds: float | None = None
        self._hashes: dict[str, str] = {}
        self._owns_directory = False

    # -- what tests read

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def host_key(self) -> Path:
        """sshd's host key (outside; the box has a copy at HOST_KEY)."""
        return self.directory / "host_key"

    @property
    def host_public_key(self) -> str:
        """sshd's host key line (``ssh-ed25519 AAAA...``)."""
        return self.host_key.with_suffix(".pub").read_text(encoding="utf-8").strip()

    @property
    def host_fingerprint(self) -> str:
        """The host key's SHA256 fingerprint as ``ssh-keygen -l`` prints it."""
        return key_fingerprint(self.host_key)

    @property
    def uri(self) -> str:
        """The libvirt URI that reaches the tower's libvirtd (root, and the
        libvirt group's members)."""
        return URI if self.with_libvirt else NO_LIBVIRT_URI

    @property
    def shared(self) -> Path:
        """A directory at the same path inside and outside (read and write)."""
        return self._box().shared

    @property
    def log(self) -> str:
        """What sshd logged so far (ssh.service's journal)."""
        self.run(["journalctl", "--sync"])
        return self.run(
            ["journalctl", "--no-pager", "-o", "cat", "-u", SSH_UNIT]
        ).stdout

    def journal(self, unit: str) -> str:
        """What the box's journal holds of ``unit`` (with time stamps)."""
        self.run(["journalctl", "--sync"])
        return self._box().journal(unit)

    def main_pid(self, unit: str = LIBVIRTD) -> int:
        """The unit's main process id as systemd tells it (0: not running)."""
        done = self.run(["systemctl", "show", "-p", "MainPID", "--value", unit])
        if done.returncode != 0:
            raise BoxTowerError(f"systemctl show {unit}: {done.stderr.strip()}")
        return int(done.stdout.strip() or 0)

    def is_active(self, *units: str) -> list[str]:
        """``systemctl is-active``'s word for each unit."""
        return self.run(["systemctl", "is-active", *units]).stdout.split()

    def run(
        self,
        argv: list[str],
        user: str = ROOT,
        *,
        stdin: str | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the tower as ``user`` (runuser: its groups, its
        HOME), with the PATH a login of that user has. Never raises on a
        failure of the command."""
        env = {
            "PATH": ROOT_PATH if user == ROOT else USER_PATH,
            "HOME": "/root",
            "LANG": "C.UTF-8",
        }
        return subprocess.run(
            [*self._box().argv(user), *argv],
            input=stdin if stdin is not None else "",
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def read(self, path: str) -> str | None:
        """The text of ``path`` inside the tower (read as root), or None when
        there is no such file."""
        return self._output(["cat", "--", path], path)

    def read_bytes(self, path: str) -> bytes | None:
        """The bytes of ``path`` inside the tower (read as root), or None when
        there is no such file."""
        encoded = self._output(["base64", "--wrap=0", "--", path], path)
        return None if encoded is None else base64.b64decode(encoded)

    def _output(self, argv: list[str], path: str) -> str | None:
        """What ``argv``, reading ``path`` as root, prints; None when there is
        no such file."""
        done = self.run(argv)
        if done.returncode == 0:
            return done.stdout
        if "No such file or directory" in done.stderr:
            return None
        raise BoxTowerError(f"cannot read {path} in the tower: {done.stderr}")

    # -- start and stop

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> Self:
        """Boot and set the tower up; on any failure everything made so far
        is undone."""
        began = time.monotonic()
        if self.directory.exists() and any(self.directory.iterdir()):
            raise ValueError(f"a box tower's directory must be new: {self.directory}")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._owns_directory = True
        try:
            generate_key(self.host_key)
            self.admins, self._hashes = make_logins(self.directory)
            masked = MASKED + (() if self.with_libvirt else LIBVIRT_UNITS)
            self.box = Box(
                self.directory / "box",
                masked=masked,
                hostname=HOSTNAME,
                ssh_port=self.port,
            )
            self.box.boot(timeout)
            self.port = self.box.ssh_port
            root = self.box.root
            prepare_files(root, HOSTNAME, python=self.python, virsh=self.with_virsh)
            make_accounts(self._inside, root, self.admins, self._hashes)
            if self.with_libvirt:
                self.box.write(NODE_FILE, node_xml(self.running))
            self._serve_ssh()
            if self.read_only_usr_local:
                self._inside("mount", "--bind", "/usr/local", "/usr/local")
                self._inside("mount", "-o", "remount,bind,ro", "/usr/local")
            if self.with_libvirt and self.with_virsh:
                self._check_libvirt()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Power the box off (every session and what it started goes with
        it) and remove the directory; BoxError if anything of the box is
        left. Safe to call after a failed start, and more than once."""
        box, self.box = self.box, None
        try:
            if box is not None:
                box.close()
        finally:
            if self._owns_directory:
                shutil.rmtree(self.directory, ignore_errors=True)
                self._owns_directory = False

    # -- the steps of start()

    def _box(self) -> Box:
        if self.box is None or self.box.pid1 is None:
            raise BoxTowerError("the tower is not running")
        return self.box

    def _serve_ssh(self) -> None:
        """ssh.service with the tower's settings: a drop-in (read before
        Debian's own sshd_config, so its values win), then a restart."""
        box = self._box()
        key = self.host_key.read_text(encoding="utf-8")
        box.write(HOST_KEY, key, mode=0o600)
        box.write(HOST_KEY + ".pub", self.host_public_key + "\n", mode=0o644)
        box.write(
            SSHD_DROP_IN,
            "# The fresh tower's (tests/support/box_tower.py).\n"
            + "\n".join(
                [
                    f"HostKey {HOST_KEY}",
                    f"UsePAM {'yes' if self.pam else 'no'}",
                    *SSHD_SETTINGS,
                    "",
                ]
            ),
        )
        restarted = box.systemctl("restart", SSH_UNIT)
        if restarted.returncode != 0:
            raise BoxTowerError(
                f"ssh.service did not restart: {restarted.stderr.strip()}\n"
                + box.journal(SSH_UNIT)[-3000:]
            )
        # Type=notify: sshd listens once the restart returns. (No probe of
        # the port: sshd's PerSourcePenalties would count a connection that
        # does not log in against 127.0.0.1.)

    def _check_libvirt(self) -> None:
        listed = self.run(["virsh", "-q", "-c", self.uri, "list", "--all", "--name"])
        names = sorted(listed.stdout.split())
        if listed.returncode != 0 or names != sorted(nodes.domains()):
            raise BoxTowerError(
                f"libvirtd does not serve the tower's domains ({names}): "
                f"{listed.stderr.strip()}\n" + self._box().journal(LIBVIRTD)[-3000:]
            )

    def _inside(
        self, *argv: str, user: str = ROOT, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a setup step inside; any failure fails the start."""
        done = self.run(list(argv), user, stdin=stdin)
        if done.returncode != 0:
            raise BoxTowerError(
                f"{argv[0]} failed in the tower ({done.returncode}): "
                f"{done.stderr.strip() or done.stdout.strip()}"
            )
        return done


__all__ = [
    "LIBVIRTD",
    "NODE_FILE",
    "URI",
    "BoxError",
    "BoxFreshTower",
    "BoxTowerError",
    "box_tower_unavailable",
    "node_xml",
    "require_box_tower",
]
