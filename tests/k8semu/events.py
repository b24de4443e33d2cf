"""Events as kube-apiserver serves them: one stored core.Event, decoded,
converted and validated per API version (core/v1 and events.k8s.io/v1);
the emulator's handlers (emulator.py) use it."""

from __future__ import annotations

import calendar
from collections.abc import Callable
import copy
from dataclasses import dataclass, field as dc_field
from datetime import UTC, datetime, timedelta
import json
import re
from typing import Any

from .selectors import FieldRequirement, SelectorError

JsonObj = dict[str, Any]

# ==================================================================== Events
#
# kube-apiserver keeps one internal core.Event (pkg/apis/core/types.go) per
# Event and serves it as core/v1 and as events.k8s.io/v1: the events.k8s.io
# registry is the core one (pkg/registry/events/rest/storage_events.go calls
# pkg/registry/core/event/storage NewREST), the versions differ by the
# conversion (pkg/apis/events/v1/conversion.go Convert_v1_Event_To_core_Event
# and back: regarding = involvedObject, note = message, deprecatedSource =
# source, deprecatedFirstTimestamp/deprecatedLastTimestamp/deprecatedCount =
# firstTimestamp/lastTimestamp/count; reportingController is core/v1's
# reportingComponent). Bodies are decoded as the apiserver's JSON serializer
# does, validated by pkg/apis/core/validation/events.go
# (pkg/registry/core/event/strategy.go Validate / ValidateUpdate with the
# request's group version) and stored in their core/v1 form.

CORE_V1 = "v1"
# metav1.RFC3339Micro (k8s.io/apimachinery/pkg/apis/meta/v1/micro_time.go) and
# time.RFC3339 (metav1.Time).
RFC3339_MICRO = "2006-01-02T15:04:05.000000Z07:00"
RFC3339 = "2006-01-02T15:04:05Z07:00"
# pkg/apis/core/validation/events.go
REPORTING_INSTANCE_LENGTH_LIMIT = 128
ACTION_LENGTH_LIMIT = 128
REASON_LENGTH_LIMIT = 128
NOTE_LENGTH_LIMIT = 1024
EVENT_TYPES = ("Normal", "Warning")  # v1.EventTypeNormal, v1.EventTypeWarning
# k8s.io/apimachinery/pkg/api/validation/generic.go
FIELD_IMMUTABLE_ERROR_MSG = "field is immutable"
# pkg/apis/events/v1/conversion.go AddFieldLabelConversionsForEvent: the
# events.k8s.io/v1 field selectors, as the core selectable fields they are
# matched against (pkg/registry/core/event/strategy.go ToSelectableFields).
EVENTS_V1_FIELD_LABELS = {
    "reason": "reason",
    "regarding.kind": "involvedObject.kind",
    "regarding.namespace": "involvedObject.namespace",
    "regarding.name": "involvedObject.name",
    "regarding.uid": "involvedObject.uid",
    "regarding.apiVersion": "involvedObject.apiVersion",
    "regarding.resourceVersion": "involvedObject.resourceVersion",
    "regarding.fieldPath": "involvedObject.fieldPath",
    "reportingController": "reportingComponent",
    "source": "source",
    "type": "type",
    "metadata.namespace": "metadata.namespace",
    "metadata.name": "metadata.name",
}
_DIGITS = "0123456789"
_GO_UTC_ZERO = datetime(1, 1, 1, tzinfo=UTC)  # time.Time{}


class DecodeError(Exception):
    """The decoder's error for a body it cannot turn into an Event."""


def _go_time_quote(text: str) -> str:
    """The time package's quote() (time/format.go): ASCII as is (quote and
    backslash escaped), every byte of anything else as ``\\xNN``."""
    out = ['"']
    for char in text:
        if ord(char) < 0x20 or ord(char) >= 0x80:
            out.extend(
                f"\\x{byte:02x}" for byte in char.encode("utf-8", "surrogatepass")
            )
        else:
            out.append("\\" + char if char in '"\\' else char)
    out.append('"')
    return "".join(out)


