"""The serving CA: a modern one, and a legacy one (no keyUsage, no key
identifiers) that Python's strict default context refuses."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
import ssl

from cryptography import x509
from cryptography.x509.oid import ExtensionOID
from kubernetes_asyncio import client
import pytest

from . import GPU_NODE, K8sEmulator
from .client import api_client_for
from .tls import make_tls

T = 10
# OpenSSL's X509_V_FLAG_X509_STRICT verdicts on such a chain.
STRICT_REFUSALS = {
    "Missing Authority Key Identifier",
    "Missing Subject Key Identifier",
    "CA cert does not include key usage extension",
}


async def handshake(port: int, context: ssl.SSLContext, hostname: str) -> None:
    """A TLS handshake with the emulator, checking the name ``hostname``."""
    _, writer = await asyncio.wait_for(
        asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname=hostname
        ),
        T,
    )
    writer.close()
    # The server may drop the connection first; only the handshake matters.
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        await writer.wait_closed()


def lenient(cadata: str) -> ssl.SSLContext:
    """The default context without VERIFY_X509_STRICT (as Go verifies)."""
    context = ssl.create_default_context(cadata=cadata)
    context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context


def extensions(pem: bytes) -> set[x509.ObjectIdentifier]:
    """The extension OIDs of a PEM certificate."""
    return {e.oid for e in x509.load_pem_x509_certificate(pem).extensions}


async def test_legacy_ca_is_refused_by_the_strict_default_context(
    socket_enabled: None, tmp_path: Path
) -> None:
    """tls.py make_tls(legacy_ca=True): Python 3.13+ turns on
    VERIFY_X509_STRICT in ssl.create_default_context (OpenSSL
    X509_V_FLAG_X509_STRICT), which refuses a CA without keyUsage and
    certificates without key identifiers; Go's crypto/x509, hence kubectl,
    accepts them. Without the strict flag the chain verifies, and the host
    name and the issuer are still checked."""
    emu = K8sEmulator(legacy_ca=True)
    emu.add_node(GPU_NODE)
    async with emu:
        ca = emu.ca_pem
        assert extensions(ca) == {ExtensionOID.BASIC_CONSTRAINTS}
        cadata = ca.decode()
        strict = ssl.create_default_context(cadata=cadata)
        assert strict.verify_flags & ssl.VERIFY_X509_STRICT
        with pytest.raises(ssl.SSLCertVerificationError) as err:
            await handshake(emu.port, strict, "127.0.0.1")
        assert err.value.verify_message in STRICT_REFUSALS

        await handshake(emu.port, lenient(cadata), "127.0.0.1")

        with pytest.raises(ssl.SSLCertVerificationError) as err:
            await handshake(emu.port, lenient(cadata), "kubernetes.example")
        assert "Hostname mismatch" in str(err.value.verify_message)
        stranger = make_tls(["127.0.0.1"], legacy_ca=True).ca_pem.decode()
        with pytest.raises(ssl.SSLCertVerificationError) as err:
            await handshake(emu.port, lenient(stranger), "127.0.0.1")
        # Without key identifiers the issuer is found by name only: a CA
        # made in the same second has the same name and fails the signature.
        assert err.value.verify_message in {
            "unable to get local issuer certificate",
            "certificate signature failure",
        }

        # kubernetes_asyncio builds its context with create_default_context:
        # against such a cluster it fails where kubectl works.
        api = await api_client_for(emu, tmp_path)
        try:
            with pytest.raises(Exception, match="certificate verify failed"):
                await client.CoreV1Api(api).list_node(_request_timeout=T)
        finally:
            await api.close()


async def test_default_ca_satisfies_the_strict_context(
    emulator: K8sEmulator,
) -> None:
    """The default CA has keyUsage and key identifiers, like kubeadm's and
    k3s's today: the strict default context accepts it."""
    assert ExtensionOID.KEY_USAGE in extensions(emulator.ca_pem)
    assert ExtensionOID.SUBJECT_KEY_IDENTIFIER in extensions(emulator.ca_pem)
    strict = ssl.create_default_context(cadata=emulator.ca_pem.decode())
    await handshake(emulator.port, strict, "127.0.0.1")
