"""A stand-in ``virsh`` for the commands in CONTRACT.md, with real virsh's
output, error texts and exit codes (pinned by the conformance tests).

virsh's own rules, reproduced here:

- one argument after the global options is a *command string*: virsh's parser
  splits it into commands at ``;`` and newlines (quotes, backslashes and ``#``
  comments as in virsh); several arguments are *one* command, where a ``;``
  token is plain data (``error: unexpected data ';'`` for most commands);
- the whole input is parsed before anything runs: an unknown command or a bad
  option anywhere fails the call with rc 1 and runs nothing;
- then every command runs, whether or not the previous one failed; the exit
  status is the last command's; unless ``-q``, a newline goes to stdout after
  each command (after a failed one too).

Runs on Python >= 3.9 with the standard library only.
"""

from __future__ import annotations

import os
import select
import stat
import struct
import sys
import time
import zlib

from . import domxml, hooks, lean, model

# The simulator is a process per virsh call: typing stays out of its imports
# (about 3 ms of each start); its names are for the type checker only.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import IO, Any

    JsonObj = dict[str, Any]

# --- command definitions --------------------------------------------------------

BOOL, STRING, INT, DATA, ARGV = "bool", "string", "int", "data", "argv"


class Opt:
    def __init__(
        self, name: str, kind: str, *, required: bool = False, positional: bool = False
    ) -> None:
        self.name = name
        self.kind = kind
        self.required = required
        self.positional = positional or kind in (DATA, ARGV)


def _bools(*names: str) -> list[Opt]:
    return [Opt(n, BOOL) for n in names]


DOMAIN = Opt("domain", DATA, required=True)

COMMANDS: dict[str, list[Opt]] = {
    "list": _bools(
        "inactive",
        "all",
        "transient",
        "persistent",
        "with-snapshot",
        "without-snapshot",
        "with-checkpoint",
        "without-checkpoint",
        "state-running",
        "state-paused",
        "state-shutoff",
        "state-other",
        "autostart",
        "no-autostart",
        "with-managed-save",
        "without-managed-save",
        "uuid",
        "name",
        "id",
        "table",
        "managed-save",
        "title",
    ),
    "dumpxml": [
        DOMAIN,
        *_bools("inactive", "security-info", "update-cpu", "migratable"),
        Opt("xpath", STRING),
        Opt("wrap", BOOL),
    ],
    "domstate": [DOMAIN, Opt("reason", BOOL)],
    "start": [
        DOMAIN,
        *_bools("console", "paused", "autodestroy", "bypass-cache", "force-boot"),
        Opt("pass-fds", STRING),
        Opt("reset-nvram", BOOL),
    ],
    "create": [
        Opt("file", STRING, required=True, positional=True),
        *_bools("console", "paused", "autodestroy"),
        Opt("pass-fds", STRING, positional=True),
        *_bools("validate", "reset-nvram"),
    ],
    "shutdown": [DOMAIN, Opt("mode", STRING)],
    "destroy": [DOMAIN, *_bools("graceful", "remove-logs")],
    "qemu-agent-command": [
        DOMAIN,
        Opt("timeout", INT),
        *_bools("async", "block", "pretty"),
        Opt("cmd", ARGV, required=True),
    ],
    "event": [
        Opt("domain", STRING),
        Opt("event", STRING),
        Opt("all", BOOL),
        Opt("loop", BOOL),
        Opt("timeout", INT),
        Opt("list", BOOL),
        Opt("timestamp", BOOL),
    ],
    "screenshot": [
        DOMAIN,
        Opt("file", STRING, positional=True),
        Opt("screen", INT, positional=True),
    ],
    "echo": [*_bools("shell", "xml", "err", "split"), Opt("string", ARGV)],
}

EVENT_NAMES = ("lifecycle", "agent-lifecycle", "channel-lifecycle")


class ParseError(Exception):
    pass


class Cmd:
    def __init__(self, name: str) -> None:
        self.name = name
        self.defs = COMMANDS[name]
        self.values: dict[str, Any] = {}
        self.raw: list[str] = [name]

    def get(self, name: str) -> Any:
        return self.values.get(name)

    def tokens(self) -> list[str]:
        """The command's words as given (after virsh's unquoting)."""
        return list(self.raw)

    def _next_positional(self) -> Opt | None:
        for opt in self.defs:
            if opt.positional and (opt.kind == ARGV or opt.name not in self.values):
                return opt
        return None

    def assign_positional(self, value: str) -> None:
        opt = self._next_positional()
        if opt is None:
            raise ParseError(f"unexpected data '{value}'")
        self.assign(opt, value)

    def assign(self, opt: Opt, value: Any) -> None:
        if opt.kind == ARGV:
            self.values.setdefault(opt.name, []).append(value)
            return
        if opt.name in self.values:
            raise ParseError(f"option --{opt.name} already seen")
        self.values[opt.name] = value

    def option(self, name: str) -> Opt:
        for opt in self.defs:
            if opt.name == name:
                return opt
        raise ParseError(f"command '{self.name}' doesn't support option --{name}")

    def check(self) -> None:
        for opt in self.defs:
            if opt.required and opt.name not in self.values:
                if opt.positional:
                    raise ParseError(
                        f"command '{self.name}' requires <{opt.name}> option"
                    )
                raise ParseError(f"command '{self.name}' requires --{opt.name} option")


END, SUBCMD_END, ARG = "end", "sub", "arg"


