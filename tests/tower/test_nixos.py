"""The NixOS module (nixos/) against the agent's own `install`.

What runs here: Nix's own parser and evaluator (`nix-instantiate`, Debian's
nix-bin) on the module's files. nixpkgs is not available, so the module is
evaluated against a small stand-in for nixpkgs' `lib` and `pkgs` (STUBS):
that checks the module's wiring (which option lands where, with which
text), not how NixOS merges it. The pure half, nixos/config.nix, needs no
stand-in: it is evaluated as it is and compared with the agent's output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import pwd
import re
import subprocess
from typing import Any

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    install as agent_install,
    wire,
)
from tests.support.agentbuild import SOURCE, agent_bytes
from tests.support.oldpython import oldest_python
from tests.tower.conftest import require_tool, run_agent
from tests.tower.test_build import compiled_at_start

REPO = Path(__file__).resolve().parents[2]
NIXOS = REPO / "nixos"
NIX_FILES = ("config.nix", "module.nix", "package.nix")

# The module's option names, and the agent_config keywords they map to.
OPTION_TO_KEYWORD = {
    "gpuNode": "gpu_node",
    "gaming": "gaming",
    "libvirtUri": "libvirt_uri",
    "stateDir": "state_dir",
    "timeouts": "timeouts",
    "path": "path",
    "detach": "detach",
}

# Option sets for nixos/config.nix's agentConfig, as the module hands them on.
OPTION_SETS = [
    pytest.param({"gpuNode": "gpu-node", "gaming": ["win-1"]}, id="defaults"),
    pytest.param(
        {
            "gpuNode": "k3s-gpu",
            "gaming": ["win-1", "linux-2"],
            "libvirtUri": "qemu+ssh://root@tower/system",
            "stateDir": "/srv/gpu handoff/state",
            "timeouts": {"agent": 240, "start": 12.5},
            "path": ["/run/current-system/sw/bin"],
            "detach": "process",
        },
        id="everything",
    ),
    pytest.param(
        {
            "gpuNode": "node",
            "gaming": ["game"],
            "timeouts": {"shutdown": 90},
            "detach": "systemd",
        },
        id="one-timeout",
    ),
]


def nix_eval(expr: str, **args: str) -> Any:
    """`expr` (a function of `args`, as strings) evaluated by Nix, as JSON."""
    require_tool("nix-instantiate")
    argv = ["nix-instantiate", "--eval", "--strict", "--json", "--expr", expr]
    for name, value in args.items():
        argv += ["--argstr", name, value]
    proc = subprocess.run(
        argv, capture_output=True, text=True, check=False, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def nix_parse(file: Path) -> subprocess.CompletedProcess[str]:
    require_tool("nix-instantiate")
    return subprocess.run(
        ["nix-instantiate", "--parse", str(file)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def normal(data: Any) -> str:
    """JSON with sorted keys: two configurations are the same file's content."""
    return json.dumps(data, sort_keys=True)


def python_config(options: dict[str, Any]) -> dict[str, Any]:
    keywords = {OPTION_TO_KEYWORD[name]: value for name, value in options.items()}
    return agent_install.agent_config(**keywords)


@pytest.mark.parametrize("name", NIX_FILES)
def test_module_files_parse(name: str) -> None:
    proc = nix_parse(NIXOS / name)
    assert proc.returncode == 0, proc.stderr


def docs_nix_blocks() -> list[str]:
    """The Nix examples of the NixOS page (docs/nixos.md)."""
    text = (REPO / "docs" / "nixos.md").read_text(encoding="utf-8")
    return re.findall(r"```nix\n(.*?)```", text, flags=re.DOTALL)


def test_docs_examples_parse(tmp_path: Path) -> None:
    blocks = docs_nix_blocks()
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        example = tmp_path / f"example-{i}.nix"
        example.write_text(block, encoding="utf-8")
        proc = nix_parse(example)
        assert proc.returncode == 0, (block, proc.stderr)
    # The by-path example's settings are the module's options.
    assert "services.gpu-handoff = {" in blocks[0]
    assert '"${gpu-handoff}/nixos/module.nix"' in blocks[1]


