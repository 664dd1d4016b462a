"""The launcher's own small HTTP server on a node's ``metrics_port``.

A node without a frontend (say, the engine node: scheduler + gpu_worker) still needs a
scrape target and a liveness probe; the launcher, which owns the node's metrics
directory and sees its children, serves both. It runs in a thread of the launcher and
never touches the request pipeline.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from cluster.metrics import render


def serve_node_http(host: str, port: int, metrics_dir: str,
                    problems: Callable[[], list[str]]) -> ThreadingHTTPServer:
    """GET /metrics: every process of this node; GET /health: 200 while every child of
    this node runs, else 503 naming what is wrong."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/metrics":
                body, content_type = render(metrics_dir)
                status = 200
            elif self.path == "/health":
                found = problems()
                status = 503 if found else 200
                body = json.dumps({"status": "unhealthy" if found else "ok",
                                   "problems": found}).encode()
                content_type = "application/json"
            else:
                status, body, content_type = 404, b'{"error": "not found"}', "application/json"
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # probes every few seconds: keep quiet
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="node-http", daemon=True).start()
    return server
