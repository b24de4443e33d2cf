"""``python -m tests.k8semu`` as a process: kubeconfig, answers, SIGTERM."""

from __future__ import annotations

import asyncio
from pathlib import Path
import signal
import sys

from kubernetes_asyncio import client, config
import yaml

from . import CONTROL_PLANE_NODE, GPU_NODE

REPO = Path(__file__).resolve().parents[2]
T = 10


async def test_standalone_process(socket_enabled: None, tmp_path: Path) -> None:
    """Starts seeded, writes a working kubeconfig, refuses a PDB-guarded eviction, stops on SIGTERM."""
    kubeconfig = tmp_path / "kubeconfig"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.k8semu",
        "--port",
        "0",
        "--seed",
        "demo",
        "--kubeconfig",
        str(kubeconfig),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()  # type: ignore[union-attr]
        assert line.startswith("k8semu ready https://127.0.0.1:"), line
        _, _, url, path = line.split()
        assert Path(path) == kubeconfig
        data = yaml.safe_load(kubeconfig.read_text())
        assert data["clusters"][0]["cluster"]["server"] == url
        assert data["clusters"][0]["cluster"]["certificate-authority-data"]
        assert oct(kubeconfig.stat().st_mode & 0o777) == "0o600"

        conf = client.Configuration()
        await config.load_kube_config(
            str(kubeconfig), client_configuration=conf, temp_file_path=str(tmp_path)
        )
        async with client.ApiClient(conf) as api:
            core = client.CoreV1Api(api)
            nodes = await core.list_node(_request_timeout=T)
            assert [n.metadata.name for n in nodes.items] == [
                CONTROL_PLANE_NODE,
                GPU_NODE,
            ]
            pods = await core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={GPU_NODE}", _request_timeout=T
            )
            assert len(pods.items) == 4
            try:
                await core.create_namespaced_pod_eviction(
                    "trainer-7c6d5e4f3-m2n9v",
                    "ai",
                    client.V1Eviction(
                        metadata=client.V1ObjectMeta(
                            name="trainer-7c6d5e4f3-m2n9v", namespace="ai"
                        )
                    ),
                    _request_timeout=T,
                )
            except client.ApiException as err:
                status = err.status
            else:
                status = 201
            assert status == 429
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            out, err_out = await proc.communicate()
    assert proc.returncode == 0, err_out.decode()
    assert out.decode().strip() == "k8semu stopped"