def _string_tokens(text: str) -> list[tuple[str, str]]:
    """virsh's command-string tokenizer: (kind, value) pairs."""
    out: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while True:
        while i < n and (
            text[i] in " \t" or (text[i] == "\\" and text[i + 1 : i + 2] == "\n")
        ):
            i += 2 if text[i] == "\\" else 1
        if i >= n:
            out.append((END, ""))
            return out
        if text[i] in ";\n":
            i += 1
            out.append((SUBCMD_END, ""))
            continue
        if text[i] == "#":
            while i < n and text[i] != "\n":
                i += 1
            i += 1 if i < n else 0
            out.append((SUBCMD_END, ""))
            continue
        single = double = False
        buf: list[str] = []
        while i < n:
            c = text[i]
            if not single and not double and c in " \t;\n":
                break
            if not double and c == "'":
                single = not single
                i += 1
                continue
            if not single and c == "\\":
                i += 1
                if i >= n:
                    raise ParseError("dangling \\")
                if text[i] == "\n":
                    i += 1
                    continue
            elif not single and c == '"':
                double = not double
                i += 1
                continue
            buf.append(text[i])
            i += 1
        if double:
            raise ParseError('missing "')
        out.append((ARG, "".join(buf)))


def parse(args: list[str]) -> list[Cmd]:
    """virsh's parser: one string argument is a command string, else argv."""
    if len(args) == 1:
        tokens = _string_tokens(args[0])
    else:
        tokens = [(ARG, a) for a in args] + [(END, "")]
    cmds: list[Cmd] = []
    cmd: Cmd | None = None
    comment = positional_only = False
    pending: Opt | None = None
    pending_value: str | None = None
    it = iter(tokens)
    while True:
        synthetic = False
        if pending is not None and pending_value is not None:
            kind, value = ARG, pending_value
            pending_value = None
            synthetic = True
        elif pending is not None and pending.kind == BOOL:
            cmd.assign(pending, True)  # type: ignore[union-attr]
            pending = None
            continue
        else:
            kind, value = next(it)
        if kind in (END, SUBCMD_END):
            if pending is not None:
                what = "number" if pending.kind == INT else "string"
                raise ParseError(f"expected syntax: --{pending.name} <{what}>")
            if cmd is not None:
                cmd.check()
                cmds.append(cmd)
            cmd, comment, positional_only = None, False, False
            if kind == END:
                return cmds
            continue
        if comment:
            continue
        if cmd is not None and not synthetic:
            cmd.raw.append(value)
        if cmd is None:
            if value.startswith("#"):
                comment = True
                continue
            if value not in COMMANDS:
                raise ParseError(f"unknown command: '{value}'")
            cmd = Cmd(value)
            continue
        if pending is not None:
            if pending.kind == BOOL:
                raise ParseError(f"invalid '=' after option --{pending.name}")
            cmd.assign(pending, value)
            pending = None
            continue
        if positional_only or not value.startswith("--"):
            cmd.assign_positional(value)
            continue
        if value == "--":
            positional_only = True
            continue
        name = value[2:]
        if "=" in name:
            name, pending_value = name.split("=", 1)
        pending = cmd.option(name)


# --- output ---------------------------------------------------------------------


class Out:
    """stdout/stderr of one virsh process."""

    def __init__(self, stdout: IO[str], stderr: IO[str], quiet: bool) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.quiet = quiet

    def print(self, text: str) -> None:
        self.stdout.write(text)

    def print_extra(self, text: str) -> None:
        if not self.quiet:
            self.stdout.write(text)

    def error(self, text: str) -> None:
        self.stdout.flush()
        self.stderr.write(f"error: {text}\n")
        self.stderr.flush()


# --- the simulated hypervisor ----------------------------------------------------


class CommandFailedError(Exception):
    """A command failed; its error lines (without ``error: ``) are the args."""


NOT_RUNNING = "Requested operation is not valid: domain is not running"
AGENT_NOT_CONNECTED = "Guest agent is not responding: QEMU guest agent is not connected"
AGENT_NOT_CONFIGURED = "argument unsupported: QEMU guest agent is not configured"
# qemuAgentSend: no reply (nor the awaited SHUTDOWN event) within its wait
AGENT_NOT_AVAILABLE = "Guest agent is not responding: Guest agent not available for now"
# qemu_agent.c, qemuAgentIO: the agent's socket closed under a waiting command
AGENT_SOCKET_EOF = "internal error: End of file from agent socket"
# virDomainObjBeginJobInternal, after VIR_JOB_WAIT_TIME, the agent job held
JOB_TIMED_OUT = (
    "Timed out during operation: cannot acquire state change lock "
    f"(held by agent={model.SHUTDOWN_API})"
)
POLL = 0.01  # how often a blocked call looks at the tower again (real seconds)
SHUTDOWN_MODES = ("acpi", "agent", "initctl", "signal", "paravirt")


