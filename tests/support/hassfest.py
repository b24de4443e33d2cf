"""Home Assistant's own checks of the integration's files, as its hassfest
checker runs them for a custom integration, and the code's side of them.

hassfest lives in Home Assistant core's ``script/hassfest``, which the
``homeassistant`` wheel does not ship. What the installed Home Assistant does
offer is used as it is:

- ``loader.Integration.resolve_from_root``: the manifest as Home Assistant
  loads a custom integration (refused without a version it can read);
- ``loader.Manifest``: the manifest keys the loader knows;
- ``helpers.service._SERVICES_SCHEMA`` and ``util.yaml.load_yaml_dict``: how
  Home Assistant reads services.yaml, selectors included;
- ``helpers.icon._load_icons_file``: how it reads icons.json;
- ``helpers.translation.recursive_flatten``: how it flattens strings;
- ``helpers.config_validation``'s validators, and the common strings in
  ``homeassistant/strings.json`` that ``[%key:common::...%]`` refers to.

hassfest's own rules are restated here from its sources (each check names
the file), never copied: manifest.py, translations.py, services.py, icons.py,
quality_scale.py and quality_scale_validation/config_flow.py.

Beyond the files themselves, the code's use of them: every translation key
the code uses has a string (each flow's steps, fields, menu options, errors
and aborts; exceptions; repair issues; entities), every action the
integration registers is described with each of its fields (services.yaml,
strings.json, icons.json), and every field of every form has a
data_description. The keys are read from the code's syntax tree, following a
key through the variables, returns and exceptions that carry it; a key the
reading cannot follow must be listed in DYNAMIC_KEYS, so none goes unchecked.

tests/test_hassfest.py runs it, and proves that every check can fail.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
import functools
import importlib
import inspect
import json
from pathlib import Path
import re
from types import ModuleType, SimpleNamespace
from typing import Any, get_type_hints

from awesomeversion import (
    AwesomeVersion,
    AwesomeVersionException,
    AwesomeVersionStrategy,
)
import homeassistant
from homeassistant import loader
from homeassistant.const import Platform
from homeassistant.data_entry_flow import FlowHandler
from homeassistant.exceptions import HomeAssistantError
from homeassistant.helpers import (
    config_validation as cv,
    selector,
    service as ha_service,
)
from homeassistant.helpers.entity import EntityDescription
from homeassistant.helpers.icon import _load_icons_file
from homeassistant.helpers.translation import recursive_flatten
from homeassistant.util.yaml import load_yaml_dict
import probatio as pb
from probatio.humanize import humanize_error
import yaml

from custom_components.gpu_handoff import health, services
from custom_components.gpu_handoff.const import DOMAIN, SUBENTRY_GAMING_VM
from custom_components.gpu_handoff.tower.gpu_handoff import wire

YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
ROOT = Path(__file__).resolve().parents[2]
COMPONENT = ROOT / "custom_components" / DOMAIN
PACKAGE = f"custom_components.{DOMAIN}"
HA_STRINGS = Path(homeassistant.__file__).parent / "strings.json"
# The files the checks read (all of them, for a copy to mutate).
FILES = (
    "manifest.json",
    "strings.json",
    "translations",
    "services.yaml",
    "icons.json",
    "quality_scale.yaml",
)

# Where each flow's strings are: its section of strings.json. Every flow
# handler the integration defines must be listed (test: the inventory).
FLOW_SECTIONS: dict[str, tuple[tuple[str, ...], ...]] = {
    "GpuHandoffConfigFlow": (("config",),),
    "GpuHandoffOptionsFlow": (("options",),),
    "GamingVmSubentryFlow": (("config_subentries", SUBENTRY_GAMING_VM),),
    "HostKeyRepairFlow": (("issues", "host_key_mismatch", "fix_flow"),),
    "NewGamingVmRepairFlow": (("issues", "new_gaming_vm", "fix_flow"),),
    "AgentUpdateRepairFlow": (
        ("issues", "agent_outdated", "fix_flow"),
        ("issues", "agent_older", "fix_flow"),
    ),
    "NodeScreenRepairFlow": (
        ("issues", "node_containers_not_starting", "fix_flow"),
        ("issues", "node_gpus_missing", "fix_flow"),
    ),
}

# Translation keys the syntax tree cannot follow, by (module, expression):
# what the code can make of them, read from the code itself.
DYNAMIC_KEYS: dict[tuple[str, str], Callable[[], set[str]]] = {
    # A GPU node's health issue is named after its reason.
    ("repair_sync", "f'node_{health.reason}'"): lambda: {
        f"node_{reason}" for reason in health.REASONS
    },
    # A finding of the tower's agent is an issue named after its code.
    ("repair_sync", "code"): lambda: {
        value for name, value in vars(wire).items() if name.startswith("FINDING_")
    },
}


# --- the rules, restated -----------------------------------------------------

# script/hassfest/translations.py: a translation key is lower case letters,
# digits, "-" and "_", starting and ending with a letter or digit, with no
# doubled separator.
TRANSLATION_KEY = re.compile(r"[a-z0-9]+(?:[_-][a-z0-9]+)*")
REFERENCE = re.compile(r"\[%key:([a-z0-9_:]+)%\]")
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _key(value: Any) -> str:
    """A translation key (translations.py's translation_key_validator)."""
    if not isinstance(value, str) or not TRANSLATION_KEY.fullmatch(value):
        raise pb.Invalid(f"invalid translation key {value!r}")
    return value


def _text(value: Any) -> str:
    """A string to show (translations.py's translation_value_validator): no
    HTML, no placeholder in single quotes, a reference only on its own, no
    spaces around."""
    text = cv.string_with_no_html(value)
    if re.search(r"'\{\w+\}'", text):
        raise pb.Invalid("a placeholder in single quotes")
    if "[%key:" in text and not REFERENCE.fullmatch(text):
        raise pb.Invalid("a reference combined with other text")
    if text != text.strip():
        raise pb.Invalid("leading or trailing spaces")
    return text


def _keyed(value_schema: Any) -> Any:
    return cv.schema_with_slug_keys(value_schema, slug_validator=_key)


def _data_described(value: dict[str, Any]) -> dict[str, Any]:
    """translations.py: a data_description names a field of the step's data."""
    for step_id, step in value.get("step", {}).items():
        for key in step.get("data_description", {}):
            if key not in step.get("data", {}):
                raise pb.Invalid(
                    f"step {step_id}: data_description {key} is not in data"
                )
    return value


def _flow_schema(*, subentry: bool = False) -> Any:
    """A flow's strings (translations.py's gen_data_entry_schema; a config
    subentry type also names its entries and its button)."""
    fields = {
        pb.Optional("data"): {str: _text},
        pb.Optional("data_description"): {str: _text},
    }
    step = {
        pb.Optional("title"): _text,
        pb.Optional("description"): _text,
        **fields,
        pb.Optional("menu_options"): {str: _text},
        pb.Optional("menu_option_descriptions"): {str: _text},
        pb.Optional("submit"): _text,
        pb.Optional("sections"): {
            str: {
                pb.Optional("name"): _text,
                pb.Optional("description"): _text,
                **fields,
            }
        },
    }
    marker = pb.Required if subentry else pb.Optional
    schema = {
        pb.Optional("flow_title"): _text,
        pb.Required("step"): {str: step},
        pb.Optional("error"): {str: _text},
        pb.Optional("abort"): {str: _text},
        pb.Optional("progress"): {str: _text},
        pb.Optional("create_entry"): {str: _text},
        marker("entry_type"): _text,
        marker("initiate_flow"): {
            marker("user"): _text,
            pb.Optional("reconfigure"): _text,
        },
    }
    return pb.All(pb.Schema(schema), _data_described)


def _states() -> Any:
    return _keyed(_text)


STRINGS_SCHEMA = pb.Schema(
    {
        pb.Optional("title"): _text,
        pb.Optional("config"): _flow_schema(),
        pb.Optional("options"): _flow_schema(),
        pb.Optional("config_subentries"): _keyed(_flow_schema(subentry=True)),
        pb.Optional("selector"): _keyed(
            {
                pb.Optional("options"): _states(),
                pb.Optional("fields"): _keyed(
                    {pb.Optional("name"): _text, pb.Optional("description"): _text}
                ),
            }
        ),
        pb.Optional("device"): _keyed({pb.Optional("name"): _text}),
        pb.Optional("entity"): cv.schema_with_slug_keys(
            _keyed(
                {
                    pb.Optional("name"): _text,
                    pb.Optional("unit_of_measurement"): _text,
                    pb.Optional("state"): _states(),
                    pb.Optional("state_attributes"): _keyed(
                        {pb.Optional("name"): _text, pb.Optional("state"): _states()}
                    ),
                }
            ),
            slug_validator=cv.slug,
        ),
        pb.Optional("exceptions"): _keyed({pb.Optional("message"): _text}),
        pb.Optional("issues"): {
            str: pb.All(
                cv.has_at_least_one_key("description", "fix_flow"),
                pb.Schema(
                    {
                        pb.Required("title"): _text,
                        pb.Exclusive("description", "fixable"): _text,
                        pb.Exclusive("fix_flow", "fixable"): _flow_schema(),
                    }
                ),
            )
        },
        pb.Optional("services"): _keyed(
            {
                pb.Required("name"): _text,
                pb.Required("description"): _text,
                pb.Optional("fields"): _keyed(
                    {
                        pb.Required("name"): _text,
                        pb.Required("description"): _text,
                        pb.Optional("example"): _text,
                    }
                ),
                pb.Optional("sections"): _keyed(
                    {pb.Required("name"): _text, pb.Optional("description"): _text}
                ),
            }
        ),
        pb.Optional("common"): {cv.slug: _text},
        # What this integration has none of, as hassfest has them or (the
        # last three) taken as they are.
        pb.Optional("entity_component"): cv.schema_with_slug_keys(
            {
                pb.Optional("name"): _text,
                pb.Optional("state"): _states(),
                pb.Optional("state_attributes"): _keyed(
                    {pb.Optional("name"): _text, pb.Optional("state"): _states()}
                ),
            },
            slug_validator=pb.Any("_", cv.slug),
        ),
        pb.Optional("device_automation"): {str: {str: _text}},
        pb.Optional("system_health"): {pb.Optional("info"): _keyed(_text)},
        pb.Optional("application_credentials"): {pb.Optional("description"): _text},
        pb.Optional("config_panel"): {str: _keyed(_text)},
        pb.Optional("conversation"): {
            pb.Required("agent"): {pb.Required("done"): _text}
        },
        pb.Optional("conditions"): dict,
        pb.Optional("triggers"): dict,
        pb.Optional("preview_features"): dict,
    }
)


def _version(value: Any) -> str:
    """manifest.py's verify_version: a version AwesomeVersion can read."""
    try:
        AwesomeVersion(
            value,
            ensure_strategy=[
                AwesomeVersionStrategy.CALVER,
                AwesomeVersionStrategy.SEMVER,
                AwesomeVersionStrategy.SIMPLEVER,
                AwesomeVersionStrategy.BUILDVER,
                AwesomeVersionStrategy.PEP440,
            ],
        )
    except AwesomeVersionException as err:
        raise pb.Invalid(f"{value!r} is not a valid version") from err
    return str(value)


def _https(value: Any) -> str:
    """manifest.py's documentation_url: an https address."""
    if not str(value).startswith("https://"):
        raise pb.Invalid("not an https address")
    return str(value)


# manifest.py: the keys a custom integration's manifest may have (its
# INTEGRATION_MANIFEST_SCHEMA and CUSTOM_INTEGRATION_MANIFEST_SCHEMA; the
# discovery matchers are taken as lists here: this integration has none).
MANIFEST_SCHEMA = pb.Schema(
    {
        pb.Required("domain"): str,
        pb.Required("name"): str,
        pb.Optional("integration_type"): pb.In(
            ["device", "entity", "hardware", "helper", "hub", "service", "system"]
        ),
        pb.Optional("config_flow"): bool,
        pb.Optional("mqtt"): [str],
        pb.Optional("zeroconf"): list,
        pb.Optional("ssdp"): list,
        pb.Optional("bluetooth"): list,
        pb.Optional("homekit"): dict,
        pb.Optional("dhcp"): list,
        pb.Optional("usb"): list,
        pb.Required("documentation"): _https,
        pb.Optional("issue_tracker"): _https,
        pb.Optional("quality_scale"): pb.In(["internal", "silver", "gold", "platinum"]),
        pb.Optional("requirements"): [str],
        pb.Optional("dependencies"): [str],
        pb.Optional("after_dependencies"): [str],
        pb.Required("codeowners"): [str],
        pb.Optional("loggers"): [str],
        pb.Optional("disabled"): str,
        pb.Optional("iot_class"): pb.In(
            [
                "assumed_state",
                "calculated",
                "cloud_polling",
                "cloud_push",
                "local_polling",
                "local_push",
            ]
        ),
        pb.Optional("single_config_entry"): bool,
        # Custom integrations only; "version" is required (validate_version).
        pb.Required("version"): _version,
        pb.Optional("import_executor"): bool,
    }
)


def _mdi(value: Any) -> str:
    """icons.py's icon_value_validator: a Material Design Icon."""
    text = cv.string_with_no_html(value)
    if not text.startswith("mdi:"):
        raise pb.Invalid(f"{text!r} is not an mdi: icon")
    return text


def _state_icons_differ(value: dict[str, Any]) -> dict[str, Any]:
    """icons.py's ensure_not_same_as_default: a state's icon is not the
    default one (hassfest's schema applies it to entity_component and
    attribute icons; here it applies to entity icons as well)."""
    default = value.get("default")
    for state, icon in value.get("state", {}).items():
        if icon == default:
            raise pb.Invalid(f"the icon of state {state} is the default icon")
    return value


_ICON = pb.All(
    pb.Schema(
        {
            pb.Optional("default"): _mdi,
            pb.Optional("state"): _keyed(_mdi),
            pb.Optional("range"): {pb.Coerce(float): _mdi},
        }
    ),
    _state_icons_differ,
)
# icons.py's icon_schema for a hub: entity icons per platform and translation
# key, action icons (HA's loader turns a bare string into {"service": ...}).
ICONS_SCHEMA = pb.Schema(
    {
        pb.Optional("entity"): cv.schema_with_slug_keys(
            _keyed(
                pb.All(
                    pb.Schema(
                        {
                            pb.Optional("default"): _mdi,
                            pb.Optional("state"): _keyed(_mdi),
                            pb.Optional("range"): {pb.Coerce(float): _mdi},
                            pb.Optional("state_attributes"): _keyed(_ICON),
                        }
                    ),
                    _state_icons_differ,
                )
            ),
            slug_validator=cv.slug,
        ),
        pb.Optional("services"): _keyed(
            {pb.Required("service"): _mdi, pb.Optional("sections"): _keyed(_mdi)}
        ),
    }
)

# quality_scale.py's ALL_RULES, by tier.
QUALITY_TIERS: dict[str, tuple[str, ...]] = {
    "bronze": (
        "action-setup",
        "appropriate-polling",
        "brands",
        "common-modules",
        "config-flow",
        "config-flow-test-coverage",
        "dependency-transparency",
        "docs-actions",
        "docs-conditions",
        "docs-high-level-description",
        "docs-installation-instructions",
        "docs-removal-instructions",
        "docs-triggers",
        "entity-event-setup",
        "entity-unique-id",
        "has-entity-name",
        "runtime-data",
        "test-before-configure",
        "test-before-setup",
        "unique-config-entry",
    ),
    "silver": (
        "action-exceptions",
        "config-entry-unloading",
        "docs-configuration-parameters",
        "docs-installation-parameters",
        "entity-unavailable",
        "integration-owner",
        "log-when-unavailable",
        "parallel-updates",
        "reauthentication-flow",
        "test-coverage",
    ),
    "gold": (
        "devices",
        "diagnostics",
        "discovery",
        "discovery-update-info",
        "docs-data-update",
        "docs-examples",
        "docs-known-limitations",
        "docs-supported-devices",
        "docs-supported-functions",
        "docs-troubleshooting",
        "docs-use-cases",
        "dynamic-devices",
        "entity-category",
        "entity-device-class",
        "entity-disabled-by-default",
        "entity-translations",
        "exception-translations",
        "icon-translations",
        "reconfiguration-flow",
        "repair-issues",
        "stale-devices",
    ),
    "platinum": ("async-dependency", "inject-websession", "strict-typing"),
}
QUALITY_RULES = frozenset(rule for rules in QUALITY_TIERS.values() for rule in rules)
# quality_scale.py: "done" or "todo", alone or with a comment; "exempt"
# always with one (why the rule does not apply).
_RULE_STATUS = pb.Any(
    pb.In(["done", "todo"]),
    pb.Schema(
        {pb.Required("status"): pb.In(["done", "todo"]), pb.Optional("comment"): str}
    ),
    pb.Schema({pb.Required("status"): "exempt", pb.Required("comment"): str}),
)
QUALITY_SCALE_SCHEMA = pb.Schema(
    {pb.Required("rules"): {pb.Optional(rule): _RULE_STATUS for rule in QUALITY_RULES}}
)


# --- what the code uses --------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """A translation key the code uses. ``carrier``: the exception class
    whose ``key`` it came through (such a key may be meant for only some of
    the places that show that class's keys)."""

    name: str
    carrier: str | None = None


@dataclass
class Flow:
    """What one flow handler shows, and where its strings are."""

    name: str
    sections: tuple[tuple[str, ...], ...]
    forms: dict[str, set[str]] = field(default_factory=dict)
    menus: dict[str, set[str]] = field(default_factory=dict)
    aborts: set[Key] = field(default_factory=set)
    errors: set[Key] = field(default_factory=set)


@dataclass
class CodeFacts:
    """The translation keys and actions of the code."""

    flows: list[Flow] = field(default_factory=list)
    exceptions: set[Key] = field(default_factory=set)
    issues: set[Key] = field(default_factory=set)
    entities: set[tuple[str, str]] = field(default_factory=set)
    actions: dict[str, set[str]] = field(default_factory=dict)
    unresolved: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Scope:
    """Where an expression is: its module, function and class."""

    module: str
    function: ast.FunctionDef | ast.AsyncFunctionDef | None = None
    cls: ast.ClassDef | None = None


Function = ast.FunctionDef | ast.AsyncFunctionDef
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
Keys = frozenset[Key] | None  # None: cannot tell


def _functions(node: ast.AST) -> Iterator[Function]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, FUNCTIONS):
            yield child


def _own_nodes(function: Function) -> Iterator[ast.AST]:
    """The nodes of a function, not those of functions nested in it."""
    stack: list[ast.AST] = list(function.body)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(
            child
            for child in ast.iter_child_nodes(node)
            if not isinstance(child, (*FUNCTIONS, ast.Lambda, ast.ClassDef))
        )


class Reader:
    """Follows translation keys through the integration's code."""

    def __init__(self, component: Path) -> None:
        self.modules: dict[str, ModuleType] = {}
        self.trees: dict[str, ast.Module] = {}
        for path in sorted(component.glob("*.py")):
            name = path.stem
            self.modules[name] = importlib.import_module(
                PACKAGE if name == "__init__" else f"{PACKAGE}.{name}"
            )
            self.trees[name] = ast.parse(path.read_text(encoding="utf-8"))
        self.unresolved: list[str] = []
        self._busy: set[int] = set()

    # The module-level functions and classes of the package, by name.
    @functools.cached_property
    def definitions(self) -> dict[str, tuple[str, ast.AST]]:
        found: dict[str, tuple[str, ast.AST]] = {}
        for module, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, (*FUNCTIONS, ast.ClassDef)):
                    found.setdefault(node.name, (module, node))
        return found

    def note(self, scope: Scope, expr: ast.AST) -> None:
        where = scope.function.name if scope.function else "<module>"
        self.unresolved.append(f"{scope.module}.{where}: {ast.unparse(expr)}")

    def keys(self, expr: ast.AST, scope: Scope) -> Keys:
        """The keys ``expr`` can be (None: cannot tell)."""
        if id(expr) in self._busy:
            return frozenset()
        self._busy.add(id(expr))
        try:
            return self._keys(expr, scope)
        finally:
            self._busy.discard(id(expr))

    def _union(self, exprs: list[ast.expr], scope: Scope) -> Keys:
        found: set[Key] = set()
        for expr in exprs:
            keys = self.keys(expr, scope)
            if keys is None:
                return None
            found |= keys
        return frozenset(found)

    def _keys(self, expr: ast.AST, scope: Scope) -> Keys:
        dynamic = DYNAMIC_KEYS.get((scope.module, ast.unparse(expr)))
        if dynamic is not None:
            return frozenset(Key(name) for name in dynamic())
        match expr:
            case ast.Constant(value=str(value)):
                return frozenset({Key(value)})
            case ast.Constant(value=None):
                return frozenset()
            case ast.Await(value=value):
                return self.keys(value, scope)
            case ast.IfExp(body=body, orelse=orelse):
                return self._union([body, orelse], scope)
            case ast.BoolOp(values=values):
                return self._union(values, scope)
            case ast.BinOp(left=left, op=ast.BitOr(), right=right):
                return self._union([left, right], scope)
            case ast.Dict(values=values):
                return self._union(values, scope)
            case ast.Name(id=name):
                return self._name(name, scope)
            case ast.Attribute(value=ast.Name(id=owner), attr="key"):
                carrier = self._exception_of(owner, expr, scope)
                if carrier is not None:
                    return frozenset(
                        Key(key.name, carrier) for key in self.carried(carrier)
                    )
            case ast.Attribute(value=ast.Name(id="self"), attr=attr) if scope.cls:
                return self._union(list(self._self_assignments(attr, scope)), scope)
            case ast.Call(func=ast.Name(id=name)):
                return self._returns(name, None, scope)
            case ast.Call(func=ast.Attribute(value=ast.Name(id="self"), attr=attr)):
                return self._method_returns(attr, None, scope)
        value = self._evaluate(expr, scope)
        if isinstance(value, str):
            return frozenset({Key(value)})
        if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            return frozenset(Key(v) for v in value.values())
        return None

    def _evaluate(self, expr: ast.AST, scope: Scope) -> Any:
        """A constant of the module (``health.GPUS_MISSING``, a mapping)."""
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        if not isinstance(expr, (ast.Name, ast.Attribute)):
            return None
        try:
            return eval(  # noqa: S307 - a name or dotted name of our own module
                compile(ast.Expression(expr), "<key>", "eval"),
                vars(self.modules[scope.module]),
            )
        except Exception:  # noqa: BLE001 - not a module constant
            return None

    def _name(self, name: str, scope: Scope) -> Keys:
        function = scope.function
        if function is not None:
            assigned = list(self._assignments(name, function, scope))
            if assigned:
                found: set[Key] = set()
                for keys in assigned:
                    if keys is None:
                        return None
                    found |= keys
                return frozenset(found)
            arguments = function.args
            params = [a.arg for a in (*arguments.posonlyargs, *arguments.args)]
            if name in params and scope.cls is not None:
                return self._call_site_arguments(function, params.index(name), scope)
        value = getattr(self.modules[scope.module], name, None)
        if isinstance(value, str):
            return frozenset({Key(value)})
        return None

    def _assignments(
        self, name: str, function: Function, scope: Scope
    ) -> Iterator[Keys]:
        """What ``name`` is assigned in ``function``: directly, by unpacking
        a call's tuple, or item by item (``errors["base"] = ...``)."""
        for node in _own_nodes(function):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = (
                    node.targets if isinstance(node, ast.Assign) else [node.target]
                )
                for target in targets:
                    if (isinstance(target, ast.Name) and target.id == name) or (
                        isinstance(target, ast.Subscript)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == name
                    ):
                        yield self.keys(node.value, scope)
                    elif isinstance(target, ast.Tuple):
                        for index, element in enumerate(target.elts):
                            if isinstance(element, ast.Name) and element.id == name:
                                yield self._unpacked(node.value, index, scope)

    def _unpacked(self, value: ast.expr, index: int, scope: Scope) -> Keys:
        if isinstance(value, ast.Await):
            value = value.value
        match value:
            case ast.Call(func=ast.Name(id=callee)):
                return self._returns(callee, index, scope)
            case ast.Call(func=ast.Attribute(value=ast.Name(id="self"), attr=attr)):
                return self._method_returns(attr, index, scope)
            case ast.Tuple(elts=elements):
                return self.keys(elements[index], scope)
        return None

    def _returns(self, name: str, index: int | None, scope: Scope) -> Keys:
        """The keys a package function returns (the ``index``-th of a tuple)."""
        module, node = self.definitions.get(name, (scope.module, None))
        if isinstance(node, ast.ClassDef):
            return frozenset()  # an instance, not a key
        if not isinstance(node, FUNCTIONS):
            return None
        return self._function_returns(node, index, Scope(module, node))

    def _method_returns(self, attr: str, index: int | None, scope: Scope) -> Keys:
        method = (
            next((f for f in _functions(scope.cls) if f.name == attr), None)
            if scope.cls
            else None
        )
        if method is None:
            return None
        return self._function_returns(
            method, index, Scope(scope.module, method, scope.cls)
        )

    def _function_returns(
        self, function: Function, index: int | None, scope: Scope
    ) -> Keys:
        found: set[Key] = set()
        for node in _own_nodes(function):
            if not isinstance(node, ast.Return) or node.value is None:
                continue
            value = node.value
            if index is not None:
                if not isinstance(value, ast.Tuple):
                    return None
                value = value.elts[index]
            keys = self.keys(value, scope)
            if keys is None:
                return None
            found |= keys
        return frozenset(found)

    def _self_assignments(self, attr: str, scope: Scope) -> Iterator[ast.expr]:
        assert scope.cls is not None
        for method in _functions(scope.cls):
            for node in _own_nodes(method):
                if isinstance(node, ast.Assign | ast.AnnAssign) and node.value:
                    targets = (
                        node.targets if isinstance(node, ast.Assign) else [node.target]
                    )
                    for target in targets:
                        if (
                            isinstance(target, ast.Attribute)
                            and isinstance(target.value, ast.Name)
                            and target.value.id == "self"
                            and target.attr == attr
                        ):
                            yield node.value

    def _call_site_arguments(
        self, function: Function, position: int, scope: Scope
    ) -> Keys:
        """A method's parameter: what its callers in the class pass."""
        assert scope.cls is not None
        found: set[Key] = set()
        for method in _functions(scope.cls):
            for node in _own_nodes(method):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == function.name
                    and len(node.args) >= position
                ):
                    keys = self.keys(
                        node.args[position - 1], Scope(scope.module, method, scope.cls)
                    )
                    if keys is None:
                        return None
                    found |= keys
        return frozenset(found)

    def _exception_of(self, name: str, expr: ast.AST, scope: Scope) -> str | None:
        """The package exception class ``name`` holds at ``expr``: caught as
        it there, or annotated so."""
        if scope.function is None:
            return None
        for node in _own_nodes(scope.function):
            if (
                isinstance(node, ast.ExceptHandler)
                and node.name == name
                and node.type is not None
                and any(inner is expr for inner in ast.walk(node))
            ):
                return ast.unparse(node.type)
        hints = _type_hints(self, scope)
        hinted = hints.get(name)
        for candidate in getattr(hinted, "__args__", (hinted,)):
            if isinstance(candidate, type) and issubclass(candidate, Exception):
                return candidate.__name__
        return None

    @functools.cache  # noqa: B019 - one reader per test session
    def carried(self, cls: str) -> frozenset[Key]:
        """Every key an exception class is raised with (its first argument)."""
        found: set[Key] = set()
        for module, tree in self.trees.items():
            for function in ast.walk(tree):
                if not isinstance(function, FUNCTIONS):
                    continue
                scope = Scope(module, function, _class_of(tree, function))
                for node in _own_nodes(function):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Name)
                        and node.func.id == cls
                        and node.args
                    ):
                        keys = self.keys(node.args[0], scope)
                        if keys is None:
                            self.note(scope, node.args[0])
                        else:
                            found |= keys
        return frozenset(found)


