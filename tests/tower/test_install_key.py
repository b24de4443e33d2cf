"""`install --authorize-key`: Home Assistant's key in the SSH user's
authorized_keys, written as that user, never through a link, and nothing
written at all for a line that is not an OpenSSH public key."""

from __future__ import annotations

import base64
import errno
import json
import os
from pathlib import Path
import pwd
import stat
import struct
import subprocess
from typing import Any

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    accounts as agent_accounts,
    install as agent_install,
    keys as agent_keys,
    state as agent_state,
)
from tests.support.account import as_user, give, shared_dir, split_account
from tests.tower.test_install import (
    StandIns,
    agent_argv,
    file_size_limit,
    install_args,
    install_run,
    public_key,
    tree,
)
from tests.tower.test_nixos import nix_eval, nixos_root

# The real one: conftest.py makes the agent's refuse to run in this process;
# here only in children it forks, which become the SSH user and exit.
REAL_DROP_PRIVILEGES = agent_state.drop_privileges
# The test process has idle threads of its own (Home Assistant's test
# plugin); the child forked here only becomes the user, writes and exits.
FORK_IN_TESTS = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning"
)
SERVE = 'restrict,command="/usr/local/bin/gpu-handoff --config /etc/gpu-handoff/config.json serve"'


@pytest.fixture
def stand_ins(tmp_path: Path) -> StandIns:
    """Recording stand-ins (tests/tower/test_install.py) of the programs
    install may run: on NixOS, none of them may run."""
    return StandIns(tmp_path / "admin")


def ssh_string(data: bytes) -> bytes:
    """An RFC 4253 string: a 32-bit big-endian length, then the bytes."""
    return struct.pack(">I", len(data)) + data


def sk_ed25519_key(comment: str = "sk") -> str:
    """A FIDO key's public line (PROTOCOL.u2f: type, key, application); no
    authenticator here for ssh-keygen to make one."""
    kind = b"sk-ssh-ed25519@openssh.com"
    blob = ssh_string(kind) + ssh_string(os.urandom(32)) + ssh_string(b"ssh:")
    return f"{kind.decode()} {base64.b64encode(blob).decode()} {comment}"


def blob_of(line: str) -> bytes:
    return base64.b64decode(line.split()[1])


def home_of(root: Path) -> Path:
    """The home of the user running the tests, under `root`, as pwd says."""
    return root / pwd.getpwuid(os.getuid()).pw_dir.lstrip("/")


# --- the key line ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "bits", "name"),
    [
        ("ed25519", 0, "ssh-ed25519"),
        ("ecdsa", 256, "ecdsa-sha2-nistp256"),
        ("ecdsa", 384, "ecdsa-sha2-nistp384"),
        ("ecdsa", 521, "ecdsa-sha2-nistp521"),
        ("rsa", 3072, "ssh-rsa"),
    ],
)
def test_key_types_ssh_keygen_makes(
    tmp_path: Path, kind: str, bits: int, name: str
) -> None:
    line = public_key(tmp_path, kind, "ha@home", bits)
    assert line.startswith(name + " ")
    normal, blob = agent_keys.parse_public_key(line)
    assert normal == line
    assert blob == blob_of(line)


def test_a_fido_key_and_the_line_written() -> None:
    line = sk_ed25519_key("  Home Assistant (kitchen)  ")
    normal, blob = agent_keys.parse_public_key(line)
    # The comment keeps its words, not its outer blanks.
    assert normal == " ".join(line.split()[:2]) + " Home Assistant (kitchen)"
    assert blob == blob_of(line)
    # No comment at all is fine too.
    assert agent_keys.parse_public_key(" ".join(line.split()[:2]))[0] == " ".join(
        line.split()[:2]
    )


def bad_lines(good: str) -> dict[str, str]:
    kind, text, _comment = good.split(" ", 2)
    truncated = base64.b64encode(ssh_string(b"ssh-ed25519")[:8]).decode()
    return {
        "empty": "",
        "one field": kind,
        "unknown type": f"ssh-dss {text} x",
        "not base64": f"{kind} AAAA!!!! x",
        "bad padding": f"{kind} {text[:-1]} x",
        "another type's key": f"ssh-rsa {text} x",
        "truncated blob": f"{kind} {truncated} x",
        "two lines": f"{good}\n{good}",
        "a tab": f"{kind}\t{text}",
        "a double quote": f'{kind} {text} say "hi"',
        "a single quote": f"{kind} {text} it's",
        "too long": f"{kind} {text} {'x' * agent_keys.KEY_LINE_MAX}",
        "a control character": f"{kind} {text} a\x1bb",
    }


