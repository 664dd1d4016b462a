"""tokenizer_worker process: chat templates and tokenization, off the frontend's loop."""

from __future__ import annotations

import logging
from collections import deque

from cluster.checkpoint import effective_max_model_len, read_model_config
from cluster.lifecycle import StopFlag, die_with_parent, read_config, setup_logging
from cluster.metrics import dropped_messages
from cluster.process_config import TokenizerConfig
from cluster.token_classifier import pair_format
from protocol import ipc
from protocol.transport import Receiver, Sender, SenderPool, sync_context
from tokenization.tokenizer_files import CheckpointTokenizer
from tokenizer_worker.deadline import Watchdog
from tokenizer_worker.memory import TRIM_AFTER_BYTES, release_memory
from tokenizer_worker.metrics import TokenizerMetrics
from tokenizer_worker.prepare import RequestPreparer
from tokenizer_worker.vision import VisionPrompt


def watchdog_limit_s(render_timeout_s: float) -> float:
    """Far past anything a request may legitimately take: a render is cut at its timeout and
    tokenizing a context's worth of text takes well under a second."""
    return 3 * render_timeout_s + 10.0


def _serve_one(req: ipc.GenerateReq | ipc.RenderReq | ipc.PoolReq, preparer: RequestPreparer,
               watchdog: Watchdog, replies: SenderPool, to_scheduler: list[Sender],
               metrics: TokenizerMetrics, log: logging.Logger) -> None:
    preparer.last_text_bytes = 0
    try:
        with watchdog.guard():
            out = (preparer.render(req) if isinstance(req, ipc.RenderReq)
                   else preparer.prepare_pooling(req) if isinstance(req, ipc.PoolReq)
                   else preparer.prepare(req))
    except Exception as exc:  # one bad request must not take the worker down
        log.exception("preparing %s failed", req.rid)
        out = ipc.RequestError(req.rid, 500, f"tokenizer worker error: {exc}",
                               type="internal_error", code="tokenizer_error")
    if isinstance(out, tuple):
        metrics.requests.labels("ok").inc()
        tokenized, info = out
        replies.send(req.reply_to, info)  # before the scheduler can produce a token
        to_scheduler[req.replica if req.replica < len(to_scheduler) else 0].send(tokenized)
    else:
        if isinstance(out, ipc.RequestError):
            metrics.requests.labels("error" if out.status >= 500 else "rejected").inc()
        replies.send(req.reply_to, out)


def main() -> None:
    die_with_parent()
    cfg = read_config(TokenizerConfig)
    log = setup_logging(cfg)
    stop = StopFlag()
    model_config = read_model_config(cfg.model_path)
    vocab = model_config.get("vocab_size")
    preparer = RequestPreparer(CheckpointTokenizer(cfg.model_path),
                               effective_max_model_len(cfg.model_path, cfg.max_model_len),
                               cfg.api, int(vocab) if vocab else None,
                               pair_format(model_config),
                               vision=VisionPrompt.for_checkpoint(cfg.model_path))
    ctx = sync_context(cfg.security, dropped_messages(cfg.role))
    inbound: Receiver = Receiver(ctx, cfg.addresses.tokenizer_in[cfg.index],
                                 ipc.TokenizerInbound)
    # one per engine replica; the frontend's router named the replica in the request
    to_scheduler = [Sender(ctx, addr) for addr in cfg.addresses.schedulers_in()]
    replies = SenderPool(ctx)
    metrics = TokenizerMetrics()
    # Received requests wait here rather than in the socket, so the backlog is visible
    # (a metric) and health probes can go first.
    backlog: deque[ipc.GenerateReq | ipc.RenderReq | ipc.PoolReq] = deque()
    watchdog = Watchdog(watchdog_limit_s(cfg.api.limits.template_render_timeout_s))
    log.info("ready")
    while not stop.is_set():
        if not backlog:
            if not inbound.sock.poll(200):
                continue
        while (more := inbound.recv_nowait()) is not None:
            probe = isinstance(more, (ipc.GenerateReq, ipc.PoolReq)) and more.probe
            (backlog.appendleft if probe else backlog.append)(more)
        more = None
        if not backlog:
            continue
        metrics.queue_depth.set(len(backlog) - 1)
        _serve_one(backlog.popleft(), preparer, watchdog, replies, to_scheduler, metrics, log)
        if preparer.last_text_bytes > TRIM_AFTER_BYTES:
            release_memory()  # the request's text is garbage by now
    replies.close()
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