def _type_hints(reader: Reader, scope: Scope) -> dict[str, Any]:
    """The annotations of the scope's function, resolved in its module."""
    assert scope.function is not None
    owner: Any = reader.modules[scope.module]
    if scope.cls is not None:
        owner = getattr(owner, scope.cls.name)
    function = getattr(owner, scope.function.name, None)
    try:
        return get_type_hints(function) if function is not None else {}
    except Exception:  # noqa: BLE001 - not resolvable at run time
        return {}


def _class_of(tree: ast.Module, function: Function) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and function in list(_functions(node)):
            return node
    return None


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _keyword(node: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in node.keywords if k.arg == name), None)


def _schema_fields(expr: ast.expr, scope: Scope, reader: Reader) -> set[str] | None:
    """The fields of a form's schema: the schema functions it calls, called
    here with empty arguments (None: cannot tell)."""
    if isinstance(expr, ast.Name) and scope.function is not None:
        values = [
            node.value
            for node in _own_nodes(scope.function)
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == expr.id for t in node.targets)
        ]
        if len(values) != 1:
            return None
        expr = values[0]
    module = reader.modules[scope.module]
    for node in ast.walk(expr):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        if name.endswith("_schema") and name != "add_suggested_values_to_schema":
            function = getattr(module, name)
            empty = {
                param: {"list": [], "dict": {}, "str": ""}[
                    str(p.annotation).split("[", 1)[0]
                ]
                for param, p in inspect.signature(function).parameters.items()
            }
            return {str(marker) for marker in function(**empty).schema}
        if (
            name == "Schema"
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Dict)
            and not node.args[0].keys
        ):
            return set()
    return None