def test_lines_that_are_not_keys_are_refused_before_anything(
    tmp_path: Path,
) -> None:
    good = public_key(tmp_path / "keys")
    root = tmp_path / "root"
    for name, line in bad_lines(good).items():
        run = install_run(root, "--authorize-key", line)
        assert run.reply["error"]["code"] == "bad_request", name
        assert "--authorize-key" in run.reply["error"]["message"], name
        assert not root.exists(), name
    # Also on NixOS, where the key would go into the printed settings.
    nixos = nixos_root(tmp_path)
    for name, line in bad_lines(good).items():
        run = install_run(nixos, "--authorize-key", line)
        assert run.reply["error"]["code"] == "bad_request", name
        assert run.stderr == ""


# --- the file ---------------------------------------------------------------------------


def test_authorized_keys_content(tmp_path: Path) -> None:
    key = public_key(tmp_path, comment="ha")
    other = public_key(tmp_path, comment="admin")
    line = f"{SERVE} {key}"
    blob = blob_of(key)
    # Lines that are not this key, each kept byte for byte: a comment, a
    # blank, another key whose options quote this key's text, a CRLF line,
    # an option with a backslash-quote, and a last line without a newline.
    others = [
        b"# keys of this host\n",
        b"\n",
        f'command="echo {key}" {other}\n'.encode(),
        f"{other}\r\n".encode(),
        f'environment="A=\\"x y\\"",no-pty {other}\n'.encode(),
        f'from="10.0.0.0/8" {other}'.encode(),
    ]
    old = b"".join(others)
    new, action = agent_keys.authorized_keys_content(old, line, blob)
    assert action == "added"
    assert new == old + b"\n" + line.encode() + b"\n"
    # The same line again: present, the file unchanged.
    assert agent_keys.authorized_keys_content(new, line, blob) == (None, "present")
    # This key under other options and another comment, twice: its first
    # line becomes the line, its second goes; the others stay as they were.
    mine = f'from="192.168.1.2",command="old serve" {key.rsplit(" ", 1)[0]} old\n'
    old = b"".join([others[0], mine.encode(), others[2], mine.encode(), others[3]])
    new, action = agent_keys.authorized_keys_content(old, line, blob)
    assert action == "replaced"
    assert new == b"".join([others[0], line.encode() + b"\n", others[2], others[3]])
    # The line itself, twice: one stays.
    twice = (line + "\n").encode() * 2
    assert agent_keys.authorized_keys_content(twice, line, blob) == (
        (line + "\n").encode(),
        "replaced",
    )
    assert agent_keys.authorized_keys_content(b"", line, blob) == (
        (line + "\n").encode(),
        "added",
    )


def test_authorized_key_of() -> None:
    line = sk_ed25519_key()
    blob = blob_of(line)
    assert agent_keys.authorized_key_of(line.encode()) == blob
    assert agent_keys.authorized_key_of(f"no-pty {line}\n".encode()) == blob
    assert agent_keys.authorized_key_of(f'command="a b" {line}'.encode()) == blob
    for nothing in (b"", b"  \n", b"# " + line.encode(), b'command="a b', b"x y"):
        assert agent_keys.authorized_key_of(nothing) is None


