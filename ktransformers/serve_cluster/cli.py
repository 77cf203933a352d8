"""``python -m ktransformers.serve_cluster --replicas N <server flags>``: the server on a Ray cluster.

The cluster's own flags are below; every other flag is ``python -m ktransformers.server``'s and
goes to each replica unchanged (``--host`` / ``--port`` are where Ray Serve's HTTP proxy listens).
A bad flag or value prints one ``error:`` line and exits with 2, as the server does.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import KTError
from ..server.main import _Parser, _check_port, parse_settings
from .routing import DEFAULT_SPILL_AT


#: more replica deployments than this is a typo, not a cluster
MAX_REPLICAS = 1024


def _between(kind, low: float, high: float):
    """An argparse type: a ``kind`` number in [low, high] (finite); argparse names the flag."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n' if kind is int else ''} {kind.__name__}") from None
        if not (low <= v <= high):  # also refuses NaN and infinities
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}, not {text!r}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m ktransformers.serve_cluster", allow_abbrev=False,
                description="Serve N replicas of a model on a Ray cluster behind a prefix-affine router.",
                epilog="Every other flag is a flag of python -m ktransformers.server (see its --help); "
                       "each replica gets them.")
    p.add_argument("--replicas", type=_between(int, 1, MAX_REPLICAS), default=2,
                   help="replicas of the model (one per machine or NUMA node) [2]")
    p.add_argument("--replica_cpus", type=_between(float, 0.0, 1e6), default=1.0,
                   help="Ray CPUs each replica reserves (its kernels' threads are --cpu_infer) [1]")
    p.add_argument("--replica_memory_gb", type=_between(float, 0.0, 1e9), default=0.0,
                   help="Ray memory each replica reserves, GiB (0: none reserved) [0]")
    p.add_argument("--spill_at", type=_between(int, 1, 1e6), default=DEFAULT_SPILL_AT,
                   help="requests in flight on a replica past which new ones go to a less-loaded one "
                        f"[{DEFAULT_SPILL_AT}]")
    p.add_argument("--ray_address", default=None,
                   help="Ray cluster to join ('auto': the one started on this machine with `ray start`); "
                        "default: start a local one")
    return p


def main(argv: list[str] | None = None) -> int:
    args, server_argv = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = parse_settings(server_argv)
        _check_port(settings.host, settings.port)
    except KTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import ray
        from ray import serve
    except ImportError:
        print("error: Ray is not installed; install the cluster extra: pip install 'ktransformers[cluster]'",
              file=sys.stderr)
        return 2
    from .deployments import build_app

    try:
        ray.init(address=args.ray_address, include_dashboard=False)
    except (ConnectionError, ValueError) as e:  # no cluster there, or not an address
        print(f"error: --ray_address {args.ray_address}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    serve.start(http_options={"host": settings.host, "port": settings.port})
    app = build_app(server_argv, replicas=args.replicas, replica_cpus=args.replica_cpus,
                    replica_memory_gb=args.replica_memory_gb, spill_at=args.spill_at,
                    max_body_bytes=settings.max_body_bytes)
    print(f"serving {args.replicas} replica(s) on http://{settings.host}:{settings.port}  "
          "(OpenAI: /v1  Ollama: /api  metrics: /metrics)", file=sys.stderr)
    try:
        serve.run(app, name="ktransformers", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0