def _read_flow(reader: Reader, module: str, cls: ast.ClassDef, flow: Flow) -> None:
    """The forms, menus, errors and aborts of one flow handler, through the
    functions of its module it calls."""
    tree = reader.trees[module]
    functions = {f.name: f for f in tree.body if isinstance(f, FUNCTIONS)}
    todo = [(f, cls) for f in _functions(cls)]
    seen: set[str] = set()
    while todo:
        function, owner = todo.pop()
        scope = Scope(module, function, owner)
        for node in _own_nodes(function):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            if (
                isinstance(node.func, ast.Name)
                and name in functions
                and name not in seen
            ):
                seen.add(name)
                todo.append((functions[name], None))
            _read_flow_call(reader, node, name, scope, flow)
    methods = {f.name for f in _functions(cls)}
    source = ast.unparse(cls)
    if "async_update_reload_and_abort" in source:
        if "async_step_reauth" in methods:
            flow.aborts.add(Key("reauth_successful"))
        if "async_step_reconfigure" in methods:
            flow.aborts.add(Key("reconfigure_successful"))
    if "_abort_if_unique_id_configured" in source:
        flow.aborts.add(Key("already_configured"))


def _read_flow_call(
    reader: Reader, node: ast.Call, name: str, scope: Scope, flow: Flow
) -> None:
    def keys(expr: ast.expr | None) -> frozenset[Key]:
        if expr is None:
            return frozenset()
        found = reader.keys(expr, scope)
        if found is None:
            reader.note(scope, expr)
            return frozenset()
        return found

    if name in ("async_show_form", "async_show_menu"):
        step_ids = {key.name for key in keys(_keyword(node, "step_id"))}
        if name == "async_show_menu":
            options = _keyword(node, "menu_options")
            assert isinstance(options, ast.List), ast.unparse(node)
            menu = {str(ast.literal_eval(option)) for option in options.elts}
            flow.menus.update(dict.fromkeys(step_ids, menu))
            return
        schema = _keyword(node, "data_schema")
        fields = set() if schema is None else _schema_fields(schema, scope, reader)
        if fields is None:
            reader.note(scope, schema or node)
            fields = set()
        for step_id in step_ids:
            flow.forms.setdefault(step_id, set()).update(fields)
        flow.errors |= keys(_keyword(node, "errors"))
    elif name in ("async_abort", "_abort_if_unique_id_mismatch"):
        flow.aborts |= keys(_keyword(node, "reason"))


