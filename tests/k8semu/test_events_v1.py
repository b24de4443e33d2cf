"""events.k8s.io/v1 Events, served as kube-apiserver serves them.

Pinned to kubernetes/kubernetes:

- pkg/registry/events/rest/storage_events.go: events.k8s.io/v1 is served
  from the core Event storage (pkg/registry/core/event/storage): one Event,
  two versions; pkg/apis/events/v1/conversion.go converts (regarding =
  involvedObject, note = message, reportingController = reportingComponent,
  deprecatedSource/FirstTimestamp/LastTimestamp/Count = source,
  firstTimestamp, lastTimestamp, count) and maps the events.k8s.io field
  selectors (AddFieldLabelConversionsForEvent: regarding.name...).
- pkg/apis/core/validation/events.go ValidateEventCreate,
  ValidateEventUpdate, legacyValidateEvent, validateV1EventSeries, with the
  request's group version (pkg/registry/core/event/strategy.go); field paths
  are the internal ones (``message``, ``involvedObject``); errors.NewInvalid
  names the internal kind, ``Event``.
- k8s.io/apimachinery/pkg/apis/meta/v1/micro_time.go: eventTime and
  series.lastObservedTime parse as RFC3339Micro (six fractional digits), a
  decoding error is 400 (handlers/create.go transformDecodeError).
- k8s.io/client-go/tools/events/event_broadcaster.go: the broadcaster posts
  a series as a strategic merge patch of ``series`` and creates the Event
  when the patch finds none (404).
- pkg/registry/core/event/strategy.go ToSelectableFields: ``source`` is the
  reporting controller when the Event has no source.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
import pytest

from . import GPU_NODE, K8sEmulator, rule
from .client import api_client_for, raw_request, raw_watch, status_of, unset

T = 10
NAME = f"{GPU_NODE}.18a5f0c2d4e6b800"  # makeEvent: <regarding>.<ns in hex>
CONTROLLER = "gpu-handoff.io/controller"
INSTANCE = "gpu-handoff-homeassistant"
EVENT_TIME = "2026-03-01T10:00:00.123456Z"
QUALIFIED_NAME_RULE = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  "
    "or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
EVENTS_USER = "system:serviceaccount:gpu-handoff:events"


def node_event(name: str = NAME, **changes: Any) -> dict[str, Any]:
    """An events.k8s.io/v1 Event about the GPU node as client-go's recorder
    makes it (event_recorder.go makeEvent); ``changes`` set fields (None
    removes one)."""
    body: dict[str, Any] = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": "default"},
        "eventTime": EVENT_TIME,
        "reportingController": CONTROLLER,
        "reportingInstance": INSTANCE,
        "action": "Cordon",
        "reason": "GamingVmStarting",
        "regarding": {"apiVersion": "v1", "kind": "Node", "name": GPU_NODE},
        "note": "Cordoned: the gaming VM needs the GPU",
        "type": "Normal",
    }
    for key, value in changes.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def as_event(body: dict[str, Any]) -> Any:
    """A JSON body for a generated create method (the client sends a dict
    as it is: what a model cannot hold, such as a wrong type, goes too)."""
    return body


def invalid(message: str, *causes: tuple[str, str, str]) -> dict[str, Any]:
    """The 422 Status for ``NAME``: ``causes`` as (reason, field, message)."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "Invalid",
        "details": {
            "name": NAME,
            "kind": "Event",
            "causes": [
                {"reason": reason, "message": text, "field": field}
                for reason, field, text in causes
            ],
        },
        "code": 422,
    }


async def refused_create(
    api: client.ApiClient, body: dict[str, Any], namespace: str = "default"
) -> tuple[int, dict[str, Any]]:
    """POST through EventsV1Api, expected to fail: its status and Status."""
    with pytest.raises(ApiException) as err:
        await client.EventsV1Api(api).create_namespaced_event(
            namespace, as_event(body), _request_timeout=T
        )
    return err.value.status, status_of(err.value)


