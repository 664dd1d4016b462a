"""GET /v1/capabilities: what this deployment serves and how it treats every request
field, from the endpoints' own declarations (``endpoints.registry``)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from api_frontend import field_policy
from api_frontend.endpoints.registry import ENDPOINTS
from api_frontend.json_body import json_response
from api_frontend.served_models import ROUTES, ServedModels
from cluster.topology import ApiSpec, LoraSpec, RequestLimits
from protocol import ipc

DETERMINISM_SCOPE = (
    "a greedy or seeded request gets bitwise the same tokens and logprobs (top_logprobs and "
    "prompt logprobs included) alone or inside any batch, on a prefix-cache hit or miss, under "
    "any --max-num-batched-tokens, preempted or not, on any replica and after a restart, within "
    "one deployment (same hardware, software, flags and tensor-parallel size)")


def determinism(stats: ipc.SchedulerStats | None) -> dict:
    """Which numerics the engine runs (``enabled`` None until it has reported)."""
    known = stats is not None and stats.worker_ready
    return {"enabled": stats.deterministic if known else None,
            "note": stats.deterministic_note if known else "the engine has not reported yet",
            "scope": DETERMINISM_SCOPE}


def public_limits(limits: RequestLimits) -> dict:
    """The limits as published: whether remote fetch and local files are on, never the
    operator's allow-list (which hosts, which directory) itself."""
    out = msgspec.to_builtins(limits)
    out["remote_media_fetch"] = bool(out.pop("allowed_media_domains"))
    out["local_media_files"] = bool(out.pop("allowed_local_media_path"))
    return out


def capabilities(models: ServedModels, api: ApiSpec, stats: ipc.SchedulerStats | None = None,
                 lora: LoraSpec | None = None) -> web.Response:
    """The tier of every request field under this deployment's flags, and each served
    model's runner (what it serves) and, for an embedding model, its pooling; the
    numerics the engine runs; the LoRA settings (adapters are named in ``model``;
    /v1/models lists them)."""
    lora = lora or LoraSpec()
    card = models.primary.card
    served = [ep for ep in ENDPOINTS if models.serves(ep.runner)]
    fields = {ep.path: ep.fields.tiers(api) for ep in served}
    endpoints = ["/v1/models", *(path for ep in served for path in ep.listed)]
    generate = models.serves("generate")
    if generate and lora.enabled and lora.allow_runtime_updates:
        endpoints += ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
    endpoints += ["/tokenize", "/detokenize", "/tokenizer_info", "/v1/capabilities", "/health"]
    return json_response({
        "object": "capabilities",
        "model": card.id,
        "max_model_len": card.max_model_len,
        "serves": [ep.serves for ep in served],
        "models": [{"id": m.card.id, "aliases": m.aliases, "runner": m.runner,
                    "routes": ROUTES[m.runner], "max_model_len": m.card.max_model_len,
                    "pooling": msgspec.to_builtins(m.pooling) if m.pooling else None}
                   for m in models.models],
        "policy": {**msgspec.to_builtins(api), "limits": public_limits(api.limits)},
        "limits": public_limits(api.limits),
        "lora": {"enabled": lora.enabled, "max_loras": lora.max_loras,
                 "max_lora_rank": lora.max_lora_rank, "max_cpu_loras": lora.host_capacity,
                 "runtime_updates": lora.enabled and lora.allow_runtime_updates},
        "tiers": field_policy.TIER_MEANINGS,
        "deterministic": determinism(stats),
        "fields": fields,
        "endpoints": endpoints,
    })
