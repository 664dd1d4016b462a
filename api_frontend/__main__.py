"""api_frontend process: aiohttp on uvloop. Several can share one port (SO_REUSEPORT);
the launcher checked that no other server holds it before starting them.

SIGTERM drains: new generation requests and /health get 503 (so a load balancer moves
away) while in-flight requests finish, up to the topology's drain_timeout_s; streams
still open then end with an error frame and [DONE]. SIGINT is the launcher's to handle
(Ctrl-C reaches the whole process group; the launcher turns it into this drain).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import uvloop
from aiohttp import web

from api_frontend.app import build_app
from api_frontend.app_keys import LOG_REQUESTS_KEY
from api_frontend.auth import ApiKeys, keys_from_env
from api_frontend.cors import cors_middleware
from api_frontend.engine_client import EngineClient
from api_frontend.http_server import JsonErrorAppRunner
from api_frontend.metrics import FrontendMetrics
from api_frontend.ops import Ops, install_ops
from api_frontend.endpoints.responses.peers import ResponsePeers
from api_frontend.endpoints.responses.store import ResponseStore, StoreMetrics
from api_frontend.served_models import ServedModel, ServedModels
from api_frontend.topology_watch import TopologyWatch
from cluster.checkpoint import effective_max_model_len, takes_images
from cluster.pooling import read_pooling_config
from cluster.lifecycle import die_with_parent, read_config, setup_logging
from cluster.process_config import FrontendConfig
from protocol.openai_api import ModelCard


def served_models(cfg: FrontendConfig, engine: EngineClient) -> ServedModels:
    """Every model the topology serves, each reaching its own engines."""
    now = int(time.time())
    models = []
    for i, served in enumerate(cfg.served()):
        name = served.names[0]
        card = ModelCard(id=name, created=now, root=name, max_model_len=effective_max_model_len(
            served.model_path, served.max_model_len))
        pooling = read_pooling_config(served.model_path) if served.runner == "pooling" else None
        vision = served.runner == "generate" and takes_images(served.model_path)
        models.append(ServedModel(card, served.names[1:], served.runner, engine.view(i),
                                  pooling, vision))
    return ServedModels(models, engine.adapters)


async def serve() -> None:
    cfg = read_config(FrontendConfig)
    log = setup_logging(cfg)
    metrics = FrontendMetrics()
    engine = EngineClient(cfg, metrics)
    engine.start()

    def on_lost(role: str, index: int, why: str) -> None:
        if role == "detokenizer":  # its per-request decoding state is gone
            n = engine.fail_requests(f"request lost: {why}", "detokenizer_lost", index)
            if n:
                log.warning("failed %d requests: %s", n, why)
        elif role == "tokenizer_worker":  # stateless, but what it held is gone
            n = engine.fail_requests(f"request lost: {why} before handing it to the engine; retry",
                                     "tokenizer_lost", tokenizer=index)
            if n:
                log.warning("failed %d requests: %s", n, why)

    def on_failed(why: str) -> None:
        n = engine.fail_requests(f"the topology is stopping: {why}", "topology_stopping")
        log.warning("topology failed (%s); failed %d in-flight requests", why, n)

    def on_replica_lost(replica: int, why: str) -> None:
        n = engine.replica_lost(replica, why)
        log.warning("engine replica %d left rotation (%s); failed its %d requests",
                    replica, why, n)

    watch = TopologyWatch(engine.ctx, cfg, on_lost, on_failed, on_replica_lost)
    watch.start()
    store = ResponseStore(cfg.api.responses_store, StoreMetrics())
    peers = ResponsePeers(store, cfg.index, cfg.addresses.frontend_results, engine.reply_to,
                          engine.ctx, store.metrics)
    engine.on_peer_message = peers.on_message
    app = build_app(engine, served_models(cfg, engine), cfg.http.max_body_mb * 2**20, cfg.api,
                    cfg.http.body_read_timeout_s, peers, cfg.lora)
    app[LOG_REQUESTS_KEY] = cfg.http.log_requests
    ops = Ops(cfg, engine, watch, metrics)
    install_ops(app, ops)
    keys = ApiKeys(keys_from_env(os.environ), cfg.http.protect_ops)
    if keys.enabled:
        app.middlewares.insert(0, keys.middleware())
    if cfg.http.cors.allowed_origins:
        app.middlewares.insert(0, cors_middleware(cfg.http.cors))
    server_level = cfg.http.server_log_level
    logging.getLogger("aiohttp").setLevel(
        logging.DEBUG if server_level == "trace" else server_level.upper())
    access_log = logging.getLogger("aiohttp.access") if server_level in ("debug", "trace") \
        else None
    lag = asyncio.create_task(metrics.watch_loop_lag())
    runner = JsonErrorAppRunner(app, handler_cancellation=True, access_log=access_log,
                                shutdown_timeout=2.0,
                                keepalive_timeout=cfg.http.keepalive_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, cfg.http.host, cfg.http.port, reuse_port=True)
    await site.start()
    log.info("listening on http://%s:%d", cfg.http.host, cfg.http.port)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopped.set)
    await stopped.wait()
    inflight = engine.inflight
    log.info("draining: %d requests in flight, up to %.0fs", inflight,
             cfg.supervision.drain_timeout_s)
    cut = await ops.drain()
    if cut:
        log.warning("drain timeout: ended %d requests with an error", cut)
    lag.cancel()
    watch.stop()
    await runner.cleanup()
    peers.close()
    await engine.close()


def main() -> None:
    die_with_parent()  # also ignores SIGINT: the launcher drives the shutdown
    uvloop.run(serve())


if __name__ == "__main__":
    main()