async def refused_patch(
    api: client.ApiClient, patch: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """A strategic merge patch through EventsV1Api, expected to fail."""
    with pytest.raises(ApiException) as err:
        await client.EventsV1Api(api).patch_namespaced_event(
            NAME, "default", patch, _request_timeout=T
        )
    return err.value.status, status_of(err.value)


# ------------------------------------------------------------------ discovery


async def test_discovery_lists_events_k8s_io(admin_api: client.ApiClient) -> None:
    """/apis lists events.k8s.io (preferred v1) in kube-apiserver's group
    order, /apis/events.k8s.io its APIGroup, /apis/events.k8s.io/v1 the
    events resource as the registry describes it (namespaced, every verb,
    short name ``ev``)."""
    groups = await client.ApisApi(admin_api).get_api_versions(_request_timeout=T)
    assert [g.name for g in groups.groups] == [
        "apps",
        "events.k8s.io",
        "policy",
        "coordination.k8s.io",
    ]
    [events_group] = [g for g in groups.groups if g.name == "events.k8s.io"]
    assert events_group.preferred_version.group_version == "events.k8s.io/v1"
    assert [v.group_version for v in events_group.versions] == ["events.k8s.io/v1"]
    group = await client.EventsApi(admin_api).get_api_group(_request_timeout=T)
    assert group.name == "events.k8s.io"
    assert group.preferred_version.version == "v1"
    resources = await client.EventsV1Api(admin_api).get_api_resources(
        _request_timeout=T
    )
    assert resources.group_version == "events.k8s.io/v1"
    [events] = resources.resources
    assert (events.name, events.singular_name, events.kind) == (
        "events",
        "event",
        "Event",
    )
    assert events.namespaced is True
    assert events.verbs == [
        "create",
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "update",
        "watch",
    ]
    assert events.short_names == ["ev"]
    assert unset(events.group)  # the group version's own resource
    with pytest.raises(ApiException) as err:
        await raw_request(admin_api, "GET", "/apis/events.k8s.io/v1beta1")
    assert err.value.status == 404  # removed in 1.25


# ------------------------------------------------------ one Event, two versions


async def test_create_round_trips_and_lists_through_core_v1(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """A Node event made through EventsV1Api reads back the same, and is the
    core/v1 Event that ``kubectl get events --field-selector
    involvedObject.name=gpu-node`` lists: note as message, reportingController
    as reportingComponent, no count (deprecatedCount unset), no source or
    first/lastTimestamp (written as {} and null, Go's omitempty on structs)."""
    node = emulator.get("Node", GPU_NODE)
    assert node is not None
    uid = node["metadata"]["uid"]
    events = client.EventsV1Api(admin_api)
    body = client.EventsV1Event(
        metadata=client.V1ObjectMeta(name=NAME, namespace="default"),
        event_time=datetime(2026, 3, 1, 10, 0, 0, 123456, tzinfo=UTC),
        reporting_controller=CONTROLLER,
        reporting_instance=INSTANCE,
        action="Cordon",
        reason="GamingVmStarting",
        regarding=client.V1ObjectReference(
            api_version="v1", kind="Node", name=GPU_NODE, uid=uid
        ),
        note="Cordoned: the gaming VM needs the GPU",
        type="Normal",
    )
    created = await events.create_namespaced_event("default", body, _request_timeout=T)
    assert created.metadata.uid
    assert created.metadata.resource_version
    assert created.event_time == datetime(2026, 3, 1, 10, 0, 0, 123456, tzinfo=UTC)
    assert created.regarding.name == GPU_NODE
    assert created.regarding.uid == uid
    assert unset(created.deprecated_count)
    read = await events.read_namespaced_event(NAME, "default", _request_timeout=T)
    assert read.to_dict() == created.to_dict()

    raw = await raw_request(
        admin_api, "GET", f"/apis/events.k8s.io/v1/namespaces/default/events/{NAME}"
    )
    assert isinstance(raw, dict)
    del raw["metadata"]
    assert raw == {
        "kind": "Event",
        "apiVersion": "events.k8s.io/v1",
        "eventTime": EVENT_TIME,
        "reportingController": CONTROLLER,
        "reportingInstance": INSTANCE,
        "action": "Cordon",
        "reason": "GamingVmStarting",
        "regarding": {"kind": "Node", "name": GPU_NODE, "uid": uid, "apiVersion": "v1"},
        "note": "Cordoned: the gaming VM needs the GPU",
        "type": "Normal",
        "deprecatedSource": {},
        "deprecatedFirstTimestamp": None,
        "deprecatedLastTimestamp": None,
    }

    core = client.CoreV1Api(admin_api)
    listed = await core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={GPU_NODE}", _request_timeout=T
    )
    [event] = listed.items
    assert event.metadata.name == NAME
    assert event.metadata.uid == created.metadata.uid
    assert event.metadata.resource_version == created.metadata.resource_version
    assert event.message == "Cordoned: the gaming VM needs the GPU"
    assert event.reporting_component == CONTROLLER
    assert event.reporting_instance == INSTANCE
    assert unset(event.count)
    assert unset(event.first_timestamp)
    assert unset(event.last_timestamp)
    assert event.event_time == created.event_time
    assert event.involved_object.kind == "Node"
    assert event.involved_object.uid == uid
    assert unset(event.source.component)
    raw_core = await raw_request(
        admin_api, "GET", f"/api/v1/namespaces/default/events/{NAME}"
    )
    assert isinstance(raw_core, dict)
    del raw_core["metadata"]
    assert raw_core == {
        "kind": "Event",
        "apiVersion": "v1",
        "involvedObject": {
            "kind": "Node",
            "name": GPU_NODE,
            "uid": uid,
            "apiVersion": "v1",
        },
        "reason": "GamingVmStarting",
        "message": "Cordoned: the gaming VM needs the GPU",
        "source": {},
        "firstTimestamp": None,
        "lastTimestamp": None,
        "type": "Normal",
        "eventTime": EVENT_TIME,
        "action": "Cordon",
        "reportingComponent": CONTROLLER,
        "reportingInstance": INSTANCE,
    }
    for selector in (
        "involvedObject.kind=Node",
        f"involvedObject.uid={uid}",
        "reason=GamingVmStarting",
        f"reportingComponent={CONTROLLER}",
        f"source={CONTROLLER}",  # no source: the reporting controller
        "type=Normal",
    ):
        listed = await core.list_event_for_all_namespaces(
            field_selector=selector, _request_timeout=T
        )
        assert [e.metadata.name for e in listed.items] == [NAME], selector
    listed = await core.list_event_for_all_namespaces(
        field_selector="involvedObject.kind=Pod", _request_timeout=T
    )
    assert listed.items == []


async def test_events_k8s_io_field_selectors(admin_api: client.ApiClient) -> None:
    """events.k8s.io/v1 selects by its own field names (regarding.name,
    reportingController...); core/v1's involvedObject.name is not one of
    them: 400 "field label not supported"."""
    events = client.EventsV1Api(admin_api)
    await events.create_namespaced_event(
        "default", as_event(node_event()), _request_timeout=T
    )
    for selector in (
        f"regarding.name={GPU_NODE}",
        "regarding.kind=Node,reason=GamingVmStarting",
        f"reportingController={CONTROLLER}",
        f"source={CONTROLLER}",
        f"metadata.name={NAME}",
    ):
        listed = await events.list_namespaced_event(
            "default", field_selector=selector, _request_timeout=T
        )
        assert [e.metadata.name for e in listed.items] == [NAME], selector
        assert listed.items[0].note == "Cordoned: the gaming VM needs the GPU"
    listed = await events.list_event_for_all_namespaces(
        field_selector="regarding.name=control-plane", _request_timeout=T
    )
    assert listed.items == []
    with pytest.raises(ApiException) as err:
        await events.list_namespaced_event(
            "default",
            field_selector=f"involvedObject.name={GPU_NODE}",
            _request_timeout=T,
        )
    assert err.value.status == 400
    assert status_of(err.value)["message"] == (
        "field label not supported: involvedObject.name"
    )


async def test_core_v1_event_reads_through_events_k8s_io(
    admin_api: client.ApiClient,
) -> None:
    """An old-style core/v1 Event (a kubelet's: source, first/lastTimestamp,
    count, no eventTime) read through events.k8s.io/v1: its deprecated*
    fields, eventTime null. kubernetes_asyncio's EventsV1Event refuses a
    null eventTime (client-side validation): such an Event can only be
    read raw through events.k8s.io/v1 with this client."""
    core = client.CoreV1Api(admin_api)
    first = datetime(2026, 3, 1, 9, 0, 0, tzinfo=UTC)
    await core.create_namespaced_event(
        "default",
        client.CoreV1Event(
            metadata=client.V1ObjectMeta(name="gpu-node.legacy"),
            involved_object=client.V1ObjectReference(kind="Node", name=GPU_NODE),
            reason="NodeNotReady",
            message="Node gpu-node status is now: NodeNotReady",
            source=client.V1EventSource(component="kubelet", host=GPU_NODE),
            first_timestamp=first,
            last_timestamp=datetime(2026, 3, 1, 9, 5, 0, 500000, tzinfo=UTC),
            count=3,
            type="Warning",
        ),
        _request_timeout=T,
    )
    raw = await raw_request(
        admin_api,
        "GET",
        "/apis/events.k8s.io/v1/namespaces/default/events/gpu-node.legacy",
    )
    assert isinstance(raw, dict)
    del raw["metadata"]
    assert raw == {
        "kind": "Event",
        "apiVersion": "events.k8s.io/v1",
        "eventTime": None,
        "reason": "NodeNotReady",
        "regarding": {"kind": "Node", "name": GPU_NODE},
        "note": "Node gpu-node status is now: NodeNotReady",
        "type": "Warning",
        "deprecatedSource": {"component": "kubelet", "host": GPU_NODE},
        "deprecatedFirstTimestamp": "2026-03-01T09:00:00Z",
        "deprecatedLastTimestamp": "2026-03-01T09:05:00Z",  # seconds: metav1.Time
        "deprecatedCount": 3,
    }
    with pytest.raises(ValueError, match="event_time"):
        await client.EventsV1Api(admin_api).read_namespaced_event(
            "gpu-node.legacy", "default", _request_timeout=T
        )
    listed = await core.list_namespaced_event(
        "default", field_selector="source=kubelet", _request_timeout=T
    )
    assert [e.metadata.name for e in listed.items] == ["gpu-node.legacy"]


async def test_watch_and_delete_through_events_k8s_io(
    admin_api: client.ApiClient,
) -> None:
    """A watch on events.k8s.io/v1 sees a core/v1 write converted; a delete
    through events.k8s.io/v1 removes the core Event."""
    events = client.EventsV1Api(admin_api)
    await events.create_namespaced_event(
        "default", as_event(node_event()), _request_timeout=T
    )
    stream = await raw_watch(
        events.list_namespaced_event,
        "default",
        field_selector=f"regarding.name={GPU_NODE}",
        timeout_seconds=1,
        _request_timeout=T,
    )
    line = await stream.content.readline()
    stream.release()
    assert b'"type":"ADDED"' in line
    assert b'"apiVersion":"events.k8s.io/v1"' in line
    assert b'"note":"Cordoned: the gaming VM needs the GPU"' in line
    status = await events.delete_namespaced_event(NAME, "default", _request_timeout=T)
    assert status.status == "Success"
    assert status.details.group == "events.k8s.io"
    assert status.details.kind == "events"
    listed = await client.CoreV1Api(admin_api).list_namespaced_event(
        "default", _request_timeout=T
    )
    assert listed.items == []
    with pytest.raises(ApiException) as err:
        await events.read_namespaced_event(NAME, "default", _request_timeout=T)
    assert err.value.status == 404
    assert status_of(err.value)["message"] == f'events.events.k8s.io "{NAME}" not found'
    assert status_of(err.value)["details"] == {
        "name": NAME,
        "group": "events.k8s.io",
        "kind": "events",
    }


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("changes", "namespace", "cause"),
    [
        pytest.param(
            {"eventTime": None},
            "default",
            ("FieldValueRequired", "eventTime", "Required value"),
            id="eventTime-missing",
        ),
        pytest.param(
            {"type": "Info"},
            "default",
            ("FieldValueInvalid", "type", 'Invalid value: "": has invalid value: Info'),
            id="type-not-Normal-or-Warning",
        ),
        pytest.param(
            {"reportingController": "GPU Handoff"},
            "default",
            (
                "FieldValueInvalid",
                "reportingController",
                f'Invalid value: "GPU Handoff": {QUALIFIED_NAME_RULE}',
            ),
            id="reportingController-not-qualified",
        ),
        pytest.param(
            {"reason": "R" * 129},
            "default",
            (
                "FieldValueInvalid",
                "reason",
                'Invalid value: "": can have at most 128 characters',
            ),
            id="reason-129",
        ),
        pytest.param(
            {"action": "A" * 129},
            "default",
            (
                "FieldValueInvalid",
                "action",
                'Invalid value: "": can have at most 128 characters',
            ),
            id="action-129",
        ),
        pytest.param(
            {"reportingInstance": "i" * 129},
            "default",
            (
                "FieldValueInvalid",
                "reportingInstance",
                'Invalid value: "": can have at most 128 characters',
            ),
            id="reportingInstance-129",
        ),
        pytest.param(
            {"note": "n" * 1025},
            "default",
            (
                "FieldValueInvalid",
                "message",
                'Invalid value: "": can have at most 1024 characters',
            ),
            id="note-1025",
        ),
        pytest.param(
            # Go's len() counts bytes: 1024 characters, 1026 bytes.
            {"note": "n" * 1023 + "…"},
            "default",
            (
                "FieldValueInvalid",
                "message",
                'Invalid value: "": can have at most 1024 characters',
            ),
            id="note-1024-characters-1026-bytes",
        ),
        pytest.param(
            {"deprecatedCount": 1},
            "default",
            ("FieldValueInvalid", "count", 'Invalid value: "": needs to be unset'),
            id="deprecatedCount-set",
        ),
        pytest.param(
            {"deprecatedSource": {"component": "gpu-handoff"}},
            "default",
            ("FieldValueInvalid", "source", 'Invalid value: "": needs to be unset'),
            id="deprecatedSource-set",
        ),
        pytest.param(
            {"deprecatedFirstTimestamp": "2026-03-01T10:00:00Z"},
            "default",
            (
                "FieldValueInvalid",
                "firstTimestamp",
                'Invalid value: "": needs to be unset',
            ),
            id="deprecatedFirstTimestamp-set",
        ),
        pytest.param(
            {"deprecatedLastTimestamp": "2026-03-01T10:00:00Z"},
            "default",
            (
                "FieldValueInvalid",
                "lastTimestamp",
                'Invalid value: "": needs to be unset',
            ),
            id="deprecatedLastTimestamp-set",
        ),
        pytest.param(
            {"series": {"count": 1, "lastObservedTime": EVENT_TIME}},
            "default",
            (
                "FieldValueInvalid",
                "series.count",
                'Invalid value: "": should be at least 2',
            ),
            id="series-count-1",
        ),
        pytest.param(
            {"series": {"count": 2}},
            "default",
            ("FieldValueRequired", "series.lastObservedTime", "Required value"),
            id="series-without-lastObservedTime",
        ),
        pytest.param(
            {"metadata": {"name": NAME, "namespace": "ai"}},
            "ai",
            (
                "FieldValueInvalid",
                "involvedObject.namespace",
                'Invalid value: "": does not match event.namespace',
            ),
            id="node-event-outside-default",
        ),
    ],
)
async def test_create_is_validated(
    admin_api: client.ApiClient,
    changes: dict[str, Any],
    namespace: str,
    cause: tuple[str, str, str],
) -> None:
    """Each rule of ValidateEventCreate for events.k8s.io/v1 alone: 422
    Invalid, the internal field path, upstream's words."""
    code, status = await refused_create(admin_api, node_event(**changes), namespace)
    assert code == 422
    _, field, text = cause
    assert status == invalid(f'Event "{NAME}" is invalid: {field}: {text}', cause)


