"""Detokenizer process: ids from the scheduler in, text deltas to frontends out."""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from cluster.lifecycle import StopFlag, die_with_parent, read_config, setup_logging
from cluster.process_config import DetokenizerConfig
from protocol import ipc
from protocol.transport import Receiver, Sender, SenderPool, sync_context
from detokenizer.incremental import RequestDetokenizer
from detokenizer.logprobs import TokenTexts


class _Live:
    __slots__ = ("detok", "reply_to", "prompt_tokens", "prompt_ids", "cached_tokens", "replica")

    def __init__(self, detok: RequestDetokenizer, reply_to: str, prompt_tokens: int,
                 prompt_ids: list[int] | None, replica: int = 0) -> None:
        self.replica = replica
        self.detok = detok
        self.reply_to = reply_to
        self.prompt_tokens = prompt_tokens
        self.prompt_ids = prompt_ids  # sent once, on the first delta
        self.cached_tokens = 0  # prefix-cache hit, known with the first token


def _request_error(out: ipc.TokenOutput) -> ipc.RequestError:
    """What a client is told about a request the engine ended with an error: why it
    failed on its own, or that a step it was in failed."""
    failure = out.failure
    if failure is None:
        return ipc.RequestError(out.rid, 500, "the engine failed while generating this request",
                                type="internal_error", code="engine_error")
    kind = "invalid_request_error" if 400 <= failure.status < 500 else "internal_error"
    return ipc.RequestError(out.rid, failure.status, failure.message, type=kind,
                            param=failure.param, code=failure.code)


def main() -> None:
    die_with_parent()
    cfg = read_config(DetokenizerConfig)
    log = setup_logging(cfg)
    stop = StopFlag()
    tokenizer = Tokenizer.from_file(os.path.join(cfg.model_path, "tokenizer.json"))
    ctx = sync_context(cfg.security)
    inbound: Receiver = Receiver(ctx, cfg.addresses.detokenizer_in[cfg.index],
                                 ipc.DetokenizerInbound)
    # one per engine replica: a stop-string abort goes to the replica running the request
    to_schedulers = [Sender(ctx, addr) for addr in cfg.addresses.schedulers_in()]
    to_frontends = SenderPool(ctx)
    live: dict[str, _Live] = {}
    texts = TokenTexts(tokenizer)
    log.info("ready")

    while not stop.is_set():
        msg = inbound.recv(timeout_ms=200)
        if msg is None:
            continue
        if isinstance(msg, ipc.DetokStart):
            live[msg.rid] = _Live(RequestDetokenizer(tokenizer, msg.detok, msg.prompt_tail),
                                  msg.reply_to, msg.prompt_tokens, msg.prompt_token_ids,
                                  replica=msg.replica)
            continue
        outgoing: dict[str, list[ipc.TextDelta]] = {}
        errors: list[tuple[str, ipc.RequestError]] = []
        for out in msg.outputs:
            state = live.get(out.rid)
            if state is None:
                continue  # already finished by a stop string; late ids are dropped
            if out.cached_tokens is not None:
                state.cached_tokens = out.cached_tokens
            detok = state.detok
            before = detok.num_tokens
            finish = out.finish_reason
            # "stop" from the engine: the last id is EOS or a stop_token_ids id
            detok.add_tokens(out.token_ids, stopping=finish == "stop")
            consumed = out.token_ids[:detok.num_tokens - before]
            if detok.stopped and finish in (None, "length"):  # the text was cut by a stop string
                if finish is None:
                    to_schedulers[state.replica].send(ipc.Abort(out.rid, "stop_string"))
                finish = "stop"
            if finish == "error":
                errors.append((state.reply_to, _request_error(out)))
                del live[out.rid]
                continue
            delta = detok.take_delta(final=finish is not None)
            if delta or consumed or finish is not None:
                outgoing.setdefault(state.reply_to, []).append(ipc.TextDelta(
                    out.rid, delta, finish, state.prompt_tokens, detok.num_tokens, consumed,
                    state.prompt_ids, state.cached_tokens,
                    texts.decode(out.logprobs[:len(consumed)] if out.logprobs else None),
                    texts.decode(out.prompt_logprobs)))
                state.prompt_ids = None
            if finish is not None:
                del live[out.rid]
        for reply_to, items in outgoing.items():
            to_frontends.send(reply_to, ipc.TextDeltas(items))
        for reply_to, err in errors:
            to_frontends.send(reply_to, err)

    to_frontends.close()
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
