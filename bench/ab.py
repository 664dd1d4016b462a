"""A/B: this checkout (or ``--head REF``) against any commit, same workload, same flags.

    python -m bench.ab --base main                       # the quick default: workload a
    python -m bench.ab --base main --workloads a,b,c --server-args "--worker-threads 1"

The base (and a ``--head REF``) is a git worktree of that commit under the cache
directory, reused on later runs. It runs with this venv when its pyproject dependencies
are the ones this checkout lists, else with a venv built for them once (layered over
this one, so only what differs is installed); the header says which. Both servers are
up together; rounds alternate which goes first; every round is printed, then each
metric's min/median/max per side, the head/base ratios round pair by round pair, a
profile (CPU per process role, step-loop phases) and a warning if other processes were
busy on the box before or during the rounds. After a model's workloads each side's RSS
is printed, with its largest process role.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from bench import box, procstat
from bench.compare import measure_rss, rss_line
from bench.profile import profile_table
from bench.rounds import add_round_args, foreign_warning, policy_from, run_rounds
from bench.servers import REPO, WARMUP, candor_server, start_warm
from bench.stats import summary_table
from bench.workloads import KV_BLOCKS, WORKLOADS, build_models, by_model, parse_workloads
from launcher.gguf_checkpoint import is_gguf, prepare

DEFAULT_CACHE = Path.home() / ".cache" / "candor" / "bench"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def resolve(repo: Path, ref: str) -> str:
    """The full commit id ``ref`` names (a SystemExit saying so if none)."""
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"{ref!r} names no commit in {repo}") from None


def worktree(repo: Path, sha: str, cache: Path) -> tuple[Path, bool]:
    """A clean, detached worktree of ``sha`` under ``cache/worktrees``; True when an
    existing one was reused (same commit, no tracked file changed)."""
    path = cache / "worktrees" / sha[:12]
    if (path / ".git").exists():
        try:
            if (git(path, "rev-parse", "HEAD") == sha
                    and not git(path, "status", "--porcelain", "--untracked-files=no")):
                return path, True
        except subprocess.CalledProcessError:
            pass
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)],
                       capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    # --force: the path may still be registered from a worktree whose folder was deleted
    git(repo, "worktree", "add", "--force", "--detach", str(path), sha)
    return path, False


def dependencies(pyproject: str) -> list[str]:
    return sorted(tomllib.loads(pyproject)["project"].get("dependencies", []))


def python_for(deps: list[str], current: list[str], cache: Path) -> tuple[str, str]:
    """The interpreter for a checkout that lists ``deps``, and a note saying how it was
    chosen: this venv when ``deps == current`` (what this checkout lists), else a venv
    kept under ``cache/venvs`` for exactly those dependencies. That venv sees this one's
    packages through a .pth line (placed after its own), so pip installs only the
    requirements this venv does not meet, and torch is never downloaded again."""
    if deps == current:
        return sys.executable, "this venv (identical dependencies)"
    key = hashlib.sha256("\n".join(deps).encode()).hexdigest()[:12]
    path = cache / "venvs" / key
    python = path / "bin" / "python"
    done = path / ".candor-complete"
    if done.exists():
        return str(python), f"venv {path} (built earlier for these dependencies)"
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True,
                          text=True).stdout.strip()
    Path(site, "zz-candor-bench-parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    *deps], check=True)
    done.write_text("\n".join(deps) + "\n")
    added = sorted(set(deps) - set(current))
    return str(python), (f"venv {path}, built now: its dependencies differ from this "
                         f"checkout's ({', '.join(added) or 'fewer requirements'})")


@dataclass
class Side:
    name: str  # base | head
    repo: Path
    python: str
    about: str  # what was checked out and which interpreter, for the header


def checkout_side(name: str, ref: str | None, cache: Path, current: list[str]) -> Side:
    """``ref`` None: this working tree as it is (uncommitted changes included)."""
    if ref is None:
        sha = git(REPO, "rev-parse", "HEAD")
        dirty = " + uncommitted changes" if git(REPO, "status", "--porcelain",
                                                "--untracked-files=no") else ""
        return Side(name, REPO, sys.executable,
                    f"working tree {REPO} at {sha[:10]}{dirty}; python: this venv")
    sha = resolve(REPO, ref)
    path, reused = worktree(REPO, sha, cache)
    python, how = python_for(dependencies(git(REPO, "show", f"{sha}:pyproject.toml")),
                             current, cache)
    subject = git(REPO, "log", "-1", "--format=%s", sha)[:60]
    return Side(name, path, python, f"{ref} = {sha[:10]} ({subject}); worktree {path} "
                f"({'reused' if reused else 'created'}); python: {how}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="commit, branch or tag to compare against")
    p.add_argument("--head", default=None,
                   help="a commit to measure instead of this working tree")
    p.add_argument("--workloads", default="a",
                   help=f"comma-separated, or 'all': {', '.join(WORKLOADS)} (see "
                   "bench/workloads.py); the default, a, takes a few minutes")
    add_round_args(p, 5, None)
    p.add_argument("--server-args", default="",
                   help="extra `candor serve` flags for both sides, e.g. '--worker-threads 1'")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                   help="worktrees, venvs and checkpoints are kept here")
    p.add_argument("--json", type=Path, default=None, help="also write every round here")
    a = p.parse_args(argv)

    names = parse_workloads(a.workloads)
    policy = policy_from(a)
    extra = shlex.split(a.server_args)
    current = dependencies((REPO / "pyproject.toml").read_text())
    sides = [checkout_side("base", a.base, a.cache_dir, current),
             checkout_side("head", a.head, a.cache_dir, current)]
    for s in sides:
        print(f"{s.name}: {s.about}")
    before = box.sample_before_run()
    cpus = procstat.box_busy_s()[1]
    print(box.describe_before(before, cpus))
    print(f"rounds: {policy.min_rounds} to {policy.max_rounds} (more while tok/s deviates "
          f"over {policy.wide:.0%}), {policy.warmup_rounds} warm-up round(s) per side, "
          "order alternating")
    models = build_models(a.cache_dir / "models", list(by_model(names)))
    results: dict[str, dict] = {}
    logs = Path(tempfile.mkdtemp(prefix="candor-ab-"))
    try:
        for model, wls in by_model(names).items():
            servers = [candor_server(models[model], model, None, KV_BLOCKS.get(model), extra,
                                     name=s.name, repo=s.repo, python=s.python, log_dir=logs)
                       for s in sides]
            print(f"server command (both sides, each from its checkout): "
                  f"{servers[0].command_line}")
            # a GGUF model (the real workloads): prompts go as text, through its tokenizer
            tokenizer = prepare(str(models[model])) / "tokenizer.json" if is_gguf(models[model]) else None
            try:
                start_warm(servers, model, warmup=replace(WARMUP, text_tokenizer=str(tokenizer))
                           if tokenizer else WARMUP)
                for wl in wls:
                    bench = WORKLOADS[wl].with_tokenizer(tokenizer) if tokenizer else WORKLOADS[wl]
                    print(f"\nworkload {wl}: {bench.describe()}")
                    per_side = run_rounds(servers, bench, policy, wl)
                    results[wl] = {"describe": bench.describe(), "rounds": per_side}
                    print(f"\nworkload {wl}: {bench.describe()}, "
                          f"{len(per_side['head'])} rounds")
                    print(summary_table(per_side, ("head", "base")))
                    print(profile_table(per_side, ("head", "base")))
                    if warning := foreign_warning(per_side):
                        print(warning)
                print(rss_line(measure_rss(servers)))  # each side's, by process role
            finally:
                for s in servers:
                    s.stop()
    finally:
        others = [r["others_cores"] for res in results.values()
                  for rounds in res["rounds"].values() for r in rounds]
        warning = box.busy_warning(before, others, cpus)
        if warning:
            print("\n" + warning)
        if a.json:
            a.json.write_text(json.dumps({"sides": [s.__dict__ for s in sides],
                                          "box_before": before.__dict__, "warning": warning,
                                          "workloads": results}, indent=2, default=str))
        shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