async def test_limits_are_inclusive_and_kube_system_takes_node_events(
    admin_api: client.ApiClient,
) -> None:
    """128 bytes of reason, action and reportingInstance and 1024 of note are
    accepted; an Event about a Node may also live in kube-system."""
    events = client.EventsV1Api(admin_api)
    created = await events.create_namespaced_event(
        "default",
        as_event(
            node_event(
                reason="R" * 128,
                action="A" * 128,
                reportingInstance="i" * 128,
                note="n" * 1021 + "…",
            )
        ),
        _request_timeout=T,
    )
    assert len(created.note.encode()) == 1024
    body = node_event(metadata={"name": NAME, "namespace": "kube-system"})
    await events.create_namespaced_event(
        "kube-system", as_event(body), _request_timeout=T
    )


async def test_errors_are_listed_together(admin_api: client.ApiClient) -> None:
    """All of legacyValidateEvent's and the strict checks' errors in one
    Status, in upstream's order; an empty reportingController is required
    and breaks both rules of a qualified name (kubernetes/kubernetes#89062
    shows a real server's answer)."""
    body = node_event(
        reportingController="",
        reportingInstance=None,
        action=None,
        type=None,
        deprecatedCount=2,
    )
    code, status = await refused_create(admin_api, body)
    assert code == 422
    empty_name = 'Invalid value: "": name part must be non-empty'
    not_qualified = f'Invalid value: "": {QUALIFIED_NAME_RULE}'
    assert status == invalid(
        f'Event "{NAME}" is invalid: [reportingController: Required value, '
        f"reportingController: {empty_name}, "
        f"reportingController: {not_qualified}, "
        "reportingInstance: Required value, action: Required value, "
        'type: Invalid value: "": has invalid value: , '
        'count: Invalid value: "": needs to be unset]',
        ("FieldValueRequired", "reportingController", "Required value"),
        ("FieldValueInvalid", "reportingController", empty_name),
        ("FieldValueInvalid", "reportingController", not_qualified),
        ("FieldValueRequired", "reportingInstance", "Required value"),
        ("FieldValueRequired", "action", "Required value"),
        ("FieldValueInvalid", "type", 'Invalid value: "": has invalid value: '),
        ("FieldValueInvalid", "count", 'Invalid value: "": needs to be unset'),
    )