@functools.cache
def code_facts() -> CodeFacts:
    """Read once: the code does not change while the tests run."""
    reader = Reader(COMPONENT)
    facts = CodeFacts()
    platforms = {platform.value for platform in Platform}
    for module, tree in reader.trees.items():
        for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
            handler = getattr(reader.modules[module], cls.name)
            steps = any(f.name.startswith("async_step_") for f in _functions(cls))
            if isinstance(handler, type) and issubclass(handler, FlowHandler) and steps:
                sections = FLOW_SECTIONS.get(cls.name)
                if sections is None:
                    facts.unresolved.append(
                        f"{module}.{cls.name}: not in FLOW_SECTIONS"
                    )
                    continue
                flow = Flow(cls.name, sections)
                _read_flow(reader, module, cls, flow)
                facts.flows.append(flow)
        for function in (f for f in ast.walk(tree) if isinstance(f, FUNCTIONS)):
            scope = Scope(module, function, _class_of(tree, function))
            for node in _own_nodes(function):
                if isinstance(node, ast.Call):
                    _read_translation_key(reader, node, scope, facts, platforms)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _describes_entity(reader, module, node):
                _read_entity(reader, node, Scope(module), facts, platforms)
    # Every action the integration registers, with its fields.
    registered: dict[str, set[str]] = {}

    def register(
        domain: str, name: str, *_: Any, schema: Any = None, **__: Any
    ) -> None:
        registered[name] = {str(marker) for marker in schema.schema}

    services.async_setup_services(
        SimpleNamespace(services=SimpleNamespace(async_register=register))  # type: ignore[arg-type]
    )
    facts.actions = registered
    facts.unresolved += reader.unresolved
    return facts


