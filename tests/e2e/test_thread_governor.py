"""The worker's thread governor: it follows the cores the other processes leave idle
(backing off at the first busy sample, rising only after agreeing samples, never past
the usable cores), keeps more threads only for steps they make faster, says what it
chose; and changing the thread count between steps never changes a token or logprob in
the deterministic mode (checked in a worker-like process: ``MKL_CBWR`` set before torch
loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.thread_governor import WAIT_LIMIT, ThreadGovernor, busy_seconds, run_queue_wait_seconds

REPO = Path(__file__).resolve().parents[2]
WIDE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
            head_dim=64, num_hidden_layers=2)


class Box:
    """A fake box: the clock, the CPUs' busy seconds and this process's CPU seconds,
    advanced by ``tick`` as if the other processes used ``others`` cores and this one
    ``own`` cores for ``dt`` seconds."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.wait = 0.0, 0.0, 0.0, 0.0

    def tick(self, others: float, own: float = 1.0, dt: float = 0.3, waiting: float = 0.0) -> None:
        self.now += dt
        self.busy += (others + own) * dt
        self.own += own * dt
        self.wait += waiting * dt


def governor(box: Box, cores: int = 2, **kw) -> tuple[ThreadGovernor, list[int]]:
    calls: list[int] = []
    gov = ThreadGovernor(cores, calls.append, read_box=lambda: box.busy, read_own=lambda: box.own,
                         read_wait=lambda: box.wait, clock=lambda: box.now, **kw)
    return gov, calls


def step(gov: ThreadGovernor, tokens: int = 32, at_one: float = 0.01, at_more: float = 0.005) -> int:
    """One step whose wall time is ``at_one`` at 1 thread and ``at_more`` above."""
    threads = gov.before_step(tokens)
    gov.after_step(at_one if threads == 1 else at_more)
    return threads


def test_starts_at_one_thread_and_rises_only_after_agreeing_samples():
    box = Box()
    gov, calls = governor(box)
    assert calls == [1] and gov.threads == 1
    box.tick(others=0.1)
    assert gov.before_step(32) == 1 and gov.allowed == 1  # one idle sample is not enough
    gov.after_step(0.01)
    box.tick(others=0.1)
    assert gov.before_step(32) == 2 and gov.allowed == 2 and calls[-1] == 2


def idle_until_two(box: Box, gov: ThreadGovernor, samples: int = 2) -> None:
    """Idle samples enough for the governor to allow 2 threads."""
    for _ in range(samples):
        box.tick(others=0.0)
        step(gov)
    assert gov.allowed == 2


def test_backs_off_at_the_first_busy_sample():
    box = Box()
    gov, calls = governor(box)
    idle_until_two(box, gov, 3)
    assert gov.threads == 2
    box.tick(others=0.9, own=1.1)  # another process took most of a core
    assert gov.before_step(32) == 1 and calls[-1] == 1
    assert gov.others == pytest.approx(0.9)


def test_backs_off_when_its_own_threads_crowd_the_box_and_rises_later_next_time():
    """Its spinning threads fill both cores, so the others look idle, but its threads wait
    on the run queue: back to 1 at once, and the next rise needs twice the idle samples."""
    box = Box()
    gov, _ = governor(box)
    idle_until_two(box, gov)
    box.tick(others=0.0, own=2.0, waiting=WAIT_LIMIT * 3)
    assert step(gov) == 1 and gov.allowed == 1 and gov.waiting == pytest.approx(WAIT_LIMIT * 3)
    rises = []
    for _ in range(6):
        box.tick(others=0.0)
        rises.append(gov.allowed if step(gov) else 0)
    assert rises.index(2) == 3  # four idle samples now, not two


def test_waiting_threads_keep_it_at_one_whatever_the_busy_counts_say():
    box = Box()
    gov, _ = governor(box, cores=8)
    for _ in range(6):
        box.tick(others=0.0, own=1.0, waiting=0.5)
        step(gov, 512)
    assert gov.allowed == 1 and gov.threads == 1