async def test_core_v1_names_the_reporting_component(
    admin_api: client.ApiClient,
) -> None:
    """Through core/v1 an Event with eventTime gets only the legacy checks,
    naming core/v1's field (reportingComponent, kubernetes/kubernetes#111506);
    type and deprecated fields are not checked there."""
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": NAME},
        "involvedObject": {"kind": "Node", "name": GPU_NODE},
        "eventTime": EVENT_TIME,
        "reportingInstance": INSTANCE,
        "action": "Cordon",
        "reason": "GamingVmStarting",
        "type": "Info",
        "count": 4,
    }
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(admin_api).create_namespaced_event(
            "default", as_event(body), _request_timeout=T
        )
    assert err.value.status == 422
    assert status_of(err.value)["details"]["causes"] == [
        {
            "reason": "FieldValueRequired",
            "message": "Required value",
            "field": "reportingComponent",
        },
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "": name part must be non-empty',
            "field": "reportingComponent",
        },
        {
            "reason": "FieldValueInvalid",
            "message": f'Invalid value: "": {QUALIFIED_NAME_RULE}',
            "field": "reportingComponent",
        },
    ]
    body["reportingComponent"] = CONTROLLER
    created = await client.CoreV1Api(admin_api).create_namespaced_event(
        "default", as_event(body), _request_timeout=T
    )
    assert (created.type, created.count) == ("Info", 4)