def test_install_authorizes_the_key(tmp_path: Path) -> None:
    """As root for root (or a user for itself): no other process; the file
    is made 0600 in a ~/.ssh made 0700, then kept, then its line replaced."""
    root = tmp_path / "root"
    home = home_of(root)
    home.mkdir(parents=True)
    key = public_key(tmp_path / "keys", comment="ha")
    run = install_run(root, "--authorize-key", key)
    assert run.rc == 0, run.reply
    keys = home / ".ssh/authorized_keys"
    assert run.reply["authorized_key"] == {"path": str(keys), "action": "added"}
    line = run.reply["authorized_keys_line"]
    assert line == f"{SERVE} {key}"
    assert keys.read_text(encoding="utf-8") == line + "\n"
    assert stat.S_IMODE((home / ".ssh").stat().st_mode) == 0o700
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600
    assert "Add this line" not in run.stderr
    assert f"Home Assistant's key is in {keys} (added)." in run.stderr
    # Again: present, the very same file.
    inode = keys.stat().st_ino
    run = install_run(root, "--force", "--authorize-key", key)
    assert run.reply["authorized_key"]["action"] == "present"
    assert keys.stat().st_ino == inode
    # The administrator's own lines, and the mode they chose, are kept.
    keys.write_text(f"# mine\n{line}\n", encoding="utf-8")
    keys.chmod(0o640)
    renamed = key.rsplit(" ", 1)[0] + " ha-renamed"
    run = install_run(root, "--force", "--authorize-key", renamed)
    assert run.reply["authorized_key"]["action"] == "replaced"
    assert keys.read_text(encoding="utf-8") == f"# mine\n{SERVE} {renamed}\n"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o640
    assert sorted(p.name for p in (home / ".ssh").iterdir()) == ["authorized_keys"]


@pytest.mark.parametrize("shape", ["directory", "too large"])
def test_an_authorized_keys_that_is_no_file_fails_the_install(
    tmp_path: Path, shape: str
) -> None:
    root = tmp_path / "root"
    keys = home_of(root) / ".ssh/authorized_keys"
    if shape == "directory":
        keys.mkdir(parents=True)
    else:
        keys.parent.mkdir(parents=True)
        keys.write_bytes(b"#" * (agent_keys.AUTHORIZED_KEYS_MAX + 1))
    before = tree(root)
    run = install_run(root, "--authorize-key", public_key(tmp_path / "keys"))
    error = run.reply["error"]
    expected = {"directory": "EINVAL", "too large": "EFBIG"}[shape]
    assert (error["code"], error["reason"], error["left"]) == (
        "install_failed",
        expected,
        [],
    )
    assert tree(root) == before


def test_a_failed_key_write_leaves_no_ssh_directory(tmp_path: Path) -> None:
    """~/.ssh made, then the file cannot be written in full (a file size
    limit, as a full disk): neither the file nor ~/.ssh is left."""
    home = tmp_path / "home"
    home.mkdir()
    key = sk_ed25519_key("x" * 4000)
    with file_size_limit(1000), pytest.raises(OSError) as failed:
        agent_keys.write_authorized_key(str(home), f"{SERVE} {key}", blob_of(key))
    assert failed.value.errno == errno.EFBIG
    assert list(home.iterdir()) == []


# --- the real privilege split: written as the user -----------------------------------------


def test_written_as_the_user() -> None:
    account = split_account()
    with shared_dir() as base:
        root = base / "root"
        home = root / account.pw_dir.lstrip("/")
        home.mkdir(parents=True)
        give(home, account, 0o700)
        key = public_key(base / "keys")
        done = agent_run_as_root(
            install_args(root, account.pw_name, "--authorize-key", key)
        )
        assert done["ok"] is True, done
        keys = home / ".ssh/authorized_keys"
        assert done["authorized_key"] == {"path": str(keys), "action": "added"}
        for path, mode in ((home / ".ssh", 0o700), (keys, 0o600)):
            st = path.lstat()
            assert (st.st_uid, st.st_gid) == (account.pw_uid, account.pw_gid), path
            assert stat.S_IMODE(st.st_mode) == mode, path
        # sshd, as the user, would read it.
        read = as_user(account, ["cat", str(keys)])
        assert read.stdout == f"{SERVE} {key}\n"


