"""Guided install: the tower's agent installed, or updated, from Home Assistant.

The user gives an administrator login on the tower once (a user with sudo, or
root; a password or a key). With it, and only for the length of the step,
Home Assistant checks what the tower has (who may use sudo, Python, virsh,
libvirt, the VMs libvirt knows), uploads the agent it ships (SFTP, to a fresh
private directory), and runs the agent's own ``install`` (or ``update``) as
root. The install writes Home Assistant's restricted key line itself; from
then on Home Assistant logs in with that key only. The administrator login is
never stored, logged or shown in diagnostics: it lives in an ``AdminLogin``
whose ``repr`` hides it, and the flow drops it when the step ends.

Every command sent to the tower is a fixed text or a list of words joined with
``shlex.join`` (each word quoted for the login shell); the words the user
chose are checked against the tower's own list or a strict pattern first.
Knows nothing about Home Assistant.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
import contextlib
from dataclasses import dataclass, field
import json
import re
import secrets
import shlex
from typing import Any, Final, Literal

import asyncssh

from .tower import build
from .tower.gpu_handoff import wire
from .tower_client import (
    CONNECT_TIMEOUT,
    TowerAuthError,
    load_private_key,
    pinned_host,
)

# The oldest Python the agent runs on (it is written for 3.9).
MIN_PYTHON: Final = (3, 9)
# A survey is a few short commands; an install also checks the tower's status.
SURVEY_TIMEOUT: Final = 60.0
INSTALL_TIMEOUT: Final = 180.0
# On the tower: a new directory (SFTP's mkdir fails on an existing one, so
# nobody can plant it), mode 0700, its name random, removed afterwards.
UPLOAD_DIR_PREFIX: Final = "/tmp/gpu-handoff-install-"  # noqa: S108
# useradd's portable names (the agent checks the same).
USER_NAME: Final = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# A libvirt URI: a scheme, then no blank, quote or shell-special character.
LIBVIRT_URI: Final = re.compile(r"^[a-z][a-z0-9+.-]*:/[^\s'\"`$\\;&|<>()]*$")

# What the survey runs as root: facts only, changes nothing. "$1" is the SSH
# user's name (an argument, never part of the script's text).
SURVEY_SCRIPT: Final = """\
export LC_ALL=C
if command -v python3 >/dev/null 2>&1; then
  python3 -c 'import sys; print("python=%d.%d" % sys.version_info[:2])' \
    || echo python=broken
else
  echo python=
fi
if command -v virsh >/dev/null 2>&1; then echo virsh=yes; else echo virsh=; fi
if [ -e /etc/NIXOS ]; then echo nixos=yes; fi
echo "user=$(id -u -- "$1" 2>/dev/null)"
if id -u -- "$1" >/dev/null 2>&1; then
  echo "groups=$(id -Gn -- "$1" 2>/dev/null)"
  entry=$(getent passwd "$1")
  home=$(printf '%s' "$entry" | cut -d: -f6)
  echo "shell=$(printf '%s' "$entry" | cut -d: -f7)"
  echo "password=$(passwd -S "$1" 2>/dev/null | cut -d' ' -f2)"
  echo "home=$home"
  echo "home_mode=$(stat -c '%a %U' -- "$home" 2>/dev/null)"
  if sudo -n -l -U "$1" 2>/dev/null | grep -q 'may run the following'; then
    echo sudoer=yes
  fi
fi
if [ -e /etc/gpu-handoff/config.json ]; then echo config=yes; fi
if [ -x /usr/local/bin/gpu-handoff ]; then
  /usr/local/bin/gpu-handoff version 2>/dev/null | sed -n 's/^/agent=/p'
fi
"""

Sudo = Literal["root", "nopasswd", "password"]


class InstallError(Exception):
    """A step of the guided install failed: ``key`` names the translated
    message, ``detail`` what the tower said, ``left`` what it left behind."""

    def __init__(self, key: str, detail: str = "", left: list[str] | None = None):
        """Keep the key, the tower's words and what is left."""
        super().__init__(f"{key}: {detail}" if detail else key)
        self.key = key
        self.detail = detail
        self.left = list(left or [])