def test_busy_samples_in_between_restart_the_rise():
    box = Box()
    gov, _ = governor(box)
    for others in (0.1, 1.0, 0.1, 1.0, 0.1):
        box.tick(others)
        assert gov.before_step(32) == 1


def test_never_exceeds_the_usable_cores_nor_goes_below_one():
    box = Box()
    gov, calls = governor(box, cores=4)
    for others in [0.0] * 5 + [7.5] * 3 + [-3.0] * 5:  # an idle box, an overloaded one, noise
        box.tick(others, own=0.5)
        step(gov, 512)
        assert 1 <= gov.threads <= 4
    assert max(calls) == 4 and min(calls) == 1


def test_the_free_cores_decide_how_many():
    box = Box()
    gov, _ = governor(box, cores=8)
    for _ in range(3):
        box.tick(others=5.1, own=2.0)  # 2.9 cores free
        gov.before_step(512)
    assert gov.allowed == int(8 - 5.1 + gov.headroom) == 3


def test_more_threads_only_where_they_measured_faster():
    """A step bucket where 2 threads were slower stays at 1 (but for a periodic re-check);
    one where they were faster keeps them."""
    box = Box()
    gov, _ = governor(box, explore_every=8)
    for _ in range(3):
        box.tick(others=0.0)
        gov.before_step(32)
    small, large = [], []
    for _ in range(40):
        t = gov.before_step(32)  # a small decode: 2 threads cost more than they give
        gov.after_step(0.004 if t == 1 else 0.009)
        small.append(t)
        t = gov.before_step(1024)  # a large prefill: 2 threads pay
        gov.after_step(0.9 if t == 1 else 0.5)
        large.append(t)
    assert small[:2] == [1, 2] and large[:2] == [1, 2]  # each measured both ways first
    assert small[10:].count(2) <= 5 and large[10:].count(1) <= 5  # the re-checks only
    assert small[-3:] == [1, 1, 1] and large[-3:] == [2, 2, 2]


def test_rechecks_back_off_while_more_threads_keep_losing_and_a_change_is_found():
    box = Box()
    gov, _ = governor(box, explore_every=8)
    for _ in range(3):
        box.tick(others=0.0)
        step(gov, at_one=0.004, at_more=0.009)
    # the box stays idle (no sample is due: the fake clock stands still)
    losing = [step(gov, at_one=0.004, at_more=0.009) for _ in range(2000)]
    assert losing.count(2) <= 10  # re-checks after 8, 16, 32, ... steps, not every 8
    assert losing[-1] == 1
    winning = [step(gov, at_one=0.004, at_more=0.002) for _ in range(8 * 64 + 2)]
    assert winning[-1] == 2  # found within the longest re-check interval


def test_describe_says_the_choice_and_how_to_fix_it():
    box = Box()
    assert governor(box, cores=1)[0].describe().startswith("1 (1 usable core")
    text = governor(box, cores=6)[0].describe()
    assert text.startswith("adaptive, 1 to 6 (6 usable cores") and "--worker-threads" in text


def test_busy_seconds_reads_only_the_given_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  300 0 100 900 50 0 0 0 0 0\n"
                    "cpu0 100 0 50 400 25 0 0 0 0 0\n"
                    "cpu1 200 0 50 500 25 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert busy_seconds(frozenset({1}), str(stat)) == pytest.approx(250 / tick)
    assert busy_seconds(frozenset({0, 1}), str(stat)) == pytest.approx(400 / tick)
    assert busy_seconds(frozenset({0}), str(tmp_path / "missing")) is None