def _go_getnum(text: str, fixed: bool) -> tuple[int, str] | None:
    """time/format.go getnum: one or two digits (two when ``fixed``)."""
    if not text or text[0] not in _DIGITS:
        return None
    if len(text) < 2 or text[1] not in _DIGITS:
        return None if fixed else (int(text[0]), text[1:])
    return int(text[:2]), text[2:]


def _go_parse_time(value: str, layout: str) -> datetime | None:
    """time.Parse(layout, value) for RFC3339 and RFC3339Micro, chunk by chunk
    as time/format.go parse() goes, with its ParseError texts (RFC3339Micro
    wants exactly six fractional digits: "...:05Z" and "...:05.123Z" are
    refused). None for Go's zero time."""

    def error(layout_elem: str, value_elem: str, message: str = "") -> DecodeError:
        if message:
            return DecodeError(f"parsing time {_go_time_quote(value)}{message}")
        return DecodeError(
            f"parsing time {_go_time_quote(value)} as {_go_time_quote(layout)}: "
            f"cannot parse {_go_time_quote(value_elem)} as "
            f"{_go_time_quote(layout_elem)}"
        )

    chunks = [
        ("", "2006"),
        ("-", "01"),
        ("-", "02"),
        ("T", "15"),
        (":", "04"),
        (":", "05"),
    ]
    if layout == RFC3339_MICRO:
        chunks.append(("", ".000000"))
    chunks.append(("", "Z07:00"))
    parts: dict[str, int] = {"micro": 0, "offset": 0}
    rest = value
    for prefix, std in chunks:
        if prefix:
            if not rest.startswith(prefix):
                raise error(prefix, rest)  # skip()
            rest = rest[len(prefix) :]
        hold = rest
        got: tuple[int, str] | None = None
        out_of_range = ""
        match std:
            case "2006":
                if len(rest) >= 4 and all(c in _DIGITS for c in rest[:4]):
                    got = int(rest[:4]), rest[4:]
            case "01":
                got = _go_getnum(rest, True)
                if got is not None and not 1 <= got[0] <= 12:
                    out_of_range = "month"
            case "02":
                got = _go_getnum(rest, True)  # checked against the month below
            case "15":
                got = _go_getnum(rest, False)
                if got is not None and got[0] >= 24:
                    out_of_range = "hour"
            case "04":
                got = _go_getnum(rest, True)
                if got is not None and got[0] >= 60:
                    out_of_range = "minute"
            case "05":
                got = _go_getnum(rest, True)
                if got is not None and got[0] >= 60:
                    out_of_range = "second"
                elif got is not None and layout == RFC3339:
                    # A fractional second the layout does not name is taken.
                    tail = got[1]
                    if len(tail) >= 2 and tail[0] in ".," and tail[1] in _DIGITS:
                        end = 2
                        while end < len(tail) and tail[end] in _DIGITS:
                            end += 1
                        parts["micro"] = int((tail[1:end] + "00000")[:6])
                        got = got[0], tail[end:]
            case ".000000":
                if (
                    len(rest) >= 7
                    and rest[0] in ".,"
                    and all(c in _DIGITS for c in rest[1:7])
                ):
                    parts["micro"] = int(rest[1:7])
                    got = 0, rest[7:]
            case _:  # Z07:00
                if rest.startswith("Z"):
                    got = 0, rest[1:]
                elif len(rest) >= 6 and rest[3] == ":":
                    hours = _go_getnum(rest[1:3], True)
                    minutes = _go_getnum(rest[4:6], True) if hours else None
                    if hours is not None and minutes is not None:
                        if hours[0] > 24:
                            out_of_range = "time zone offset hour"
                        if minutes[0] > 60:
                            out_of_range = "time zone offset minute"
                        if rest[0] in "+-":
                            sign = 1 if rest[0] == "+" else -1
                            parts["offset"] = sign * (hours[0] * 60 + minutes[0])
                            got = 0, rest[6:]
        if out_of_range:
            raise error("", "", f": {out_of_range} out of range")
        if got is None:
            raise error(std, hold)
        parts[std] = got[0]
        rest = got[1]
    if rest:
        raise error("", rest, f": extra text: {_go_time_quote(rest)}")
    year, month, day = parts["2006"], parts["01"], parts["02"]
    if day < 1 or day > calendar.monthrange(max(year, 1), month)[1]:
        raise error("", "", ": day out of range")
    try:
        moment = datetime(
            year,
            month,
            day,
            parts["15"],
            parts["04"],
            parts["05"],
            parts["micro"],
            tzinfo=UTC,
        ) - timedelta(minutes=parts["offset"])
    except ValueError, OverflowError:
        return None  # around year 0: nothing an Event carries
    return None if moment == _GO_UTC_ZERO else moment


