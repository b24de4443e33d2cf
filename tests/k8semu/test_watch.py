"""Watches: events for changes, resourceVersion resumption, timeoutSeconds, 410."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException
import pytest

from . import CONTROL_PLANE_NODE, GPU_NODE, K8sEmulator
from .client import api_client_for, raw_watch

T = 10


async def test_watch_sees_cordon(emulator: K8sEmulator, api: client.ApiClient) -> None:
    """Initial ADDED for every node, then MODIFIED with the new resourceVersion."""
    core = client.CoreV1Api(api)
    events: list[tuple[str, str, Any]] = []
    patched: list[client.V1Node] = []
    async with asyncio.timeout(15), watch.Watch() as w:
        async for event in w.stream(
            core.list_node, timeout_seconds=10, _request_timeout=T
        ):
            obj = event["object"]
            events.append((event["type"], obj.metadata.name, obj.spec.unschedulable))
            if len(events) == 2:
                patched.append(
                    await core.patch_node(
                        GPU_NODE, {"spec": {"unschedulable": True}}, _request_timeout=T
                    )
                )
            if event["type"] == "MODIFIED":
                [node] = patched
                assert obj.metadata.resource_version == node.metadata.resource_version
                assert str(w.resource_version) == node.metadata.resource_version
                break
    assert events == [
        ("ADDED", CONTROL_PLANE_NODE, None),
        ("ADDED", GPU_NODE, None),
        ("MODIFIED", GPU_NODE, True),
    ]


async def test_watch_ends_at_timeout_seconds(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """The server closes the stream after timeoutSeconds; the iteration ends."""
    core = client.CoreV1Api(api)
    nodes = await core.list_node(_request_timeout=T)
    async with asyncio.timeout(15), watch.Watch() as w:
        received = [
            event["type"]
            async for event in w.stream(
                core.list_node,
                resource_version=nodes.metadata.resource_version,
                timeout_seconds=1,
                _request_timeout=T,
            )
        ]
    assert received == []
    [request] = emulator.requests_for(verb="watch")
    assert request.query["timeoutSeconds"] == "1"


async def test_watch_resumes_from_resource_version(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """From a list's resourceVersion: only the later changes, filtered by field selector."""
    core = client.CoreV1Api(admin_api)  # the product may not watch pods
    pods = await core.list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={GPU_NODE}", _request_timeout=T
    )
    emulator.add_pod("elsewhere", "ai", node=CONTROL_PLANE_NODE)
    emulator.add_pod("newcomer", "ai", node=GPU_NODE)
    emulator.remove_pod("llm-inference-5d9c8b7f6-q4w8z", "ai")
    seen: list[tuple[str, str]] = []
    async with asyncio.timeout(15), watch.Watch() as w:
        async for event in w.stream(
            core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={GPU_NODE}",
            resource_version=pods.metadata.resource_version,
            timeout_seconds=10,
            _request_timeout=T,
        ):
            seen.append((event["type"], event["object"].metadata.name))
            if len(seen) == 2:
                break
    assert seen == [("ADDED", "newcomer"), ("DELETED", "llm-inference-5d9c8b7f6-q4w8z")]


async def test_watch_with_too_old_resource_version_is_410(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """After compaction, an old resourceVersion gets an ERROR event with 410 Expired."""
    core = client.CoreV1Api(api)
    nodes = await core.list_node(_request_timeout=T)
    emulator.set_node_up(GPU_NODE, False)
    emulator.compact()
    async with asyncio.timeout(15), watch.Watch() as w:
        with pytest.raises(ApiException) as err:
            async for _event in w.stream(
                core.list_node,
                resource_version=nodes.metadata.resource_version,
                timeout_seconds=5,
                _request_timeout=T,
            ):
                pass
    assert err.value.status == 410
    assert "Expired: too old resource version" in str(err.value.reason)
    assert emulator.requests_for(verb="watch")[-1].status == 200


async def test_raw_watch_lines(emulator: K8sEmulator, api: client.ApiClient) -> None:
    """One JSON object per line: type and object with kind and resourceVersion."""
    core = client.CoreV1Api(api)
    response = await raw_watch(
        core.list_node,
        field_selector=f"metadata.name={GPU_NODE}",
        timeout_seconds=5,
        _request_timeout=T,
    )
    try:
        first = await response.content.readline()
        emulator.set_node_up(GPU_NODE, False)
        second = await response.content.readline()
    finally:
        response.release()
    assert first.endswith(b"\n")
    added, modified = json.loads(first), json.loads(second)
    assert added["type"] == "ADDED"
    assert added["object"]["kind"] == "Node"
    assert modified["type"] == "MODIFIED"
    assert int(modified["object"]["metadata"]["resourceVersion"]) > int(
        added["object"]["metadata"]["resourceVersion"]
    )


async def test_stop_ends_open_watches(socket_enabled: None, tmp_path: Any) -> None:
    """stop() with a watch open returns promptly and the client sees the end."""
    emu = K8sEmulator()
    emu.add_node(GPU_NODE)
    await emu.start()
    api = await api_client_for(emu, tmp_path)
    try:
        response = await raw_watch(client.CoreV1Api(api).list_node, _request_timeout=T)
        assert b"ADDED" in await response.content.readline()
        async with asyncio.timeout(10):
            await emu.stop()
            assert await response.content.readline() == b""
        response.release()
    finally:
        await api.close()
        await emu.stop()


async def test_hung_watch_delivers_nothing_until_resumed(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """hang_watches(): the stream stays open and silent (no end at timeoutSeconds)."""
    core = client.CoreV1Api(api)
    nodes = await core.list_node(_request_timeout=T)
    emulator.hang_watches()
    response = await raw_watch(
        core.list_node,
        resource_version=nodes.metadata.resource_version,
        timeout_seconds=1,
        _request_timeout=T,
    )
    try:
        emulator.set_node_up(GPU_NODE, False)  # lost: the stream is hung
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.5):  # past timeoutSeconds: still no end
                await response.content.readline()
        emulator.hang_watches(False)
        emulator.set_node_up(GPU_NODE, True)
        async with asyncio.timeout(10):
            line = await response.content.readline()
    finally:
        response.release()
    event = json.loads(line)
    assert event["type"] == "MODIFIED"
    ready = next(
        c for c in event["object"]["status"]["conditions"] if c["type"] == "Ready"
    )
    assert ready["status"] == "True"
