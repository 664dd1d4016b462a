"""`python launch_cluster.py TOPOLOGY.yaml` runs the same machinery as `candor serve`."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from tests.support.polling import wait_until
from tests.support.server import REPO, free_port


def test_yaml_topology_serves_requests(tiny_model_dir, tmp_path):
    port = free_port()
    yaml_text = (REPO / "deploy" / "topologies" / "single-host.yaml").read_text()
    yaml_text = yaml_text.replace("~/.cache/candor/models/tiny-llama", str(tiny_model_dir))
    yaml_text = yaml_text.replace("port: 8000", f"port: {port}")
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml_text)
    proc = subprocess.Popen([sys.executable, str(REPO / "launch_cluster.py"), str(topo)], cwd=REPO)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, "launcher exited"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(healthy, "/health 200", timeout=120, interval=0.2)
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 3}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = json.loads(r.read())
        assert body["model"] == "tiny-llama" and body["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