def _json_kind(value: Any) -> str:
    """encoding/json's name for a JSON value in an UnmarshalTypeError."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, str):
        return "string"
    if isinstance(value, int | float):
        return "number"
    return "array" if isinstance(value, list) else "object"


@dataclass(frozen=True)
class _Ref:
    """core.ObjectReference."""

    kind: str = ""
    namespace: str = ""
    name: str = ""
    uid: str = ""
    api_version: str = ""
    resource_version: str = ""
    field_path: str = ""


# (JSON name, attribute, Go type, Go field name) in ObjectReference's order.
_REF_FIELDS = (
    ("kind", "kind", "string", "Kind"),
    ("namespace", "namespace", "string", "Namespace"),
    ("name", "name", "string", "Name"),
    ("uid", "uid", "types.UID", "UID"),
    ("apiVersion", "api_version", "string", "APIVersion"),
    ("resourceVersion", "resource_version", "string", "ResourceVersion"),
    ("fieldPath", "field_path", "string", "FieldPath"),
)


@dataclass
class ApiEvent:
    """The internal core.Event: what both versions convert to and from."""

    metadata: JsonObj = dc_field(default_factory=dict)
    involved_object: _Ref = _Ref()
    reason: str = ""
    message: str = ""
    source: tuple[str, str] = ("", "")  # component, host
    first_timestamp: datetime | None = None
    last_timestamp: datetime | None = None
    count: int = 0
    type: str = ""
    event_time: datetime | None = None
    series: tuple[int, datetime | None] | None = None  # count, lastObservedTime
    action: str = ""
    related: _Ref | None = None
    reporting_controller: str = ""
    reporting_instance: str = ""


# Each version's fields in its Go struct's order: (JSON name, attribute,
# kind, omitempty). k8s.io/api core/v1 types.go Event and events/v1
# types.go Event: an omitempty struct or metav1.Time/MicroTime is written
# all the same ({} or null); core/v1's reportingComponent and
# reportingInstance have no omitempty, events.k8s.io/v1's eventTime neither.
_CORE_V1_EVENT_FIELDS = (
    ("involvedObject", "involved_object", "ref", False),
    ("reason", "reason", "string", True),
    ("message", "message", "string", True),
    ("source", "source", "source", False),
    ("firstTimestamp", "first_timestamp", "time", False),
    ("lastTimestamp", "last_timestamp", "time", False),
    ("count", "count", "int32", True),
    ("type", "type", "string", True),
    ("eventTime", "event_time", "microtime", False),
    ("series", "series", "series", True),
    ("action", "action", "string", True),
    ("related", "related", "ref?", True),
    ("reportingComponent", "reporting_controller", "string", False),
    ("reportingInstance", "reporting_instance", "string", False),
)
_EVENTS_V1_EVENT_FIELDS = (
    ("eventTime", "event_time", "microtime", False),
    ("series", "series", "series", True),
    ("reportingController", "reporting_controller", "string", True),
    ("reportingInstance", "reporting_instance", "string", True),
    ("action", "action", "string", True),
    ("reason", "reason", "string", True),
    ("regarding", "involved_object", "ref", False),
    ("related", "related", "ref?", True),
    ("note", "message", "string", True),
    ("type", "type", "string", True),
    ("deprecatedSource", "source", "source", False),
    ("deprecatedFirstTimestamp", "first_timestamp", "time", False),
    ("deprecatedLastTimestamp", "last_timestamp", "time", False),
    ("deprecatedCount", "count", "int32", True),
)
# The Go types a JSON value of the wrong type is reported against.
_GO_TYPES = {
    "string": "string",
    "int32": "int32",
    "ref": "v1.ObjectReference",
    "ref?": "v1.ObjectReference",
    "source": "v1.EventSource",
    "series": "v1.EventSeries",
}


class _GoDecoder:
    """Decoding into a Go struct as the apiserver's JSON serializer does
    (sigs.k8s.io/json, a case-sensitive encoding/json): unknown keys are
    dropped, null leaves the zero value, a value of the wrong JSON type is
    an UnmarshalTypeError saved while decoding goes on (the first one is
    the error), and metav1.Time / MicroTime UnmarshalJSON errors end the
    decoding at once. ``lenient``: a stored object, taken as it is."""

    def __init__(self, *, lenient: bool) -> None:
        self.lenient = lenient
        self.saved: str | None = None

    def _mismatch(self, value: Any, struct: str, path: str, go_type: str) -> None:
        if self.saved is None:
            self.saved = (
                f"json: cannot unmarshal {_json_kind(value)} into Go struct field "
                f"{struct}.{path} of type {go_type}"
            )

    def string(
        self, value: Any, struct: str, path: str, go_type: str = "string"
    ) -> str:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        self._mismatch(value, struct, path, go_type)
        return ""

    def int32(self, value: Any, struct: str, path: str) -> int:
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int | float):
            self._mismatch(value, struct, path, "int32")
            return 0
        if isinstance(value, float) or not -(2**31) <= value < 2**31:
            # strconv.ParseInt fails (a fraction, an exponent) or overflows.
            if self.saved is None:
                self.saved = (
                    f"json: cannot unmarshal number {value!r} into Go struct field "
                    f"{struct}.{path} of type int32"
                )
            return 0
        return int(value)

    def time(self, value: Any, layout: str) -> datetime | None:
        if value is None:
            return None
        if self.lenient:
            try:
                moment = datetime.fromisoformat(str(value))
            except ValueError:
                return None
            return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
        if not isinstance(value, str):
            # UnmarshalJSON's json.Unmarshal(b, &str)
            raise DecodeError(
                f"json: cannot unmarshal {_json_kind(value)} into Go value of type string"
            )
        return _go_parse_time(value, layout)

    def struct(self, value: Any, struct: str, path: str, kind: str) -> JsonObj | None:
        if value is None:
            return None
        if isinstance(value, dict):
            return value
        self._mismatch(value, struct, path, _GO_TYPES[kind])
        return None

    def ref(self, value: JsonObj, path: str) -> _Ref:
        names = {json_name: (attr, go) for json_name, attr, go, _ in _REF_FIELDS}
        values: dict[str, str] = {}
        for key, item in value.items():
            if key in names:
                attr, go_type = names[key]
                values[attr] = self.string(
                    item, "ObjectReference", f"{path}.{key}", go_type
                )
        return _Ref(**values)

    def field(self, kind: str, value: Any, path: str) -> Any:
        """One field of the Event."""
        match kind:
            case "string":
                return self.string(value, "Event", path)
            case "int32":
                return self.int32(value, "Event", path)
            case "time":
                return self.time(value, RFC3339)
            case "microtime":
                return self.time(value, RFC3339_MICRO)
        obj = self.struct(value, "Event", path, kind)
        if kind == "ref":
            return _Ref() if obj is None else self.ref(obj, path)
        if kind == "ref?":
            return None if obj is None else self.ref(obj, path)
        if kind == "source":
            if obj is None:
                return ("", "")
            source = {"component": "", "host": ""}
            for key in source:
                if key in obj:
                    source[key] = self.string(obj[key], "EventSource", f"{path}.{key}")
            return source["component"], source["host"]
        if obj is None:  # series
            return None
        count, observed = 0, None
        for key, item in obj.items():
            if key == "count":
                count = self.int32(item, "EventSeries", f"{path}.count")
            elif key == "lastObservedTime":
                observed = self.time(item, RFC3339_MICRO)
        return count, observed


def decode_event(body: JsonObj, version: str, *, lenient: bool = False) -> ApiEvent:
    """The Event a core/v1 or events.k8s.io/v1 body decodes to (metadata as
    it is). DecodeError: the decoder's error text (not when ``lenient``)."""
    table = _CORE_V1_EVENT_FIELDS if version == CORE_V1 else _EVENTS_V1_EVENT_FIELDS
    fields = {name: (attr, kind) for name, attr, kind, _ in table}
    decoder = _GoDecoder(lenient=lenient)
    event = ApiEvent(metadata=copy.deepcopy(body.get("metadata") or {}))
    for key, value in body.items():
        if key in fields:
            attr, kind = fields[key]
            setattr(event, attr, decoder.field(kind, value, key))
    if decoder.saved is not None and not lenient:
        raise DecodeError(decoder.saved)
    return event