class Session:
    def __init__(
        self,
        state_dir: str,
        out: Out,
        uri: str = "qemu:///system",
        call_id: str | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.out = out
        self.uri = uri
        self.call_id = call_id  # this invocation's record (Tower.commands)

    def lookup(
        self, data: JsonObj, world: model.World, word: str, *, by_id: bool = True
    ) -> model.Dom:
        """The domain ``--domain WORD`` names, as virsh finds it
        (tools/virsh-util.c, virshLookupDomainInternal): the RUNNING domain of
        that id if WORD reads as one (``domain_id``), else the domain of that
        UUID if WORD reads as one (``domain_uuid``), else the domain of that
        name. ``start`` looks up by UUID and name only (cmdStart passes
        VIRSH_BYNAME | VIRSH_BYUUID: a shut-off domain has no id)."""
        number = domain_id(word) if by_id else None
        if number is not None:
            for candidate in world.doms.values():
                if candidate.running and candidate.id == number:
                    return candidate
        raw = domain_uuid(word)
        if raw is not None:
            for candidate in world.doms.values():
                if _uuid_bytes(candidate) == raw:
                    return candidate
        dom = world.doms.get(word)
        if dom is None:
            raise CommandFailedError(f"failed to get domain '{word}'")
        return dom

    def run(self, cmd: Cmd) -> bool:
        handler: Callable[[Cmd], None] = getattr(
            self, "cmd_" + cmd.name.replace("-", "_")
        )
        try:
            handler(cmd)
        except CommandFailedError as err:
            for line in err.args:
                self.out.error(line)
            return False
        return True

    @lean.contextmanager
    def transaction(self, domain: str | None) -> Iterator[JsonObj]:
        """Hold the lock while a command reads and changes the state; the data.

        First the stop hooks of the stops no process saw yet run; and, as
        libvirtd makes a call wait for the lock of a domain whose start runs
        its qemu hook, a call about a domain another process is starting (or
        ``list``, ``domain`` None, while any start runs) waits until it ended.
        """
        hooks.dispatch_stops(self.state_dir)
        deadline = time.monotonic() + hooks.WAIT_LIMIT
        while True:
            with model.locked(self.state_dir):
                data = model.load(self.state_dir)
                if time.monotonic() > deadline or not hooks.busy(
                    self.state_dir, data, domain
                ):
                    yield data
                    return
            time.sleep(0.005)

    @lean.contextmanager
    def agent_job(
        self, word: str, *failed: str
    ) -> Iterator[tuple[JsonObj, float, model.World, model.Dom]]:
        """The domain's agent job, as virDomainObjBeginAgentJob takes it (the
        lock held; the data, the time, the world and the domain): while a
        blocked ``shutdown --mode agent`` holds it, wait for it up to the job
        wait time (VIR_JOB_WAIT_TIME: 30 s, scaled), then fail with libvirt's
        text after the lines ``failed``. ``qemu-agent-command --timeout``
        bounds only the agent's reply, not this wait."""
        deadline: float | None = None
        while True:
            with self.transaction(word) as data:
                t = model.now(data)
                world = model.world(data, t)
                dom = self.lookup(data, world, word)
                if not dom.agent_job_held(t):
                    yield data, t, world, dom
                    return
                if deadline is None:
                    deadline = t + model.libvirt_wait(data, "job_wait")
                elif t >= deadline:
                    raise CommandFailedError(*failed, JOB_TIMED_OUT)
            time.sleep(POLL)

    def _agent_shutdown_wait(
        self, name: str, boot_t: float | None, until: float, socket_eof: bool
    ) -> bool:
        """qemuAgentShutdown's wait: True when the guest powered off (QEMU's
        SHUTDOWN event, qemuAgentNotifyEvent) or its agent went away
        (qemuAgentNotifyClose) before ``until``; False at ``until``. With
        ``socket_eof`` its agent's socket reaches end of file as QEMU exits,
        before either is seen: only the power-off ends the wait."""
        while True:
            with model.locked(self.state_dir, exclusive=False):
                data = model.load(self.state_dir)
            t = model.now(data)
            dom = model.world(data, t).doms.get(name)
            if dom is None or not dom.running or dom.boot_t != boot_t:
                hooks.dispatch_stops(self.state_dir)
                return True
            if not dom.agent_connected and not socket_eof:
                return True
            if t >= until:
                return False
            time.sleep(POLL)

    def cmd_echo(self, cmd: Cmd) -> None:
        words = list(cmd.get("string") or [])
        if cmd.get("xml"):
            words = [domxml.quote(w)[1:-1].replace('"', "&quot;") for w in words]
        if cmd.get("shell"):
            import shlex

            words = [shlex.quote(w) for w in words]
        text = " ".join(words)
        if cmd.get("err"):
            self.out.stderr.write(text + "\n")
        else:
            self.out.print(text + "\n" if cmd.get("split") else text)
        # virsh's echo prints no newline of its own: the command's newline ends it

    def cmd_list(self, cmd: Cmd) -> None:
        with self.transaction(None) as data:
            world = model.world(data)
        show_all = bool(cmd.get("all"))
        doms = [
            d
            for d in world.listing()
            if (
                show_all
                or (d.running and not cmd.get("inactive"))
                or (cmd.get("inactive") and not d.running)
            )
            and _state_filter(cmd, d.state_at(world.t)[0])
        ]
        if cmd.get("name") or cmd.get("uuid") or cmd.get("id"):
            for d in doms:
                if cmd.get("id") and d.id is None:
                    continue
                fields = []
                if cmd.get("id"):
                    fields.append(str(d.id))
                if cmd.get("name"):
                    fields.append(d.name)
                if cmd.get("uuid"):
                    fields.append(str(d.spec["uuid"]))
                self.out.print(" ".join(fields) + "\n")
            return
        rows = [
            [
                str(d.id) if d.id is not None else "-",
                d.name,
                d.state_text(reason=False, t=world.t),
            ]
            for d in doms
        ]
        header = ["Id", "Name", "State"]
        table = rows if self.out.quiet else [header, *rows]
        widths = (
            [max(len(r[i]) for r in table) for i in range(3)] if table else [0, 0, 0]
        )
        if not self.out.quiet:
            self.out.print(
                " "
                + "   ".join(c.ljust(w) for c, w in _pairs(header, widths)).rstrip()
                + "\n"
            )
            self.out.print("-" * (1 + sum(widths) + 3 * 2 + 2) + "\n")
        for row in rows:
            self.out.print(
                " "
                + "   ".join(c.ljust(w) for c, w in _pairs(row, widths)).rstrip()
                + "\n"
            )

    def cmd_dumpxml(self, cmd: Cmd) -> None:
        with self.transaction(cmd.get("domain")) as data:
            world = model.world(data)
            dom = self.lookup(data, world, cmd.get("domain"))
        if cmd.get("inactive"):
            # the persistent definition, also while a live-only one runs
            self.out.print(domxml.dump_xml(dom.spec, None))
        else:
            self.out.print(domxml.dump_xml(dom.live_spec(), dom.id))

    def cmd_domstate(self, cmd: Cmd) -> None:
        with self.transaction(cmd.get("domain")) as data:
            world = model.world(data)
            dom = self.lookup(data, world, cmd.get("domain"))
        self.out.print(dom.state_text(reason=bool(cmd.get("reason")), t=world.t) + "\n")

    def cmd_start(self, cmd: Cmd) -> None:
        """Start a defined domain, running libvirt's qemu hook (``hooks.launch``):
        the PCI functions are taken after ``prepare begin``, as
        qemuProcessPrepareHost takes them after qemuProcessInit's hook."""
        with self.transaction(cmd.get("domain")) as data:
            t = model.now(data)
            world = model.world(data, t)
            dom = self.lookup(data, world, cmd.get("domain"), by_id=False)
            if dom.running:
                # virsh's own check (cmdStart), before libvirt is asked
                raise CommandFailedError("Domain is already active")
            start = hooks.claim(data, world, dom, t, "start")
            model.save(self.state_dir, data)
        try:
            hooks.launch(self.state_dir, start, f"Failed to start domain '{dom.name}'")
        except hooks.StartFailedError as err:
            raise CommandFailedError(*err.args) from None
        self.out.print_extra(f"Domain '{dom.name}' started\n")

    def cmd_create(self, cmd: Cmd) -> None:
        """Start a defined domain from a live-only definition (``virsh create``).

        As libvirt (``virDomainObjListAdd`` with a live definition): the file
        names a defined domain by name and UUID; that domain starts with the
        file as its definition until it stops, and its persistent definition
        stays as it was. A file naming no defined domain would make a
        transient domain, which the simulator does not have.
        """
        path = str(cmd.get("file"))
        fds = cmd.get("pass-fds")
        for fd in [] if fds is None else str(fds).split(","):
            if not fd.isdigit():
                raise CommandFailedError(f"Unable to parse FD number '{fd}'")
        text = _read_file(path)
        failed = f"Failed to create domain from {path}"
        flags = [
            name
            for name in ("console", "paused", "autodestroy", "validate", "reset-nvram")
            if cmd.get(name)
        ] + (["pass-fds"] if fds is not None else [])
        if flags:
            raise CommandFailedError(
                failed,
                f"Operation not supported: the tower simulator has no create --{flags[0]}",
            )
        try:
            definition = domxml.read_definition(text)
        except domxml.DefinitionError as err:
            raise CommandFailedError(failed, str(err)) from None
        with self.transaction(definition.name) as data:
            t = model.now(data)
            world = model.world(data, t)
            dom = self._created_domain(world, definition, failed)
            try:
                hostdevs = domxml.live_hostdevs(definition, dom.spec)
            except domxml.UnmodelledError as err:
                raise CommandFailedError(
                    failed,
                    "Operation not supported: the tower simulator models a live "
                    "definition only as its domain's persistent definition with "
                    f"other PCI hostdevs, and {err}",
                ) from None
            start = hooks.claim(
                data, world, dom, t, "create", hostdevs=hostdevs, file=path
            )
            model.save(self.state_dir, data)
        try:
            hooks.launch(self.state_dir, start, failed)
        except hooks.StartFailedError as err:
            raise CommandFailedError(*err.args) from None
        self.out.print_extra(f"Domain '{dom.name}' created from {path}\n")

    @staticmethod
    def _created_domain(
        world: model.World, definition: domxml.Definition, failed: str
    ) -> model.Dom:
        """The defined domain a live definition is for, with libvirt's checks
        (the UUID first, then the name, then whether it runs)."""
        uuid = definition.uuid
        by_uuid = None
        if uuid is not None:
            by_uuid = next((d for d in world.doms.values() if _uuid(d) == uuid), None)
        if by_uuid is not None and by_uuid.name != definition.name:
            raise CommandFailedError(
                failed,
                f"operation failed: domain '{by_uuid.name}' is already defined "
                f"with uuid {_uuid(by_uuid)}",
            )
        by_name = world.doms.get(definition.name)
        if by_uuid is None and by_name is not None:
            raise CommandFailedError(
                failed,
                f"operation failed: domain '{by_name.name}' already exists "
                f"with uuid {_uuid(by_name)}",
            )
        if by_uuid is None:
            raise CommandFailedError(
                failed,
                "Operation not supported: the tower simulator has no transient "
                f"domains, and no domain named '{definition.name}' is defined",
            )
        if by_uuid.running:
            raise CommandFailedError(
                failed,
                f"Requested operation is not valid: domain '{by_uuid.name}' "
                "is already active",
            )
        return by_uuid

    def cmd_shutdown(self, cmd: Cmd) -> None:
        modes: list[str] = []
        if cmd.get("mode") is not None:
            for mode in str(cmd.get("mode")).split(","):
                if mode not in SHUTDOWN_MODES:
                    raise CommandFailedError(
                        f"Unknown mode {mode} value, expecting "
                        "'acpi', 'agent', 'initctl', 'signal', or 'paravirt'"
                    )
                modes.append(mode)
        # cmdShutdown names the domain as it was given (an id, a UUID)
        failed = f"Failed to shutdown domain '{cmd.get('domain')}'"
        blocked: tuple[str, float | None, float, bool] | None = None
        with self.agent_job(cmd.get("domain"), failed) as (data, t, _world, found):
            dom = found
            if not dom.running:
                raise CommandFailedError(failed, NOT_RUNNING)
            unsupported = [m for m in modes if m not in ("acpi", "agent")]
            if unsupported:
                raise CommandFailedError(
                    failed,
                    f"Operation not supported: the tower simulator has no '{unsupported[0]}' shutdown",
                )
            if dom.name in data.get("guest_shutdown_races", []):
                # the player shut the guest down from inside just now
                data["guest_shutdown_races"].remove(dom.name)
                model.record(data, "shutdown", dom.name, t, mode="guest")
                model.save(self.state_dir, data)
                dom = model.world(data, t).doms[dom.name]
            if not dom.active_state(t):
                # paused, crashed or in shutdown: qemuDomainShutdownFlagsAgent
                # and qemuDomainShutdownFlagsMonitor both require RUNNING
                raise CommandFailedError(failed, NOT_RUNNING)
            use_agent = "agent" in modes or (
                not modes and dom.has_channel and dom.agent_connected
            )
            if use_agent and not ("acpi" in modes and not dom.agent_connected):
                if not dom.has_channel:
                    raise CommandFailedError(failed, AGENT_NOT_CONFIGURED)
                if not dom.agent_connected:
                    raise CommandFailedError(failed, AGENT_NOT_CONNECTED)
                # qemuDomainShutdownFlagsAgent: guest-shutdown, then wait
                until = t + model.libvirt_wait(data, "agent_shutdown_timeout")
                model.record(
                    data, "shutdown", dom.name, t, mode="agent", job_until=until
                )
                closes = data.get("agent_socket_closes_first", [])
                socket_eof = dom.name in closes
                if socket_eof:
                    closes.remove(dom.name)
                blocked = (dom.name, dom.boot_t, until, socket_eof)
            else:
                self._acpi(data, dom, t)
            model.save(self.state_dir, data)
        if blocked is not None and self._agent_shutdown_wait(*blocked):
            if blocked[3]:
                # QEMU exited under the waiting command (Tower.agent_sockets_close_first)
                raise CommandFailedError(failed, AGENT_SOCKET_EOF)
        elif blocked is not None:
            if not modes or "acpi" in modes:
                # qemuDomainShutdownFlags: the agent failed, not forced: ACPI
                # (unless the guest went away meanwhile)
                with self.transaction(cmd.get("domain")) as data:
                    t = model.now(data)
                    dom = model.world(data, t).doms[blocked[0]]
                    if dom.running:
                        self._acpi(data, dom, t)
                        model.save(self.state_dir, data)
            else:
                raise CommandFailedError(failed, AGENT_NOT_AVAILABLE)
        self.out.print_extra(f"Domain '{cmd.get('domain')}' is being shutdown\n")

    @staticmethod
    def _acpi(data: JsonObj, dom: model.Dom, t: float) -> None:
        """qemuDomainShutdownFlagsMonitor: QEMU's system_powerdown (the ACPI
        power button), and return at once."""
        if not dom.spec.get("ignore_acpi"):
            model.record(data, "shutdown", dom.name, t, mode="acpi")
        else:
            # the guest ignores the ACPI power button: accepted, no effect
            model.record(data, "acpi-ignored", dom.name, t)

    def cmd_destroy(self, cmd: Cmd) -> None:
        with self.transaction(cmd.get("domain")) as data:
            world = model.world(data)
            self.lookup(data, world, cmd.get("domain"))
        # cmdDestroy names the domain as it was given
        raise CommandFailedError(
            f"Failed to destroy domain '{cmd.get('domain')}'",
            "Operation not supported: the tower simulator refuses destroy "
            "(GPU Handoff never destroys a domain); the attempt was recorded",
        )

    def cmd_qemu_agent_command(self, cmd: Cmd) -> None:
        timeout = cmd.get("timeout")
        if timeout is not None:
            try:
                seconds = int(timeout)
            except ValueError:
                raise CommandFailedError(
                    f"Numeric value '{timeout}' for <timeout> option is malformed or out of range"
                ) from None
            if seconds < 1:
                raise CommandFailedError("timeout must be positive")
        text = " ".join(cmd.get("cmd") or [])
        # qemuDomainQemuAgentCommand: virDomainObjBeginAgentJob first
        with self.agent_job(cmd.get("domain")) as (_data, t, _world, dom):
            pass
        if not dom.active_state(t):
            # virDomainObjCheckActive, then qemuDomainAgentAvailable: a
            # paused, crashed or shutting-down domain is "not running"
            raise CommandFailedError(NOT_RUNNING)
        if not dom.has_channel:
            raise CommandFailedError(AGENT_NOT_CONFIGURED)
        if not dom.agent_connected:
            raise CommandFailedError(AGENT_NOT_CONNECTED)
        try:
            import json  # only for a guest-agent command

            request = json.loads(text)
            execute = request.get("execute") if isinstance(request, dict) else None
        except ValueError:
            execute = None
        if execute is None:
            raise CommandFailedError(
                "internal error: unable to execute QEMU agent command "
                f"'{text}': Invalid JSON syntax"
            )
        if execute != "guest-ping":
            raise CommandFailedError(
                f"internal error: unable to execute QEMU agent command '{execute}': "
                f"The command {execute} has not been found"
            )
        if cmd.get("pretty"):
            self.out.print('{\n  "return": {\n  }\n}\n')
        else:
            self.out.print('{"return":{}}\n')

    def cmd_screenshot(self, cmd: Cmd) -> None:
        screen = cmd.get("screen")
        if screen is not None:
            try:
                int(screen)
            except ValueError:
                raise CommandFailedError(
                    f"Numeric value '{screen}' for <screen> option is malformed or out of range"
                ) from None
        with self.transaction(cmd.get("domain")) as data:
            t = model.now(data)
            world = model.world(data, t)
            dom = self.lookup(data, world, cmd.get("domain"))
        screen = dom.spec.get("screen") or {}
        mime = str(screen.get("mime", MIME_PNG))
        path = cmd.get("file")
        if path is None:
            stamp = time.strftime("%Y-%m-%d-%H:%M:%S", time.localtime(t))
            path = f"{dom.name}-{stamp}{SCREEN_EXTENSIONS[mime]}"
        if not dom.running:
            raise CommandFailedError(
                f"could not take a screenshot of {dom.name}", NOT_RUNNING
            )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        except OSError:
            raise CommandFailedError(f"cannot create file {path}") from None
        with os.fdopen(fd, "wb") as handle:
            handle.write(screen_image(dom.name, dom.boot_t or 0.0, screen))
        self.out.print_extra(f"Screenshot saved to {path}, with type of {mime}")

    # --- event ----------------------------------------------------------------

    def cmd_event(self, cmd: Cmd) -> None:
        if cmd.get("list"):
            for name in EVENT_NAMES:
                self.out.print(name + "\n")
            return
        wanted = cmd.get("event")
        if not cmd.get("all") and wanted is None:
            raise CommandFailedError(
                "one of --list, --all, or --event <type> is required"
            )
        if wanted is not None and wanted not in EVENT_NAMES:
            raise CommandFailedError(f"unknown event type {wanted}")
        timeout = cmd.get("timeout")
        limit: float | None = None
        if timeout is not None:
            try:
                limit = float(int(timeout))
            except ValueError:
                raise CommandFailedError(
                    f"Numeric value '{timeout}' for <timeout> option is malformed or out of range"
                ) from None
        domain = cmd.get("domain")
        loop = bool(cmd.get("loop"))
        timestamp = bool(cmd.get("timestamp"))
        if domain is not None:
            # virsh finds the domain once (an id, a UUID or a name) and
            # follows that domain
            with model.locked(self.state_dir, exclusive=False):
                data = model.load(self.state_dir)
                domain = self.lookup(data, model.world(data), domain).name
        import signal  # only an event stream handles signals

        count = 0
        interrupted: list[bool] = []

        def on_sigint(signum: int, frame: Any) -> None:
            interrupted.append(True)

        # virsh catches SIGINT before it registers for events (cmdEvent in
        # tools/virsh-domain-event.c: vshEventStart, then
        # virConnectDomainEventRegisterAny): a caller that waits for the
        # stream to subscribe, then interrupts it, ends it
        previous = signal.signal(signal.SIGINT, on_sigint)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        stream = EventStream(self.state_dir, domain, wanted)
        if self.call_id is not None:
            # From here on it sees every event (Command.subscribed): what a
            # test waits for, rather than a while after the call began.
            model.append_command(
                self.state_dir,
                {"kind": "subscribed", "id": self.call_id, "t": time.time()},
            )
        started = time.monotonic()
        try:
            while not interrupted:
                for event in stream.poll():
                    self.out.print(event.line(timestamp=timestamp) + "\n")
                    self.out.stdout.flush()
                    count += 1
                    if not loop:
                        break
                if count and not loop:
                    break
                if stream.disconnected:
                    # virshCatchDisconnect (tools/virsh.c), then cmdEvent:
                    # "events received", and the failed deregistration
                    # (virConnectDomainEventDeregisterAny on the closed
                    # connection) makes the command fail
                    self.out.error(f"Disconnected from {self.uri} due to end of file")
                    self.out.print(f"events received: {count}\n")
                    raise CommandFailedError("internal error: client socket is closed")
                if limit is not None and time.monotonic() - started >= limit:
                    self.out.print(f"event loop timed out\nevents received: {count}\n")
                    if count == 0:
                        raise CommandFailedError
                    return
                if _reader_gone(self.out.stdout):
                    os.kill(os.getpid(), signal.SIGPIPE)
                time.sleep(stream.wait_hint())
        finally:
            signal.signal(signal.SIGINT, previous)
        if interrupted:
            self.out.print("event loop interrupted\n")
        self.out.print(f"events received: {count}\n")


# An event stream reads the state whole at least this often, whatever its
# stamp says: a stamp (mtime, inode, size) can miss a change in theory, and
# a stream that missed one would otherwise wait for the next change, which
# a quiet world may never make (CI saw the conformance tests' streams wait
# 20-30 s for events the test driver had sent; the cause is not known).
REREAD_SECONDS = 0.5


class EventStream:
    """New events as the simulated clock passes them."""

    def __init__(self, state_dir: str, domain: str | None, wanted: str | None) -> None:
        self.state_dir = state_dir
        self.domain = domain
        self.wanted = wanted
        self.seen: set[str] = set()
        self.stamp: tuple[int, int, int] | None = None
        # The last full read (the stamp may miss a change: see REREAD_SECONDS).
        self.read_at = 0.0
        self.pending: list[float] = []
        self.clock_offset = 0.0
        self.disconnected = False
        with model.locked(state_dir, exclusive=False):
            data = model.load(state_dir)
            world = model.world(data)
        self.since = world.t
        self._remember(world)

    def _remember(self, world: model.World) -> None:
        self.seen.update(e.key for e in world.events)
        self.pending = world.pending

    def _wanted(self, event: model.Event) -> bool:
        if self.domain is not None and event.domain != self.domain:
            return False
        if self.wanted is None:
            return True
        return event.text.startswith(f"event '{self.wanted}' ")

    def poll(self) -> list[model.Event]:
        stamp = model.state_mtime(self.state_dir)
        sim_now = time.time() + self.clock_offset
        if (
            stamp == self.stamp
            and not (self.pending and self.pending[0] <= sim_now)
            and time.monotonic() - self.read_at < REREAD_SECONDS
        ):
            return []
        self.read_at = time.monotonic()
        with model.locked(self.state_dir, exclusive=False):
            data = model.load(self.state_dir)
            stamp = model.state_mtime(self.state_dir)
            world = model.world(data)
        self.stamp = stamp
        self.clock_offset = float(data.get("clock_offset", 0.0))
        if hooks.pending_stops(data, world):
            # libvirtd runs the stop hooks before it sends the stop's event
            hooks.dispatch_stops(self.state_dir)
        fresh = [
            e for e in world.events if e.key not in self.seen and e.t >= self.since
        ]
        ends = model.libvirtd_restart_after(data, self.since)
        if ends is not None and ends <= world.t:
            # the connection ended: events after that never reach it
            fresh = [e for e in fresh if e.t < ends]
            self.disconnected = True
        self._remember(world)
        fresh.sort(key=lambda e: e.t)
        return [e for e in fresh if self._wanted(e)]

    def wait_hint(self) -> float:
        if self.pending:
            ahead = self.pending[0] - (time.time() + self.clock_offset)
            return max(0.002, min(0.02, ahead))
        return 0.02


# virStrToLong_i (src/util/virstring.c) reads with g_ascii_strtoll (strtol
# before libvirt 6.x): C whitespace, then a sign, then digits, to the end.
STRTOLL_SPACE = " \t\n\v\f\r"
# virUUIDParse (src/util/viruuid.c) skips g_ascii_isspace, which has no \v.
GLIB_SPACE = " \t\n\f\r"
HEX_DIGITS = "0123456789abcdefABCDEF"
UUID_STRING_LEN = 36  # VIR_UUID_STRING_BUFLEN - 1


def domain_id(word: str) -> int | None:
    """The id virsh reads in ``word``, or None: virshLookupDomainInternal
    tries an id when ``virStrToLong_i(word, NULL, 10, &id) == 0 && id >= 0``:
    the whole word read (nothing after the digits, not even a blank), within
    an int, not negative ("-0" is 0)."""
    i = 0
    while i < len(word) and word[i] in STRTOLL_SPACE:
        i += 1
    j = i + 1 if word[i : i + 1] in ("+", "-") else i
    k = j
    while k < len(word) and word[k] in "0123456789":
        k += 1
    if k == j or k != len(word) or len(word[j:k].lstrip("0")) > 10:
        return None
    value = int(word[i:k])
    return value if 0 <= value < 2**31 else None


def domain_uuid(word: str) -> bytes | None:
    """The UUID virsh reads in ``word``, or None: tried when ``strlen(word) ==
    VIR_UUID_STRING_BUFLEN-1`` (36 bytes), parsed by virUUIDParse: GLib
    whitespace, then 16 pairs of hex digits with any '-' or ' ' between the
    pairs (none inside one), then only whitespace."""
    if len(os.fsencode(word)) != UUID_STRING_LEN:
        return None
    cur = 0
    while cur < len(word) and word[cur] in GLIB_SPACE:
        cur += 1
    raw = bytearray()
    while len(raw) < 16:
        if cur >= len(word):
            return None
        if word[cur] in "- ":
            cur += 1
            continue
        pair = word[cur : cur + 2]
        if len(pair) < 2 or any(c not in HEX_DIGITS for c in pair):
            return None
        raw.append(int(pair, 16))
        cur += 2
    if any(c not in GLIB_SPACE for c in word[cur:]):
        return None
    return bytes(raw)


def _uuid_bytes(dom: model.Dom) -> bytes:
    from uuid import UUID  # only a lookup by UUID needs it (not every call)

    return UUID(str(dom.spec["uuid"])).bytes


def _uuid(dom: model.Dom) -> str:
    return str(dom.spec["uuid"]).lower()


# virsh reads a domain's XML file itself, up to this size (VSH_MAX_XML_FILE)
MAX_XML_FILE = 10 * 1024 * 1024


def _read_file(path: str) -> str:
    """The file's text, or virsh's error (``virFileReadAll``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise CommandFailedError(
            f"Failed to open file '{path}': {os.strerror(err.errno or 0)}"
        ) from None
    chunks: list[bytes] = []
    size = 0
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_XML_FILE:
                raise CommandFailedError(f"File '{path}' is too large")
    except OSError as err:
        raise CommandFailedError(
            f"Failed to read file '{path}': {os.strerror(err.errno or 0)}"
        ) from None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


def _state_filter(cmd: Cmd, state: str) -> bool:
    """``list --state-*``: the states asked for (none: every state), as
    virConnectListAllDomains filters them (VIR_CONNECT_LIST_DOMAINS_RUNNING,
    _PAUSED, _SHUTOFF and _OTHER, which is every other state)."""
    asked = {
        "running": bool(cmd.get("state-running")),
        "paused": bool(cmd.get("state-paused")),
        "shut off": bool(cmd.get("state-shutoff")),
    }
    if not any(asked.values()) and not cmd.get("state-other"):
        return True
    if state in asked:
        return asked[state]
    return bool(cmd.get("state-other"))


def _pairs(cells: list[str], widths: list[int]) -> list[tuple[str, int]]:
    return list(zip(cells, widths))  # noqa: B905 - strict= needs Python 3.10


# a tuple, so that no formatter turns it into 3.14-only syntax
_STREAM_ERRORS = (OSError, ValueError)


def _reader_gone(stream: IO[str]) -> bool:
    """Whether stdout is a pipe whose reader has closed it."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLERR)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except _STREAM_ERRORS:
        return False


# --- screenshots ----------------------------------------------------------------

# What `virsh screenshot` saves: a PNG with libvirt >= 9.0 and QEMU >= 7.1 (and
# with libvirt's test driver), QEMU's PPM with older ones; the file name virsh
# makes up without --file ends as libvirt's virFileExtensionForMimeType says.
MIME_PNG = "image/png"
MIME_PPM = "image/x-portable-pixmap"
SCREEN_EXTENSIONS = {MIME_PNG: ".png", MIME_PPM: ".ppm"}


def screen_image(name: str, seed: float, screen: JsonObj) -> bytes:
    """The file of a domain's screenshot, as its ``screen`` setting says
    (``Tower.set_screen``): a recorded frame as it is, else a drawn one."""
    frame = screen.get("frame")
    if frame is not None:
        with open(frame, "rb") as handle:  # noqa: PTH123 - pathlib stays out of its imports
            data = handle.read()
        import gzip  # only for a recorded frame: not at every call

        return gzip.decompress(data) if str(frame).endswith(".gz") else data
    width = int(screen.get("width", 160))
    height = int(screen.get("height", 100))
    if screen.get("mime", MIME_PNG) == MIME_PPM:
        return ppm_image(name, seed, width, height)
    return png_image(name, seed, width, height)


def _screen_rows(name: str, seed: float, width: int, height: int) -> list[bytes]:
    """RGB rows: a colour band per domain, a stripe for the boot."""
    digest = zlib.crc32(name.encode("utf-8"))
    base = (digest & 0xFF, (digest >> 8) & 0xFF, (digest >> 16) & 0xFF)
    stripe = int(seed * 10) % width
    rows = []
    for y in range(height):
        row = bytearray()
        for x in range(width):
            if abs(x - stripe) < 3:
                row += b"\xff\xff\xff"
            else:
                shade = (x * 255 // max(1, width - 1) + y) % 256
                row += bytes(
                    ((base[0] + shade) % 256, base[1], (base[2] + y * 2) % 256)
                )
        rows.append(bytes(row))
    return rows


def ppm_image(name: str, seed: float, width: int, height: int) -> bytes:
    """A binary PPM as QEMU's screendump writes it ("P6\\nW H\\n255\\n")."""
    header = f"P6\n{width} {height}\n255\n".encode("ascii")
    return header + b"".join(_screen_rows(name, seed, width, height))


def png_image(name: str, seed: float, width: int = 160, height: int = 100) -> bytes:
    """A small real PNG (filter type 0 on every row)."""
    rows = [b"\x00" + row for row in _screen_rows(name, seed, width, height)]

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body))
            + kind
            + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows), 9))
        + chunk(b"IEND", b"")
    )


