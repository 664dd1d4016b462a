"""``launch``: validate a topology, settle what is left to the machine, and run this
node's part of it under a ``NodeSupervisor`` until a signal or a fatal death.

The run directory (ipc sockets, metrics) holds the launcher's pid, so a later launcher
removes the directories of launchers that were killed outright.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import tempfile

from launcher.draft_check import check_draft_model
from launcher.gguf_checkpoint import prepare_gguf_models
from launcher.hf_overrides import prepare_overridden_models
from launcher.preflight import (check_chat_template, check_lora_adapters, check_model_config,
                                check_port_free, resolve_api_keys, settle_defaults)
from launcher.supervisor import NodeSupervisor, say, stop
from cluster.topology import Topology
from launcher.topology_check import TopologyError, check_topology

RUN_DIR_PREFIX = "candor-"
PID_FILE = "launcher.pid"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clean_stale_run_dirs(parent: str | None = None) -> list[str]:
    """Remove run directories whose launcher is gone (killed with -9, or a crash): each
    holds its launcher's pid. A directory without a pid file is left alone (it may be a
    launcher between mkdtemp and writing it, or not ours)."""
    removed = []
    for path in glob.glob(os.path.join(parent or tempfile.gettempdir(),
                                       RUN_DIR_PREFIX + "*")):
        try:
            with open(os.path.join(path, PID_FILE)) as fh:
                pid = int(fh.read().strip())
            if os.stat(path).st_uid != os.getuid():
                continue
        except (OSError, ValueError):
            continue
        if not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _make_run_dir() -> str:
    run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
    partial = os.path.join(run_dir, PID_FILE + ".partial")
    with open(partial, "w") as fh:
        fh.write(f"{os.getpid()}\n")
    os.replace(partial, os.path.join(run_dir, PID_FILE))  # never read half-written
    return run_dir


def launch(topology: Topology, node: str | None = None,
           api_keys: list[str] | None = None) -> int:
    """Run this node's part of the topology until a signal (exit 0, after draining) or a
    child's fatal death (exit 1, naming it)."""
    topology = prepare_gguf_models(topology)  # a GGUF file -> its prepared directory
    topology = prepare_overridden_models(topology)  # --hf-overrides -> its own config.json
    try:
        check_topology(topology, node)
    except TopologyError as err:
        raise SystemExit("candor: invalid topology:\n  " + "\n  ".join(err.problems)) from None
    check_model_config(topology)
    check_draft_model(topology)
    nodes = topology.effective_nodes()
    if node is None:
        if len(nodes) > 1:
            raise SystemExit(f"candor: this topology has nodes {[n.name for n in nodes]}; "
                             "start each with --node NAME on its machine")
        node = nodes[0].name
    spec = next(n for n in nodes if n.name == node)
    if "gpu_worker" in spec.roles:  # the adapters' files are read where the ranks run
        check_lora_adapters(topology)
    if topology.api.chat_template is not None and "tokenizer_worker" in spec.roles:
        check_chat_template(topology)  # a refusal stays one line: check before settling
    topology = settle_defaults(topology, spec)
    from api_frontend.tool_parsers.resolve import resolve_tool_parser
    topology = resolve_tool_parser(topology)
    for path in clean_stale_run_dirs():
        say(f"removed {path}: its launcher is gone")
    keys = resolve_api_keys(topology, api_keys or [])
    if "api_frontend" in spec.roles:
        check_port_free(topology.http_of(spec))
    run_dir = _make_run_dir()
    stop_requested = False

    def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    supervisor = None
    try:
        supervisor = NodeSupervisor(topology, spec, run_dir, keys)
        return supervisor.run(lambda: stop_requested)
    finally:
        if supervisor is not None and supervisor.children:
            stop(supervisor.children)  # idempotent; covers an exception in run()
        shutil.rmtree(run_dir, ignore_errors=True)
