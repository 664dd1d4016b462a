"""api_frontend process: aiohttp on uvloop. Several can share one port (SO_REUSEPORT)."""

from __future__ import annotations

import asyncio
import signal
import time

import uvloop
from aiohttp import web

from api_frontend.app import build_app
from api_frontend.engine_client import EngineClient
from protocol.checkpoint import effective_max_model_len
from protocol.lifecycle import die_with_parent, read_config, setup_logging
from protocol.openai_api import ModelCard


async def serve() -> None:
    cfg = read_config()
    log = setup_logging(cfg)
    engine = EngineClient(cfg)
    engine.start()
    card = ModelCard(id=cfg.served_model_name, created=int(time.time()),
                     max_model_len=effective_max_model_len(cfg.model_path, cfg.max_model_len),
                     root=cfg.model_path)
    app = build_app(engine, card, cfg.http.max_body_mb * 2**20, cfg.api)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.http.host, cfg.http.port, reuse_port=True)
    await site.start()
    log.info("listening on http://%s:%d", cfg.http.host, cfg.http.port)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    await stopped.wait()
    await runner.cleanup()
    await engine.close()


def main() -> None:
    die_with_parent()
    uvloop.run(serve())


if __name__ == "__main__":
    main()
