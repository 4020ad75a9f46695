"""Who may talk to the scheduler's gRPC port: TLS (optionally mutual) and API keys.

- `--tls-cert/--tls-key`: the server's certificate chain and key (PEM); the port speaks TLS.
- `--tls-client-ca`: also require a client certificate signed by this CA (mutual TLS).
- `--api-key-file`: one key per line (blank lines and `#` comments ignored). Every call but the
  health service must carry `authorization: Bearer <key>`, else UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # probes need no key


class SecurityConfigError(ValueError):
    """A TLS or API-key setting is unusable; the message names the flag."""


def load_api_keys(path: str) -> list[bytes]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise SecurityConfigError(f"--api-key-file={path!r} cannot be read: {err.strerror}") from err
    keys = [line.strip().encode() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise SecurityConfigError(f"--api-key-file={path!r} holds no key (one per line)")
    return keys


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials | None:
    if not (cert or key or client_ca):
        return None
    if not (cert and key):
        raise SecurityConfigError("--tls-cert and --tls-key go together (and --tls-client-ca needs both)")

    def read(flag: str, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as err:
            raise SecurityConfigError(f"{flag}={path!r} cannot be read: {err.strerror}") from err

    return grpc.ssl_server_credentials(
        [(read("--tls-key", key), read("--tls-cert", cert))],
        root_certificates=read("--tls-client-ca", client_ca) if client_ca else None,
        require_client_auth=bool(client_ca),
    )


def check_files(api_key_file: str, cert: str, key: str, client_ca: str) -> None:
    """Read the API-key and TLS files as the scheduler will; SecurityConfigError names a bad one.
    `duoserve serve` calls it before it starts any process, not after the workers have loaded."""
    if api_key_file:
        load_api_keys(api_key_file)
    server_credentials(cert, key, client_ca)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a known `authorization: Bearer <key>` (health stays open)."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self._keys = list(keys)

    def _authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for name, value in metadata or ():
            if name.lower() == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, token = text.partition(" ")
                if scheme.lower() != "bearer":
                    return False
                presented = token.strip().encode()
                # Compare against every key, always, so timing says nothing about which matched.
                return any([hmac.compare_digest(presented, key) for key in self._keys])
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method  # type: ignore[attr-defined]
        if method.startswith(OPEN_SERVICES) or self._authorized(handler_call_details.invocation_metadata):  # type: ignore[attr-defined]
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _refusing(handler)


_REFUSAL = "missing or unknown API key: send the metadata 'authorization: Bearer <key>'"


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
        yield  # pragma: no cover (makes this an async generator)

    deserializer = getattr(handler, "request_deserializer", None)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, request_deserializer=deserializer)
    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=deserializer)
