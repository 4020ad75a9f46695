"""The scheduler process: gRPC server, health, reflection, and the engine."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from protos import inference_pb2
from scheduler import tracing
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.errors import safe_deserializer
from scheduler.http_server import HttpEndpoint
from scheduler.metrics import RequestMetrics
from scheduler.model_files import model_name, resolve_model
from scheduler.ports import addresses_in_use
from scheduler.proctitle import set_process_title
from scheduler.security import ApiKeyInterceptor, SecurityConfigError, load_api_keys, server_credentials
from scheduler.servicer import InferenceServicer
from scheduler.tokenizer import TokenizerLoadError, load_tokenizer

log = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# gRPC's core holds the calls that have arrived but that the server has not taken up yet, and
# past 1000 of them (its default) it refuses a share of new ones, more the longer the backlog,
# all of them past 3000, and ends them CANCELLED: to a client, a status that says it gave up
# itself. A burst of 4096 streams on one channel lost 1154 of them so; the rest were answered
# RESOURCE_EXHAUSTED by the scheduler's own admission, which names the limit and asks the client
# to retry later. So the backlog may hold several times --max-queued-requests (at least 8192
# calls): every call of a burst reaches the admission, which bounds what is admitted. A call
# still untaken after 30 s is ended by gRPC all the same; that happens only while the event loop
# is saturated (bench/serving_ceiling.py's instant worker with thousands of streams).
BACKLOG_PER_QUEUED_REQUEST = 4
MIN_BACKLOG = 8192


def call_backlog_options(max_queued_requests: int) -> list[tuple[str, int]]:
    """The server options that let gRPC's core hold a backlog of calls scaled to the admission limit."""
    soft = max(MIN_BACKLOG, BACKLOG_PER_QUEUED_REQUEST * max_queued_requests)
    return [
        ("grpc.server.max_pending_requests", soft),
        ("grpc.server.max_pending_requests_hard_limit", 2 * soft),
    ]


# Set by tests so the block-pool invariants are checked after every step.
DEBUG_CHECKS_ENV = "DUOSERVE_DEBUG_CHECKS"


class SchedulerServer:
    """Wires the servicer, health and reflection to one engine and runs until stopped."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        model_path = resolve_model(config.model)
        self.tokenizer = load_tokenizer(model_path)
        self.model_name = model_name(model_path)
        # Checked before anything listens, so a bad file is a start-up error naming the flag.
        self.api_keys = load_api_keys(config.api_key_file) if config.api_key_file else []
        self.credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)

    def _build(self) -> None:
        """Objects bound to the running event loop: the engine's socket and the gRPC server."""
        self.engine = Engine(
            self.config, self.tokenizer.eos_token_ids, debug_checks=os.environ.get(DEBUG_CHECKS_ENV) == "1"
        )
        self.health = health.aio.HealthServicer()
        loop = asyncio.get_running_loop()
        # A lost worker turns the gRPC health NOT_SERVING, as /health already reads engine.ready.
        self.engine.on_worker_lost = lambda: loop.create_task(self._set_serving(False))
        self.engine.on_worker_ready = lambda: loop.create_task(self._set_serving(True))
        interceptors = [ApiKeyInterceptor(self.api_keys)] if self.api_keys else []
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                *call_backlog_options(self.config.max_queued_requests),
            ],
        )
        self.registry = CollectorRegistry()
        servicer = InferenceServicer(
            self.engine, self.tokenizer, self.model_name, RequestMetrics(self.registry)
        )
        self.server.add_generic_rpc_handlers((inference_handlers(servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        health_service = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_service, reflection.SERVICE_NAME), self.server
        )

    async def _set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def run(self) -> int:
        taken = addresses_in_use(self.config.host, self.config.port)
        if taken:  # gRPC would listen on the host's other addresses and call that success
            log.error("cannot listen on %s: %s in use", self.config.grpc_address, ", ".join(taken))
            return 1
        self._build()
        if self.credentials is not None:
            port = self.server.add_secure_port(self.config.grpc_address, self.credentials)
        else:
            port = self.server.add_insecure_port(self.config.grpc_address)
        if port == 0:
            log.error("cannot listen on %s (in use?)", self.config.grpc_address)
            return 1
        try:
            http = HttpEndpoint(self.config.host, self.config.metrics_port, self.engine, self.registry)
        except OSError as err:
            log.error("cannot serve /health and /metrics on port %d: %s", self.config.metrics_port, err)
            return 1
        http.start()
        log.info("/health and /metrics on %s:%d", self.config.host, http.port)
        await self._set_serving(False)
        await self.server.start()
        log.info(
            "gRPC listening on %s; waiting for the worker on %s",
            self.config.grpc_address,
            self.config.worker_address,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        start = asyncio.create_task(self.engine.start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
        # A stop signal before the worker is ready is a clean stop; a failed handshake is not.
        failed = start.done() and start.exception() is not None
        if failed:
            log.error("worker handshake failed: %s", start.exception())
        elif start.done():
            await self._set_serving(True)
            log.info("serving %s", self.model_name)
            await stopped
        start.cancel()
        stopped.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal: no more waiting
            loop.add_signal_handler(sig, _exit_at_once)
        log.info("shutting down: draining for up to %.1f s", self.config.drain_timeout)
        await self._set_serving(False)
        await self.engine.drain(self.config.drain_timeout)
        await self.server.stop(grace=1.0)
        await self.engine.close()
        http.close()
        return 1 if failed else 0


def inference_handlers(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """The Inference service's handlers, like the generated ones but with request deserializers
    that turn unparsable bytes into INVALID_ARGUMENT instead of gRPC's UNKNOWN."""
    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    handlers = {}
    for method in service.methods:
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=safe_deserializer(request_type.FromString, method.input_type.full_name),
            response_serializer=response_type.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _exit_at_once() -> None:
    log.warning("second stop signal: exiting at once, in-flight requests are cut")
    logging.shutdown()
    os._exit(0)  # still a requested stop, not a failure


def run_scheduler(config: SchedulerConfig) -> int:
    """Run the scheduler process until SIGINT/SIGTERM; returns the exit code."""
    set_process_title("scheduler")
    tracing.setup(
        tracing.SCHEDULER_SERVICE, config.otlp_endpoint, config.otlp_protocol, config.trace_sample_ratio
    )
    try:
        try:
            server = SchedulerServer(config)
        except SecurityConfigError as err:
            log.error("%s", err)
            return 2
        except TokenizerLoadError as err:  # the worker, reading the same file, says why too
            log.error("cannot load the model's tokenizer: %s", err)
            return 1
        return asyncio.run(server.run())
    finally:
        tracing.shutdown()
