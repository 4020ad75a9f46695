"""`duoserve serve`: starts the worker(s) and the scheduler as separate processes.

It waits until the scheduler reports SERVING, watches its children, and on
SIGINT/SIGTERM stops the scheduler first (which drains its streams and tells the
workers to shut down), then the workers, so no process is left behind. Children
run in their own process group (a Ctrl-C reaches only this launcher, which
coordinates the order) and are told by the kernel to exit if it dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from argparse import Namespace
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_worker.config import CANNOT_START
from scheduler.cli import SCHEDULER_FLAGS, TRACING_FLAGS, WORKER_FLAGS, Flag, scheduler_config, worker_config
from scheduler.config import SchedulerConfig
from scheduler.model_files import resolve_model
from scheduler.ports import addresses_in_use
from scheduler.proctitle import die_with_parent, set_process_title
from scheduler.security import SecurityConfigError, check_files

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
WORKER_EXIT_SECONDS = 10.0
RESTART_BACKOFF_FIRST = 0.5
RESTART_BACKOFF_MAX = 8.0
KILL_AFTER_SECONDS = 5.0


@dataclass(slots=True)
class Child:
    name: str
    process: subprocess.Popen[bytes]


def flags_to_argv(flags: Sequence[Flag], values: object) -> list[str]:
    """Command-line flags that reproduce `values` (a config dataclass or Namespace)."""
    argv = []
    for flag in flags:
        if not hasattr(values, flag.dest):
            continue
        value = getattr(values, flag.dest)
        if value is None:  # unset: the child decides as the parent would have
            continue
        if flag.type is bool:
            argv.append(flag.name if value else "--no-" + flag.name.removeprefix("--"))
        else:
            argv += [flag.name, str(value)]
    return argv


class StopSignal:
    """SIGINT and SIGTERM, waited for on a pipe. The handlers only record the signal and write a
    byte: they take no lock. (A handler that set a threading.Event could run while the main thread,
    inside that Event's wait, held its lock, and then wait for it forever.)"""

    def __init__(self) -> None:
        self.received = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        signal.signal(signal.SIGINT, self._note)
        signal.signal(signal.SIGTERM, self._note)

    def _note(self, *_: object) -> None:
        self.received = True
        with contextlib.suppress(BlockingIOError):  # the pipe is full of earlier signals: one is enough
            os.write(self._write, b"\0")

    def wait(self, timeout: float) -> bool:
        """Whether a stop signal came, waiting up to `timeout` seconds for one."""
        if not self.received:
            select.select([self._read], [], [], timeout)
        return self.received


def _spawn(name: str, argv: list[str]) -> Child:
    command = [sys.executable, "-m", "scheduler.cli", *argv]
    log.info("starting %s: %s", name, " ".join(command))
    process = subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_parent)
    return Child(name, process)


def _is_serving(config: SchedulerConfig) -> bool:
    if config.tls_cert:  # the launcher holds no client credentials: ask the plain-HTTP probe instead
        if not config.metrics_port:
            return False
        url = f"http://{config.host}:{config.metrics_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False
    address = config.grpc_address
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _stop(children: list[Child], grace: float) -> None:
    """Scheduler first (it drains and shuts its workers down), then whatever is left."""
    scheduler, workers = children[-1], children[:-1]
    if scheduler.process.poll() is None:
        scheduler.process.send_signal(signal.SIGTERM)
        _wait(scheduler, grace + KILL_AFTER_SECONDS)
    for worker in workers:
        _wait(worker, WORKER_EXIT_SECONDS, already_told=True)


