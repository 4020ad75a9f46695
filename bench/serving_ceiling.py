"""The serving path's ceiling: the scheduler, gRPC and the client SDK with a worker that answers
every step at once.

    python bench/serving_ceiling.py                      # a worker that says it runs on CUDA
    python bench/serving_ceiling.py --device cpu --no-lookahead --serving-args "--quick"

`duoserve scheduler` runs as it serves (the default model's tokenizer, detokenization, the gRPC
streams), and an instant worker process takes the model's place: it says Ready as a `--device`
worker would (DBO lanes split the running sequences on a GPU and not on a CPU), samples token
`--token` for each sequence that reaches its end, and answers each step as soon as it arrives.
bench/serving.py then runs its workloads against the scheduler. What they reach is what the
serving path allows before any model computes: a GPU worker's throughput close to it is bound by
the host, not the device.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq
from servers import free_port

from duoserve_client import Client
from protos import worker_pb2
from protos.running import unpack_running

HEARTBEAT_S = 0.5


def run_instant_worker(address: str, device: str, lookahead: bool, token: int) -> int:
    """Serve the scheduler at `address` until Shutdown, answering each step at once; the steps
    answered."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.connect(address)
    pid = os.getpid()
    socket.send(worker_pb2.WorkerMessage(hello=worker_pb2.Hello(worker_id=0, pid=pid)).SerializeToString())
    configure = worker_pb2.SchedulerMessage.FromString(socket.recv()).configure
    ready = worker_pb2.Ready(
        model_name="instant",
        context_length=8192,
        vocab_size=49152,
        dtype="bfloat16",
        attention_backend="none",
        device=device,
        block_size=configure.block_size,
        num_blocks=configure.max_blocks or 4096,
        lookahead=lookahead,
    )
    socket.send(worker_pb2.WorkerMessage(ready=ready).SerializeToString())
    heartbeat = worker_pb2.WorkerMessage(
        heartbeat=worker_pb2.Heartbeat(worker_id=0, pid=pid)
    ).SerializeToString()
    lengths: dict[int, list[int]] = {}  # seq_id -> [tokens known, tokens computed]
    answered, last_beat = 0, time.monotonic()
    while True:
        if time.monotonic() - last_beat > HEARTBEAT_S:
            socket.send(heartbeat)
            last_beat = time.monotonic()
        if not socket.poll(int(HEARTBEAT_S * 1000)):
            continue
        message = worker_pb2.SchedulerMessage.FromString(socket.recv())
        if message.WhichOneof("kind") != "step":
            return answered
        step = message.step
        for seq_id in np.frombuffer(step.released_seq_ids, dtype="<u8").tolist():
            lengths.pop(seq_id, None)
        scheduled = []
        for new in step.new_sequences:
            lengths[new.seq_id] = [len(new.token_ids) // 4, new.num_computed_tokens]
            scheduled.append((new.seq_id, new.num_new_tokens))
        running = unpack_running(step.running)
        scheduled += zip(running.seq_ids.tolist(), running.num_new_tokens.tolist(), strict=True)
        sampled = []
        for seq_id, num_new in scheduled:
            known = lengths[seq_id]
            known[1] += num_new
            if known[1] >= known[0]:  # reached its newest token: samples the next
                known[0] = known[1] + 1
                sampled.append(seq_id)
        result = worker_pb2.StepResult(
            step_id=step.step_id,
            lane=step.lane,
            seq_ids=np.asarray(sampled, dtype="<u8").tobytes(),
            token_ids=np.full(len(sampled), token, dtype="<i4").tobytes(),
        )
        socket.send(worker_pb2.WorkerMessage(result=result).SerializeToString())
        answered += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="the device the worker says"
    )
    parser.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--token", type=int, default=28, help="the token every sampled sequence gets")
    parser.add_argument("--serving-args", default="", help="flags for bench/serving.py, one string")
    parser.add_argument("--scheduler-args", default="", help="flags for duoserve scheduler, one string")
    parser.add_argument("--worker", metavar="ADDRESS", help=argparse.SUPPRESS)  # the instant worker itself
    args = parser.parse_args(argv)
    if args.worker:
        answered = run_instant_worker(args.worker, args.device, args.lookahead, args.token)
        print(f"# instant worker: answered {answered} steps", flush=True)
        return 0

    duoserve = Path(sys.executable).parent / "duoserve"
    port, address = free_port(), f"tcp://127.0.0.1:{free_port()}"
    scheduler_command = [str(duoserve), "scheduler", "--host", "127.0.0.1", "--port", str(port)]
    scheduler_command += [
        "--metrics-port",
        "0",
        "--worker-address",
        address,
        *shlex.split(args.scheduler_args),
    ]
    worker_command = [
        sys.executable,
        __file__,
        "--worker",
        address,
        "--device",
        args.device,
        "--token",
        str(args.token),
    ]
    worker_command.append("--lookahead" if args.lookahead else "--no-lookahead")
    print(f"# scheduler: {shlex.join(scheduler_command)}", flush=True)
    with tempfile.TemporaryFile() as log:
        scheduler = subprocess.Popen(scheduler_command, stdout=log, stderr=subprocess.STDOUT)
        worker = subprocess.Popen(worker_command)
        try:
            with Client(f"127.0.0.1:{port}") as client:
                client.wait_until_ready(120)
            serving = [
                sys.executable,
                str(Path(__file__).with_name("serving.py")),
                "--server",
                f"127.0.0.1:{port}",
            ]
            status = subprocess.run([*serving, *shlex.split(args.serving_args)]).returncode
        finally:
            scheduler.send_signal(signal.SIGTERM)
            scheduler_status = scheduler.wait(60)
            worker_status = worker.wait(60)
        if scheduler_status or worker_status:
            log.seek(0)
            print(log.read().decode(errors="replace")[-4000:], file=sys.stderr)
            print(f"# scheduler exited {scheduler_status}, worker {worker_status}", file=sys.stderr)
            return 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
