"""Start a Candor topology and supervise it; also the ``candor`` command line.

    python launch_cluster.py deploy/topologies/single-host.yaml
    candor serve --model PATH [--port 8000] [--tokenizer-workers N]
    candor make-tiny-model DIR

Both start paths build a ``Topology`` and hand it to ``launch``: one OS process per role
instance, each given its ``ProcessConfig`` as JSON. The launcher owns every child: if
one dies, it stops the rest and exits non-zero naming the role; SIGINT/SIGTERM stop
every child (children also die with the launcher through PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import msgspec

from protocol.topology import (HttpSpec, ProcessConfig, Topology, load_topology,
                               process_configs)

GRACE_S = 10.0
DEFAULT_MODEL_DIR = os.path.expanduser(
    os.environ.get("CANDOR_MODEL_DIR", "~/.cache/candor/models/tiny-llama"))

# Roles that never load a model get one BLAS/tokenizers thread: the cores belong to the
# gpu_worker, which sets its own count.
_LEAN_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1",
             "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Child:
    config: ProcessConfig
    proc: subprocess.Popen

    @property
    def name(self) -> str:
        return f"{self.config.role}[{self.config.index}]"


def _spawn(cfg: ProcessConfig) -> subprocess.Popen:
    env = dict(os.environ)
    if cfg.role != "gpu_worker":
        env.update(_LEAN_ENV)
    env.setdefault("PYTHONUNBUFFERED", "1")
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", cfg.role, msgspec.json.encode(cfg).decode()],
                            env=env)


def _check_model_dir(topology: Topology) -> None:
    path = topology.model.resolved_path()
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(path, name)):
            raise SystemExit(f"model.path {path!r} has no {name}: not a HF checkpoint directory")


def _wait_healthy(http: HttpSpec, children: list[Child], timeout_s: float) -> bool:
    url = f"http://{http.host}:{http.port}/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(c.proc.poll() is not None for c in children):
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


def _stop_all(children: list[Child]) -> None:
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def launch(topology: Topology) -> int:
    """Run the topology until a signal (exit 0) or a child's death (exit 1)."""
    _check_model_dir(topology)
    run_dir = tempfile.mkdtemp(prefix="candor-")
    configs = process_configs(topology, run_dir)
    stop_requested = False

    def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    children: list[Child] = []
    exit_code = 0
    try:
        children = [Child(cfg, _spawn(cfg)) for cfg in configs]
        print(f"candor: started {len(children)} processes: "
              + ", ".join(c.name for c in children), file=sys.stderr, flush=True)
        if _wait_healthy(topology.http, children, timeout_s=600):
            print(f"candor: ready on http://{topology.http.host}:{topology.http.port} "
                  f"serving {topology.model.name()!r}", file=sys.stderr, flush=True)
        while not stop_requested:
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                for c in dead:
                    print(f"candor: {c.name} exited with code {c.proc.returncode}; "
                          "stopping the topology", file=sys.stderr, flush=True)
                exit_code = 1
                break
            time.sleep(0.1)
    finally:
        _stop_all(children)
        shutil.rmtree(run_dir, ignore_errors=True)
    return exit_code


# ---------------------------------------------------------------- command line


def _serve_topology(args: argparse.Namespace) -> Topology:
    """The flags as a topology, validated by the same constraints as a YAML file."""
    return msgspec.convert({
        "model": {"path": args.model, "served_model_name": args.served_model_name,
                  "max_model_len": args.max_model_len, "dtype": args.dtype,
                  "load_format": args.load_format},
        "roles": {"api_frontend": args.frontends, "tokenizer_worker": args.tokenizer_workers,
                  "detokenizer": args.detokenizers},
        "engine": {"num_kv_blocks": args.num_kv_blocks, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "worker_threads": args.worker_threads,
                   "fault_token_id": args.fault_token_id},
        "http": {"host": args.host, "port": args.port, "max_body_mb": args.max_body_mb},
        "api": {"strict": args.strict, "max_tokens_policy": args.max_tokens_policy,
                "chat_template": args.chat_template,
                "allow_request_chat_template": args.allow_request_chat_template},
    }, Topology)


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="candor", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a HF checkpoint directory")
    serve.add_argument("--model", default=DEFAULT_MODEL_DIR)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    serve.add_argument("--frontends", type=int, default=1)
    serve.add_argument("--tokenizer-workers", type=int, default=1)
    serve.add_argument("--detokenizers", type=int, default=1)
    serve.add_argument("--num-kv-blocks", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=1024)
    serve.add_argument("--worker-threads", type=int, default=None)
    serve.add_argument("--max-body-mb", type=int, default=32)
    serve.add_argument("--fault-token-id", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--strict", action="store_true",
                       help="every ignored or clamped request field is a 400 naming it")
    serve.add_argument("--max-tokens-policy", default="reject", choices=["reject", "clamp"],
                       help="prompt + max_tokens beyond the context: 400 (reject) or clamp")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template file that replaces the checkpoint's")
    serve.add_argument("--allow-request-chat-template", action="store_true",
                       help="accept a chat_template field in request bodies")

    tiny = sub.add_parser("make-tiny-model", help="build the deterministic tiny checkpoint")
    tiny.add_argument("dir", nargs="?", default=DEFAULT_MODEL_DIR)
    tiny.add_argument("--if-missing", action="store_true",
                      help="do nothing when DIR already holds a checkpoint")

    launch_p = sub.add_parser("launch", help="start a topology YAML file")
    launch_p.add_argument("topology")

    sub.add_parser("bench", add_help=False,
                   help="load-test any OpenAI-compatible server (see candor bench --help)")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from bench.loadgen import main as bench_main
        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "make-tiny-model":
        if args.if_missing and os.path.isfile(os.path.join(args.dir, "config.json")):
            print(f"candor: tiny model already present in {args.dir}")
            return 0
        from gpu_worker.tiny_model import build_tiny_model
        path = build_tiny_model(args.dir, overwrite=True)
        print(f"candor: tiny model written to {path}")
        return 0
    if args.command == "launch":
        return main([args.topology])
    try:
        topology = _serve_topology(args)
    except msgspec.ValidationError as err:
        parser.error(str(err))
    return launch(topology)


def main(argv: list[str] | None = None) -> int:
    """``python launch_cluster.py TOPOLOGY.yaml``"""
    parser = argparse.ArgumentParser(description="start a Candor topology from YAML")
    parser.add_argument("topology")
    args = parser.parse_args(argv)
    try:
        topology = load_topology(args.topology)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        print(f"candor: invalid topology {args.topology}: {err}", file=sys.stderr)
        return 2
    return launch(topology)


if __name__ == "__main__":
    _SUBCOMMANDS = {"serve", "make-tiny-model", "launch", "bench", "-h", "--help"}
    sys.exit(cli() if sys.argv[1:2] and sys.argv[1] in _SUBCOMMANDS else main())
