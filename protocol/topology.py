"""The topology: which roles run, how many, and the ZeroMQ addresses between them.

A YAML file decodes straight into ``Topology`` (msgspec.yaml, unknown keys rejected, so
a typo names the bad key). The launcher resolves it into one ``ProcessConfig`` per OS
process and hands each child its own config as JSON on the command line.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

ROLES = ("api_frontend", "tokenizer_worker", "scheduler", "gpu_worker", "detokenizer")

Count = Annotated[int, Meta(ge=1, le=64)]
Port = Annotated[int, Meta(ge=1, le=65535)]


class ModelSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    path: str
    served_model_name: str | None = None
    max_model_len: Annotated[int, Meta(ge=16)] | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    load_format: Literal["auto", "dummy"] = "auto"

    def resolved_path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.path))

    def name(self) -> str:
        return self.served_model_name or os.path.basename(self.resolved_path().rstrip("/"))


class EngineSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    device: str = "cpu"
    block_size: Annotated[int, Meta(ge=1, le=256)] = 16
    num_kv_blocks: Annotated[int, Meta(ge=2)] | None = None
    kv_cache_memory_mb: Annotated[int, Meta(ge=1)] = 512
    max_num_seqs: Annotated[int, Meta(ge=1)] = 64
    max_num_batched_tokens: Annotated[int, Meta(ge=16)] = 1024
    worker_threads: Annotated[int, Meta(ge=1)] | None = None
    seed: int = 0
    # Test hook: a step that feeds this token id fails in the worker, exercising the
    # "failure after the stream started" path end to end. Never set in production.
    fault_token_id: int | None = None


class HttpSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Port = 8000
    max_body_mb: Annotated[int, Meta(ge=1)] = 32


class ApiSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The deployment's API policy (issue 4); published by GET /v1/capabilities.

    strict: every ignored or clamped field is a 400 naming it. max_tokens_policy: what a
    prompt + max_tokens beyond the context gets (reject: 400 with the accounting; clamp:
    cut to what fits and reported as a clamp). chat_template: a server-wide template file
    that replaces the checkpoint's. allow_request_chat_template: accept ``chat_template``
    in a request body (a template is code the server runs, so it is off by default)."""

    strict: bool = False
    max_tokens_policy: Literal["reject", "clamp"] = "reject"
    chat_template: str | None = None
    allow_request_chat_template: bool = False


class RoleCounts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    api_frontend: Count = 1
    tokenizer_worker: Count = 1
    detokenizer: Count = 1


class Addresses(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Address templates. ``{run_dir}`` is the launcher's private socket directory and
    ``{i}`` the instance index of a role that has several processes."""

    scheduler_in: str = "ipc://{run_dir}/scheduler-in"
    scheduler_pub: str = "ipc://{run_dir}/scheduler-pub"
    worker_in: str = "ipc://{run_dir}/worker-in"
    worker_out: str = "ipc://{run_dir}/worker-out"
    tokenizer_in: str = "ipc://{run_dir}/tokenizer-{i}"
    detokenizer_in: str = "ipc://{run_dir}/detokenizer-{i}"
    frontend_results: str = "ipc://{run_dir}/frontend-{i}"


class Topology(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: ModelSpec
    roles: RoleCounts = msgspec.field(default_factory=RoleCounts)
    engine: EngineSpec = msgspec.field(default_factory=EngineSpec)
    http: HttpSpec = msgspec.field(default_factory=HttpSpec)
    addresses: Addresses = msgspec.field(default_factory=Addresses)
    api: ApiSpec = msgspec.field(default_factory=ApiSpec)


class ResolvedAddresses(msgspec.Struct, kw_only=True):
    scheduler_in: str
    scheduler_pub: str
    worker_in: str
    worker_out: str
    tokenizer_in: list[str]
    detokenizer_in: list[str]
    frontend_results: list[str]


class ProcessConfig(msgspec.Struct, kw_only=True):
    """Everything one child process needs; nothing else is read from the environment."""

    role: str
    index: int
    model_path: str
    served_model_name: str
    max_model_len: int | None
    dtype: str
    load_format: str
    engine: EngineSpec
    http: HttpSpec
    addresses: ResolvedAddresses
    api: ApiSpec = msgspec.field(default_factory=ApiSpec)


def load_topology(path: str) -> Topology:
    with open(path, "rb") as fh:
        return msgspec.yaml.decode(fh.read(), type=Topology)


def resolve(topology: Topology, run_dir: str) -> ResolvedAddresses:
    a = topology.addresses
    counts = topology.roles

    def one(template: str) -> str:
        return template.format(run_dir=run_dir, i=0)

    def many(template: str, n: int) -> list[str]:
        return [template.format(run_dir=run_dir, i=i) for i in range(n)]

    resolved = ResolvedAddresses(
        scheduler_in=one(a.scheduler_in),
        scheduler_pub=one(a.scheduler_pub),
        worker_in=one(a.worker_in),
        worker_out=one(a.worker_out),
        tokenizer_in=many(a.tokenizer_in, counts.tokenizer_worker),
        detokenizer_in=many(a.detokenizer_in, counts.detokenizer),
        frontend_results=many(a.frontend_results, counts.api_frontend),
    )
    every = [resolved.scheduler_in, resolved.scheduler_pub, resolved.worker_in,
             resolved.worker_out, *resolved.tokenizer_in, *resolved.detokenizer_in,
             *resolved.frontend_results]
    duplicates = sorted({x for x in every if every.count(x) > 1})
    if duplicates:
        raise ValueError(f"topology addresses collide: {duplicates} (a role with count > 1 "
                         "needs '{i}' in its address template)")
    return resolved


def process_configs(topology: Topology, run_dir: str) -> list[ProcessConfig]:
    """One config per process, in start order (consumers of a socket before producers
    does not matter for ZeroMQ, but the worker goes first because it loads the model)."""
    addresses = resolve(topology, run_dir)
    model = topology.model
    counts = {"gpu_worker": 1, "scheduler": 1, "detokenizer": topology.roles.detokenizer,
              "tokenizer_worker": topology.roles.tokenizer_worker,
              "api_frontend": topology.roles.api_frontend}
    configs = []
    for role, count in counts.items():
        for index in range(count):
            configs.append(ProcessConfig(
                role=role, index=index, model_path=model.resolved_path(),
                served_model_name=model.name(), max_model_len=model.max_model_len,
                dtype=model.dtype, load_format=model.load_format, engine=topology.engine,
                http=topology.http, addresses=addresses, api=topology.api))
    return configs
