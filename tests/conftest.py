"""Fixtures shared by the Home Assistant tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator, Iterator
import os
from pathlib import Path
import shutil
from typing import Any

from homeassistant.config_entries import ConfigSubentryData
from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.core import HomeAssistant
from kubernetes_asyncio.client import CoreV1Api
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry
import yaml

from custom_components.gpu_handoff.cluster_client import ClusterClient
from custom_components.gpu_handoff.const import (
    CONF_AUTO_RETURN,
    CONF_DOMAIN_NAME,
    CONF_DRAIN_TIMEOUT,
    CONF_GPU_NODE,
    CONF_HOST_KEY,
    CONF_K8S_NODE,
    CONF_KUBECONFIG,
    CONF_PASSPHRASE,
    CONF_PRIVATE_KEY,
    CONF_SCAN_INTERVAL,
    DOMAIN,
    SUBENTRY_GAMING_VM,
)
from tests.k8semu import K8sEmulator
from tests.k8semu.client import api_client_for
from tests.support.kubelet import FAST, Kubelet
from tests.support.simtower import write_agent_config
from tests.support.sshd import Sshd, sshd_available
from tests.support.testdriver import agent_command, write_tower
from tests.towersim import Tower, realistic_tower

pytest_plugins = ["tests.k8semu.fixtures"]


@pytest.fixture(autouse=True)
def auto_enable_custom_integrations(
    enable_custom_integrations: None,
) -> Generator[None]:
    """Let Home Assistant load the integration from custom_components/."""
    return


@pytest.fixture
def entry_data() -> dict[str, Any]:
    """Data of a config entry for a tower."""
    return {CONF_HOST: "127.0.0.1", CONF_PORT: 2222, CONF_USERNAME: "hass"}


@pytest.fixture
def mock_config_entry(entry_data: dict[str, Any]) -> MockConfigEntry:
    """A config entry for a tower."""
    return MockConfigEntry(
        domain=DOMAIN,
        title="127.0.0.1",
        unique_id="127.0.0.1:2222",
        data=entry_data,
    )


@pytest.fixture
def tower_dir(tmp_path: Path) -> Path:
    """Where the tower's files (test-driver node, agent config, sshd) live."""
    return tmp_path / "tower"


@pytest.fixture
def tower(tower_dir: Path, socket_enabled: None) -> Iterator[Sshd]:
    """A real sshd on 127.0.0.1 forcing the real agent, on a test-driver tower."""
    if not (sshd_available() and shutil.which("virsh")):
        if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM"):
            pytest.fail("sshd and virsh are required here")
        pytest.skip("needs OpenSSH's sshd and libvirt's virsh")
    tower_dir.mkdir(parents=True, exist_ok=True)
    server = Sshd(tower_dir / "sshd", agent_command(write_tower(tower_dir))).start()
    yield server
    server.stop()


def gaming_subentries(*numbers: int) -> list[ConfigSubentryData]:
    """Subentries for gaming-N ("Gaming station N")."""
    return [
        ConfigSubentryData(
            data={CONF_DOMAIN_NAME: f"gaming-{n}"},
            subentry_type=SUBENTRY_GAMING_VM,
            title=f"Gaming station {n}",
            unique_id=f"gaming-{n}",
        )
        for n in numbers
    ]


def tower_entry_data(server: Sshd) -> dict[str, Any]:
    """Config entry data that logs in to ``server`` with its client key."""
    return {
        CONF_HOST: "127.0.0.1",
        CONF_PORT: server.port,
        CONF_USERNAME: server.user,
        CONF_PRIVATE_KEY: server.client_key.read_text(encoding="utf-8"),
        CONF_PASSPHRASE: None,
        CONF_HOST_KEY: server.host_public_key,
        CONF_GPU_NODE: "gpu-node",
        CONF_KUBECONFIG: "",
        CONF_K8S_NODE: "gpu-node",
    }