async def test_bodies_decode_as_the_apiserver_decodes_them(
    admin_api: client.ApiClient,
) -> None:
    """eventTime decodes as metav1.MicroTime (RFC3339Micro: exactly six
    fractional digits): a datetime without microseconds, as
    kubernetes_asyncio writes it (isoformat), or three digits is 400; so is
    a value of the wrong JSON type, and a body of the other API version."""
    events = client.EventsV1Api(admin_api)
    body = client.EventsV1Event(
        metadata=client.V1ObjectMeta(name=NAME),
        event_time=datetime(2026, 3, 1, 10, 0, 0, tzinfo=UTC),
        reporting_controller=CONTROLLER,
        reporting_instance=INSTANCE,
        action="Cordon",
        reason="GamingVmStarting",
        regarding=client.V1ObjectReference(kind="Node", name=GPU_NODE),
        type="Normal",
    )
    with pytest.raises(ApiException) as err:
        await events.create_namespaced_event("default", body, _request_timeout=T)
    assert err.value.status == 400
    assert status_of(err.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'Event in version "v1" cannot be handled as a Event: parsing time '
        '"2026-03-01T10:00:00+00:00" as "2006-01-02T15:04:05.000000Z07:00": '
        'cannot parse "+00:00" as ".000000"',
        "reason": "BadRequest",
        "code": 400,
    }
    code, status = await refused_create(
        admin_api, node_event(eventTime="2026-03-01T10:00:00.123Z")
    )
    assert code == 400
    assert status["message"].endswith(
        'parsing time "2026-03-01T10:00:00.123Z" as '
        '"2006-01-02T15:04:05.000000Z07:00": cannot parse ".123Z" as ".000000"'
    )
    code, status = await refused_create(admin_api, node_event(deprecatedCount="2"))
    assert code == 400
    assert status["message"] == (
        'Event in version "v1" cannot be handled as a Event: json: cannot unmarshal '
        "string into Go struct field Event.deprecatedCount of type int32"
    )
    code, status = await refused_create(admin_api, node_event(apiVersion="v1"))
    assert code == 400
    assert status["message"] == (
        "the API version in the data (v1) does not match the expected API version "
        "(events.k8s.io/v1)"
    )
    body.event_time = datetime(2026, 3, 1, 10, 0, 0, 1, tzinfo=UTC)
    created = await events.create_namespaced_event("default", body, _request_timeout=T)
    assert created.event_time == body.event_time