@dataclass(frozen=True, kw_only=True)
class AdminLogin:
    """An administrator's login on the tower, for one step: a password or a
    key (and its passphrase), and sudo's password when it differs from the
    login's. Never stored; ``repr`` shows no secret."""

    username: str
    password: str | None = None
    private_key: str | None = None
    passphrase: str | None = None
    sudo_password: str | None = None

    def __repr__(self) -> str:
        """The user name and how it logs in; never the secrets."""
        how = "key" if self.private_key else "password"
        return f"AdminLogin(username={self.username!r}, with={how})"

    @property
    def password_for_sudo(self) -> str | None:
        """What sudo gets when it asks: its own password, else the login's."""
        return self.sudo_password or self.password


# Groups whose members are root in all but name (sudo and su rights, the
# logs, the container engines' sockets, raw disks, the shadow file): an
# account in one of them is not one to hand Home Assistant a key to.
ADMIN_GROUPS: Final = frozenset(
    {
        "root",
        "sudo",
        "wheel",
        "admin",
        "adm",
        "docker",
        "podman",
        "lxd",
        "incus-admin",
        "disk",
        "shadow",
    }
)


@dataclass(frozen=True, kw_only=True)
class Account:
    """An existing account of the name given for Home Assistant, as root
    sees it: the install keeps it as it is (its shell, its password, its
    groups) and only adds libvirt and Home Assistant's key."""

    groups: list[str]
    shell: str
    # passwd -S: P (a usable password), L (locked), NP (none), or "?"
    password: str
    home: str
    home_mode: str  # "755 gpu-handoff": its mode and owner
    sudoer: bool

    def refusal(self, user: str) -> InstallError | None:
        """Why this account may not be the agent's (None: it may)."""
        admin = ADMIN_GROUPS & set(self.groups) | ({"sudo"} if self.sudoer else set())
        if admin:
            return InstallError("agent_user_is_admin", ", ".join(sorted(admin)))
        mode, _, owner = self.home_mode.partition(" ")
        try:
            writable = int(mode, 8) & 0o022
        except ValueError:
            writable = 1  # no home to check: sshd would refuse the key
        if writable or owner not in (user, "root"):
            return InstallError(
                "agent_user_home_unsafe", f"{self.home} {self.home_mode}"
            )
        return None


@dataclass(frozen=True, kw_only=True)
class Survey:
    """What the tower has, as root sees it."""

    sudo: Sudo
    python: str
    nixos: bool
    config_exists: bool
    agent_version: str | None
    # The VMs the agent may manage; those whose names virsh would read as a
    # domain id or UUID first (the agent refuses them) are left out.
    domains: list[str]
    left_out: list[str] = field(default_factory=list)
    # The account for Home Assistant, if it exists already (None: made).
    account: Account | None = None


@dataclass(frozen=True, kw_only=True)
class InstallPlan:
    """The options of one install (checked: see ``check_plan``)."""

    user: str
    gpu_node: str
    gaming: list[str]
    uri: str
    public_key: str
    restart_libvirt: bool
    replace_config: bool

    def argv(self, program: str) -> list[str]:
        """The agent's install command line."""
        words = [
            "python3",
            program,
            "install",
            "--user",
            self.user,
            "--gpu-node",
            self.gpu_node,
        ]
        for name in self.gaming:
            words += ["--gaming", name]
        words += [
            "--uri",
            self.uri,
            "--create-user",
            "--join-libvirt-group",
            "--authorize-key",
            self.public_key,
        ]
        if self.restart_libvirt:
            words.append("--restart-libvirt")
        if self.replace_config:
            words.append("--force")
        return words


@dataclass(frozen=True, kw_only=True)
class InstallReport:
    """What the install did and found."""

    nixos: bool
    nixos_module: str = ""
    libvirt_restarted: bool | None = None
    libvirt_restart_message: str = ""
    findings: list[dict[str, Any]] = field(default_factory=list)
    status_error: str = ""


@dataclass(frozen=True, kw_only=True)
class UpdateReport:
    """What the update replaced."""

    path: str
    previous: str | None
    version: str


