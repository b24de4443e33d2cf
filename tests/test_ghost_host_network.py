"""Host networking hides a ghost.

The seed story's ghost GPU node (br_netfilter never loaded, so flannel never
wrote /run/flannel/subnet.env) could not give one pod on the pod network its
sandbox, while pods on the host network, which need no network plugin, still
started: the NVIDIA device plugin (its chart's ``enableHostNetwork``), node
exporters. A crash-looping one starts containers again and again, and the
health judgement took any container start on the node as proof that it
works: the ghost went unreported.

Stories with the whole product (Home Assistant, sshd forcing the real agent
on the tower simulator, the Kubernetes API emulator, the kubelet stand-in):

- the GPU node comes back from a handoff Ready and with its cards, but its
  pod network never comes while its node exporter crash-loops on the host
  network: the Health problem and its repair, whose events read the
  kubelet's combined sandbox failures as the failures they count;
- the ordinary reboot: the node is Ready before flannel has written its
  subnet file, so every pod on the pod network fails its sandbox for a
  while (combined events and all), then starts: never a problem.

And the repair's reading of combined events, on the emulator's data.

The rigs are pinned to upstream in tests/k8semu/test_pod_network.py
(containerd RunPodSandbox, the kubelet's SyncPod, flannel's CNI plugin,
client-go's events_cache.go); the node exporter is on the host network as
prometheus-community/helm-charts' prometheus-node-exporter chart puts it
(``hostNetwork: true`` by default).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
from typing import Any
from zoneinfo import ZoneInfo

from homeassistant.core import Event, EventStateChangedData, HomeAssistant, callback
from homeassistant.helpers import issue_registry as ir
from homeassistant.helpers.event import async_track_state_change_event
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff import health
from custom_components.gpu_handoff.cluster_client import ClusterClient
from custom_components.gpu_handoff.const import DOMAIN, EVENT_CARDS_RETURNED
from custom_components.gpu_handoff.health import CONTAINERS_NOT_STARTING, judge
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.k8semu.recorder import COMBINED_PREFIX
from tests.support.kubelet import SANDBOX_FAILURE, Kubelet
from tests.support.stories import SWITCH_1, play, setup_entry, switch, until
from tests.test_health import tower
from tests.towersim import Tower

HEALTH = "binary_sensor.gpu_node_health"
STUCK = 3.0  # the bound, a hundred times shorter
BURST_STUCK = 4.0  # the same, with room for a burst of half of it
BOUND = 30.0  # seconds any single wait may take on a loaded machine
MIRROR = f"gpu-exporter-{GPU_NODE}"  # on the pod network
EXPORTER = "node-exporter-7qk4d"  # on the host network
FLANNEL_CAUSE = (
    "failed to load flannel 'subnet.env' file: open /run/flannel/subnet.env: "
    "no such file or directory. Check the flannel pod log for this node."
)


def _issue(hass: HomeAssistant, entry: MockConfigEntry) -> ir.IssueEntry | None:
    return ir.async_get(hass).async_get_issue(DOMAIN, f"node_health_{entry.entry_id}")


async def _refresh(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()


async def _judged(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    """Refresh until one refresh read the cluster and judged the GPU node
    (on a loaded machine a read may time out; a job may still be ending)."""
    coordinator = entry.runtime_data.coordinator
    async with asyncio.timeout(BOUND):
        while True:
            await _refresh(hass, entry)
            data = coordinator.data
            if (
                coordinator.last_update_success
                and data.node is not None
                and health.watched(data.tower, data.node)
            ):
                return
            await asyncio.sleep(0.1)


def _health(hass: HomeAssistant) -> tuple[str, str, list[str]]:
    state = hass.states.get(HEALTH)
    assert state is not None
    return (
        state.state,
        state.attributes["reason"],
        state.attributes["pods_not_starting"],
    )


def _time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


def _node_exporter(cluster: K8sEmulator) -> dict[str, Any]:
    """The node exporter's DaemonSet pod on the GPU node, on the host
    network."""
    labels = {"app.kubernetes.io/name": "prometheus-node-exporter"}
    image = "quay.io/prometheus/node-exporter:v1.9.1"
    exporter = cluster.add_daemonset(
        "prometheus-node-exporter", "monitoring", labels=labels, image=image
    )
    return cluster.add_pod(
        EXPORTER,
        "monitoring",
        node=GPU_NODE,
        labels=labels,
        owner=cluster.owner_ref(exporter),
        image=image,
        container_name="node-exporter",
        host_network=True,
    )


def _waited(cluster: K8sEmulator, name: str, namespace: str) -> float:
    """Seconds the pod has waited for its sandbox as the judgement counts it
    (since its condition turned False, or since the node turned Ready if
    later); 0 while it has its sandbox."""
    pod = cluster.get("Pod", name, namespace)
    sandbox = next(
        c
        for c in pod["status"]["conditions"]
        if c["type"] == "PodReadyToStartContainers"
    )
    if sandbox["status"] == "True":
        return 0.0
    node = cluster.get("Node", GPU_NODE, "")
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    since = max(
        _time(sandbox["lastTransitionTime"]), _time(ready["lastTransitionTime"])
    )
    return (dt.datetime.now(dt.UTC) - since).total_seconds()


def _last_start(cluster: K8sEmulator, name: str, namespace: str) -> dt.datetime:
    """The latest startedAt of the pod's containers, running or exited."""
    [container] = cluster.get("Pod", name, namespace)["status"]["containerStatuses"]
    starts = [
        phase["startedAt"]
        for state in (container["state"], container.get("lastState") or {})
        for key, phase in state.items()
        if key in ("running", "terminated") and "startedAt" in phase
    ]
    return max(_time(start) for start in starts)