def test_parse_rejects_broken_nix(tmp_path: Path) -> None:
    """The parse check can fail: a file with an unclosed attribute set."""
    broken = tmp_path / "broken.nix"
    broken.write_text((NIXOS / "config.nix").read_text(encoding="utf-8")[:-3])
    assert nix_parse(broken).returncode != 0


def test_defaults_are_the_agents() -> None:
    defaults = nix_eval(
        '{ repo }: (import (/. + repo + "/nixos/config.nix")).defaults',
        repo=str(REPO),
    )
    assert defaults == {
        "libvirtUri": agent_config.DEFAULT_LIBVIRT_URI,
        "stateDir": agent_install.DEFAULT_INSTALL_STATE_DIR,
        "configPath": agent_config.DEFAULT_CONFIG_PATH,
        "timeouts": agent_config.TIMEOUT_DEFAULTS,
        "detachModes": list(agent_config.DETACH_MODES),
    }
    # Floating point on both sides: the files are the same, not just equal.
    assert normal(defaults["timeouts"]) == normal(agent_config.TIMEOUT_DEFAULTS)


@pytest.mark.parametrize("options", OPTION_SETS)
def test_config_is_the_agents(options: dict[str, Any]) -> None:
    """nixos/config.nix writes what the agent writes for the same options."""
    from_nix = nix_eval(
        '{ repo, options }: (import (/. + repo + "/nixos/config.nix"))'
        ".agentConfig (builtins.fromJSON options)",
        repo=str(REPO),
        options=json.dumps(options),
    )
    from_agent = python_config(options)
    assert normal(from_nix) == normal(from_agent)
    assert agent_config.validate_config(from_agent) == []


PROGRAMS = [
    "/nix/store/0123456789abcdfghijklmnpqrsvwxyz-gpu-handoff-0.2.0/bin/gpu-handoff",
    "/opt/my tools/it's $HOME/gpu-handoff",
]


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize(
    "config_path", [agent_config.DEFAULT_CONFIG_PATH, "/etc/gh/c.json"]
)
def test_hook_and_key_line_are_the_agents(program: str, config_path: str) -> None:
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample home-assistant"
    from_nix = nix_eval(
        "{ repo, program, configPath, key }: "
        'let c = import (/. + repo + "/nixos/config.nix"); in {'
        "  hook = c.hookScript { inherit program configPath; };"
        "  line = c.authorizedKeysLine { inherit program configPath key; };"
        "}",
        repo=str(REPO),
        program=program,
        configPath=config_path,
        key=key,
    )
    assert from_nix == {
        "hook": agent_install.hook_script(program, config_path),
        "line": agent_install.authorized_keys_line(program, config_path, key),
    }


def test_nix_hook_hands_libvirt_arguments_to_the_hook_verb(tmp_path: Path) -> None:
    """The hook text from config.nix, run by sh: the agent gets `--config
    PATH hook` and libvirt's four arguments, as they are, and its stdin."""
    program = tmp_path / "with space" / "gpu-handoff"
    program.parent.mkdir()
    record = tmp_path / "argv.json"
    program.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        f"json.dump([sys.argv[1:], sys.stdin.read()], open({str(record)!r}, 'w'))\n",
        encoding="utf-8",
    )
    program.chmod(0o755)
    text = nix_eval(
        '{ repo, program }: (import (/. + repo + "/nixos/config.nix"))'
        ".hookScript { inherit program; }",
        repo=str(REPO),
        program=str(program),
    )
    hook = tmp_path / "hook"
    hook.write_text(text, encoding="utf-8")
    hook.chmod(0o755)
    subprocess.run(
        [str(hook), "win-1", "prepare", "begin", "-"],
        input="<domain/>",
        text=True,
        check=True,
        timeout=30,
    )
    argv, stdin = json.loads(record.read_text(encoding="utf-8"))
    assert argv == [
        "--config",
        agent_config.DEFAULT_CONFIG_PATH,
        "hook",
        "win-1",
        "prepare",
        "begin",
        "-",
    ]
    assert stdin == "<domain/>"


