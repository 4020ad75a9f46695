"""CURVE security for the scheduler ↔ worker ZeroMQ link when it crosses a network.

`duoserve keys DIR` writes a key pair for the scheduler and one for a worker (ZeroMQ's
certificate files) and an `authorized/` directory holding the public keys of the workers the
scheduler accepts. The scheduler then binds with --zmq-curve-secret (its secret file) and
--zmq-curve-authorized (that directory); a worker connects with --zmq-curve-secret (its own)
and --zmq-curve-server-key (the scheduler's public file). A worker presenting no key, or one
not in `authorized/`, is refused by ZeroMQ's authentication handler: it never gets a Configure.

ipc:// sockets (owner-only file permissions) and tcp:// on loopback need no keys; a tcp://
address any other host could reach is refused without them.
"""

from __future__ import annotations

import ipaddress
import shutil
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth

SCHEDULER_NAME = "scheduler"
WORKER_NAME = "worker"
AUTHORIZED_DIR = "authorized"


class CurveConfigError(ValueError):
    """Keys are missing, unreadable or required; the message names the flag."""


def generate(directory: str) -> list[Path]:
    """Write scheduler and worker key pairs and authorize the worker's public key."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (SCHEDULER_NAME, WORKER_NAME):
        public, secret = zmq.auth.create_certificates(str(root), name)
        written += [Path(public), Path(secret)]
    authorized = root / AUTHORIZED_DIR
    authorized.mkdir(exist_ok=True)
    shutil.copy(root / f"{WORKER_NAME}.key", authorized / f"{WORKER_NAME}.key")
    for path in root.glob("*.key_secret"):
        path.chmod(0o600)
    return [*written, authorized / f"{WORKER_NAME}.key"]


def faces_network(address: str) -> bool:
    """True for a tcp:// address other hosts could reach (anything but loopback)."""
    if not address.startswith("tcp://"):
        return False
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a host name: assume other hosts resolve it too


def _load(flag: str, path: str, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, private = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise CurveConfigError(f"{flag}={path!r} is not a readable ZeroMQ certificate: {err}") from err
    if secret and private is None:
        raise CurveConfigError(f"{flag}={path!r} holds no secret key (use the .key_secret file)")
    return public, private


def check_required(flag: str, address: str, given: bool) -> None:
    if faces_network(address) and not given:
        raise CurveConfigError(
            f"{flag}={address} can be reached from other hosts: give CURVE keys "
            "(--zmq-curve-secret and, on the scheduler, --zmq-curve-authorized; on a worker, "
            "--zmq-curve-server-key); `duoserve keys DIR` creates them"
        )


def secure_server(socket: zmq.Socket, context: zmq.Context, secret_file: str, authorized_dir: str) -> object:
    """Make `socket` (not yet bound) a CURVE server accepting only the authorized keys; returns
    the authenticator, which must live as long as the socket."""
    public, private = _load("--zmq-curve-secret", secret_file, secret=True)
    if not Path(authorized_dir).is_dir():
        raise CurveConfigError(f"--zmq-curve-authorized={authorized_dir!r} is not a directory of public keys")
    from zmq.auth.asyncio import AsyncioAuthenticator
    from zmq.auth.thread import ThreadAuthenticator

    authenticator = (
        AsyncioAuthenticator(context)
        if isinstance(context, zmq.asyncio.Context)
        else ThreadAuthenticator(context)
    )
    authenticator.start()
    authenticator.configure_curve(domain="*", location=authorized_dir)
    socket.curve_secretkey = private
    socket.curve_publickey = public
    socket.curve_server = True
    return authenticator


def secure_client(socket: zmq.Socket, secret_file: str, server_key_file: str) -> None:
    """Make `socket` (not yet connected) a CURVE client of the scheduler."""
    public, private = _load("--zmq-curve-secret", secret_file, secret=True)
    server_public, _ = _load("--zmq-curve-server-key", server_key_file, secret=False)
    socket.curve_secretkey = private
    socket.curve_publickey = public
    socket.curve_serverkey = server_public