# ------------------------------------------------------------ update, patch


async def test_only_the_series_may_change(admin_api: client.ApiClient) -> None:
    """ValidateEventUpdate through events.k8s.io/v1: a patch or an update
    changing anything but the series is 422 ("field is immutable", the new
    value printed as upstream prints it; reason is checked twice upstream:
    two causes, one line)."""
    events = client.EventsV1Api(admin_api)
    await events.create_namespaced_event(
        "default", as_event(node_event()), _request_timeout=T
    )

    code, status = await refused_patch(admin_api, {"note": "Something else"})
    assert code == 422
    assert status == invalid(
        f'Event "{NAME}" is invalid: message: Invalid value: "Something else": '
        "field is immutable",
        (
            "FieldValueInvalid",
            "message",
            'Invalid value: "Something else": field is immutable',
        ),
    )

    code, status = await refused_patch(admin_api, {"reason": "Other"})
    assert code == 422
    immutable_reason = (
        "FieldValueInvalid",
        "reason",
        'Invalid value: "Other": field is immutable',
    )
    assert status == invalid(
        f'Event "{NAME}" is invalid: reason: Invalid value: "Other": field is immutable',
        immutable_reason,
        immutable_reason,
    )

    code, status = await refused_patch(admin_api, {"regarding": {"name": "other"}})
    assert code == 422
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: {"Kind":"Node","Namespace":"","Name":"other",'
            '"UID":"","APIVersion":"v1","ResourceVersion":"","FieldPath":""}: '
            "field is immutable",
            "field": "involvedObject",
        }
    ]

    code, status = await refused_patch(
        admin_api, {"eventTime": "2026-03-01T10:00:01.000000Z"}
    )
    assert code == 422
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "2026-03-01T10:00:01.000000Z": '
            "field is immutable",
            "field": "eventTime",
        }
    ]

    current = await events.read_namespaced_event(NAME, "default", _request_timeout=T)
    current.type = "Warning"
    with pytest.raises(ApiException) as err:
        await events.replace_namespaced_event(
            NAME, "default", current, _request_timeout=T
        )
    assert err.value.status == 422
    assert status_of(err.value)["message"] == (
        f'Event "{NAME}" is invalid: type: Invalid value: "Warning": field is immutable'
    )

    code, status = await refused_patch(
        admin_api, {"series": {"count": 1, "lastObservedTime": EVENT_TIME}}
    )
    assert code == 422
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "": should be at least 2',
            "field": "series.count",
        }
    ]
    stored = await events.read_namespaced_event(NAME, "default", _request_timeout=T)
    assert stored.note == "Cordoned: the gaming VM needs the GPU"
    assert stored.type == "Normal"
    assert unset(stored.series)


