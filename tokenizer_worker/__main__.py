"""tokenizer_worker process: chat templates and tokenization, off the frontend's loop."""

from __future__ import annotations

from protocol import ipc
from protocol.checkpoint import effective_max_model_len, read_model_config
from protocol.lifecycle import StopFlag, die_with_parent, read_config, setup_logging
from protocol.transport import Receiver, Sender, SenderPool, sync_context
from tokenizer_worker.prepare import RequestPreparer
from tokenizer_worker.tokenizer_files import CheckpointTokenizer


def main() -> None:
    die_with_parent()
    cfg = read_config()
    log = setup_logging(cfg)
    stop = StopFlag()
    vocab = read_model_config(cfg.model_path).get("vocab_size")
    preparer = RequestPreparer(CheckpointTokenizer(cfg.model_path),
                               effective_max_model_len(cfg.model_path, cfg.max_model_len),
                               cfg.api, int(vocab) if vocab else None)
    ctx = sync_context()
    inbound: Receiver = Receiver(ctx, cfg.addresses.tokenizer_in[cfg.index],
                                 ipc.TokenizerInbound)
    to_scheduler = Sender(ctx, cfg.addresses.scheduler_in)
    replies = SenderPool(ctx)
    log.info("ready")
    while not stop.is_set():
        req = inbound.recv(timeout_ms=200)
        if req is None:
            continue
        try:
            out = preparer.render(req) if isinstance(req, ipc.RenderReq) else preparer.prepare(req)
        except Exception as exc:  # one bad request must not take the worker down
            log.exception("preparing %s failed", req.rid)
            out = ipc.RequestError(req.rid, 500, f"tokenizer worker error: {exc}",
                                   type="internal_error", code="tokenizer_error")
        if isinstance(out, tuple):
            tokenized, info = out
            replies.send(req.reply_to, info)  # before the scheduler can produce a token
            to_scheduler.send(tokenized)
        else:
            replies.send(req.reply_to, out)
    replies.close()
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