# --- the module, against a stand-in for nixpkgs ------------------------------------

# Just enough of nixpkgs' lib and pkgs for module.nix: mkIf and mkMerge
# return the markers nixpkgs' own do, packages are store paths, and the
# builders keep their arguments so the test can read them.
STUBS = """
  lib = {
    mkIf = condition: content: { _type = "if"; inherit condition content; };
    mkMerge = contents: { _type = "merge"; inherit contents; };
    mkOption = attrs: attrs // { _type = "option"; };
    mkEnableOption = name: { _type = "option"; default = false; description = name; };
    literalExpression = text: { _type = "literalExpression"; inherit text; };
    mapAttrs = builtins.mapAttrs;
    types = {
      package = "package";
      str = "str";
      listOf = t: "list of ${t}";
      nonEmptyListOf = t: "non-empty list of ${t}";
      numbers.positive = "positive number";
      nullOr = t: "null or ${t}";
      enum = values: "one of ${builtins.concatStringsSep ", " values}";
    };
  };
  pkgs = {
    callPackage = fn: args: "/nix/store/stub-gpu-handoff";
    writeText = name: text: { outPath = "/nix/store/stub-${name}"; inherit text; };
    writeScript = name: text: { outPath = "/nix/store/stub-${name}"; inherit text; };
    runCommand = name: env: script: {
      outPath = "/nix/store/stub-${name}";
      inherit env script;
    };
  };
"""

MODULE_EVAL = (
    "{ repo, given, group }: let"
    + STUBS
    + """
  module = config: import (/. + repo + "/nixos/module.nix") { inherit config lib pkgs; };
  declared = (module { }).options.services.gpu-handoff;
  defaults = builtins.mapAttrs (
    name: option: if name == "timeouts"
      then builtins.mapAttrs (kind: o: o.default) option
      else option.default or null
  ) declared;
  set = builtins.fromJSON given;
  # What the module system hands the module: its defaults, then the user's.
  cfg = defaults // set // { timeouts = defaults.timeouts // (set.timeouts or { }); };
  evaluated = (module {
    services.gpu-handoff = cfg;
    virtualisation.libvirtd.enable = true;
    users.users.${cfg.user}.group = group;
  }).config;
  c = evaluated.content;
  users = c.users.users.contents;
  etc = c.environment.etc."gpu-handoff/config.json".source;
in {
  enabledBy = evaluated.condition;
  optionDefaults = removeAttrs defaults [ "package" ];
  assertions = map (a: { inherit (a) assertion message; }) c.assertions;
  packages = c.environment.systemPackages;
  settings = builtins.fromJSON etc.env.settingsFile.text;
  build = etc.script;
  hook = c.virtualisation.libvirtd.hooks.qemu.gpu-handoff.text;
  account = builtins.elemAt users 0;
  creates = {
    user = (builtins.elemAt users 1).condition;
    attrs = (builtins.elemAt users 1).content;
    groups = c.users.groups;
  };
  tmpfiles = c.systemd.tmpfiles.settings;
}
"""
)


def evaluate_module(given: dict[str, Any], group: str = "users") -> Any:
    return nix_eval(MODULE_EVAL, repo=str(REPO), given=json.dumps(given), group=group)


def fake_package(tmp_path: Path) -> Path:
    """A package directory whose bin/gpu-handoff is this agent."""
    package = tmp_path / "package"
    (package / "bin").mkdir(parents=True)
    (package / "bin/gpu-handoff").write_bytes(agent_bytes())
    (package / "bin/gpu-handoff").chmod(0o755)
    return package