def _time_json(moment: datetime | None) -> str | None:
    """metav1.Time MarshalJSON: RFC 3339 in UTC, seconds; null when unset."""
    if moment is None:
        return None
    utc = moment.astimezone(UTC)
    return f"{utc.year:04d}-{utc:%m-%dT%H:%M:%S}Z"


def _micro_json(moment: datetime | None) -> str | None:
    """metav1.MicroTime MarshalJSON: RFC3339Micro in UTC; null when unset."""
    if moment is None:
        return None
    utc = moment.astimezone(UTC)
    return f"{utc.year:04d}-{utc:%m-%dT%H:%M:%S}.{utc.microsecond:06d}Z"


def _ref_json(ref: _Ref) -> JsonObj:
    """A v1.ObjectReference (every field omitempty)."""
    return {
        name: getattr(ref, attr)
        for name, attr, _, _ in _REF_FIELDS
        if getattr(ref, attr)
    }


def encode_event(event: ApiEvent, version: str) -> JsonObj:
    """The Event as the version's Go type serializes it."""
    table = _CORE_V1_EVENT_FIELDS if version == CORE_V1 else _EVENTS_V1_EVENT_FIELDS
    out: JsonObj = {
        "kind": "Event",
        "apiVersion": version,
        "metadata": copy.deepcopy(event.metadata),
    }
    for name, attr, kind, omitempty in table:
        value = getattr(event, attr)
        match kind:
            case "string" | "int32":
                if value or not omitempty:
                    out[name] = value
            case "time":
                out[name] = _time_json(value)
            case "microtime":
                out[name] = _micro_json(value)
            case "ref":
                out[name] = _ref_json(value)
            case "ref?":
                if value is not None:
                    out[name] = _ref_json(value)
            case "source":
                out[name] = {
                    key: part
                    for key, part in zip(("component", "host"), value, strict=True)
                    if part
                }
            case _:  # series: core/v1's count is omitempty, events.k8s.io/v1's not
                if value is not None:
                    series: JsonObj = {}
                    if value[0] or version != CORE_V1:
                        series["count"] = value[0]
                    series["lastObservedTime"] = _micro_json(value[1])
                    out[name] = series
    return out