def _read_translation_key(
    reader: Reader, node: ast.Call, scope: Scope, facts: CodeFacts, platforms: set[str]
) -> None:
    expr = _keyword(node, "translation_key")
    if expr is None or _describes_entity(reader, scope.module, node):
        return
    keys = reader.keys(expr, scope)
    if keys is None:
        reader.note(scope, expr)
        return
    if _call_name(node) == "async_create_issue":
        facts.issues |= keys
    elif _keyword(node, "translation_domain") is not None:
        facts.exceptions |= keys
    else:
        reader.note(scope, node)


def _describes_entity(reader: Reader, module: str, node: ast.Call) -> bool:
    """Whether the call makes an entity description (of any subclass)."""
    made = getattr(reader.modules[module], _call_name(node), None)
    return isinstance(made, type) and issubclass(made, EntityDescription)


def _read_entity(
    reader: Reader, node: ast.Call, scope: Scope, facts: CodeFacts, platforms: set[str]
) -> None:
    expr = _keyword(node, "translation_key")
    if expr is None:
        return
    keys = reader.keys(expr, scope)
    if keys is None or scope.module not in platforms:
        reader.note(scope, expr)
        return
    facts.entities |= {(scope.module, key.name) for key in keys}


# --- the validator -------------------------------------------------------------


