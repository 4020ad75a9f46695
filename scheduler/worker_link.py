"""The scheduler's end of the ZeroMQ link to its worker(s).

The scheduler binds a ROUTER socket; each worker connects a DEALER, which it sends its Hello
on and receives steps from (and up to two more DEALERs that only send: heartbeats, and the
results of a CPU worker with SBO). Messages are the protobufs of protos/worker.proto, one per
ZeroMQ frame; nothing is pickled.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable
from pathlib import Path

import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError

from protos import worker_pb2
from scheduler import curve

log = logging.getLogger(__name__)


class WorkerProtocolError(RuntimeError):
    """A worker sent something the conversation does not allow at this point."""


class WorkerLink:
    """Binds the worker socket and exchanges protobuf messages with one worker."""

    def __init__(self, address: str, curve_secret: str = "", curve_authorized: str = "") -> None:
        self.address = address
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._authenticator = (
            curve.secure_server(self._socket, self._context, curve_secret, curve_authorized)
            if curve_secret
            else None
        )
        self._socket.bind(address)
        if address.startswith("ipc://"):
            # Only this user may talk to the scheduler through the socket file.
            os.chmod(address.removeprefix("ipc://"), 0o600)
        self._identity: bytes | None = None

    async def handshake(self, configure: worker_pb2.Configure) -> worker_pb2.Ready:
        """Wait for a worker's Hello, configure it, and wait until it is Ready. A worker says Hello
        before it loads its weights; one that dies loading them is replaced, and the replacement's
        Hello is configured in its turn."""
        message = await self._expect("hello")
        while message.WhichOneof("kind") == "hello":
            log.info("worker %d (pid %d) connected", message.hello.worker_id, message.hello.pid)
            await self.send(worker_pb2.SchedulerMessage(configure=configure))
            message = await self._expect("ready", "hello")
        return message.ready

    async def _expect(self, *kinds: str) -> worker_pb2.WorkerMessage:
        message = await self.recv()
        while message.WhichOneof("kind") == "heartbeat":
            message = await self.recv()
        if message.WhichOneof("kind") not in kinds:
            detail = (
                message.error.message if message.WhichOneof("kind") == "error" else message.WhichOneof("kind")
            )
            raise WorkerProtocolError(f"expected {' or '.join(kinds)} from the worker, got {detail}")
        return message

    async def recv(self) -> worker_pb2.WorkerMessage:
        """The next message a worker sent; frames that are not a WorkerMessage are logged and skipped."""
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            if len(frames) != 2:
                log.warning("ignoring a %d-frame message on the worker socket", len(frames))
                continue
            identity, payload = frames
            try:
                message = worker_pb2.WorkerMessage.FromString(payload.buffer)
            except DecodeError as err:
                log.warning(
                    "ignoring %d bytes on the worker socket that are no WorkerMessage: %s", len(payload), err
                )
                continue
            break
        # A worker's Hello comes over the socket it receives steps on; heartbeats, and on a CPU
        # worker with SBO its results, come over sockets of their own.
        if message.WhichOneof("kind") == "hello":
            self._identity = bytes(identity.buffer)
        return message

    def send(self, message: worker_pb2.SchedulerMessage) -> Awaitable[object]:
        """Hand the message to ZeroMQ now, not when the event loop next runs a task: a step
        dispatched before the scheduler's text work then reaches the worker before that work.
        It is a future, done once ZeroMQ took it (at once unless its queue to the worker is full)
        and holds any error."""
        assert self._identity is not None, "no worker has connected yet"
        return self._socket.send_multipart([self._identity, message.SerializeToString()])

    def close(self) -> None:
        # A short linger lets a queued Shutdown reach the worker before the socket goes.
        self._socket.close(linger=500)
        if self._authenticator is not None:
            self._authenticator.stop()  # type: ignore[attr-defined]
        self._context.term()
        if self.address.startswith("ipc://"):
            Path(self.address.removeprefix("ipc://")).unlink(missing_ok=True)