def check_user_name(name: str) -> bool:
    """Whether ``name`` is an account name the install may use or create:
    never root (the agent needs no privilege; its key must not get one)."""
    return USER_NAME.fullmatch(name) is not None and name != "root"


def check_uri(uri: str) -> bool:
    """Whether ``uri`` is a libvirt URI of the tower's own libvirt, which the
    survey and the install may use as root: the agent's install takes the
    same (its local_libvirt_uri); no host, no transport or parameter that
    runs a program, reads a key or connects elsewhere."""
    return LIBVIRT_URI.fullmatch(uri) is not None and wire.local_libvirt_uri(uri)


def _account(found: dict[str, str]) -> Account:
    """The survey's facts of an existing account."""
    return Account(
        groups=found.get("groups", "").split(),
        shell=found.get("shell", ""),
        password=found.get("password") or "?",
        home=found.get("home", ""),
        home_mode=found.get("home_mode", ""),
        sudoer=bool(found.get("sudoer")),
    )


def check_plan(plan: InstallPlan, survey: Survey) -> None:
    """Refuse a plan whose names are not the tower's own (InstallError)."""
    known = set(survey.domains)
    if not check_user_name(plan.user):
        raise InstallError("invalid_agent_user", plan.user)
    if not check_uri(plan.uri):
        raise InstallError("invalid_uri", plan.uri)
    for name in (plan.gpu_node, *plan.gaming):
        if wire.virsh_reads_as(name):
            raise InstallError("ambiguous_domain", name)
    if plan.gpu_node not in known:
        raise InstallError("unknown_domain", plan.gpu_node)
    for name in plan.gaming:
        if name not in known or name == plan.gpu_node:
            raise InstallError("unknown_domain", name)
    if not plan.gaming:
        raise InstallError("no_gaming_vm")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