@pytest.fixture
def cluster(k8s_emulator: K8sEmulator) -> K8sEmulator:
    """The Kubernetes API emulator over real HTTPS, seeded with the demo cluster.

    Its default token carries only the verbs the product's ClusterRole grants.
    """
    return k8s_emulator


def kubeconfig_text(emulator: K8sEmulator, token: str | None = None) -> str:
    """The emulator's kubeconfig as a user would paste it."""
    return yaml.safe_dump(emulator.kubeconfig(token), sort_keys=False)


@pytest.fixture
async def operator(cluster: K8sEmulator, tmp_path: Path) -> AsyncIterator[CoreV1Api]:
    """What ``kubectl get events`` reads with: core/v1, an admin's token."""
    # (Imported here: the module is a plugin, registered before it is read.)
    from tests.k8semu.fixtures import ADMIN_TOKEN

    api = await api_client_for(cluster, tmp_path, ADMIN_TOKEN)
    yield CoreV1Api(api)
    await api.close()


@pytest.fixture
async def cluster_client(cluster: K8sEmulator) -> AsyncIterator[ClusterClient]:
    """The product's cluster client, with the product's token."""
    api = await ClusterClient.create(kubeconfig_text(cluster))
    yield api
    await api.close()


def add_tower_entry(
    hass: HomeAssistant,
    server: Sshd,
    cluster: K8sEmulator,
    vms: tuple[int, ...] = (1, 2),
    drain_timeout: int = 300,
) -> MockConfigEntry:
    """Add a set-up-ready entry for the tower behind ``server`` and ``cluster``,
    with Gaming station N for each N in ``vms``."""
    entry = MockConfigEntry(
        domain=DOMAIN,
        title="tower",
        unique_id=f"127.0.0.1:{server.port}",
        data=tower_entry_data(server) | {CONF_KUBECONFIG: kubeconfig_text(cluster)},
        options={
            CONF_SCAN_INTERVAL: 30,
            CONF_DRAIN_TIMEOUT: drain_timeout,
            CONF_AUTO_RETURN: True,
        },
        subentries_data=gaming_subentries(*vms),
    )
    entry.add_to_hass(hass)
    return entry


# --- the end-to-end stories' tower and cluster --------------------------------


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Tower]:
    """The realistic simulated tower, guests 100x faster than real ones."""
    tower = realistic_tower(tmp_path / "sim", time_scale=0.01)
    yield tower
    assert tower.destroy_attempts() == []
    tower.close()


@pytest.fixture
def agent_config(sim: Tower, tmp_path: Path) -> Path:
    """The agent's configuration: short guest-agent wait for the failure tests."""
    return write_agent_config(sim, tmp_path / "agent", agent=3.0)


@pytest.fixture
def sim_sshd(
    agent_config: Path, tmp_path: Path, socket_enabled: None
) -> Iterator[Sshd]:
    """sshd forcing the real agent on the simulated tower."""
    server = Sshd(tmp_path / "sshd", agent_command(agent_config)).start()
    yield server
    server.stop()


@pytest.fixture
async def kubelet(sim: Tower, cluster: K8sEmulator) -> AsyncIterator[Kubelet]:
    """The gpu-node's kubelet, following the simulated VM as a real k3s
    node's does, a hundred times faster: silent when the VM stops (the node
    stays Ready until the emulator's grace period of 0.5 s, then Unknown),
    Ready with a new bootID and 0 GPUs 0.1 s after each boot, the cards the
    VM runs with 0.2 s after that (tests/support/kubelet.py)."""
    stand_in = Kubelet(sim, cluster, **FAST)
    stand_in.start()
    yield stand_in
    await stand_in.stop()