def test_run_queue_wait_sums_every_thread(tmp_path):
    for tid, stat in (("10", "500 2000000000 7\n"), ("11", "9 500000000 1\n")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(stat)
    (tmp_path / "12").mkdir()  # a thread that ended between the listing and the read
    assert run_queue_wait_seconds(str(tmp_path)) == pytest.approx(2.5)
    assert run_queue_wait_seconds(str(tmp_path / "none")) is None
    assert run_queue_wait_seconds() is not None  # this kernel has schedstat


# ---------------------------------------------------------------- through the launcher


def test_the_start_up_log_says_what_was_chosen(tiny_model_dir, tmp_path):
    """By default the launcher and the worker say the count is adaptive and up to how
    many cores; ``--worker-threads`` fixes it and the worker says so. Both serve."""
    from tests.support.server import CandorServer

    cores = len(os.sched_getaffinity(0))
    env = {"OMP_NUM_THREADS": ""}  # an operator's value would fix the count
    for flags, launcher_says, worker_says in (
            ((), f"gpu_worker threads: adaptive, 1 to {cores} (",
             f"threads: {'adaptive, 1 to %d (%d usable cores' % (cores, cores) if cores > 1 else '1 (1 usable core'}"),
            (("--worker-threads", "1"), None, "threads: --worker-threads 1")):
        log = tmp_path / f"log{len(flags)}"
        srv = CandorServer(tiny_model_dir, "--served-model-name", "tiny", "--max-model-len", "256",
                           *flags, env=env).start(log_path=log)
        try:
            status, body = srv.post_json("/v1/completions", {"model": "tiny", "prompt": "hello",
                                                              "max_tokens": 4, "temperature": 0})
        finally:
            assert srv.stop() == 0
        text = log.read_text()
        assert status == 200, body
        assert worker_says in text, text[-3000:]
        if launcher_says:
            assert launcher_says in text, text[-3000:]
        else:
            assert "gpu_worker threads:" not in text


# ---------------------------------------------------------------- determinism


# "wide": matmuls (512 x 1536) and elementwise ops large enough that MKL and torch really
# split them over the threads (the zoo's 64-wide models run every op on one thread).
@pytest.mark.parametrize("arch", ["wide", "qwen3_moe"])
def test_changing_threads_between_steps_keeps_every_bit(arch, tmp_path):
    """The deterministic scenarios (alone, busy batches, prefix hits, preemption, greedy
    and seeded) at 1 thread, at 2 throughout, and switching 1/2 at every step: the same
    tokens and logprobs, bit for bit. Run as the worker runs: MKL_CBWR set before torch."""
    env = {**os.environ, "MKL_CBWR": "AUTO,STRICT", "PYTHONPATH": str(REPO)}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.e2e.test_thread_governor", arch,
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "identical" in proc.stdout


def _child(arch: str, where: Path) -> None:
    import torch

    from gpu_worker.model_runner import ModelRunner
    from tests.support import model_zoo
    from tests.unit.gpu_worker.test_deterministic_runner import GREEDY, SEEDED, _scenarios, serve

    path = model_zoo.build("qwen2", where / arch, **WIDE) if arch == "wide" else model_zoo.build(arch, where / arch)
    runner = ModelRunner(str(path), num_blocks=400)
    assert runner.deterministic, runner.deterministic_note
    execute = runner.execute

    def run_all(pattern: list[int]) -> dict:
        steps = iter(range(10**9))

        def switching(plan):
            torch.set_num_threads(pattern[next(steps) % len(pattern)])
            return execute(plan)

        runner.execute = switching
        try:
            return {(p_name, name): serve(runner, reqs, **opts)["t"].out
                    for p_name, params in (("greedy", GREEDY), ("seeded", SEEDED))
                    for name, (reqs, opts) in _scenarios(params).items()}
        finally:
            runner.execute = execute

    want = run_all([1])
    for pattern in ([2], [1, 2]):
        got = run_all(pattern)
        bad = [key for key in want if got[key] != want[key]]
        assert not bad, f"threads {pattern}: {bad} differ from 1 thread"
    print("identical")


if __name__ == "__main__":
    _child(sys.argv[1], Path(sys.argv[2]))