def events_v1_field_selector(
    fields: list[FieldRequirement],
) -> list[FieldRequirement]:
    """An events.k8s.io/v1 field selector in the core selectable fields'
    names (the list handler's ConvertFieldLabel, handlers/get.go
    ListResource: an unknown label is 400 "field label not supported")."""
    for req in fields:
        if req.field not in EVENTS_V1_FIELD_LABELS:
            raise SelectorError(f"field label not supported: {req.field}")
    return [
        FieldRequirement(EVENTS_V1_FIELD_LABELS[req.field], req.operator, req.value)
        for req in fields
    ]


def stored_event(obj: JsonObj) -> ApiEvent:
    """A stored Event (its core/v1 form; a control-API one as written)."""
    return decode_event(obj, CORE_V1, lenient=True)


def event_selectable(obj: JsonObj) -> JsonObj:
    """The stored Event as ToSelectableFields (pkg/registry/core/event/
    strategy.go) sees it: ``source`` is source.component, or the reporting
    controller when there is none (an events.k8s.io/v1 Event)."""
    if (obj.get("source") or {}).get("component"):
        return obj
    return {**obj, "source": {"component": obj.get("reportingComponent") or ""}}


# ------------------------------------------------------ field errors (422)


@dataclass(frozen=True)
class FieldError:
    """A field.Error (k8s.io/apimachinery/pkg/util/validation/field/errors.go)."""

    type: str  # FieldValueRequired, FieldValueInvalid
    field: str
    bad_value: str | None = None  # as ErrorBody prints it; None for Required
    detail: str = ""

    def body(self) -> str:
        """ErrorBody."""
        text = (
            "Required value" if self.type == "FieldValueRequired" else "Invalid value"
        )
        if self.bad_value is not None:
            text += f": {self.bad_value}"
        if self.detail:
            text += f": {self.detail}"
        return text


