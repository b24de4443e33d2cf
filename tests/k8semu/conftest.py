"""The emulator's own tests use the shared fixtures under short names."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from kubernetes_asyncio import client
import pytest

from tests.support.kubelet import FAST, Kubelet
from tests.towersim import Tower

from .emulator import K8sEmulator
from .fixtures import (  # noqa: F401 - fixtures
    device_plugin_fixture,
    k8s_admin_api_fixture,
    k8s_api_fixture,
    k8s_emulator_fixture,
)
from .nodelog import NodeLog


@pytest.fixture
def emulator(k8s_emulator: K8sEmulator) -> K8sEmulator:
    """The demo cluster."""
    return k8s_emulator


@pytest.fixture
def api(k8s_api: client.ApiClient) -> client.ApiClient:
    """A client with the product's token."""
    return k8s_api


@pytest.fixture
def admin_api(k8s_admin_api: client.ApiClient) -> client.ApiClient:
    """A client that may do everything."""
    return k8s_admin_api


@pytest.fixture
def log(emulator: K8sEmulator) -> Iterator[NodeLog]:
    """The GPU node's changes from now on."""
    node_log = NodeLog(emulator)
    yield node_log
    node_log.close()


@pytest.fixture
async def kubelet(sim: Tower, emulator: K8sEmulator) -> AsyncIterator[Kubelet]:
    """The gpu-node VM's kubelet at the tests' pace."""
    stand_in = Kubelet(sim, emulator, **FAST)
    stand_in.start()
    yield stand_in
    await stand_in.stop()
