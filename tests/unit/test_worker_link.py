"""The scheduler's ROUTER end: steps go to the socket a worker said Hello on, whatever else it sends on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq

from gpu_worker.config import WorkerConfig
from gpu_worker.worker import results_socket
from protos import worker_pb2
from scheduler.worker_link import WorkerLink, WorkerProtocolError


def test_results_and_heartbeats_from_other_sockets_do_not_move_the_steps(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/link.sock"

    async def conversation() -> None:
        link = WorkerLink(address)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        main = context.socket(zmq.DEALER)
        main.connect(address)
        results = results_socket(context, WorkerConfig(model="unused", scheduler_address=address))
        heartbeats = context.socket(zmq.DEALER)
        heartbeats.connect(address)
        try:
            main.send(
                worker_pb2.WorkerMessage(hello=worker_pb2.Hello(worker_id=0, pid=1)).SerializeToString()
            )
            assert (await asyncio.wait_for(link.recv(), 5)).WhichOneof("kind") == "hello"
            result = worker_pb2.WorkerMessage(result=worker_pb2.StepResult(step_id=7))
            results.send(result.SerializeToString())
            heartbeats.send(worker_pb2.WorkerMessage(heartbeat=worker_pb2.Heartbeat()).SerializeToString())
            got = [await asyncio.wait_for(link.recv(), 5) for _ in range(2)]
            assert sorted(m.WhichOneof("kind") for m in got) == ["heartbeat", "result"]
            assert next(m for m in got if m.HasField("result")).result.step_id == 7
            step = worker_pb2.SchedulerMessage(step=worker_pb2.Step(step_id=8))
            await link.send(step)
            assert main.poll(5000), "the step did not reach the socket that said Hello"
            assert worker_pb2.SchedulerMessage.FromString(main.recv()).step.step_id == 8
            assert not results.poll(0) and not heartbeats.poll(0)
        finally:
            for socket in (main, results, heartbeats):
                socket.close(linger=0)
            link.close()

    asyncio.run(conversation())


def test_a_worker_replaced_before_it_was_ready_is_configured_in_its_turn(tmp_path: Path) -> None:
    """A worker says Hello before loading its weights; if it dies loading them, its replacement's
    Hello gets a Configure of its own and its Ready ends the handshake."""
    address = f"ipc://{tmp_path}/link.sock"

    def hello(pid: int) -> bytes:
        return worker_pb2.WorkerMessage(hello=worker_pb2.Hello(worker_id=0, pid=pid)).SerializeToString()

    async def conversation() -> None:
        link = WorkerLink(address)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        first, second = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        first.connect(address)
        second.connect(address)
        configure = worker_pb2.Configure(block_size=16, max_blocks=32)
        try:
            handshake = asyncio.ensure_future(link.handshake(configure))
            first.send(hello(1))
            assert await asyncio.to_thread(first.poll, 5000), "the first worker got no Configure"
            assert worker_pb2.SchedulerMessage.FromString(first.recv()).configure == configure
            first.close(linger=0)  # died loading its weights
            second.send(hello(2))
            assert await asyncio.to_thread(second.poll, 5000), "the replacement got no Configure"
            assert worker_pb2.SchedulerMessage.FromString(second.recv()).configure == configure
            assert not handshake.done()
            ready = worker_pb2.Ready(worker_id=0, num_blocks=32, block_size=16)
            second.send(worker_pb2.WorkerMessage(ready=ready).SerializeToString())
            assert await asyncio.wait_for(handshake, 5) == ready
            await link.send(worker_pb2.SchedulerMessage(step=worker_pb2.Step(step_id=3)))
            assert await asyncio.to_thread(second.poll, 5000), "steps did not go to the replacement"
            assert worker_pb2.SchedulerMessage.FromString(second.recv()).step.step_id == 3
        finally:
            for socket in (first, second):
                socket.close(linger=0)
            link.close()

    asyncio.run(conversation())


def test_a_message_other_than_ready_after_configure_is_a_protocol_error(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/link.sock"

    async def conversation() -> None:
        link = WorkerLink(address)
        worker = zmq.Context.instance().socket(zmq.DEALER)
        worker.connect(address)
        try:
            handshake = asyncio.ensure_future(link.handshake(worker_pb2.Configure(block_size=16)))
            worker.send(
                worker_pb2.WorkerMessage(hello=worker_pb2.Hello(worker_id=0, pid=1)).SerializeToString()
            )
            assert await asyncio.to_thread(worker.poll, 5000)
            worker.recv()
            failure = worker_pb2.WorkerError(message="out of memory")
            worker.send(worker_pb2.WorkerMessage(error=failure).SerializeToString())
            with pytest.raises(
                WorkerProtocolError, match="expected ready or hello from the worker, got out of memory"
            ):
                await asyncio.wait_for(handshake, 5)
        finally:
            worker.close(linger=0)
            link.close()

    asyncio.run(conversation())