def test_module_option_defaults() -> None:
    out = evaluate_module({"enable": True, "gpuNode": "n", "gaming": ["g"]})
    assert out["optionDefaults"] == {
        "enable": False,
        "user": "gpu-handoff",
        "authorizedKeys": [],
        "gpuNode": None,
        "gaming": None,
        "libvirtUri": agent_config.DEFAULT_LIBVIRT_URI,
        "stateDir": agent_install.DEFAULT_INSTALL_STATE_DIR,
        "timeouts": agent_config.TIMEOUT_DEFAULTS,
        # libvirtd's service PATH has no virsh; the system profile has it.
        "path": ["/run/current-system/sw/bin"],
        "detach": None,
    }
    assert out["enabledBy"] is True
    assert [a["assertion"] for a in out["assertions"]] == [True] * 4
    # Left at its default, the user is made by the module, with a shell
    # (sshd runs the forced command through it) and a group of its own.
    assert out["creates"]["user"] is True
    assert out["creates"]["attrs"]["gpu-handoff"]["useDefaultShell"] is True
    assert out["creates"]["attrs"]["gpu-handoff"]["group"] == "gpu-handoff"
    assert out["creates"]["groups"]["condition"] is True


def test_module_wiring(tmp_path: Path) -> None:
    package = fake_package(tmp_path)
    program = f"{package}/bin/gpu-handoff"
    keys = ["ssh-ed25519 AAAAC3Nza-one ha", "ssh-ed25519 AAAAC3Nza-two ha2"]
    given = {
        "enable": True,
        "package": str(package),
        "user": "hass",
        "authorizedKeys": keys,
        "gpuNode": "gpu-node",
        "gaming": ["win-1", "win-2"],
        "stateDir": "/var/lib/gh",
        "timeouts": {"agent": 240},
    }
    out = evaluate_module(given, group="users")
    # The configuration: the agent's for the same options, plus the
    # module's `path` default.
    assert normal(out["settings"]) == normal(
        agent_install.agent_config(
            gpu_node="gpu-node",
            gaming=["win-1", "win-2"],
            state_dir="/var/lib/gh",
            timeouts={"agent": 240},
            path=["/run/current-system/sw/bin"],
        )
    )
    assert out["packages"] == [str(package)]
    assert out["hook"] == agent_install.hook_script(
        program, agent_config.DEFAULT_CONFIG_PATH
    )
    account = out["account"]["hass"]
    assert account["extraGroups"] == ["libvirtd"]
    assert account["linger"] is True  # job units outlive the SSH session
    assert account["openssh"]["authorizedKeys"]["keys"] == [
        agent_install.authorized_keys_line(
            program, agent_config.DEFAULT_CONFIG_PATH, key
        )
        for key in keys
    ]
    assert out["creates"]["user"] is False  # hass is the user's own account
    assert out["tmpfiles"] == {
        "gpu-handoff": {
            "/var/lib/gh": {"d": {"user": "hass", "group": "users", "mode": "0700"}}
        }
    }


GOOD = {"enable": True, "gpuNode": "n", "gaming": ["g"], "user": "hass"}


@pytest.mark.parametrize(
    ("given", "broken"),
    [
        ({"user": "root"}, "must not be root"),
        (
            {"authorizedKeys": ["ssh-ed25519 AAAAC3Nza ha\nssh-ed25519 AAAAother x"]},
            "one public key on one line",
        ),
        (
            {"authorizedKeys": ['command="sh" ssh-ed25519 AAAAC3Nza ha']},
            "one public key on one line",
        ),
        ({"authorizedKeys": ["AAAAC3Nza ha"]}, "one public key on one line"),
        ({"stateDir": "var/lib/gh"}, "absolute plain path"),
        ({"stateDir": "/var/lib/../../tmp/gh"}, "absolute plain path"),
        ({"stateDir": "/tmp/gh"}, "absolute plain path"),
        ({"stateDir": "/home/hass/gh"}, "absolute plain path"),
    ],
)
def test_module_refuses_what_would_widen_the_key(
    given: dict[str, Any], broken: str
) -> None:
    """An account of root, a key that would add a second authorized_keys line
    (without restrict and the forced command) or carry options of its own,
    a state directory that is relative, climbs out, or lies where other
    users write: each fails an assertion, which fails the rebuild."""
    out = evaluate_module({**GOOD, **given})
    failed = [a["message"] for a in out["assertions"] if not a["assertion"]]
    assert len(failed) == 1, failed
    assert broken in failed[0]