_GO_QUOTE_ESCAPES = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
}


def go_quote(text: str) -> str:
    """strconv.Quote (fmt's %q of a string)."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif char.isprintable():
            out.append(char)
        elif char in _GO_QUOTE_ESCAPES:
            out.append(_GO_QUOTE_ESCAPES[char])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def go_json(value: Any, *, sort_keys: bool = False) -> str:
    """encoding/json Marshal: compact, with <, >, & and U+2028/U+2029 escaped."""
    text = json.dumps(
        value, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys
    )
    for char, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escaped)
    return text


def go_fmt_v(value: Any) -> str:
    """fmt's %+v of a decoded JSON value (map keys sorted, as fmt prints maps)."""
    if isinstance(value, dict):
        items = " ".join(f"{k}:{go_fmt_v(value[k])}" for k in sorted(value))
        return f"map[{items}]"
    if isinstance(value, list):
        return "[" + " ".join(go_fmt_v(v) for v in value) + "]"
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _bad_value(value: str | int) -> str:
    """How ErrorBody prints a string (%q) or an int32 (%v) bad value."""
    return go_quote(value) if isinstance(value, str) else str(value)


def required(path: str, detail: str = "") -> FieldError:
    """field.Required."""
    return FieldError("FieldValueRequired", path, None, detail)


def _invalid(path: str, value: str | int, detail: str) -> FieldError:
    """field.Invalid with a string or int32 value."""
    return FieldError("FieldValueInvalid", path, _bad_value(value), detail)


# k8s.io/apimachinery/pkg/util/validation/validation.go
_QUALIFIED_NAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_QUALIFIED_NAME_ERR = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start "
    "and end with an alphanumeric character"
)
_DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_LABEL_ERR = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric "
    "characters or '-', and must start and end with an alphanumeric character"
)
_DNS1123_SUBDOMAIN_FMT = _DNS1123_LABEL_FMT + "(\\." + _DNS1123_LABEL_FMT + ")*"
_DNS1123_SUBDOMAIN_ERR = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
    "characters, '-' or '.', and must start and end with an alphanumeric character"
)


def _regex_error(message: str, fmt: str, *examples: str) -> str:
    """validation.RegexError."""
    if not examples:
        return f"{message} (regex used for validation is '{fmt}')"
    message += " (e.g. "
    for i, example in enumerate(examples):
        if i > 0:
            message += " or "
        message += f"'{example}', "
    return message + f"regex used for validation is '{fmt}')"


def _go_len(text: str) -> int:
    """Go's len() of a string: its UTF-8 bytes."""
    return len(text.encode("utf-8", "surrogatepass"))


def _is_dns1123_subdomain(value: str) -> list[str]:
    """validation.IsDNS1123Subdomain."""
    errs = []
    if _go_len(value) > 253:
        errs.append("must be no more than 253 characters")
    if not re.fullmatch(_DNS1123_SUBDOMAIN_FMT, value):
        errs.append(
            _regex_error(_DNS1123_SUBDOMAIN_ERR, _DNS1123_SUBDOMAIN_FMT, "example.com")
        )
    return errs


def _is_dns1123_label(value: str) -> list[str]:
    """validation.IsDNS1123Label."""
    errs = []
    if _go_len(value) > 63:
        errs.append("must be no more than 63 characters")
    if not re.fullmatch(_DNS1123_LABEL_FMT, value):
        errs.append(
            _regex_error(_DNS1123_LABEL_ERR, _DNS1123_LABEL_FMT, "my-name", "123-abc")
        )
    return errs


