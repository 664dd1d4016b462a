"""Detokenizer process: ids from the scheduler in, text deltas to frontends out.

It also listens to the launchers' NodeStatus: when an engine replica is lost its
scheduler will never finish the requests it held, so their decoding state is freed here
(the frontends fail those requests themselves) and late starts for it are ignored.
"""

from __future__ import annotations

import logging
import os

import zmq
from tokenizers import Tokenizer

from cluster.lifecycle import StopFlag, die_with_parent, read_config, setup_logging
from cluster.metrics import dropped_messages
from cluster.process_config import DetokenizerConfig
from protocol import ipc
from protocol.health import NodeStatus
from protocol.transport import Receiver, Sender, SenderPool, sync_context
from detokenizer.incremental import RequestDetokenizer
from detokenizer.logprobs import TokenTexts


class _Live:
    __slots__ = ("detok", "reply_to", "prompt_tokens", "prompt_ids", "cached_tokens",
                 "replicas")

    def __init__(self, detok: RequestDetokenizer, reply_to: str, prompt_tokens: int,
                 prompt_ids: list[int] | None, replicas: tuple[int, ...] = (0,)) -> None:
        self.replicas = replicas  # serving it: one, or prefill and decode
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
    return failure.error(out.rid)


class Detokenizer:
    """The per-request decoding state of this process and what it does per message."""

    def __init__(self, tokenizer: Tokenizer, to_schedulers: list[Sender],
                 to_frontends: SenderPool, log: logging.Logger) -> None:
        from prometheus_client import Gauge

        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)
        self.to_schedulers = to_schedulers  # a stop-string abort goes to the request's replica
        self.to_frontends = to_frontends
        self.log = log
        self.live: dict[str, _Live] = {}
        self.lost_replicas: set[int] = set()
        self.tracked = Gauge("candor_detokenizer_requests", "Requests whose decoding state "
                             "a detokenizer holds (started, not yet finished)",
                             multiprocess_mode="livesum", registry=None)
        self._tracked = 0

    def _track(self) -> None:
        """The gauge follows ``live`` (written only when its size changed: ~9 us each)."""
        if len(self.live) != self._tracked:
            self._tracked = len(self.live)
            self.tracked.set(self._tracked)

    def start(self, msg: ipc.DetokStart) -> None:
        replicas = (msg.replica,) if msg.decode_replica < 0 else (msg.replica,
                                                                  msg.decode_replica)
        if self.lost_replicas.intersection(replicas):
            return  # sent before its replica died: it never gets a token
        self.live[msg.rid] = _Live(RequestDetokenizer(self.tokenizer, msg.detok, msg.prompt_tail),
                                   msg.reply_to, msg.prompt_tokens, msg.prompt_token_ids,
                                   replicas=replicas)
        self._track()

    def tokens(self, msg: ipc.TokenBatch) -> None:
        live = self.live
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
                    for replica in state.replicas:
                        self.to_schedulers[replica].send(ipc.Abort(out.rid, "stop_string"))
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
                    self.texts.decode(out.logprobs[:len(consumed)] if out.logprobs else None),
                    self.texts.decode(out.prompt_logprobs),
                    text_offsets=detok.offsets[before:detok.num_tokens] if out.logprobs else None,
                    stop_string=detok.stop_string if finish is not None else None,
                    # the engine's counts so far: on the last delta, whoever ended it
                    spec_drafted=out.spec_drafted if finish is not None else 0,
                    spec_accepted=out.spec_accepted if finish is not None else 0))
                state.prompt_ids = None
            if finish is not None:
                del live[out.rid]
        for reply_to, items in outgoing.items():
            self.to_frontends.send(reply_to, ipc.TextDeltas(items))
        for reply_to, err in errors:
            self.to_frontends.send(reply_to, err)
        self._track()

    def node_status(self, msg: NodeStatus) -> None:
        for replica in msg.lost_replicas:
            if replica in self.lost_replicas:
                continue
            self.lost_replicas.add(replica)
            gone = [rid for rid, state in self.live.items() if replica in state.replicas]
            for rid in gone:
                del self.live[rid]
            self._track()
            self.log.warning("engine replica %d was lost; freed the state of its %d "
                             "request(s)", replica, len(gone))


def main() -> None:
    die_with_parent()
    cfg = read_config(DetokenizerConfig)
    log = setup_logging(cfg)
    stop = StopFlag()
    tokenizer = Tokenizer.from_file(os.path.join(cfg.model_path, "tokenizer.json"))
    ctx = sync_context(cfg.security, dropped_messages(cfg.role))
    inbound: Receiver = Receiver(ctx, cfg.addresses.detokenizer_in[cfg.index],
                                 ipc.DetokenizerInbound)
    status: Receiver = Receiver(ctx, cfg.addresses.node_status, NodeStatus, bind=False,
                                kind=zmq.SUB)
    poller = zmq.Poller()
    poller.register(inbound.sock, zmq.POLLIN)
    poller.register(status.sock, zmq.POLLIN)
    to_frontends = SenderPool(ctx)
    work = Detokenizer(tokenizer, [Sender(ctx, addr) for addr in cfg.addresses.schedulers_in()],
                       to_frontends, log)
    log.info("ready")

    while not stop.is_set():
        events = dict(poller.poll(200))
        if status.sock in events:
            while (update := status.recv_nowait()) is not None:
                work.node_status(update)
        if inbound.sock not in events:
            continue
        while (msg := inbound.recv_nowait()) is not None:
            if isinstance(msg, ipc.DetokStart):
                work.start(msg)
            else:
                work.tokens(msg)

    to_frontends.close()
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