def test_a_link_planted_in_the_home_is_not_followed() -> None:
    """The user's authorized_keys is a link to a file of root's: root's file
    stays as it was, the install fails and undoes everything."""
    account = split_account()
    with shared_dir() as base:
        root = base / "root"
        ssh = root / account.pw_dir.lstrip("/") / ".ssh"
        ssh.mkdir(parents=True)
        for path in (ssh.parent, ssh):
            give(path, account, 0o700)
        victim = base / "root-only"
        victim.write_text("root's own\n", encoding="utf-8")
        victim.chmod(0o644)
        (ssh / "authorized_keys").symlink_to(victim)
        os.lchown(ssh / "authorized_keys", account.pw_uid, account.pw_gid)
        before = tree(root)
        key = public_key(base / "keys")
        done = agent_run_as_root(
            install_args(root, account.pw_name, "--authorize-key", key)
        )
        assert done["ok"] is False
        error = done["error"]
        assert (error["code"], error["reason"], error["left"]) == (
            "install_failed",
            "ELOOP",
            [],
        )
        assert victim.read_text(encoding="utf-8") == "root's own\n"
        assert victim.stat().st_uid == 0
        assert tree(root) == before


@FORK_IN_TESTS
def test_the_key_is_written_by_a_child_that_is_the_user(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In this process (root): the write happens in a child that became the
    user; what it says comes back to the install, success or failure."""
    account = split_account()
    monkeypatch.setattr(agent_accounts, "drop_privileges", REAL_DROP_PRIVILEGES)
    monkeypatch.setattr(agent_state, "drop_privileges", REAL_DROP_PRIVILEGES)
    with shared_dir() as base:
        home = base / "home"
        home.mkdir()
        give(home, account, 0o700)
        key = sk_ed25519_key()
        line = f"{SERVE} {key}"
        done = agent_keys.authorize_key(account, str(home), line, blob_of(key))
        keys = home / ".ssh/authorized_keys"
        assert done == {"path": str(keys), "action": "added"}
        assert keys.stat().st_uid == account.pw_uid
        (home / ".ssh").chmod(0o500)  # the user may no longer write there
        other = sk_ed25519_key()
        with pytest.raises(agent_accounts.StepError) as failed:
            agent_keys.authorize_key(
                account, str(home), f"{SERVE} {other}", blob_of(other)
            )
        assert failed.value.reason == "EACCES"
        assert keys.read_text(encoding="utf-8") == line + "\n"


@FORK_IN_TESTS
def test_a_child_that_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    account = split_account()
    monkeypatch.setattr(agent_accounts, "drop_privileges", REAL_DROP_PRIVILEGES)
    monkeypatch.setattr(agent_state, "drop_privileges", REAL_DROP_PRIVILEGES)

    def vanish() -> dict[str, Any]:
        os._exit(3)

    reply = agent_accounts.as_user(account, vanish, "the work")
    assert reply["error"] == {
        "code": "internal",
        "message": "the work as the SSH user said nothing",
    }


def agent_run_as_root(argv: list[str]) -> dict[str, Any]:
    """The agent as a program of its own (root here), as Home Assistant runs it."""
    done = subprocess.run(
        agent_argv(*argv),
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
        timeout=120,
        check=False,
    )
    assert done.stdout, done.stderr
    reply: dict[str, Any] = json.loads(done.stdout)
    return reply


# --- NixOS ----------------------------------------------------------------------------------


def test_nixos_takes_the_key_into_its_settings(
    tmp_path: Path, stand_ins: StandIns
) -> None:
    """On NixOS the module declares the user, its group and its keys: the
    key goes into the printed settings; the account and restart options are
    accepted and do nothing."""
    root = nixos_root(tmp_path)
    key = sk_ed25519_key("ha ${x} \\ home")
    stand_ins.add("systemctl")
    run = install_run(
        root,
        "--authorize-key",
        key,
        "--create-user",
        "--join-libvirt-group",
        "--restart-libvirt",
        env=stand_ins.env,
    )
    assert run.rc == 0, run.reply
    assert run.reply["nixos"] is True
    assert run.reply["installed"] == []
    assert stand_ins.calls() == []
    assert sorted(p.name for p in root.rglob("*")) == ["etc", "os-release"]
    snippet = run.reply["nixos_module"]
    assert agent_install.PLACEHOLDER_KEY not in snippet
    settings = tmp_path / "settings.nix"
    settings.write_text(snippet, encoding="utf-8")
    keys = nix_eval(
        "{ file }: (import (/. + file)).services.gpu-handoff.authorizedKeys",
        file=str(settings),
    )
    assert keys == [key]
    assert "restart libvirtd" in run.stderr
