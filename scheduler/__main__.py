"""Scheduler process: continuous batching over the paged KV cache."""

from cluster.lifecycle import StopFlag, die_with_parent, read_config, setup_logging
from cluster.metrics import dropped_messages
from cluster.process_config import SchedulerConfig
from protocol.transport import sync_context
from scheduler.engine_loop import EngineLoop


def main() -> None:
    die_with_parent()
    cfg = read_config(SchedulerConfig)
    log = setup_logging(cfg)
    stop = StopFlag()
    ctx = sync_context(cfg.security, dropped_messages(cfg.role))
    loop = EngineLoop(cfg, ctx, log)
    log.info("ready")
    loop.run(stop.is_set)
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
