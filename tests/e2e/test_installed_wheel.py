"""The wheel, installed (not editable) into a fresh virtual environment, serves from
outside the checkout: every package and data file the processes need at run time is in
it. The editable install and the Docker image run from the source tree, so they would
hide a package or a kernel source left out of the wheel.

Torch and the other dependencies are not downloaded again: the fresh environment sees
the project environment's site-packages through a ``.pth`` line (a plain path entry, so
that directory's own ``.pth`` files, the editable install's finder among them, stay
inactive) and the wheel is installed with ``--no-deps``.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path

import pytest

from tests.support.server import REPO, CandorServer

# what a wheel build reads from the checkout: the packages (discovered) and the metadata
_SKIP = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist",
                               ".hypothesis", ".pytest_cache", "tests", "deploy", "docs", ".ci")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _purelib(venv: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """(fresh venv, environment without the checkout on any path, a directory outside it)."""
    root = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    source = root / "source"
    shutil.copytree(REPO, source, ignore=_SKIP)
    wheels = root / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(wheels), str(source)], root, env)
    shutil.rmtree(source)  # nothing may fall back to the copied sources
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, env)
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (_purelib(venv) / "project_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    wheel = next(wheels.glob("candor_serve-*.whl"))
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index",
          "--ignore-installed", "-q", str(wheel)], root, env)
    outside = root / "elsewhere"
    outside.mkdir()
    return venv, env, outside


def test_installed_packages_come_from_the_wheel(installed):
    """Every package of the checkout (but the tests), every module of each."""
    venv, env, outside = installed
    packages = sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests")
    code = ("import importlib, json, pkgutil\n"
            "import launch_cluster\n"
            "names = ['launch_cluster']\n"
            f"for top in {packages!r}:\n"
            "    pkg = importlib.import_module(top)\n"
            "    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, top + '.')\n"
            "              if not m.name.endswith('__main__')]\n"
            "print(json.dumps({n: importlib.import_module(n).__file__ for n in names}))\n")
    files = json.loads(_run([str(venv / "bin" / "python"), "-c", code], outside, env))
    assert "gpu_worker.models.decoder" in files  # a subpackage the old hand-made list left out
    # (walk_packages skips a folder without __init__.py: kv_connectors/ had none)
    assert {"gpu_worker.kv_connectors.registry", "scheduler.kv_connectors.registry"} <= set(files)
    outside_venv = {n: f for n, f in files.items() if not f.startswith(str(venv))}
    assert not outside_venv, f"imported from outside the installed wheel: {outside_venv}"


def test_installed_wheel_holds_the_data_files(installed):
    """The kernel sources and the tiny model's corpus and template (read at run time; a
    kernel source left out would only show as a slower fallback)."""
    venv, _, _ = installed
    purelib = _purelib(venv)
    data = [p.relative_to(REPO) for top in REPO.glob("*/__init__.py") if top.parent.name != "tests"
            for p in top.parent.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc", ".sh")]
    assert any(p.name == "paged_decode.cpp" for p in data)
    missing = [str(p) for p in data if not (purelib / p).is_file()]
    assert not missing, f"left out of the wheel: {missing} (under {purelib})"


def test_installed_candor_serves_the_tiny_model_from_outside_the_checkout(installed):
    venv, env, outside = installed
    model = outside / "tiny-llama"
    _run([str(venv / "bin" / "candor"), "make-tiny-model", str(model)], outside, env)
    srv = CandorServer(model, "--served-model-name", "tiny-llama", "--max-model-len", "256")
    srv.cmd = [str(venv / "bin" / "candor"), *srv.cmd[2:]]
    srv.env, srv.cwd = env, outside
    srv.start()
    try:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello!"}],
                "max_tokens": 8, "temperature": 0}
        req = urllib.request.Request(srv.base_url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            reply = json.loads(resp.read())
        assert reply["usage"]["completion_tokens"] == 8
        assert reply["choices"][0]["message"]["content"]
    finally:
        assert srv.stop() == 0