def _is_qualified_name(value: str) -> list[str]:
    """validation.IsQualifiedName: an optional DNS subdomain prefix and "/",
    and a name of at most 63 alphanumeric, '-', '_' or '.' characters."""
    errs: list[str] = []
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errs.append("prefix part must be non-empty")
        else:
            errs.extend("prefix part " + m for m in _is_dns1123_subdomain(prefix))
    else:
        return [
            "a qualified name "
            + _regex_error(
                _QUALIFIED_NAME_ERR, _QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc"
            )
            + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    if not name:
        errs.append("name part must be non-empty")
    elif _go_len(name) > 63:
        errs.append("name part must be no more than 63 characters")
    if not re.fullmatch(_QUALIFIED_NAME_FMT, name):
        errs.append(
            "name part "
            + _regex_error(
                _QUALIFIED_NAME_ERR, _QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc"
            )
        )
    return errs


def _legacy_validate_event(event: ApiEvent, version: str) -> list[FieldError]:
    """legacyValidateEvent (pkg/apis/core/validation/events.go), for every
    request: without eventTime (an old-style Event) involvedObject.namespace
    must equal the Event's namespace (an empty one: the Event in "" or
    "default"); with eventTime, an Event about a cluster-scoped object (no
    involvedObject.namespace, a Node) lives in "default" or "kube-system",
    and reportingController (a qualified name; named reportingComponent
    for a core/v1 request, kubernetes/kubernetes#111506), reportingInstance,
    action and reason are required, reportingInstance, action and reason at
    most 128 bytes, the message (note) at most 1024; the namespace is a DNS
    subdomain."""
    errs: list[FieldError] = []
    controller = "reportingComponent" if version == CORE_V1 else "reportingController"
    namespace = event.metadata.get("namespace") or ""
    involved = event.involved_object.namespace
    mismatch = _invalid(
        "involvedObject.namespace", involved, "does not match event.namespace"
    )
    if event.event_time is None:
        if not involved:
            if namespace not in ("", "default"):
                errs.append(mismatch)
        elif namespace != involved:
            errs.append(mismatch)
    else:
        if not involved and namespace not in ("default", "kube-system"):
            errs.append(mismatch)
        if not event.reporting_controller:
            errs.append(required(controller))
        errs.extend(
            _invalid(controller, event.reporting_controller, msg)
            for msg in _is_qualified_name(event.reporting_controller)
        )
        for path, value, limit in (
            (
                "reportingInstance",
                event.reporting_instance,
                REPORTING_INSTANCE_LENGTH_LIMIT,
            ),
            ("action", event.action, ACTION_LENGTH_LIMIT),
            ("reason", event.reason, REASON_LENGTH_LIMIT),
        ):
            if not value:
                errs.append(required(path))
            if _go_len(value) > limit:
                errs.append(_invalid(path, "", f"can have at most {limit} characters"))
        if _go_len(event.message) > NOTE_LENGTH_LIMIT:
            errs.append(
                _invalid(
                    "message", "", f"can have at most {NOTE_LENGTH_LIMIT} characters"
                )
            )
    errs.extend(
        _invalid("namespace", namespace, msg)
        for msg in _is_dns1123_subdomain(namespace)
    )
    return errs


def _validate_v1_event_series(event: ApiEvent) -> list[FieldError]:
    """validateV1EventSeries: a series counts at least 2 and has a
    lastObservedTime."""
    errs: list[FieldError] = []
    if event.series is not None:
        count, observed = event.series
        if count < 2:
            errs.append(_invalid("series.count", "", "should be at least 2"))
        if observed is None:
            errs.append(required("series.lastObservedTime"))
    return errs


def _validate_object_meta(meta: JsonObj) -> list[FieldError]:
    """ValidateObjectMeta(..., requiresNamespace, NameIsDNSSubdomain) for
    name and namespace (labels, annotations, owner references: not
    checked here)."""
    errs: list[FieldError] = []
    name = meta.get("name") or ""
    if not name:
        errs.append(required("metadata.name", "name or generateName is required"))
    else:
        errs.extend(
            _invalid("metadata.name", name, msg) for msg in _is_dns1123_subdomain(name)
        )
    namespace = meta.get("namespace") or ""
    if not namespace:
        errs.append(required("metadata.namespace"))
    else:
        errs.extend(
            _invalid("metadata.namespace", namespace, msg)
            for msg in _is_dns1123_label(namespace)
        )
    return errs


def validate_event_create(event: ApiEvent, version: str) -> list[FieldError]:
    """ValidateEventCreate: legacy validation; for events.k8s.io/v1 also
    the metadata, the series, eventTime required, type Normal or Warning,
    and the deprecated fields (firstTimestamp, lastTimestamp, count,
    source) unset. Field paths are the internal (core) names: ``message``
    for note, ``involvedObject`` for regarding."""
    errs = _legacy_validate_event(event, version)
    if version == CORE_V1:
        return errs  # no further validation, for backwards compatibility
    errs.extend(_validate_object_meta(event.metadata))
    errs.extend(_validate_v1_event_series(event))
    if event.event_time is None:
        errs.append(required("eventTime"))
    if event.type not in EVENT_TYPES:
        errs.append(_invalid("type", "", f"has invalid value: {event.type}"))
    if event.first_timestamp is not None:
        errs.append(_invalid("firstTimestamp", "", "needs to be unset"))
    if event.last_timestamp is not None:
        errs.append(_invalid("lastTimestamp", "", "needs to be unset"))
    if event.count != 0:
        errs.append(_invalid("count", "", "needs to be unset"))
    if event.source != ("", ""):
        errs.append(_invalid("source", "", "needs to be unset"))
    return errs


def _ref_internal(ref: _Ref | None) -> str:
    """A core.ObjectReference (no JSON tags: Go field names) as
    encoding/json marshals it; null for a nil *ObjectReference."""
    if ref is None:
        return "null"
    return go_json({go: getattr(ref, attr) for _, attr, _, go in _REF_FIELDS})


def validate_event_update(
    new: ApiEvent, old: ApiEvent, version: str
) -> list[FieldError]:
    """ValidateEventUpdate: legacy validation; for events.k8s.io/v1 also a
    changed series validated, and every other field immutable
    (ValidateImmutableField: "field is immutable", the new value printed as
    ErrorBody prints it; reason is checked twice upstream, so a changed
    reason gives two causes and one line of message; eventTime compared to
    the microsecond)."""
    errs = _legacy_validate_event(new, version)
    if version == CORE_V1:
        return errs
    if new.series != old.series:
        errs.extend(_validate_v1_event_series(new))
    checks: list[tuple[str, Any, Any, Callable[[Any], str]]] = [
        ("involvedObject", new.involved_object, old.involved_object, _ref_internal),
        ("reason", new.reason, old.reason, _bad_value),
        ("message", new.message, old.message, _bad_value),
        (
            "source",
            new.source,
            old.source,
            lambda s: go_json({"Component": s[0], "Host": s[1]}),
        ),
        (
            "firstTimestamp",
            new.first_timestamp,
            old.first_timestamp,
            lambda t: go_json(_time_json(t)),
        ),
        (
            "lastTimestamp",
            new.last_timestamp,
            old.last_timestamp,
            lambda t: go_json(_time_json(t)),
        ),
        ("count", new.count, old.count, _bad_value),
        ("reason", new.reason, old.reason, _bad_value),
        ("type", new.type, old.type, _bad_value),
        (
            "eventTime",
            new.event_time,
            old.event_time,
            lambda t: go_json(_micro_json(t)),
        ),
        ("action", new.action, old.action, _bad_value),
        ("related", new.related, old.related, _ref_internal),
        (
            "reportingController",
            new.reporting_controller,
            old.reporting_controller,
            _bad_value,
        ),
        (
            "reportingInstance",
            new.reporting_instance,
            old.reporting_instance,
            _bad_value,
        ),
    ]
    for path, new_value, old_value, render in checks:
        if new_value != old_value:
            errs.append(
                FieldError(
                    "FieldValueInvalid",
                    path,
                    render(new_value),
                    FIELD_IMMUTABLE_ERROR_MSG,
                )
            )
    return errs