@pytest.fixture
def no_pdb(cluster: K8sEmulator) -> None:
    """Let the trainer pod be evicted (its PDB otherwise refuses forever)."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")


@pytest.fixture
def entry(
    hass: HomeAssistant, sim_sshd: Sshd, cluster: K8sEmulator, kubelet: None
) -> MockConfigEntry:
    """A tower with both gaming VMs; a short drain timeout (a budget that
    refuses fails the handoff in seconds), with room for a loaded machine's
    kubelet stand-in to finish the pods it evicts."""
    return add_tower_entry(hass, sim_sshd, cluster, vms=(1, 2), drain_timeout=5)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``early`` (half a minute or more each) first, the
    others in their order. pytest-xdist deals the tests out in order and an
    idle worker takes from the end of another's: a long test dealt late
    would end the run alone, the other workers idle."""
    items.sort(key=lambda item: item.get_closest_marker("early") is None)


# Seconds spent per part of the suite (setup, call and teardown of every
# test), printed at the end: where the suite's time goes. And the CPU it
# used: on the machines the suite is made for, CPU is what bounds it.
PART_SECONDS: dict[str, float] = {}
PART_CPU: dict[str, float] = {}
TEST_CPU: dict[str, float] = {}
_CPU_AT_SETUP: dict[str, float] = {}


def _cpu_seconds() -> float:
    """This process's CPU (every thread), and its children's once reaped:
    sshd, and what it ran, when a test's fixture stops it; the simulated
    virsh and the agent's runs, when their parent waits for them."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None]:
    """Note the CPU used before the test's setup (in the worker that runs it)."""
    _CPU_AT_SETUP[item.nodeid] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None]:
    """The teardown's report carries the test's CPU to the process that
    reports (pytest-xdist sends a report's user_properties along)."""
    if call.when == "teardown" and item.nodeid in _CPU_AT_SETUP:
        used = _cpu_seconds() - _CPU_AT_SETUP.pop(item.nodeid)
        item.user_properties.append(("cpu_seconds", used))
    yield


def pytest_runtest_logreport(report: Any) -> None:
    """Add a test phase's duration (and a test's CPU) to its part: a
    directory under tests/, or the file for a test at the top of tests/."""
    parts = report.nodeid.split("::", 1)[0].split("/")
    part = "/".join(parts[:2])
    PART_SECONDS[part] = PART_SECONDS.get(part, 0.0) + float(report.duration)
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "cpu_seconds":
                PART_CPU[part] = PART_CPU.get(part, 0.0) + float(value)
                TEST_CPU[report.nodeid] = float(value)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where the time went, by part; how long the tower boxes took to boot
    (tests/support/box.py)."""
    if PART_SECONDS:
        total = sum(PART_SECONDS.values())
        cpu = sum(PART_CPU.values())
        terminalreporter.write_line(
            f"time by part (setup + call + teardown, {total:.0f} s in all; "
            f"CPU, {cpu:.0f} s in all, of the tests' processes and of the "
            "children they waited for):"
        )
        ranked = sorted(PART_SECONDS.items(), key=lambda item: -item[1])
        for part, seconds in ranked[:20]:
            used = PART_CPU.get(part, 0.0)
            terminalreporter.write_line(
                f"  {seconds:8.1f} s  {100 * seconds / total:5.1f} %"
                f"  CPU {used:7.1f} s  {100 * used / max(cpu, 1e-9):5.1f} %  {part}"
            )
    if TEST_CPU:
        terminalreporter.write_line("the tests that used the most CPU:")
        for nodeid, used in sorted(TEST_CPU.items(), key=lambda item: -item[1])[:15]:
            terminalreporter.write_line(f"  {used:7.1f} s  {nodeid}")
    from tests.support.box import BOOT_SECONDS

    if BOOT_SECONDS:
        ordered = sorted(BOOT_SECONDS)
        terminalreporter.write_line(
            f"tower box: {len(ordered)} boots of systemd as PID 1, "
            f"median {ordered[len(ordered) // 2]:.2f} s, longest {ordered[-1]:.2f} s"
        )
