"""Pytest fixtures for any test that needs a cluster.

Import them into a conftest.py::

    from tests.k8semu.fixtures import (  # noqa: F401
        device_plugin_fixture,
        k8s_admin_api_fixture,
        k8s_api_fixture,
        k8s_emulator_fixture,
    )

(or ``pytest_plugins = ["tests.k8semu.fixtures"]`` in the top conftest.py).

``k8s_emulator`` is the demo cluster over HTTPS on 127.0.0.1 (it requests
``socket_enabled``); ``k8s_api`` is a kubernetes_asyncio ApiClient with the
product's token (PRODUCT_RULES only); ``k8s_admin_api`` may do everything.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path

from kubernetes_asyncio import client
import pytest

from .auth import ALL_RULES
from .client import api_client_for
from .emulator import K8sEmulator
from .objects import PLAIN, DevicePlugin
from .seed import seed_demo

ADMIN_TOKEN = "admin-test-token"  # noqa: S105 - a test credential


@pytest.fixture(name="device_plugin")
def device_plugin_fixture() -> DevicePlugin:
    """How the demo cluster's GPU node advertises its cards: one
    ``nvidia.com/gpu`` each (a test parametrizes ``device_plugin`` for
    another form)."""
    return PLAIN


@pytest.fixture(name="k8s_emulator")
async def k8s_emulator_fixture(
    socket_enabled: None, device_plugin: DevicePlugin
) -> AsyncGenerator[K8sEmulator]:
    """The demo cluster; leases renewed every 0.05 s, a silent node marked
    Unknown 0.5 s after its last heartbeat (the node monitor looks every
    0.05 s), the pods of an unreachable node deleted 3 s after its taint: a
    real cluster's 10 s, 50 s, 5 s and 300 s, a hundred times faster."""
    emu = K8sEmulator(
        lease_interval=0.05,
        node_monitor_grace_period=0.5,
        node_monitor_period=0.05,
        toleration_scale=0.01,
    )
    emu.add_token(ADMIN_TOKEN, ALL_RULES, user="kubernetes-admin")
    seed_demo(emu, device_plugin)
    await emu.start()
    yield emu
    await emu.stop()


@pytest.fixture(name="k8s_api")
async def k8s_api_fixture(
    k8s_emulator: K8sEmulator, tmp_path: Path
) -> AsyncGenerator[client.ApiClient]:
    """A client with the product's token."""
    api_client = await api_client_for(k8s_emulator, tmp_path)
    yield api_client
    await api_client.close()


@pytest.fixture(name="k8s_admin_api")
async def k8s_admin_api_fixture(
    k8s_emulator: K8sEmulator, tmp_path: Path
) -> AsyncGenerator[client.ApiClient]:
    """A client that may do everything."""
    api_client = await api_client_for(k8s_emulator, tmp_path, ADMIN_TOKEN)
    yield api_client
    await api_client.close()