def _load_json(path: Path, errors: list[str]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        errors.append(f"{path.name}: cannot be read: {err}")
        return None


def schema_errors(name: str, schema: Any, data: Any, errors: list[str]) -> None:
    """Each of the schema's findings, one by one."""
    try:
        schema(data)
    except pb.MultipleInvalid as err:
        errors.extend(f"{name}: {humanize_error(data, one)}" for one in err.errors)
    except pb.Invalid as err:
        errors.append(f"{name}: {humanize_error(data, err)}")


def get_in(tree: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def check_manifest(component: Path, errors: list[str]) -> None:
    """manifest.py: the schema, a version, the domain, an IoT class, the
    order of the keys; and Home Assistant's own loader accepts it."""
    manifest = _load_json(component / "manifest.json", errors)
    if not isinstance(manifest, dict):
        return
    schema_errors("manifest.json", MANIFEST_SCHEMA, manifest, errors)
    unknown = set(manifest) - set(loader.Manifest.__annotations__)
    if unknown:
        errors.append(
            f"manifest.json: keys Home Assistant's loader does not know: {sorted(unknown)}"
        )
    if manifest.get("domain") != component.name:
        errors.append("manifest.json: the domain is not the directory's name")
    keys = list(manifest)
    if keys[:2] != ["domain", "name"] or keys[2:] != sorted(keys[2:]):
        errors.append("manifest.json: keys are not domain, name, then alphabetical")
    fake = SimpleNamespace(
        data={
            loader.DATA_PRELOAD_PLATFORMS: [],
            loader.DATA_COMPONENTS: {},
            loader.DATA_MISSING_PLATFORMS: {},
        }
    )
    root = SimpleNamespace(
        __path__=[str(component.parent)], __name__="custom_components"
    )
    integration = loader.Integration.resolve_from_root(fake, root, component.name)  # type: ignore[arg-type]
    if integration is None:
        errors.append("manifest.json: Home Assistant's loader refuses it (its version)")


def _resolve(value: Any, strings: dict[str, Any], common: dict[str, Any]) -> Any:
    """strings.json as Home Assistant ships it in translations/en.json."""
    if isinstance(value, dict):
        return {key: _resolve(item, strings, common) for key, item in value.items()}
    if isinstance(value, str) and (match := REFERENCE.fullmatch(value)):
        parts = match.group(1).split("::")
        own = ["component", DOMAIN]
        tree = (
            get_in(strings, tuple(parts[2:]))
            if parts[:2] == own
            else get_in(common, tuple(parts))
        )
        if not isinstance(tree, str):
            return None
        return _resolve(tree, strings, common)
    return value


def check_strings(component: Path, errors: list[str]) -> dict[str, Any] | None:
    """translations.py: strings.json and every translation against the
    schema; references that lead somewhere; translations/en.json is
    strings.json resolved; every translation has the same keys and, string
    by string, the same placeholders."""
    strings = _load_json(component / "strings.json", errors)
    if not isinstance(strings, dict):
        return None
    schema_errors("strings.json", STRINGS_SCHEMA, strings, errors)
    common = json.loads(HA_STRINGS.read_text(encoding="utf-8"))
    resolved = _resolve(strings, strings, common)
    flat = recursive_flatten("", resolved)
    errors.extend(
        f"strings.json: {key} refers to no string"
        for key, value in flat.items()
        if value is None
    )
    for path in sorted((component / "translations").glob("*.json")):
        name = f"translations/{path.name}"
        translation = _load_json(path, errors)
        if not isinstance(translation, dict):
            continue
        schema_errors(name, STRINGS_SCHEMA, translation, errors)
        if path.stem == "en" and translation != resolved:
            errors.append(f"{name}: is not strings.json with its references resolved")
        theirs = recursive_flatten("", translation)
        errors.extend(
            f"{name}: {key} is missing" for key in sorted(set(flat) - set(theirs))
        )
        errors.extend(
            f"{name}: {key} is not in strings.json"
            for key in sorted(set(theirs) - set(flat))
        )
        errors.extend(
            f"{name}: {key} has other placeholders than strings.json"
            for key in sorted(set(flat) & set(theirs))
            if set(PLACEHOLDER.findall(str(flat[key])))
            != set(PLACEHOLDER.findall(str(theirs[key])))
        )
    return strings


def _steps(strings: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every step of every flow in strings.json, by its dotted path."""
    flows = [("config", strings.get("config")), ("options", strings.get("options"))]
    flows += [
        (f"config_subentries.{kind}", flow)
        for kind, flow in strings.get("config_subentries", {}).items()
    ]
    flows += [
        (f"issues.{issue}.fix_flow", value.get("fix_flow"))
        for issue, value in strings.get("issues", {}).items()
        if isinstance(value, dict)
    ]
    for prefix, flow in flows:
        if isinstance(flow, dict):
            for step_id, step in flow.get("step", {}).items():
                if isinstance(step, dict):
                    yield f"{prefix}.step.{step_id}", step


def check_data_descriptions(strings: dict[str, Any], errors: list[str]) -> None:
    """quality_scale_validation/config_flow.py and the config-flow rule:
    every field of every step has a data_description."""
    errors.extend(
        f"strings.json: {path}.data.{key} has no data_description"
        for path, step in _steps(strings)
        for key in step.get("data", {})
        if key not in step.get("data_description", {})
    )


def _missing(strings: dict[str, Any], path: tuple[str, ...], errors: list[str]) -> bool:
    if get_in(strings, path) is None:
        errors.append(f"strings.json: {'.'.join(path)} is missing (the code uses it)")
        return True
    return False


def _loose(
    keys: list[tuple[Key, tuple[str, ...]]], strings: dict[str, Any], errors: list[str]
) -> None:
    """A key that came through an exception class must be in at least one
    of the places that show that class's keys."""
    where: dict[tuple[str, str], list[tuple[str, ...]]] = {}
    for key, section in keys:
        where.setdefault((str(key.carrier), key.name), []).append(section)
    for (carrier, name), sections in sorted(where.items()):
        if not any(
            get_in(strings, (*section, name)) is not None for section in sections
        ):
            shown = ", ".join(".".join(s) for s in sections)
            errors.append(f"strings.json: {carrier} key {name} is in none of {shown}")


def check_used_keys(
    strings: dict[str, Any], facts: CodeFacts, errors: list[str]
) -> None:
    """Every key the code uses has a string: each flow's steps (their fields
    with a data_description), menu options, errors and aborts; exceptions;
    repair issues; entities."""
    loose: list[tuple[Key, tuple[str, ...]]] = []

    def need(key: Key, section: tuple[str, ...]) -> None:
        if key.carrier is not None:
            loose.append((key, section))
        else:
            _missing(strings, (*section, key.name), errors)

    for flow in facts.flows:
        for section in flow.sections:
            for step_id, fields in sorted(flow.forms.items()):
                step = (*section, "step", step_id)
                if _missing(strings, step, errors):
                    continue
                for name in sorted(fields):
                    _missing(strings, (*step, "data", name), errors)
                    _missing(strings, (*step, "data_description", name), errors)
                errors.extend(
                    f"strings.json: {'.'.join(step)}.data.{name} is no field of the form"
                    for name in sorted(
                        set(get_in(strings, (*step, "data")) or {}) - fields
                    )
                )
            shown = set(flow.forms) | set(flow.menus)
            errors.extend(
                f"strings.json: {'.'.join(section)}.step.{step_id} is no step the flow shows"
                for step_id in sorted(
                    set(get_in(strings, (*section, "step")) or {}) - shown
                )
            )
            for step_id, options in sorted(flow.menus.items()):
                menu = (*section, "step", step_id, "menu_options")
                if not _missing(strings, menu, errors):
                    errors.extend(
                        f"strings.json: {'.'.join(menu)}: {name} is not the menu's"
                        for name in sorted(options ^ set(get_in(strings, menu)))
                    )
            for key in flow.errors:
                need(key, (*section, "error"))
            for key in flow.aborts:
                need(key, (*section, "abort"))
    for key in facts.exceptions:
        need(key, ("exceptions",))
        if key.carrier is None:
            _missing(strings, ("exceptions", key.name, "message"), errors)
    for key in facts.issues:
        need(key, ("issues",))
    for platform, key in sorted(facts.entities):
        _missing(strings, ("entity", platform, key), errors)
    _loose(loose, strings, errors)


def check_services(
    component: Path, strings: dict[str, Any], facts: CodeFacts, errors: list[str]
) -> None:
    """services.py: services.yaml as Home Assistant reads it (selectors
    included) and as hassfest's custom-integration schema allows; every
    registered action and each of its fields is in it, named and described
    in strings.json, and nothing else is."""
    try:
        described = load_yaml_dict(component / "services.yaml")
    except (HomeAssistantError, FileNotFoundError) as err:
        errors.append(f"services.yaml: cannot be read: {err}")
        return
    schema_errors("services.yaml", ha_service._SERVICES_SCHEMA, described, errors)
    field_schema = pb.Schema(
        {
            pb.Optional("name"): str,
            pb.Optional("description"): str,
            pb.Optional("example"): object,
            pb.Optional("default"): object,
            pb.Optional("required"): bool,
            pb.Optional("advanced"): bool,
            pb.Optional("selector"): selector.validate_selector,
        }
    )
    action_schema = pb.Any(
        None,
        pb.Schema(
            {
                pb.Optional("name"): str,
                pb.Optional("description"): str,
                pb.Optional("target"): object,
                pb.Optional("fields"): {str: field_schema},
            }
        ),
    )
    schema_errors(
        "services.yaml", pb.Schema({cv.slug: action_schema}), described, errors
    )
    texts = strings.get("services", {})
    for action in sorted(set(facts.actions) | set(described) | set(texts)):
        if action not in facts.actions:
            where = "services.yaml" if action in described else "strings.json services"
            errors.append(f"{where}: {action} is no action the integration registers")
            continue
        if action not in described:
            errors.append(f"services.yaml: the action {action} is missing")
        if action not in texts:
            errors.append(f"strings.json: services.{action} is missing")
        fields = facts.actions[action]
        yaml_fields = set((described.get(action) or {}).get("fields") or {})
        text_fields = set((texts.get(action) or {}).get("fields") or {})
        for name in sorted(fields | yaml_fields | text_fields):
            if name not in fields:
                errors.append(f"{action}: field {name} is not in the action's schema")
                continue
            if name not in yaml_fields:
                errors.append(f"services.yaml: {action}.fields.{name} is missing")
            errors.extend(
                f"strings.json: services.{action}.fields.{name}.{part} is missing"
                for part in ("name", "description")
                if get_in(texts, (action, "fields", name, part)) is None
            )


def check_icons(
    component: Path, strings: dict[str, Any], facts: CodeFacts, errors: list[str]
) -> None:
    """icons.py: the schema; every entity icon is one of the code's entities
    and its states are the entity's; the actions' icons are the registered
    actions, each with one."""
    try:
        icons = _load_icons_file(component / "icons.json")
    except (HomeAssistantError, OSError, ValueError) as err:
        errors.append(f"icons.json: cannot be read: {err}")
        return
    schema_errors("icons.json", ICONS_SCHEMA, icons, errors)
    for platform, entities in (icons.get("entity") or {}).items():
        for key, value in (entities or {}).items():
            if (platform, key) not in facts.entities:
                errors.append(
                    f"icons.json: entity.{platform}.{key} is no entity of the integration"
                )
                continue
            text = get_in(strings, ("entity", platform, key)) or {}
            on_off = {"on", "off"} if platform in ("binary_sensor", "switch") else set()
            states = set((value or {}).get("state") or {})
            errors.extend(
                f"icons.json: entity.{platform}.{key}.state.{state} is no state of it"
                for state in sorted(states - set(text.get("state") or {}) - on_off)
            )
            attributes = set((value or {}).get("state_attributes") or {})
            errors.extend(
                f"icons.json: entity.{platform}.{key}.state_attributes.{name} "
                "is not translated"
                for name in sorted(attributes - set(text.get("state_attributes") or {}))
            )
    actions = set(icons.get("services") or {})
    for action in sorted(actions ^ set(facts.actions)):
        if action in actions:
            errors.append(
                f"icons.json: services.{action} is no action the integration registers"
            )
        else:
            errors.append(f"icons.json: the action {action} has no icon")


def check_quality_scale(component: Path, errors: list[str]) -> None:
    """quality_scale.py: known rules only, each done, todo or exempt (with a
    comment)."""
    try:
        scale = load_yaml_dict(component / "quality_scale.yaml")
    except (HomeAssistantError, FileNotFoundError) as err:
        errors.append(f"quality_scale.yaml: cannot be read: {err}")
        return
    schema_errors("quality_scale.yaml", QUALITY_SCALE_SCHEMA, scale, errors)


def validate(component: Path, facts: CodeFacts | None = None) -> list[str]:
    """What Home Assistant's checks say of the integration's files."""
    facts = facts or code_facts()
    errors: list[str] = []
    check_manifest(component, errors)
    strings = check_strings(component, errors)
    if strings is not None:
        check_data_descriptions(strings, errors)
        check_used_keys(strings, facts, errors)
        check_services(component, strings, facts, errors)
        check_icons(component, strings, facts, errors)
    check_quality_scale(component, errors)
    return errors
