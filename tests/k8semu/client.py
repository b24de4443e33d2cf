"""Build a real kubernetes_asyncio client for an emulator (never touching the
process-wide default configuration)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
import json
from pathlib import Path
from typing import Any, cast

from aiohttp import ClientResponse
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from .emulator import K8sEmulator


async def api_client_for(
    emu: K8sEmulator, temp_dir: Path, token: str | None = None
) -> client.ApiClient:
    """An ApiClient configured from ``emu.kubeconfig(token)``; close it after use."""
    conf = client.Configuration()
    await config.load_kube_config_from_dict(
        emu.kubeconfig(token),
        client_configuration=conf,
        temp_file_path=str(temp_dir),
    )
    return client.ApiClient(configuration=conf)


async def raw_request(
    api: client.ApiClient,
    method: str,
    path: str,
    *,
    body: object = None,
    content_type: str = "application/json",
    timeout: float = 10,
) -> object:
    """A request for a path the generated API has no method for (JSON back)."""
    return await api.call_api(
        path,
        method,
        header_params={"Content-Type": content_type, "Accept": "application/json"},
        body=body,
        response_types_map={200: "object", 201: "object"},
        auth_settings=["BearerToken"],
        _return_http_data_only=True,
        _request_timeout=timeout,
    )


def status_of(err: ApiException) -> dict[str, Any]:
    """The Status object of a failed call."""
    body: dict[str, Any] = json.loads(err.body or b"{}")
    return body


async def raw_watch(
    list_call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
) -> ClientResponse:
    """Start a watch through a generated list method and get the raw stream
    (read it with ``.content.readline()``, then ``.release()``)."""
    response = await list_call(*args, watch=True, _preload_content=False, **kwargs)
    return cast(ClientResponse, response)


def unset(value: object) -> bool:
    """Whether a model field was absent from the JSON (the stubs type many
    optional fields as always present)."""
    return value is None