# --- main -----------------------------------------------------------------------

USAGE_ERROR = "error: unsupported option '{}'. See --help.\n"
OPTS_WITH_VALUE = {"-c": "connect", "-d": "debug", "-e": "escape", "-k": "keepalive-interval",
                   "-K": "keepalive-count", "-l": "log"}  # fmt: skip
LONG_WITH_VALUE = {"--connect", "--debug", "--escape", "--keepalive-interval",
                   "--keepalive-count", "--log"}  # fmt: skip
LONG_FLAGS = {"--quiet", "--readonly", "--timing", "--no-pkttyagent"}


def main(
    state_dir: str,
    argv: list[str],
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    quiet = False
    uri: str | None = None
    args = list(argv)
    while args and args[0].startswith("-") and args[0] != "-":
        opt = args.pop(0)
        if opt == "--":
            break
        if opt in ("-q", "--quiet"):
            quiet = True
        elif opt in ("-c", "--connect") and args:
            uri = args.pop(0)
        elif opt.startswith("--connect="):
            uri = opt.split("=", 1)[1]
        elif opt.startswith("-c") and len(opt) > 2:
            uri = opt[2:]
        elif opt in ("-r", "-t", "--readonly", "--timing", "--no-pkttyagent"):
            pass
        elif opt in ("-v", "--version", "-V"):
            stdout.write("12.8.0\n")
            return 0
        elif opt in OPTS_WITH_VALUE or opt in LONG_WITH_VALUE:
            if not args:
                long = OPTS_WITH_VALUE.get(opt, opt[2:])
                short = next(
                    (s for s, name in OPTS_WITH_VALUE.items() if name == long), opt
                )
                stderr.write(
                    f"error: option '{short}'/'--{long}' requires an argument\n"
                )
                return 1
            args.pop(0)
        elif opt.split("=", 1)[0] in LONG_WITH_VALUE:
            pass
        elif len(opt) > 2 and opt[:2] in OPTS_WITH_VALUE:
            pass  # -cURI
        else:
            stderr.write(USAGE_ERROR.format(opt))
            return 1
    started = time.time()
    record: JsonObj = {
        "kind": "start",
        "id": f"{os.getpid()}-{time.monotonic_ns()}",
        "pid": os.getpid(),
        "argv": list(argv),
        "t": started,
    }
    out = Out(stdout, stderr, quiet)
    try:
        cmds = parse(args) if args else []
    except ParseError as err:
        record["commands"] = None
        model.append_command(state_dir, record)
        out.error(str(err))
        _record_end(state_dir, record, 1)
        return 1
    record["commands"] = [c.tokens() for c in cmds]
    model.append_command(state_dir, record)
    if not args:
        stderr.write("error: the tower simulator has no interactive virsh shell\n")
        _record_end(state_dir, record, 1)
        return 1
    if args == [""]:
        _record_end(state_dir, record, 1)
        return 1
    session = Session(state_dir, out, uri or DEFAULT_URI, record["id"])
    if uri is not None and not _libvirtd_answers(state_dir):
        # virshInit: a URI given with -c is connected to before any command
        for line in model.CONNECT_FAILED:
            out.error(line)
        _record_end(state_dir, record, 1)
        return 1
    ok = True
    for cmd in cmds:
        if cmd.name not in NO_CONNECT and not _libvirtd_answers(state_dir):
            # vshCommandRun: the default URI is connected to at the first
            # command that needs it
            for line in model.CONNECT_FAILED:
                out.error(line)
            ok = False
        else:
            ok = session.run(cmd)
        out.print_extra("\n")
    stdout.flush()
    rc = 0 if ok else 1
    _record_end(state_dir, record, rc)
    return rc


DEFAULT_URI = "qemu:///system"
NO_CONNECT = frozenset({"echo"})  # VSH_CMD_FLAG_NOCONNECT


def _libvirtd_answers(state_dir: str) -> bool:
    """Whether libvirtd answers a new connection now. While it restarts, a
    socket-activated daemon (systemd holds its socket: the connection waits in
    the socket's backlog) makes the caller wait until it is back; else the
    socket is gone and the connection fails at once. Once it is back, its
    ``reconnect`` hooks have run (hooks.dispatch_reconnects)."""
    while True:
        with model.locked(state_dir, exclusive=False):
            data = model.load(state_dir)
        down = model.libvirtd_down(data, model.now(data))
        if down is None:
            if data.get("libvirtd_restarts"):
                hooks.dispatch_reconnects(state_dir)
            return True
        if not down.get("socket_activated"):
            return False
        time.sleep(POLL)


def _record_end(state_dir: str, record: JsonObj, rc: int) -> None:
    model.append_command(
        state_dir, {"kind": "end", "id": record["id"], "rc": rc, "t": time.time()}
    )
