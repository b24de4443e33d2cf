"""The emulator's own tests use the shared fixtures under short names."""

from __future__ import annotations

from kubernetes_asyncio import client
import pytest

from .emulator import K8sEmulator
from .fixtures import (  # noqa: F401 - fixtures
    k8s_admin_api_fixture,
    k8s_api_fixture,
    k8s_emulator_fixture,
)


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
