"""429 from API Priority and Fairness and 504 from the request deadline, on
any verb; Status errors carrying a retry hint."""

from __future__ import annotations

import json

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
import pytest

from . import GPU_NODE, K8sEmulator
from .client import raw_watch, status_of
from .test_eviction import LLM, eviction

T = 10
APF_BODY = b"Too many requests, please try again later.\n"


def header(err: ApiException, name: str) -> str:
    """A response header of a failed call."""
    assert err.headers is not None
    return str(err.headers[name])


def body_bytes(err: ApiException) -> bytes:
    """The raw response body of a failed call."""
    body = err.body
    return body if isinstance(body, bytes) else str(body).encode()


async def test_apf_rejects_any_verb_with_a_plain_text_429(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """staging/src/k8s.io/apiserver/pkg/server/filters/priority-and-fairness.go
    (not served: setResponseHeaders, then maxinflight.go tooManyRequests):
    429 with Retry-After and the line "Too many requests, please try again
    later." as text/plain (Go's http.Error), no Status and so no
    DisruptionBudget cause. Each matching request uses one up."""
    core = client.CoreV1Api(api)
    emulator.throttle(3, retry_after=4)
    calls = (
        lambda: core.read_node(GPU_NODE, _request_timeout=T),
        lambda: core.list_pod_for_all_namespaces(_request_timeout=T),
        lambda: core.create_namespaced_pod_eviction(
            LLM, "ai", eviction(LLM, "ai"), _request_timeout=T
        ),
    )
    for call in calls:
        with pytest.raises(ApiException) as err:
            await call()
        assert err.value.status == 429
        assert body_bytes(err.value) == APF_BODY
        assert header(err.value, "Retry-After") == "4"
        assert header(err.value, "Content-Type") == "text/plain; charset=utf-8"
        assert header(err.value, "X-Content-Type-Options") == "nosniff"
        assert header(err.value, "X-Kubernetes-Pf-Flowschema-Uid")
        assert header(err.value, "X-Kubernetes-Pf-Prioritylevel-Uid")
    assert emulator.get("Pod", LLM, "ai") is not None  # the eviction never ran
    await core.read_node(GPU_NODE, _request_timeout=T)  # used up
    assert [(r.verb, r.resource, r.status) for r in emulator.requests] == [
        ("get", "nodes", 429),
        ("list", "pods", 429),
        ("create", "pods/eviction", 429),
        ("get", "nodes", 200),
    ]


async def test_apf_matches_verb_and_resource_and_comes_before_authorization(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """APF sits between authentication and authorization in the handler
    chain (DefaultBuildHandlerChain): a throttled request is 429 even if it
    would be forbidden. Only the named verb/resource is throttled; watches
    too."""
    core = client.CoreV1Api(api)
    emulator.throttle(1, verb="delete", resource="pods")
    emulator.throttle(1, verb="patch", resource="nodes")
    emulator.throttle(1, verb="watch", resource="nodes")
    await core.list_node(_request_timeout=T)  # not matching
    with pytest.raises(ApiException) as err:
        await core.delete_namespaced_pod(LLM, "ai", _request_timeout=T)
    assert err.value.status == 429
    with pytest.raises(ApiException) as err:
        await core.delete_namespaced_pod(LLM, "ai", _request_timeout=T)
    assert err.value.status == 403  # the product may not delete pods
    with pytest.raises(ApiException) as err:
        await core.patch_node(
            GPU_NODE, {"spec": {"unschedulable": True}}, _request_timeout=T
        )
    assert err.value.status == 429
    node = emulator.get("Node", GPU_NODE, "")
    assert node is not None
    assert "unschedulable" not in node["spec"]
    # A raw stream is handed back whatever its status.
    stream = await raw_watch(core.list_node, timeout_seconds=1, _request_timeout=T)
    try:
        assert stream.status == 429
        assert await stream.read() == APF_BODY
    finally:
        stream.release()


async def test_request_timeout_is_a_504_status(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """handlers/finisher/finisher.go: the request's deadline passes, the
    answer is a Status 504 reason Timeout. Without ``applied`` nothing
    changed; with it the change was made anyway (the handler runs on after
    the deadline), the classic "did my eviction happen?" case."""
    core = client.CoreV1Api(api)
    emulator.throttle(1, status=504, verb="patch", resource="nodes")
    with pytest.raises(ApiException) as err:
        await core.patch_node(
            GPU_NODE, {"metadata": {"labels": {"x": "1"}}}, _request_timeout=T
        )
    assert err.value.status == 504
    assert status_of(err.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Timeout: request did not complete within requested timeout - context deadline exceeded",
        "reason": "Timeout",
        "details": {},
        "code": 504,
    }
    node = emulator.get("Node", GPU_NODE, "")
    assert node is not None
    assert "x" not in node["metadata"]["labels"]

    emulator.throttle(1, status=504, resource="pods/eviction", applied=True)
    with pytest.raises(ApiException) as err:
        await core.create_namespaced_pod_eviction(
            LLM, "ai", eviction(LLM, "ai"), _request_timeout=T
        )
    assert err.value.status == 504
    assert emulator.get("Pod", LLM, "ai") is None  # evicted all the same


async def test_watches_have_no_deadline(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """staging/src/k8s.io/apiserver/pkg/server/filters/timeout.go
    WithTimeoutForNonLongRunningRequests: long-running requests (watches)
    have no deadline, so a pending 504 waits for the next request."""
    core = client.CoreV1Api(api)
    emulator.throttle(1, status=504)
    stream = await raw_watch(core.list_node, timeout_seconds=1, _request_timeout=T)
    try:
        first = json.loads(await stream.content.readline())
        assert first["type"] == "ADDED"
    finally:
        stream.release()
    with pytest.raises(ApiException) as err:
        await core.read_node(GPU_NODE, _request_timeout=T)
    assert err.value.status == 504


async def test_fail_next_with_a_retry_hint(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """responsewriters.ErrorNegotiated: a Status with
    details.retryAfterSeconds also gets the Retry-After header, e.g. the
    watch cache's 429 "storage is (re)initializing"."""
    emulator.fail_next(
        1,
        429,
        verb="list",
        resource="pods",
        message="storage is (re)initializing",
        retry_after=1,
    )
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(api).list_pod_for_all_namespaces(_request_timeout=T)
    assert err.value.status == 429
    assert header(err.value, "Retry-After") == "1"
    body = status_of(err.value)
    assert (body["reason"], body["message"], body["details"]) == (
        "TooManyRequests",
        "storage is (re)initializing",
        {"retryAfterSeconds": 1},
    )


def test_throttle_only_answers_429_or_504(emulator: K8sEmulator) -> None:
    """Other codes belong to fail_next."""
    with pytest.raises(ValueError, match="429"):
        emulator.throttle(1, status=500)
