"""The scheduler's ROUTER end: steps go to the socket a worker said Hello on, whatever else it sends on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq

from gpu_worker.config import WorkerConfig
from gpu_worker.worker import results_socket
from protos import worker_pb2
from scheduler.worker_link import WorkerLink


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
