"""TLS credentials and API-key metadata for talking to a secured server."""

from __future__ import annotations

from pathlib import Path

import grpc


def api_key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The `authorization: Bearer <key>` metadata the server's --api-key-file asks for."""
    if api_key is None:
        return ()
    if not api_key.strip() or any(c in api_key for c in "\r\n"):
        raise ValueError("api_key must be a non-empty single line")
    return (("authorization", f"Bearer {api_key.strip()}"),)


def tls_credentials(
    ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
) -> grpc.ChannelCredentials:
    """Channel credentials from PEM files: `ca` to trust (None: the system's roots); `cert` and
    `key` for a server that requires client certificates (mutual TLS)."""
    if (cert is None) != (key is None):
        raise ValueError("cert and key go together (both for mutual TLS, or neither)")

    def read(path: str | Path | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert)
    )
