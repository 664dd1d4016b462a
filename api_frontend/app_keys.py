"""What the aiohttp app holds for every handler (``request.app[KEY]``), set by
``app.build_app``: an endpoint's handlers read their dependencies here rather than having
``app`` pass them in, so adding an endpoint does not touch the app."""

from __future__ import annotations

from aiohttp import web

from api_frontend.engine_client import EngineClient
from api_frontend.media_fetch import MediaFetcher
from api_frontend.served_models import ServedModels
from cluster.topology import ApiSpec, LoraSpec

ENGINE_KEY = web.AppKey("engine", EngineClient)
MODELS_KEY = web.AppKey("models", ServedModels)  # every served model, by name
API_KEY = web.AppKey("api", ApiSpec)
BODY_TIMEOUT_KEY = web.AppKey("body_read_timeout_s", float)
LORA_KEY = web.AppKey("lora", LoraSpec)  # adapters and whether they may be loaded at runtime
LOG_REQUESTS_KEY = web.AppKey("log_requests", bool)
MEDIA_KEY = web.AppKey("media", MediaFetcher)  # http(s) image URLs behind the allow-list