def test_module_refuses_an_account_of_user_id_0() -> None:
    out = nix_eval(
        MODULE_EVAL.replace(
            "users.users.${cfg.user}.group = group;",
            "users.users.${cfg.user} = { inherit group; uid = 0; };",
        ),
        repo=str(REPO),
        given=json.dumps({**GOOD, "user": "toor"}),
        group="users",
    )
    failed = [a["message"] for a in out["assertions"] if not a["assertion"]]
    assert len(failed) == 1, failed
    assert "must not be root" in failed[0]


def test_module_takes_every_key_type_openssh_offers() -> None:
    keys = [
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA home-assistant",
        "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ== ha@host",
        "ecdsa-sha2-nistp256 AAAAE2VjZHNh",
        "sk-ssh-ed25519@openssh.com AAAAGnNrLXNzaC1lZDI1NTE5 yubikey",
    ]
    out = evaluate_module({**GOOD, "authorizedKeys": keys, "stateDir": "/srv/gh"})
    assert all(a["assertion"] for a in out["assertions"]), out["assertions"]


def run_build(
    script: str, settings: dict[str, Any], tmp_path: Path
) -> tuple[int, Path]:
    """The configuration's build step, as a builder runs it (bash -e)."""
    source = tmp_path / "settings.json"
    source.write_text(json.dumps(settings), encoding="utf-8")
    out = tmp_path / "out.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "settingsFile": str(source), "out": str(out)}
    proc = subprocess.run(
        ["bash", "-e", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return proc.returncode, out


def test_module_checks_the_configuration_as_it_builds(tmp_path: Path) -> None:
    """The build step runs the agent's check-config: a configuration the
    agent refuses fails the build, a good one is the output."""
    package = fake_package(tmp_path)
    given = {
        "enable": True,
        "package": str(package),
        "gpuNode": "gpu-node",
        "gaming": ["win-1"],
    }
    out = evaluate_module(given)
    rc, built = run_build(out["build"], out["settings"], tmp_path)
    assert rc == 0
    assert json.loads(built.read_text(encoding="utf-8")) == out["settings"]
    refused = {**out["settings"], "gaming": ["gpu-node"]}
    assert agent_config.validate_config(refused) != []
    rc, built = run_build(out["build"], refused, tmp_path)
    assert rc != 0
    assert not built.exists()


# What would put a directory ahead of /run/wrappers/bin: a PATH set by hand,
# a wrapper program, a session variable, a systemd unit's `path`.
PATH_SETTERS = re.compile(
    r"\bPATH\s*=|makeWrapper|makeBinaryWrapper|wrapProgram|wrapPython"
    r"|environment\.(variables|sessionVariables|extraInit|shellInit)"
    r"|systemd\.(user\.)?services|--prefix|--suffix"
)


def code_lines(file: Path) -> list[str]:
    """The file's lines, but for those that are comments."""
    return [
        line
        for line in file.read_text(encoding="utf-8").splitlines()
        if not line.lstrip().startswith("#")
    ]


@pytest.mark.parametrize("name", NIX_FILES)
def test_module_sets_no_path(name: str) -> None:
    """Nothing in nixos/ may put a directory ahead of /run/wrappers/bin:
    the module sets no PATH anywhere; its `path` goes to the agent's
    configuration, which the agent searches after the inherited PATH
    (tests/tower/test_config.py)."""
    offending = [line for line in code_lines(NIXOS / name) if PATH_SETTERS.search(line)]
    assert offending == []


def test_path_rule_check_can_fail(tmp_path: Path) -> None:
    wrapped = tmp_path / "wrapped.nix"
    wrapped.write_text(
        "# a comment may say PATH=x\n"
        'postFixup = "wrapProgram $out/bin/gpu-handoff --prefix PATH : ${libvirt}/bin";\n',
        encoding="utf-8",
    )
    assert [line for line in code_lines(wrapped) if PATH_SETTERS.search(line)] != []
    assert "PATH" not in agent_install.hook_script("/p", "/c").replace("#!/bin/sh", "")


def test_package(tmp_path: Path) -> None:
    """package.nix, against a stand-in stdenv: the agent built from its
    sources (with the package's python3) as bin/gpu-handoff, the
    integration's version, no wrapper."""
    out = nix_eval(
        '{ repo }: let d = import (/. + repo + "/nixos/package.nix") {'
        "  lib = {"
        "    importJSON = f: builtins.fromJSON (builtins.readFile f);"
        '    licenses.mit = "mit"; platforms.linux = [ "x86_64-linux" ];'
        "  };"
        "  stdenvNoCC.mkDerivation = attrs: attrs;"
        '  python3 = "/nix/store/stub-python3";'
        "}; in d // { src = toString d.src; }",
        repo=str(REPO),
    )
    assert out["version"] == wire.VERSION
    assert Path(out["src"]) == SOURCE.parent
    assert out["buildInputs"] == ["/nix/store/stub-python3"]
    assert out["nativeBuildInputs"] == ["/nix/store/stub-python3"]
    assert out["meta"]["mainProgram"] == "gpu-handoff"
    assert "postFixup" not in out
    prefix = tmp_path / "out"
    work = tmp_path / "build"
    work.mkdir()
    # The build phase's python3: the oldest the agent claims, on its PATH.
    python, env = oldest_python()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(python)
    subprocess.run(
        [
            "bash",
            "-e",
            "-c",
            "runHook() { :; }\n" + out["buildPhase"] + out["installPhase"],
        ],
        env={
            **os.environ,
            **env,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "src": out["src"],
            "out": str(prefix),
        },
        cwd=work,
        check=True,
        timeout=30,
    )
    installed = prefix / "bin/gpu-handoff"
    assert installed.read_bytes() == agent_bytes()
    assert os.access(installed, os.X_OK)
    # patchShebangs rewrites this line into python3's store path.
    assert installed.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    # Beside it, its modules compiled for that python3: a start compiles
    # none of the agent.
    caches = sorted(p.name for p in (prefix / "bin/__pycache__").iterdir())
    assert caches == ["gpu-handoff.cpython-39.pyc"]
    compiled = compiled_at_start((python, env), installed)
    assert not [name for name in compiled if "/gpu_handoff/" in name], compiled


# --- install on NixOS ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"etc/NIXOS": ""}, True),
        ({"etc/os-release": "NAME=NixOS\nID=nixos\nVERSION_ID=25.11\n"}, True),
        ({"etc/os-release": 'NAME="NixOS"\nID="nixos"\n'}, True),
        ({"usr/lib/os-release": "ID=nixos\n"}, True),
        ({"etc/os-release": "ID=debian\n", "usr/lib/os-release": "ID=nixos\n"}, False),
        ({"etc/os-release": "ID=debian\nID_LIKE=nixos\n"}, False),
        ({"etc/os-release": "ID=nixos-like\n"}, False),
        ({}, False),
    ],
)
def test_is_nixos(tmp_path: Path, files: dict[str, str], expected: bool) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert agent_install.is_nixos(str(tmp_path)) is expected


