"""gpu_worker process: owns the weights and the KV cache, runs the steps it is sent.

One process per tensor-parallel rank of an engine replica (``cfg.tp_rank``; ``cfg.index``
counts across replicas). Every rank subscribes
to the scheduler's plan publisher and runs every plan; rank 0 alone answers (ready,
results, errors). A rank other than 0 holds nothing worth draining and may be blocked in
a collective a dead peer will never join, so SIGTERM ends it at once.

``main`` loads the model and sizes the threads; the loop (``worker_loop.WorkerLoop``)
then owns the sockets and runs a step per plan.
"""

from __future__ import annotations

import os
import signal
import time

from cluster.checkpoint import effective_max_model_len
from cluster.lifecycle import StopFlag, die_with_parent, read_config, setup_logging
from cluster.pooling import read_pooling_config
from cluster.process_config import WorkerConfig


def fixed_threads(asked: int | None) -> tuple[int | None, str]:
    """The operator's thread count (``--worker-threads``, else ``OMP_NUM_THREADS``) and
    where it came from; (None, "") leaves it to the ``ThreadGovernor``."""
    if asked:
        return asked, f"--worker-threads {asked}"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    return None, ""


def main() -> None:
    die_with_parent()
    cfg = read_config(WorkerConfig)
    log = setup_logging(cfg)
    stop = StopFlag()
    rank, size = cfg.tp_rank, cfg.tensor_parallel
    if size > 1:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    if cfg.engine.deterministic is not False:
        # MKL's strict reproducibility mode: a GEMM row's result no longer depends on how
        # the rows split over threads (see batch_invariant); read when MKL loads, with torch.
        os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    import torch  # only this role pays for torch

    from gpu_worker.distributed import init_ranks
    from gpu_worker.kv_budget import resolve_device
    from gpu_worker.model_runner import ModelRunner
    from gpu_worker.thread_governor import for_this_process, usable_cpus
    from gpu_worker.worker_loop import WorkerLoop  # (its KV connectors import torch)

    eng = cfg.engine
    spec = eng.speculative_config
    device, device_why = resolve_device(eng.device)
    if size > 1 and device == "cuda" and torch.cuda.device_count() > 1:
        device = f"cuda:{rank % torch.cuda.device_count()}"  # no per-rank device list given
    threads, threads_why = fixed_threads(eng.worker_threads)
    # Loading (and the start-up measurements) runs while the other roles wait: a core
    # left to them, the rest split between this host's ranks; then the governor decides.
    torch.set_num_threads(threads or max(1, (len(usable_cpus()) - 1) // size))
    log.info("device %s (%s)", device, device_why)
    ranks = init_ranks(rank, size, cfg.tp_address, torch.device(device), cfg.tp_interface)
    started = time.perf_counter()
    runner = ModelRunner(
        cfg.model_path, device=device, dtype=cfg.dtype, block_size=eng.block_size,
        num_blocks=eng.num_kv_blocks,
        kv_cache_memory_bytes=eng.kv_cache_memory_mb * 2**20 if eng.kv_cache_memory_mb else None,
        gpu_memory_utilization=eng.gpu_memory_utilization,
        max_model_len=effective_max_model_len(cfg.model_path, cfg.max_model_len),
        load_format=cfg.load_format, seed=eng.seed, enforce_eager=eng.enforce_eager,
        max_num_seqs=eng.max_num_seqs, ranks=ranks, deterministic=eng.deterministic,
        pooling=read_pooling_config(cfg.model_path) if cfg.runner == "pooling" else None,
        lora=cfg.lora,
        forced_drafts=spec.num_speculative_tokens if spec is not None else 0,
        draft_model=spec.model if spec is not None and spec.method in ("draft_model", "eagle3")
        else None,
        draft_method=spec.method if spec is not None else "draft_model")
    kv_mib = runner.num_blocks * runner.block_bytes / 2**20
    log.info("rank %d/%d: model loaded in %.2fs (%d threads), dtype %s (%s); KV cache %d blocks "
             "= %.0f MiB = %d tokens (%s)", rank, size, time.perf_counter() - started,
             torch.get_num_threads(), str(runner.dtype).removeprefix("torch."),
             runner.dtype_reason, runner.num_blocks, kv_mib,
             runner.num_blocks * runner.block_size, runner.kv_reason)
    log.info("deterministic mode %s", runner.deterministic_note)
    governor = None if threads else for_this_process(torch.set_num_threads)
    log.info("threads: %s", threads_why or governor.describe())

    WorkerLoop(cfg, runner, governor).run(stop)


if __name__ == "__main__":
    main()
