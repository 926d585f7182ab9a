"""`python -m pagedkv.healthcheck HOST:PORT [--service NAME]`: exit 0 when SERVING.

The container health check of both services (docker-compose.yml) and the readiness probe of
the local stack: it asks the standard gRPC health service, so it reports what the server
itself says (NOT_SERVING while recovering, registering or draining) rather than "the port
accepts connections".
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout_s: float = 2.0) -> str:
    """The health status name (`SERVING`, `NOT_SERVING`, ...) or `UNREACHABLE`."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            return (
                "UNREACHABLE"
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                else f"ERROR_{code.name if code else 'UNKNOWN'}"
            )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="HOST:PORT of a pagedkv service")
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args(argv)
    status = check(args.target, args.service, args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