async def test_series_patches_as_the_broadcaster_sends_them(
    admin_api: client.ApiClient,
) -> None:
    """The second and later occurrences: strategic merge patches of
    ``series`` (count 2, then 3, lastObservedTime) are accepted and read
    the same through both APIs; core/v1 keeps count unset (series.count is
    not deprecatedCount). A JSON merge patch works too; a series without
    lastObservedTime does not."""
    events = client.EventsV1Api(admin_api)
    created = await events.create_namespaced_event(
        "default", as_event(node_event()), _request_timeout=T
    )
    patched = await events.patch_namespaced_event(
        NAME,
        "default",
        {"series": {"count": 2, "lastObservedTime": "2026-03-01T10:01:00.000000Z"}},
        _request_timeout=T,
    )
    assert patched.series.count == 2
    assert int(patched.metadata.resource_version) > int(
        created.metadata.resource_version
    )
    patched = await events.patch_namespaced_event(
        NAME,
        "default",
        {"series": {"count": 3, "lastObservedTime": "2026-03-01T10:05:00.654321Z"}},
        _request_timeout=T,
    )
    assert patched.series.count == 3
    assert patched.series.last_observed_time == datetime(
        2026, 3, 1, 10, 5, 0, 654321, tzinfo=UTC
    )
    read = await events.read_namespaced_event(NAME, "default", _request_timeout=T)
    assert read.series.count == 3
    assert read.note == created.note
    assert read.event_time == created.event_time
    [core] = (
        await client.CoreV1Api(admin_api).list_namespaced_event(
            "default",
            field_selector=f"involvedObject.name={GPU_NODE}",
            _request_timeout=T,
        )
    ).items
    assert core.series.count == 3
    assert core.series.last_observed_time == patched.series.last_observed_time
    assert unset(core.count)
    assert core.message == created.note
    assert core.metadata.resource_version == patched.metadata.resource_version

    merged = await raw_request(
        admin_api,
        "PATCH",
        f"/apis/events.k8s.io/v1/namespaces/default/events/{NAME}",
        body={"series": {"count": 4}},
        content_type="application/merge-patch+json",
    )
    assert isinstance(merged, dict)
    assert merged["series"] == {
        "count": 4,
        "lastObservedTime": "2026-03-01T10:05:00.654321Z",
    }
    code, status = await refused_patch(
        admin_api, {"series": {"count": 5, "lastObservedTime": None}}
    )
    assert code == 422
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueRequired",
            "message": "Required value",
            "field": "series.lastObservedTime",
        }
    ]


