"""`python -m pagedkv.healthcheck HOST:PORT [--service NAME] [TLS options]`: exit 0 when SERVING.

The container health check of both services (docker-compose.yml) and the readiness probe of
the local stack: it asks the standard gRPC health service, so it reports what the server
itself says (NOT_SERVING while recovering, registering or draining) rather than "the port
accepts connections".

TLS: `--ca-file` / `--cert-file` / `--key-file` / `--server-name` / `--tls` (environment
`PAGEDKV_HEALTHCHECK_*`), or `--tls-env PREFIX` to dial with the service's own settings from
its environment (`PAGEDKV_TLS__` for the block manager, `PAGEDKV_CN_TLS__` for a compute node):
inside a service's container the probe then uses the service's certificate, and stays
plaintext when the service has no TLS configured. The health service needs no token.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.cli import EXIT_USAGE, ArgumentParser, fail, seconds, summary
from pagedkv.rpc import answered_plain_http
from pagedkv.tls import TlsSettings, add_tls_arguments, open_channel, tls_from_args, tls_from_env


def check(target: str, service: str = "", timeout_s: float = 2.0, tls: TlsSettings | None = None) -> str:
    """The health status name (`SERVING`, `NOT_SERVING`, ...), `UNREACHABLE`, or `NOT_GRPC`
    when the port answers plain HTTP (the OpenAI server's: its probe is
    `python -m engine.api.healthcheck`)."""
    with open_channel(target, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else None
            if answered_plain_http(details):
                return "NOT_GRPC"
            return (
                "UNREACHABLE"
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                else f"ERROR_{code.name if code else 'UNKNOWN'}"
            )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pagedkv.healthcheck", description=summary(__doc__))
    parser.add_argument("target", help="HOST:PORT of a pagedkv service")
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=seconds, default=2.0, help="seconds (default 2)")
    parser.add_argument("--tls-env", metavar="PREFIX", help="TLS settings from the environment: PREFIXCA_FILE, ...")
    add_tls_arguments(parser, "PAGEDKV_HEALTHCHECK_")
    args = parser.parse_args(argv)
    try:
        tls = tls_from_args(args) or (tls_from_env(args.tls_env) if args.tls_env else None)
        status = check(args.target, args.service, args.timeout, tls)
    except (OSError, ValueError) as exc:   # unreadable or non-PEM certificate files
        return fail(parser.prog, EXIT_USAGE, str(exc))
    if status == "NOT_GRPC":
        print(f"{status} (the port answers plain HTTP; the OpenAI server's probe is python -m engine.api.healthcheck)")
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