def nixos_root(tmp_path: Path) -> Path:
    root = tmp_path / "nixos-root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text("ID=nixos\n", encoding="utf-8")
    return root


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# Options with text that needs escaping in Nix: quotes, `${`, a backslash.
NIXOS_OPTIONS = [
    "--gpu-node",
    "gpu-node",
    "--gaming",
    "win-1",
    "--gaming=win-2",
    "--uri",
    "test+unix:///default?socket=/tmp/s/libvirt-sock",
    "--state-dir",
    '/var/lib/gpu "handoff" ${x}\\y',
    "--timeout-agent",
    "240",
    "--timeout-start=12.5",
    "--detach",
    "process",
]


def test_install_on_nixos_writes_nothing(tmp_path: Path) -> None:
    root = nixos_root(tmp_path)
    before = tree(root)
    run = run_agent(
        ["install", "--root", str(root), "--user", "no-such-user-here", *NIXOS_OPTIONS]
    )
    assert run.rc == 0, run.reply
    assert tree(root) == before
    reply = run.reply
    assert reply["nixos"] is True
    assert reply["installed"] == []
    snippet = reply["nixos_module"]
    assert snippet in run.stderr
    assert "services.gpu-handoff = {" in snippet
    # The account need not exist yet: the module can make it.
    assert 'user = "no-such-user-here";' in snippet
    assert "systemctl restart libvirtd" in run.stderr