class AdminSession:
    """One administrator connection to the tower."""

    def __init__(self, conn: asyncssh.SSHClientConnection, login: AdminLogin):
        """Wrap an open connection."""
        self._conn = conn
        self._login = login
        self._sudo: Sudo | None = None

    async def _run(
        self, words: list[str], *, as_root: bool, timeout: float
    ) -> asyncssh.SSHCompletedProcess:
        """Run ``words`` (quoted for the login shell), as root when asked:
        through sudo unless the login is root's. sudo's password, when it
        wants one, goes on standard input, never on a command line."""
        prefix: list[str] = []
        stdin = ""
        if as_root and self._sudo == "nopasswd":
            prefix = ["sudo", "-n", "--"]
        elif as_root and self._sudo == "password":
            prefix = ["sudo", "-k", "-S", "-p", "", "--"]
            stdin = f"{self._login.password_for_sudo}\n"
        command = "LC_ALL=C " + shlex.join([*prefix, *words])
        async with asyncio.timeout(timeout):
            return await self._conn.run(command, input=stdin, check=False)

    async def _check_sudo(self) -> Sudo:
        """root, sudo without a password, or sudo with one (checked)."""
        who = await self._run(["id", "-u"], as_root=False, timeout=SURVEY_TIMEOUT)
        if _text(who.stdout).strip() == "0":
            return "root"
        plain = await self._run(
            ["sudo", "-n", "true"], as_root=False, timeout=SURVEY_TIMEOUT
        )
        if plain.exit_status == 0:
            return "nopasswd"
        said = _text(plain.stderr)
        if "password is required" not in said:
            raise InstallError("admin_no_sudo", _first_line(said))
        password = self._login.password_for_sudo
        if not password:
            raise InstallError("admin_sudo_password")
        self._sudo = "password"
        checked = await self._run(["true"], as_root=True, timeout=SURVEY_TIMEOUT)
        if checked.exit_status == 0:
            return "password"
        said = _text(checked.stderr)
        if "incorrect password" in said or "try again" in said:
            raise InstallError("admin_sudo_wrong_password")
        raise InstallError("admin_no_sudo", _first_line(said))

    async def survey(self, user: str, uri: str) -> Survey:
        """What the tower has; InstallError when it lacks what the agent needs."""
        if not check_user_name(user):
            raise InstallError("invalid_agent_user", user)
        if not check_uri(uri):
            raise InstallError("invalid_uri", uri)
        self._sudo = await self._check_sudo()
        facts = await self._run(
            ["sh", "-c", SURVEY_SCRIPT, "sh", user],
            as_root=True,
            timeout=SURVEY_TIMEOUT,
        )
        found: dict[str, str] = {}
        for line in _text(facts.stdout).splitlines():
            key, sep, value = line.partition("=")
            if sep and key not in found:
                found[key] = value.strip()
        if found.get("user") == "0":  # another name of root's
            raise InstallError("invalid_agent_user", user)
        account = _account(found) if found.get("user") else None
        if account is not None and (refused := account.refusal(user)) is not None:
            raise refused
        python = found.get("python", "")
        if not _python_ok(python):
            raise InstallError("tower_no_python", python or "python3")
        if not found.get("virsh"):
            raise InstallError("tower_no_virsh")
        listing = await self._domains(uri)
        # virsh would look such a name up as a domain id or UUID first, and
        # could act on another VM: the agent refuses it, so nobody picks it.
        left_out = [name for name in listing if wire.virsh_reads_as(name)]
        domains = [name for name in listing if name not in left_out]
        if not domains:
            raise InstallError("ambiguous_domain", ", ".join(left_out))
        return Survey(
            sudo=self._sudo,
            python=python,
            nixos=bool(found.get("nixos")),
            config_exists=bool(found.get("config")),
            agent_version=_agent_version(found.get("agent", "")),
            domains=domains,
            left_out=left_out,
            account=account,
        )

    async def _domains(self, uri: str) -> list[str]:
        """Every domain libvirt at ``uri`` defines, sorted (at least one)."""
        listed = await self._run(
            ["virsh", "-q", "-c", uri, "list", "--all", "--name"],
            as_root=True,
            timeout=SURVEY_TIMEOUT,
        )
        if listed.exit_status != 0:
            said = _first_line(_text(listed.stderr)) or _first_line(
                _text(listed.stdout)
            )
            raise InstallError("tower_not_libvirt", said)
        listing = sorted(
            {line.strip() for line in _text(listed.stdout).splitlines()} - {""}
        )
        if not listing:
            raise InstallError("tower_no_domains", uri)
        return listing

    @contextlib.asynccontextmanager
    async def _uploaded_agent(self) -> AsyncIterator[str]:
        """The agent this integration ships, built into its one file (as the
        tower runs it), in a fresh directory only the administrator can enter;
        removed afterwards whatever happens."""
        directory = UPLOAD_DIR_PREFIX + secrets.token_hex(8)
        program = f"{directory}/gpu-handoff"
        code = await asyncio.get_running_loop().run_in_executor(
            None, build.archive_bytes
        )
        try:
            sftp = await self._conn.start_sftp_client()
        except (asyncssh.Error, OSError) as err:
            raise InstallError("upload_failed", str(err)) from err
        async with sftp:
            try:
                await sftp.mkdir(directory, asyncssh.SFTPAttrs(permissions=0o700))
                async with sftp.open(program, "wb") as handle:
                    await handle.write(code)
            except (asyncssh.Error, OSError) as err:
                with contextlib.suppress(asyncssh.Error, OSError):
                    await sftp.rmtree(directory)
                raise InstallError("upload_failed", str(err)) from err
            try:
                yield program
            finally:
                with contextlib.suppress(asyncssh.Error, OSError):
                    await sftp.rmtree(directory)

    async def _agent(self, words: list[str]) -> dict[str, Any]:
        """Run the uploaded agent as root; its JSON reply (ok or not)."""
        done = await self._run(words, as_root=True, timeout=INSTALL_TIMEOUT)
        lines = [line for line in _text(done.stdout).splitlines() if line.strip()]
        try:
            reply = json.loads(lines[-1]) if lines else None
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            said = _first_line(_text(done.stderr)) or f"exit {done.exit_status}"
            raise InstallError("install_failed", said)
        return reply

    async def install(self, plan: InstallPlan, survey: Survey) -> InstallReport:
        """Upload the agent and run its install with the plan's options."""
        check_plan(plan, survey)
        self._sudo = survey.sudo
        async with self._uploaded_agent() as program:
            reply = await self._agent(plan.argv(program))
        if not reply.get("ok"):
            raise _install_error(reply)
        if reply.get("nixos"):
            return InstallReport(
                nixos=True, nixos_module=str(reply.get("nixos_module"))
            )
        restart = reply.get("libvirt_restart")
        status_error = reply.get("status_error")
        return InstallReport(
            nixos=False,
            libvirt_restarted=bool(restart.get("done"))
            if isinstance(restart, dict)
            else None,
            libvirt_restart_message=str(restart.get("message") or "")
            if isinstance(restart, dict)
            else "",
            findings=[f for f in reply.get("findings") or [] if isinstance(f, dict)],
            status_error=str(status_error.get("message") or "")
            if isinstance(status_error, dict)
            else "",
        )

    async def update(self) -> UpdateReport:
        """Replace the installed agent with the one this integration ships."""
        self._sudo = await self._check_sudo()
        async with self._uploaded_agent() as program:
            reply = await self._agent(["python3", program, "update"])
        if not reply.get("ok"):
            raise _install_error(reply)
        return UpdateReport(
            path=str(reply.get("updated")),
            previous=reply.get("previous")
            if isinstance(reply.get("previous"), str)
            else None,
            version=str(reply.get("version")),
        )