def _failures(cluster: K8sEmulator, name: str) -> list[dict[str, Any]]:
    """The kubelet's FailedCreatePodSandBox Events about the pod."""
    return [
        event
        for event in cluster.list_objects("Event")
        if event["involvedObject"]["name"] == name
        and event["reason"] == "FailedCreatePodSandBox"
    ]


async def _return_from_a_handoff(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, cluster: K8sEmulator
) -> None:
    """Hand the cards to Gaming station 1 and back: the GPU node is drained,
    shut down, started again; done once the cards are back with the cluster
    (its node Ready, its GPUs advertised, uncordoned)."""
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    await until(lambda: not cluster.node_is_up(GPU_NODE))
    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(returned))


async def test_a_ghost_with_a_crash_looping_host_network_pod_is_reported(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    kubelet: Kubelet,
    no_pdb: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU node comes back Ready with its cards (its device plugin is on
    the host network), but flannel never writes its subnet file: the GPU
    exporter, on the pod network, waits for its sandbox past the bound while
    the node exporter, on the host network, crash-loops (it starts again
    every fraction of the bound). Its starts prove nothing about the pod
    network: the Health problem names the exporter that waits, and the
    repair shows the kubelet's sandbox failures as one line, every failure
    counted (nine Events and the combined one) and flannel's cause whole."""
    monkeypatch.setattr(health, "STUCK_BOUND", STUCK)
    _node_exporter(cluster)
    kubelet.crash_loop(EXPORTER, "monitoring", runs_for=0.2, backoff=(0.1, 0.4))
    kubelet.network_delay = None  # from the next boot on, no pod network
    await _return_from_a_handoff(hass, entry, sim, cluster)

    def a_ghost_with_a_live_exporter() -> bool:
        fresh = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=STUCK - 1)
        return (
            _waited(cluster, MIRROR, "kube-system") > STUCK + 1
            and any(
                e["message"].startswith(COMBINED_PREFIX)
                for e in _failures(cluster, MIRROR)
            )
            and _last_start(cluster, EXPORTER, "monitoring") >= fresh
        )

    await until(a_ghost_with_a_live_exporter)
    exporter = cluster.get("Pod", EXPORTER, "monitoring")
    assert exporter["status"]["containerStatuses"][0]["restartCount"] >= 3
    assert cluster.node_ready_status(GPU_NODE) == "True"
    await _judged(hass, entry)

    assert _health(hass) == (
        "on",
        CONTAINERS_NOT_STARTING,
        [f"kube-system/{MIRROR}"],
    )
    issue = _issue(hass, entry)
    assert issue is not None
    assert issue.translation_key == "node_containers_not_starting"
    [line] = (issue.translation_placeholders or {})["events"].splitlines()
    shown = re.match(
        rf"- `kube-system/{MIRROR}` FailedCreatePodSandBox \((\d+)\) ", line
    )
    assert shown is not None, line
    # Every failure counted: the nine Events and the combined one, as many
    # as the recorder had written when the refresh read them.
    counted = sum(int(e["count"]) for e in _failures(cluster, MIRROR))
    assert 10 <= int(shown[1]) <= counted
    assert COMBINED_PREFIX.strip() not in line
    assert line.endswith(FLANNEL_CAUSE)
    assert "Failed to create pod sandbox: rpc error" in line