async def test_a_series_patch_of_a_missing_event_is_404_then_created(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """recordEvent: the patch of an Event that is gone (its TTL) answers
    404, and the broadcaster creates it with its series; PUT creates a
    missing Event too (the event strategy allows create on update: 201)."""
    events = client.EventsV1Api(admin_api)
    code, status = await refused_patch(
        admin_api, {"series": {"count": 2, "lastObservedTime": EVENT_TIME}}
    )
    assert code == 404
    assert status["message"] == f'events.events.k8s.io "{NAME}" not found'
    series = {"count": 2, "lastObservedTime": "2026-03-01T10:01:00.000000Z"}
    created = await events.create_namespaced_event(
        "default", as_event(node_event(series=series)), _request_timeout=T
    )
    assert created.series.count == 2
    with pytest.raises(ApiException) as err:
        await events.create_namespaced_event(
            "default", as_event(node_event(series=series)), _request_timeout=T
        )
    assert err.value.status == 409
    assert status_of(err.value)["reason"] == "AlreadyExists"
    assert status_of(err.value)["message"] == (
        f'events.events.k8s.io "{NAME}" already exists'
    )
    other = f"{GPU_NODE}.18a5f0c2d4e6b801"
    replaced = await raw_request(
        admin_api,
        "PUT",
        f"/apis/events.k8s.io/v1/namespaces/default/events/{other}",
        body=node_event(other),
    )
    assert isinstance(replaced, dict)
    assert replaced["metadata"]["name"] == other
    assert emulator.requests_for(verb="update")[-1].status == 201
    stored = emulator.get("Event", other)
    assert stored is not None
    assert stored["reportingComponent"] == CONTROLLER


# ---------------------------------------------------------------------- RBAC


async def test_rbac_is_checked_against_events_k8s_io(
    emulator: K8sEmulator, tmp_path: Path
) -> None:
    """events.k8s.io Events are authorized as resource ``events`` in group
    ``events.k8s.io``: a grant on core ``events`` does not cover them (403
    Forbidden, not 404: an emitter that drops errors cannot pass for
    working); create and patch in events.k8s.io do, and nothing more."""
    emulator.add_token(
        "core-events", (rule(["create", "patch"], ["events"]),), user=EVENTS_USER
    )
    api = await api_client_for(emulator, tmp_path, "core-events")
    try:
        code, status = await refused_create(api, node_event())
        assert code == 403
        assert status == {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f'events.events.k8s.io is forbidden: User "{EVENTS_USER}" '
            'cannot create resource "events" in API group "events.k8s.io" in the '
            'namespace "default"',
            "reason": "Forbidden",
            "details": {"group": "events.k8s.io", "kind": "events"},
            "code": 403,
        }
        code, status = await refused_patch(
            api, {"series": {"count": 2, "lastObservedTime": EVENT_TIME}}
        )
        assert code == 403
        assert status["message"] == (
            f'events.events.k8s.io "{NAME}" is forbidden: User "{EVENTS_USER}" '
            'cannot patch resource "events" in API group "events.k8s.io" in the '
            'namespace "default"'
        )
        assert emulator.list_objects("Event") == []
    finally:
        await api.close()

    emulator.add_token(
        "events-v1",
        (rule(["create", "patch"], ["events"], ["events.k8s.io"]),),
        user=EVENTS_USER,
    )
    api = await api_client_for(emulator, tmp_path, "events-v1")
    try:
        events = client.EventsV1Api(api)
        await events.create_namespaced_event(
            "default", as_event(node_event()), _request_timeout=T
        )
        patched = await events.patch_namespaced_event(
            NAME,
            "default",
            {"series": {"count": 2, "lastObservedTime": EVENT_TIME}},
            _request_timeout=T,
        )
        assert patched.series.count == 2
        with pytest.raises(ApiException) as err:
            await events.list_namespaced_event("default", _request_timeout=T)
        assert err.value.status == 403
        with pytest.raises(ApiException) as err:
            await client.CoreV1Api(api).create_namespaced_event(
                "default",
                as_event(node_event("core", apiVersion="v1")),
                _request_timeout=T,
            )
        assert err.value.status == 403
        assert status_of(err.value)["details"] == {"kind": "events"}
    finally:
        await api.close()
    writes = [
        (r.verb, r.group, r.status) for r in emulator.requests_for(resource="events")
    ]
    assert writes == [
        ("create", "events.k8s.io", 403),
        ("patch", "events.k8s.io", 403),
        ("create", "events.k8s.io", 201),
        ("patch", "events.k8s.io", 200),
        ("list", "events.k8s.io", 403),
        ("create", "", 403),
    ]