def _python_ok(version: str) -> bool:
    major, _, minor = version.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        return False
    return (int(major), int(minor)) >= MIN_PYTHON


def _agent_version(line: str) -> str | None:
    try:
        reply = json.loads(line) if line else None
    except ValueError:
        return None
    version = reply.get("version") if isinstance(reply, dict) else None
    return version if isinstance(version, str) else None


def _install_error(reply: dict[str, Any]) -> InstallError:
    """The translated failure of an agent's install or update reply."""
    error = reply.get("error")
    error = error if isinstance(error, dict) else {}
    code = str(error.get("code") or "")
    message = str(error.get("message") or "")
    left = [str(path) for path in error.get("left") or []]
    if error.get("reason") == "EROFS":
        return InstallError("install_read_only", message, left)
    if error.get("reason") == "EBUSY":
        return InstallError("install_busy", message, left)
    if code == "not_installed":
        return InstallError("update_not_installed", message, left)
    if code == "nixos":
        return InstallError("update_nixos", message, left)
    return InstallError("install_failed", message, left)


@contextlib.asynccontextmanager
async def admin_session(
    host: str, port: int, host_key: str, login: AdminLogin
) -> AsyncIterator[AdminSession]:
    """An administrator's connection to the tower, its pinned host key checked."""
    if not login.password and not login.private_key:
        raise InstallError("admin_login_missing")
    keys: list[asyncssh.SSHKey] = []
    if login.private_key:
        try:
            keys.append(
                await asyncio.get_running_loop().run_in_executor(
                    None, load_private_key, login.private_key, login.passphrase
                )
            )
        except TowerAuthError as err:
            raise InstallError("admin_key_invalid") from err
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            conn = await asyncssh.connect(
                host,
                port,
                username=login.username,
                # Only what the user gave: never this machine's keys (an
                # empty list would have asyncssh load ~/.ssh/id_*, and an
                # authorized one would skip the password check) or agent.
                client_keys=keys or None,
                password=login.password or None,
                **pinned_host(asyncssh.import_public_key(host_key)),
            )
    except asyncssh.PermissionDenied as err:
        raise InstallError("admin_auth_failed") from err
    except asyncssh.HostKeyNotVerifiable as err:
        raise InstallError("host_key_changed") from err
    except (OSError, TimeoutError, asyncssh.Error) as err:
        raise InstallError("cannot_connect", str(err)) from err
    try:
        yield AdminSession(conn, login)
    except TimeoutError as err:  # an OSError too: first
        raise InstallError("install_timeout") from err
    except (asyncssh.Error, OSError) as err:
        raise InstallError("install_failed", str(err)) from err
    finally:
        conn.close()
        with contextlib.suppress(Exception):
            await conn.wait_closed()
