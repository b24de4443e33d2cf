"""The typed protocol module refuses what it cannot read, and says what.

The shapes the agent really sends are pinned by tests/test_contract.py (the
real agent, strict parsing). These are the other side: a message that is
not what this side expects is refused with a ProtocolError naming the
field, never half-read.
"""

from __future__ import annotations

from typing import Any

import pytest

from custom_components.gpu_handoff.core import PendingJob
from custom_components.gpu_handoff.models import Snapshot
from custom_components.gpu_handoff.protocol import (
    PROTOCOL,
    Hello,
    JobKind,
    JobRecord,
    JobState,
    ProtocolError,
    StepName,
    decode_line,
    error_of,
    parse_job_reply,
    parse_push,
    parse_status,
    parse_submitted,
    parse_version,
)
from custom_components.gpu_handoff.sensor import gpu_node_state


def _status(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "uri": "qemu:///system",
        "gpu_node": "gpu-node",
        "gaming": ["gaming-1"],
        "domains": [
            {
                "name": "gpu-node",
                "title": None,
                "role": "gpu_node",
                "exists": True,
                "state": "running",
                "reason": "booted",
                "agent_channel": True,
                "agent_ready": True,
                "hostdevs": [
                    {"address": "0000:01:00.0", "managed": True, "rom_bar": "off"}
                ],
            }
        ],
        "cards": [
            {
                "address": "0000:01:00.0",
                "held_by": "gpu-node",
                "claimed_by": ["gpu-node"],
            }
        ],
        "findings": [],
        "hook_requests": [],
        "active_jobs": [],
        "virsh_calls": 1,
    }
    body.update(changes)
    return body


def _job(**changes: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "id": "j1",
        "kind": "handoff",
        "args": {"domain": "gaming-1"},
        "state": "running",
        "step": 1,
        "steps": [
            {
                "name": "wait_agent",
                "domain": "gpu-node",
                "started": "t",
                "finished": "t",
                "result": "ok",
                "detail": None,
            },
            {
                "name": "shutdown",
                "domain": "gpu-node",
                "started": "t",
                "finished": None,
                "result": None,
                "detail": None,
            },
        ],
        "created": "t",
        "created_epoch": 1.0,
        "started": "t",
        "finished": None,
        "error": None,
        "requested_by": "ssh",
        "runner": None,
        "request_id": "ha-123456789",
    }
    job.update(changes)
    return job


def test_a_status_as_sent_reads_and_its_title_defaults_to_the_name() -> None:
    """The happy path, for reference: every field typed."""
    status = parse_status(_status(), strict=True)
    gpu = status.domains["gpu-node"]
    assert gpu.title == "gpu-node"
    assert gpu.cards == ("0000:01:00.0",)
    assert status.gpus_held_by("gpu-node") == 1
    assert status.job_for("gpu-node") is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "expected an object"),
        (_status(gaming="gaming-1"), "'gaming' is str"),
        (_status(gaming=[1]), "'gaming' must hold strings"),
        (_status(virsh_calls=True), "'virsh_calls' is bool"),
        (_status(virsh_calls="1"), "'virsh_calls' is str"),
        (_status(domains=[{"name": "x"}]), "no 'role'"),
        (_status(active_jobs=[_job(kind="destroy")]), "'kind' is 'destroy'"),
        (
            _status(
                active_jobs=[{**_job(), "step": "reboot", "args": {"domain": "x"}}]
            ),
            "'step' is 'reboot'",
        ),
        (
            _status(active_jobs=[{**_job(), "args": ["gaming-1"], "step": None}]),
            "expected an object",
        ),
    ],
)
def test_a_status_of_another_shape_is_refused(body: Any, message: str) -> None:
    """Wrong types, missing fields, unknown enum values: refused, named."""
    with pytest.raises(ProtocolError, match=message):
        parse_status(body)


def test_strict_parsing_refuses_unknown_fields() -> None:
    """Lenient by default (an agent may add a field); strict in the contract."""
    body = _status(new_field=1)
    assert parse_status(body).gpu_node == "gpu-node"
    with pytest.raises(ProtocolError, match="unknown fields"):
        parse_status(body, strict=True)


def test_job_records_and_their_current_step() -> None:
    """A full record names its current step by index, and reports it."""
    record = parse_job_reply({"protocol": PROTOCOL, "ok": True, "job": _job()})
    assert record.job.kind is JobKind.HANDOFF
    assert record.job.state is JobState.RUNNING
    assert record.current is not None
    assert record.current.name is StepName.SHUTDOWN
    assert record.job.domains == ("gaming-1",)
    summary_only = JobRecord(job=record.job, steps=record.steps)
    assert summary_only.current is not None
    assert summary_only.current.name is StepName.SHUTDOWN
    done = parse_job_reply({"job": _job(step=None, state="succeeded")})
    assert done.current is None
    assert not done.job.state.active


def test_replies_and_lines_of_another_shape() -> None:
    """Submit and version replies, lines that are not objects, errors."""
    with pytest.raises(ProtocolError, match="no 'existing'"):
        parse_submitted({"job": {"id": "j", "kind": "stop", "state": "queued"}})
    with pytest.raises(ProtocolError, match="'protocol' is str"):
        parse_version({"protocol": "2", "version": "x", "verbs": []})
    with pytest.raises(ProtocolError, match="'host_name' is int"):
        parse_version({"protocol": 2, "version": "x", "verbs": [], "host_name": 7})
    with pytest.raises(ProtocolError, match="not JSON"):
        decode_line("{")
    with pytest.raises(ProtocolError, match="not a JSON object"):
        decode_line("[1]")
    with pytest.raises(ProtocolError, match="unknown type"):
        parse_push({"type": "gossip"})
    error = error_of({"ok": False, "error": "not an object"})
    assert error is not None
    assert error.code == "unknown"
    assert error_of({"ok": True}) is None


