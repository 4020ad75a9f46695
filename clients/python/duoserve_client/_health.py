"""The two ``grpc.health.v1`` messages, built from a descriptor so the SDK needs only protobuf.

They live in a private descriptor pool: a process that also imports ``grpc_health``
(a server in the same process, a test) registers the same names in the default pool.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

CHECK_METHOD = "/grpc.health.v1.Health/Check"
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


@dataclass(frozen=True, slots=True)
class HealthMessages:
    """The request and response classes of ``grpc.health.v1.Health/Check``."""

    request: Any
    response: Any


@functools.cache
def health_messages() -> HealthMessages:
    """Build (once) the HealthCheckRequest / HealthCheckResponse classes."""
    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="duoserve_client/grpc_health_v1.proto", package="grpc.health.v1", syntax="proto3"
    )
    file.message_type.add(name="HealthCheckRequest").field.add(
        name="service", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL
    )
    response = file.message_type.add(name="HealthCheckResponse")
    status_enum = response.enum_type.add(name="ServingStatus")
    for number, name in STATUS_NAMES.items():
        status_enum.value.add(name=name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=field.TYPE_ENUM,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
        label=field.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return HealthMessages(
        request=message_factory.GetMessageClass(
            pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")
        ),
        response=message_factory.GetMessageClass(
            pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")
        ),
    )


def status_name(response: Any) -> str:
    """The ServingStatus name of a HealthCheckResponse ("SERVING", "NOT_SERVING", ...)."""
    return STATUS_NAMES.get(int(response.status), "UNKNOWN")