async def test_the_burst_after_a_reboot_never_raises_the_problem(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    kubelet: Kubelet,
    no_pdb: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reboot: the node is Ready before flannel has written its subnet
    file, so every pod on the pod network fails its sandbox until it has.
    Here that takes half the bound, with a try every 0.1 s (a real node
    fails two or three times in its first 20 s; this burst is long enough
    for combined events), refreshed as the poll would, only faster, until
    the bound has passed twice over since the node turned Ready: the Health
    sensor never turns on, no repair is raised, and the pods run."""
    monkeypatch.setattr(health, "STUCK_BOUND", BURST_STUCK)
    kubelet.network_delay = BURST_STUCK / 2
    turned_on: list[str] = []
    issues: list[str] = []

    @callback
    def follow(event: Event[EventStateChangedData]) -> None:
        new = event.data["new_state"]
        if new is not None and new.state == "on":
            turned_on.append(new.attributes["reason"])

    @callback
    def issue_seen(event: Event[ir.EventIssueRegistryUpdatedData]) -> None:
        if event.data["issue_id"].startswith("node_health"):
            issues.append(event.data["action"])

    hass.bus.async_listen(ir.EVENT_REPAIRS_ISSUE_REGISTRY_UPDATED, issue_seen)
    unsubscribe = async_track_state_change_event(hass, HEALTH, follow)
    await _return_from_a_handoff(hass, entry, sim, cluster)
    posted = time.monotonic()  # the boot's first post came before the return

    def settled() -> bool:
        return (
            time.monotonic() - posted > 2 * BURST_STUCK
            and _waited(cluster, MIRROR, "kube-system") == 0.0
        )

    async with asyncio.timeout(BOUND):
        while not settled():
            await _refresh(hass, entry)
            await asyncio.sleep(0.1)
    unsubscribe()

    tries = sum(int(e["count"]) for e in _failures(cluster, MIRROR))
    assert tries >= 10
    assert any(
        e["message"].startswith(COMBINED_PREFIX) for e in _failures(cluster, MIRROR)
    )
    assert cluster.get("Pod", MIRROR, "kube-system")["status"]["phase"] == "Running"
    assert turned_on == []
    assert issues == []
    assert _health(hass) == ("off", "none", [])


# --- the repair's words, on the emulator's data -----------------------------------------


async def test_the_repair_reads_combined_events_as_the_failures_they_count(
    cluster_client: ClusterClient, cluster: K8sEmulator
) -> None:
    """Twelve sandbox failures of one pod, as the kubelet's recorder writes
    them: nine Events and one combined Event counting three. Judged ten
    minutes later, the repair shows one line for the pod and its reason:
    twelve failures, the latest message without the recorder's prefix, its
    64-hex sandbox id shortened as crictl shows it, so that flannel's cause
    fits whole."""
    pod = cluster.add_pod(
        "llm-stuck",
        "ai",
        node=GPU_NODE,
        phase="Pending",
        waiting_reason="ContainerCreating",
    )
    sandboxes = [f"{i:02x}" * 32 for i in range(12)]
    for sandbox in sandboxes:
        cluster.record_event(
            pod,
            reason="FailedCreatePodSandBox",
            message=SANDBOX_FAILURE.format(sandbox=sandbox),
            host=GPU_NODE,
        )
    reading = await cluster_client.node_reading(GPU_NODE)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10)
    verdict = judge(reading, tower(cards=reading.view.gpu_allocatable), later)
    [stuck] = [p for p in verdict.stuck_pods if p.name == "llm-stuck"]
    [event] = stuck.events
    assert event.count == 12
    assert event.combined
    words = health.issue_placeholders(verdict, GPU_NODE, ZoneInfo("UTC"))
    [line] = [line for line in words["events"].splitlines() if "`ai/llm-stuck`" in line]
    assert line.endswith(
        ": Failed to create pod sandbox: rpc error: code = Unknown desc = failed "
        f'to setup network for sandbox "{sandboxes[-1][:13]}": plugin '
        f'type="flannel" failed (add): {FLANNEL_CAUSE}'
    )
    assert " FailedCreatePodSandBox (12) " in line