def test_a_stored_job_that_cannot_be_read_is_none() -> None:
    """Storage written by another version, or damaged: no job, not a crash."""
    assert PendingJob.from_dict(None) is None
    assert PendingJob.from_dict({"kind": "destroy", "request_id": "x"}) is None
    assert PendingJob.from_dict({"kind": "stop"}) is None
    job = PendingJob.from_dict({"kind": "stop", "domain": "g", "request_id": "r"})
    assert job is not None
    assert job.boot_id is None  # stored before bootIDs were
    assert PendingJob.from_dict(job.as_dict()) == job
    release = PendingJob.from_dict(
        {"kind": "release", "domain": None, "request_id": "r", "boot_id": "b-1"}
    )
    assert release is not None
    assert release.boot_id == "b-1"
    assert PendingJob.from_dict(release.as_dict()) == release


def test_the_towers_name_is_read_and_older_agents_have_none() -> None:
    """A version reply (or hello) names the tower; an agent from before the
    field sends none, which reads as None even when parsed strictly."""
    base = {"protocol": 2, "ok": True, "version": "0.2.0", "verbs": ["status"]}
    named = parse_version(base | {"host_name": "attic"}, strict=True)
    assert named.host_name == "attic"
    assert (named.protocol, named.version, named.verbs) == (2, "0.2.0", ("status",))
    assert parse_version(base, strict=True).host_name is None
    hello = parse_push(base | {"type": "hello", "host_name": "attic"}, strict=True)
    assert isinstance(hello, Hello)
    assert hello.version.host_name == "attic"


def test_a_lend_job_acts_on_the_gpu_node() -> None:
    """A lend job names no domain, yet it stops and starts the GPU node: the
    GPU node's job, as a handoff's and a release's are."""
    summary = {
        k: v
        for k, v in _job(kind="lend", args={"domain": None}).items()
        if k not in ("steps", "created_epoch", "started", "runner")
    }
    status = parse_status(_status(active_jobs=[{**summary, "step": "shutdown"}]))
    job = status.job_for("gpu-node")
    assert job is not None
    assert job.kind is JobKind.LEND
    assert status.job_for("gaming-1") is None


def _step(name: str, result: str | None, detail: str | None) -> dict[str, Any]:
    return {
        "name": name,
        "domain": "gpu-node",
        "started": "t",
        "finished": "t",
        "result": result,
        "detail": detail,
    }


@pytest.mark.parametrize(
    ("steps", "shut_down", "started"),
    [
        ([_step("shutdown", "ok", "shutdown --mode agent accepted")], True, False),
        ([_step("shutdown", "skipped", "already shut off")], False, False),
        ([_step("shutdown", None, None)], False, False),
        ([_step("start", "ok", "started")], False, True),
        ([_step("start", "ok", "already running")], False, False),
        ([_step("start_free", "ok", "started with every card")], False, True),
        ([_step("start_free", "skipped", "every card is in use")], False, False),
    ],
)
def test_what_a_job_did_is_read_from_its_steps(
    steps: list[dict[str, Any]], shut_down: bool, started: bool
) -> None:
    """A step the agent skipped, or that found its work done, did nothing."""
    record = parse_job_reply({"job": _job(steps=steps, step=None)})
    assert record.did(StepName.SHUTDOWN, "gpu-node") is shut_down
    assert (
        record.did(StepName.START, "gpu-node")
        or record.did(StepName.START_FREE, "gpu-node")
    ) is started
    assert not record.did(StepName.SHUTDOWN, "gaming-1")


@pytest.mark.parametrize(
    ("vm_state", "held_by", "expected"),
    [
        ("running", "gpu-node", "unreachable"),  # no Kubernetes node seen
        ("in_shutdown", "gpu-node", "stopping"),
        ("shut_off", None, "off"),
    ],
)
def test_the_gpu_node_is_off_only_once_shut_off(
    vm_state: str, held_by: str | None, expected: str
) -> None:
    """Between the guest's power-off and QEMU's exit libvirt says ``in
    shutdown`` and the GPU node still holds its cards (the status says so):
    stopping, not off (a status read in that moment showed off with the
    cards still held)."""
    body = _status()
    body["domains"][0]["state"] = vm_state
    body["cards"] = [{**card, "held_by": held_by} for card in body["cards"]]
    status = parse_status(body)
    assert status.domains["gpu-node"].state == vm_state
    assert gpu_node_state(Snapshot(tower=status, node=None)) == expected


@pytest.mark.parametrize(
    ("vm_state", "step", "expected"),
    [
        ("running", "wait_agent", "stopping"),
        ("running", "shutdown", "stopping"),
        ("shut_off", "wait_shut_off", "starting"),
        ("shut_off", "start_free", "starting"),
    ],
)
def test_a_lend_job_shows_in_the_handoff_state(
    vm_state: str, step: str, expected: str
) -> None:
    """A lend job stops the GPU node and starts it with the free cards: the
    Handoff state says so while no operation of this Home Assistant runs it
    (after a restart, or an operation it abandoned)."""
    summary = {
        k: v
        for k, v in _job(kind="lend", args={"domain": None}).items()
        if k not in ("steps", "created_epoch", "started", "runner")
    }
    body = _status(active_jobs=[{**summary, "step": step}])
    body["domains"][0]["state"] = vm_state
    status = parse_status(body)
    assert gpu_node_state(Snapshot(tower=status, node=None)) == expected