def _wait(child: Child, timeout: float, already_told: bool = False) -> None:
    try:
        child.process.wait(timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    if already_told:
        child.process.send_signal(signal.SIGTERM)
        try:
            child.process.wait(KILL_AFTER_SECONDS)
            return
        except subprocess.TimeoutExpired:
            pass
    log.warning("%s did not exit; killing it", child.name)
    child.process.kill()
    child.process.wait()


def _cannot_serve(config: SchedulerConfig) -> int | None:
    """The exit code, with the reason logged, where this server cannot start: a security file it
    cannot read (2), or a port already taken (1). A missing model raises, as a usage error."""
    try:
        check_files(config.api_key_file, config.tls_cert, config.tls_key, config.tls_client_ca)
    except SecurityConfigError as err:
        log.error("%s", err)
        return 2
    resolve_model(config.model)  # a missing model is a usage error, before any process starts
    # A server already on the port would answer the health checks in this one's place.
    for flag, port in (("--port", config.port), ("--metrics-port", config.metrics_port)):
        taken = addresses_in_use(config.host, port)
        if taken:
            log.error("cannot serve on %s:%d (%s): %s in use", config.host, port, flag, ", ".join(taken))
            return 1
    return None


def _worker_argv(args: Namespace, config: SchedulerConfig, model: list[str], worker_id: int) -> list[str]:
    """The `duoserve worker` command line of one worker: the serve flags it takes, and where it
    finds the scheduler."""
    worker = worker_config(
        args, scheduler_address=config.worker_address, worker_id=worker_id, model=config.model
    )
    argv = ["worker", *model, *flags_to_argv((*TRACING_FLAGS, *WORKER_FLAGS), worker)]
    return [*argv, "--scheduler-address", worker.scheduler_address, "--worker-id", str(worker_id)]


def _supervise(
    config: SchedulerConfig, children: list[Child], worker_argvs: list[list[str]], stop: StopSignal
) -> int:
    """Watch the children (the workers, then the scheduler) until a stop signal or a death that
    ends the server; announce once it serves; restart a worker that died, as the config allows,
    in `children`'s place. Returns the exit code."""
    announced = False
    restarts = 0
    while not stop.received:
        dead = [c for c in children if c.process.poll() is not None]
        worker_died = dead and dead[0] is not children[-1]
        if worker_died and dead[0].process.returncode == CANNOT_START:
            log.error(
                "%s cannot start with this model and these settings (its error is above); stopping",
                dead[0].name,
            )
            return 1
        if worker_died and config.restart_workers and restarts < config.max_worker_restarts:
            # The scheduler notices the loss itself (heartbeats), keeps the requests, and resumes
            # them once this replacement says Ready.
            index = children.index(dead[0])
            restarts += 1
            delay = min(RESTART_BACKOFF_MAX, RESTART_BACKOFF_FIRST * 2 ** (restarts - 1))
            log.error(
                "%s exited with code %s; restarting it in %.1f s (restart %d of %d)",
                dead[0].name,
                dead[0].process.returncode,
                delay,
                restarts,
                config.max_worker_restarts,
            )
            if stop.wait(delay):
                break
            children[index] = _spawn(dead[0].name, worker_argvs[index])
            continue
        if dead:
            log.error("%s exited with code %s; stopping", dead[0].name, dead[0].process.returncode)
            return 1
        if not announced and _is_serving(config):
            log.info("duoserve is serving %s on %s", config.model, config.grpc_address)
            announced = True
        stop.wait(POLL_SECONDS if announced else 0.5)
    return 0


def serve(args: Namespace) -> int:
    """Run the whole server until SIGINT/SIGTERM; returns the exit code."""
    set_process_title("serve")
    config: SchedulerConfig = scheduler_config(args)
    refused = _cannot_serve(config)
    if refused is not None:
        return refused
    model = ["--model", config.model, "--log-level", args.log_level]
    worker_argvs = [_worker_argv(args, config, model, worker_id) for worker_id in range(config.num_workers)]
    children = [_spawn(f"worker {worker_id}", argv) for worker_id, argv in enumerate(worker_argvs)]
    scheduler_argv = flags_to_argv((*TRACING_FLAGS, *SCHEDULER_FLAGS), config)
    children.append(_spawn("scheduler", ["scheduler", *model, *scheduler_argv]))
    exit_code = _supervise(config, children, worker_argvs, StopSignal())
    started = time.monotonic()

    def exit_at_once(*_: object) -> None:
        log.warning("second stop signal: killing the children and exiting at once")
        for child in children:
            if child.process.poll() is None:
                child.process.kill()
        os._exit(exit_code)

    signal.signal(signal.SIGINT, exit_at_once)
    signal.signal(signal.SIGTERM, exit_at_once)
    _stop(children, config.drain_timeout)
    log.info("stopped in %.1f s", time.monotonic() - started)
    return exit_code
