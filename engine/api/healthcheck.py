"""Health probe of the API server for container health checks (the image has no curl):

    python -m engine.api.healthcheck 127.0.0.1:8000        # exit 0 when GET /health answers 200

It prints the answer's status line, or why there was none; exit 1 otherwise.
"""

from __future__ import annotations

import http.client
import sys
import urllib.error
import urllib.request

from pagedkv.cli import ArgumentParser, seconds, summary


def check(target: str, timeout_s: float = 3.0) -> tuple[bool, str]:
    url = target if target.startswith(("http://", "https://")) else f"http://{target}"
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as reply:  # noqa: S310
            return reply.status == 200, f"{reply.status} {reply.read(200).decode(errors='replace')}"
    except urllib.error.HTTPError as exc:
        return False, f"{exc.code} {exc.read(200).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"UNREACHABLE ({getattr(exc, 'reason', exc)})"
    except http.client.HTTPException as exc:    # something answered, but not HTTP/1.x (a gRPC port)
        return False, f"NOT HTTP ({type(exc).__name__}: {target} did not answer HTTP/1.1; is it the API server's port?)"
    except ValueError as exc:                   # a target that is no URL at all
        return False, f"BAD TARGET ({exc})"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m engine.api.healthcheck", description=summary(__doc__))
    parser.add_argument("target", help="HOST:PORT of the API server (or its base URL)")
    parser.add_argument("--timeout", type=seconds, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    ok, detail = check(args.target, args.timeout)
    print(detail)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
