"""Start a Candor topology and supervise it; also the ``candor`` command line.

    python launch_cluster.py deploy/topologies/single-host.yaml
    python launch_cluster.py deploy/topologies/two-node.yaml --node engine   # per machine
    candor serve --model PATH [--port 8000] [--tokenizer-workers N]
    candor make-tiny-model DIR
    candor default-model               # the path of make serve's GGUF file
    candor build-kernels               # compile the CPU kernels now (make serve/test do)
    candor keygen DIR                  # CURVE keys for the tcp:// sockets between nodes

Both start paths build a ``Topology``, validate it whole (every problem named), and hand
it to ``launcher.launch.launch``: one OS process per role instance of this node, owned and
supervised by ``launcher.supervisor.NodeSupervisor``. A dead child is restarted when the
topology marks its role restartable, otherwise the launcher stops the rest and exits
non-zero naming the role and exit code. SIGTERM and SIGINT drain (frontends refuse new
work and finish what they hold) and exit 0; children also die with the launcher through
PR_SET_PDEATHSIG. This file is only the command line.
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

from launcher.gguf_checkpoint import served_name
from launcher.hf_cache import ModelNotFound, resolve_model
from launcher.launch import launch
from launcher.serve_cli import (DEFAULT_MODEL_DIR, ServeArgsError, model_argument,
                                normalize_argv, serve_parser, serve_topology)
from launcher.supervisor import say
from cluster.topology import Topology, load_topology
from launcher.topology_check import TopologyError, check_topology


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="candor", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("serve", add_help=False, help="serve a checkpoint directory or a cached "
                   "Hugging Face repo id (vLLM's flags; see candor serve --help)")

    keygen = sub.add_parser("keygen", help="write CURVE keys for the tcp:// sockets "
                            "(security.curve.key_dir)")
    keygen.add_argument("dir")

    tiny = sub.add_parser("make-tiny-model", help="build the deterministic tiny checkpoint")
    tiny.add_argument("dir", nargs="?", default=DEFAULT_MODEL_DIR)
    tiny.add_argument("--if-missing", action="store_true",
                      help="do nothing when DIR already holds a checkpoint")

    sub.add_parser("default-model", help="print the path of the default model's GGUF file "
                   "(SmolLM2-135M-Instruct, installed by make install)")

    sub.add_parser("build-kernels", help="compile the gpu_worker's CPU kernels now (a "
                   "worker would at its first start)")

    launch_p = sub.add_parser("launch", help="start a topology YAML file")
    launch_p.add_argument("topology")
    launch_p.add_argument("--node", default=None)
    launch_p.add_argument("--check", action="store_true")

    sub.add_parser("bench", add_help=False,
                   help="load-test any OpenAI-compatible server (see candor bench --help)")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from launcher.loadgen import main as bench_main
        return bench_main(argv[1:])
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "keygen":
        write_curve_keys(args.dir)
        print(f"candor: CURVE keys written to {args.dir} (server.key, server.key_secret, "
              "client.key, client.key_secret); name it in security.curve.key_dir")
        return 0
    if args.command == "default-model":
        from launcher.default_model import DefaultModelMissing, default_gguf
        try:
            print(default_gguf())
        except DefaultModelMissing as err:
            print(f"candor: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "build-kernels":
        from gpu_worker.prebuild import build_all
        build_all()
        return 0  # a kernel that cannot be built leaves the torch path: not an error
    if args.command == "make-tiny-model":
        if args.if_missing and os.path.isfile(os.path.join(args.dir, "config.json")):
            print(f"candor: tiny model already present in {args.dir}")
            return 0
        from launcher.tiny_model import build_tiny_model
        path = build_tiny_model(args.dir, overwrite=True)
        print(f"candor: tiny model written to {path}")
        return 0
    return main([args.topology] + (["--node", args.node] if args.node else [])
                + (["--check"] if args.check else []))


def serve_args_to_topology(argv: list[str],
                           environ: dict[str, str] | None = None) -> tuple[Topology, argparse.Namespace]:
    """``candor serve`` flags -> (validated topology, parsed flags); a bad flag, an absent
    model or a bad value exits 2 with one message."""
    parser = serve_parser()
    args = parser.parse_args(normalize_argv(argv))
    try:
        given = model_argument(args)
        resolved = resolve_model(given, args.revision, environ)
        if resolved.repo_id is not None:
            say(f"{given}: the Hugging Face cache snapshot {resolved.revision} at "
                f"{resolved.path}")
        default_name = given if resolved.repo_id else served_name(resolved.path)
        return serve_topology(args, resolved.path, default_name, environ), args
    except (ServeArgsError, ModelNotFound) as err:
        parser.error(str(err))
    except msgspec.ValidationError as err:
        parser.error(str(err))
    raise AssertionError("unreachable")


def serve(argv: list[str]) -> int:
    topology, args = serve_args_to_topology(argv)
    if args.log_level is not None:  # read by every child's setup_logging
        os.environ["CANDOR_LOG_LEVEL"] = args.log_level.upper()
    return launch(topology, api_keys=args.api_key)


def write_curve_keys(directory: str) -> None:
    """A server and a client key pair (zmq certificate files); secrets are 0600."""
    import zmq.auth
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for name in ("server", "client"):
        _, secret_file = zmq.auth.create_certificates(directory, name)
        os.chmod(secret_file, 0o600)


def main(argv: list[str] | None = None) -> int:
    """``python launch_cluster.py TOPOLOGY.yaml [--node NAME]``"""
    parser = argparse.ArgumentParser(description="start a Candor topology from YAML")
    parser.add_argument("topology")
    parser.add_argument("--node", default=None,
                        help="start only this node's roles (required when the topology "
                             "has several nodes; the same file is used on every machine)")
    parser.add_argument("--check", action="store_true",
                        help="validate the topology (every node) and exit")
    args = parser.parse_args(argv)
    try:
        topology = load_topology(args.topology)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        print(f"candor: invalid topology {args.topology}: {err}", file=sys.stderr)
        return 2
    if args.check:
        try:
            check_topology(topology, args.node)
        except TopologyError as err:
            print(f"candor: invalid topology {args.topology}:\n  "
                  + "\n  ".join(err.problems), file=sys.stderr)
            return 2
        print(f"candor: {args.topology} is valid: nodes "
              f"{[n.name for n in topology.effective_nodes()]}", file=sys.stderr)
        return 0
    try:
        return launch(topology, args.node)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    _SUBCOMMANDS = {"serve", "make-tiny-model", "default-model", "build-kernels", "keygen", "launch", "bench",
                    "-h", "--help"}
    sys.exit(cli() if sys.argv[1:2] and sys.argv[1] in _SUBCOMMANDS else main())