def test_install_on_nixos_module_settings_evaluate(tmp_path: Path) -> None:
    """The printed settings are a Nix expression; through config.nix they
    give the configuration `install` writes elsewhere for the same options."""
    root = nixos_root(tmp_path)
    run = run_agent(["install", "--root", str(root), "--user", "hass", *NIXOS_OPTIONS])
    assert run.rc == 0, run.reply
    snippet_file = tmp_path / "gpu-handoff.nix"
    snippet_file.write_text(run.reply["nixos_module"], encoding="utf-8")
    assert nix_parse(snippet_file).returncode == 0
    out = nix_eval(
        "{ repo, file }: let"
        "  snippet = import (/. + file);"
        "  s = snippet.services.gpu-handoff;"
        '  c = import (/. + repo + "/nixos/config.nix");'
        "in {"
        "  inherit (snippet) imports;"
        "  inherit (s) enable user authorizedKeys;"
        '  config = c.agentConfig (removeAttrs s [ "enable" "user" "authorizedKeys" ]);'
        "}",
        repo=str(REPO),
        file=str(snippet_file),
    )
    assert out["imports"] == [str(NIXOS / "module.nix")]
    assert out["enable"] is True
    assert out["user"] == "hass"
    assert out["authorizedKeys"] == [agent_install.PLACEHOLDER_KEY]
    # The same options, installed the usual way into a plain root.
    plain = tmp_path / "plain-root"
    me = pwd.getpwuid(os.getuid()).pw_name
    done = run_agent(["install", "--root", str(plain), "--user", me, *NIXOS_OPTIONS])
    assert done.rc == 0, done.reply
    written = json.loads((plain / "etc/gpu-handoff/config.json").read_text("utf-8"))
    assert normal(out["config"]) == normal(written)


def test_install_on_nixos_refuses_what_does_not_apply(tmp_path: Path) -> None:
    root = nixos_root(tmp_path)
    base = ["install", "--root", str(root), "--user", "hass", "--gpu-node", "n"]
    base += ["--gaming", "g"]
    for extra in (["--prefix", "/opt/gh"], ["--config", "/etc/gh/c.json"]):
        run = run_agent([*base, *extra])
        assert run.reply["error"]["code"] == "bad_request", extra
        assert "NixOS" in run.reply["error"]["message"]
    # The default configuration path is where the module puts it.
    assert run_agent([*base, "--config", agent_config.DEFAULT_CONFIG_PATH]).rc == 0
    # The agent's checks apply before anything is printed.
    bad = run_agent(
        [
            "install",
            "--root",
            str(root),
            "--user",
            "hass",
            "--gpu-node",
            "n",
            "--gaming",
            "n",
        ]
    )
    assert bad.reply["error"]["code"] == "config_invalid"
    assert bad.stderr == ""
    assert tree(root) == ["etc", "etc/os-release"]


@pytest.mark.parametrize(
    ("value", "literal"),
    [(240.0, "240"), (12.5, "12.5"), (1e-05, "1.0e-05"), (2.5e-07, "2.5e-07")],
)
def test_nix_number(value: float, literal: str) -> None:
    assert agent_install.nix_number(value) == literal


def test_nix_literals_evaluate_to_their_values() -> None:
    values = [240.0, 12.5, 1e-05, 2.5e-07, 1e20]
    texts = ['say "hi"', "${HOME} and $HOME", "back\\slash", "tab\tnew\nline", "é"]
    expr = (
        "{ numbers = [ "
        + " ".join(agent_install.nix_number(v) for v in values)
        + " ]; texts = [ "
        + " ".join(agent_install.nix_string(t) for t in texts)
        + " ]; }"
    )
    assert nix_eval(expr) == {"numbers": values, "texts": texts}
