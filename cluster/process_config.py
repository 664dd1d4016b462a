"""What each child process is told: one config per OS process, typed by its role.

Every config shares a small envelope (who the process is, where it runs, its sockets,
the CURVE keys, the metrics directory); each role's struct adds only the topology
slices that role reads, so a role's ``__main__`` decodes its own type and nothing else.
The role is the msgspec tag: decoding one role's JSON as another's type fails, and
``role`` travels in the JSON for the launcher and the tests that read command lines.
"""

from __future__ import annotations

import msgspec

from cluster.topology import (LOCAL_NODE, ApiSpec, DisaggregationSpec, EngineGroup,
                              EngineSpec, HttpSpec, KvStoreSpec, LoraSpec, ReplicaRole,
                              ResolvedAddresses,
                              RouterSpec, SupervisionSpec, Topology, resolve)
from protocol.security import SecuritySpec


class ProcessConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True,
                    tag_field="role"):
    """The envelope every role gets; nothing else is read from the environment."""

    index: int  # the instance of its role (gpu_worker: counts across replicas)
    node: str = LOCAL_NODE
    addresses: ResolvedAddresses
    security: SecuritySpec = msgspec.field(default_factory=SecuritySpec)
    metrics_dir: str | None = None  # prometheus multiprocess directory of this host

    @property
    def role(self) -> str:
        return self.__struct_config__.tag

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"


class ServedEngine(msgspec.Struct, kw_only=True):
    """One served model as a frontend routes to it: its names, checkpoint, runner, and
    the processes (their indexes within each role) that serve it."""

    names: list[str]
    model_path: str
    max_model_len: int | None = None
    runner: str = "generate"
    replicas: list[int]
    tokenizers: list[int]
    detokenizers: list[int]


class FrontendConfig(ProcessConfig, kw_only=True, tag="api_frontend"):
    """HTTP, API policy, the served names, supervision thresholds for /health, and the
    replicas it routes between. ``engines``: every served model (the first is the one
    the fields above describe); empty: that model alone, on every replica."""

    model_path: str
    served_model_name: str
    served_model_aliases: list[str] = []  # further names that answer, after the primary
    max_model_len: int | None = None
    http: HttpSpec = msgspec.field(default_factory=HttpSpec)
    api: ApiSpec = msgspec.field(default_factory=ApiSpec)
    supervision: SupervisionSpec = msgspec.field(default_factory=SupervisionSpec)
    nodes: list[str] = []  # every node's name, in the order of addresses.node_status
    replicas: int = 1
    router: RouterSpec = msgspec.field(default_factory=RouterSpec)
    runner: str = "generate"
    engines: list[ServedEngine] = []
    lora: LoraSpec = msgspec.field(default_factory=LoraSpec)  # adapters, runtime loading
    prefill_replicas: int = 0  # disaggregation: replicas 0..this-1 prefill, the rest decode

    def served(self) -> list[ServedEngine]:
        if self.engines:
            return self.engines
        return [ServedEngine(names=[self.served_model_name, *self.served_model_aliases],
                             model_path=self.model_path, max_model_len=self.max_model_len,
                             runner=self.runner, replicas=list(range(self.replicas)),
                             tokenizers=list(range(len(self.addresses.tokenizer_in))),
                             detokenizers=list(range(len(self.addresses.detokenizer_in))))]


class TokenizerConfig(ProcessConfig, kw_only=True, tag="tokenizer_worker"):
    """The checkpoint's tokenizer and template, and the API policy it enforces."""

    model_path: str
    max_model_len: int | None = None
    api: ApiSpec = msgspec.field(default_factory=ApiSpec)


class DetokenizerConfig(ProcessConfig, kw_only=True, tag="detokenizer"):
    model_path: str


class ReplicaConfig(ProcessConfig, kw_only=True):
    """A process of one engine replica (its scheduler or a gpu_worker rank). Both halves
    of the engine read the one ``EngineSpec``, so their block size and batch bounds
    cannot disagree."""

    engine: EngineSpec = msgspec.field(default_factory=EngineSpec)
    tensor_parallel: int = 1  # ranks in the replica's gpu_worker group
    replica: int = 0
    lora: LoraSpec = msgspec.field(default_factory=LoraSpec)  # the adapters both halves number alike
    disaggregation: DisaggregationSpec | None = None
    kv_store: KvStoreSpec | None = None  # the replicas share a KV store (see kv_store/)

    @property
    def replica_role(self) -> ReplicaRole:
        """colocated, or this replica's half of a prefill/decode split."""
        split = self.disaggregation
        if split is None:
            return "colocated"
        return "prefill" if self.replica < split.prefill_replicas else "decode"


class KvStoreConfig(ProcessConfig, kw_only=True, tag="kv_store"):
    """The store's bounds (memory, the disk tier)."""

    kv_store: KvStoreSpec


class SchedulerConfig(ReplicaConfig, kw_only=True, tag="scheduler"):
    pass


class WorkerConfig(ReplicaConfig, kw_only=True, tag="gpu_worker"):
    """The checkpoint to load and how; ``index`` = replica * tensor_parallel + rank."""

    model_path: str
    max_model_len: int | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    runner: str = "generate"
    first_worker: int = 0  # the index of its replica's first gpu_worker
    tp_interface: str | None = None  # the interface the collectives bind to (Topology)

    @property
    def tp_rank(self) -> int:
        return (self.index - self.first_worker) % self.tensor_parallel

    @property
    def tp_address(self) -> str:
        return self.addresses.tp_rendezvous


def _engines(topology: Topology, groups: list[EngineGroup]) -> list[ServedEngine]:
    if len(groups) == 1:
        return []
    return [ServedEngine(names=g.model.names(), model_path=g.model.resolved_path(),
                         max_model_len=g.model.max_model_len, runner=g.runner,
                         replicas=g.replica_ids(), tokenizers=g.tokenizer_ids(),
                         detokenizers=g.detokenizer_ids()) for g in groups]


def _role_config(role: str, topology: Topology, group: EngineGroup, replica: int,
                 groups: list[EngineGroup], **envelope) -> ProcessConfig:
    """``group``: the served model this process belongs to (a frontend's: the first)."""
    model = group.model
    path = model.resolved_path()
    if role == "api_frontend":
        return FrontendConfig(
            **envelope, model_path=path, served_model_name=model.name(),
            served_model_aliases=model.names()[1:], max_model_len=model.max_model_len,
            http=topology.http_of(topology.node_of(role, envelope["index"])),
            api=topology.api, supervision=topology.supervision,
            nodes=[n.name for n in topology.effective_nodes()],
            replicas=topology.total_replicas, router=topology.router, runner=group.runner,
            engines=_engines(topology, groups),
            lora=next((g.model.lora for g in groups if g.runner == "generate"), LoraSpec()),
            prefill_replicas=topology.disaggregation.prefill_replicas
            if topology.disaggregation is not None else 0)
    if role == "tokenizer_worker":
        return TokenizerConfig(**envelope, model_path=path, max_model_len=model.max_model_len,
                               api=topology.api)
    if role == "detokenizer":
        return DetokenizerConfig(**envelope, model_path=path)
    if role == "kv_store":
        assert topology.kv_store is not None
        return KvStoreConfig(**envelope, kv_store=topology.kv_store)
    split = topology.disaggregation
    engine = dict(engine=group.engine, tensor_parallel=group.tp_of(replica),
                  replica=replica, lora=model.lora,
                  disaggregation=split.resolved(topology.tensor_parallel) if split else None,
                  kv_store=topology.kv_store)
    if role == "scheduler":
        return SchedulerConfig(**envelope, **engine)
    return WorkerConfig(**envelope, **engine, model_path=path,
                        max_model_len=model.max_model_len, dtype=model.dtype,
                        load_format=model.load_format, runner=group.runner,
                        first_worker=group.ranks_of(replica)[0],
                        tp_interface=topology.tp_interface(replica))


def _owner(role: str, index: int, groups: list[EngineGroup]) -> tuple[EngineGroup, int]:
    """(the served model a process belongs to, its engine replica: 0 for shared roles)."""
    for g in groups:
        if role == "gpu_worker" and index < g.first_worker + g.workers:
            return g, next(r for r in g.replica_ids() if index in g.ranks_of(r))
        if role == "scheduler" and index in g.replica_ids():
            return g, index
        if role == "tokenizer_worker" and index in g.tokenizer_ids():
            return g, 0
        if role == "detokenizer" and index in g.detokenizer_ids():
            return g, 0
    return groups[0], 0


def process_configs(topology: Topology, run_dir: str, node: str | None = None,
                    metrics_dir: str | None = None) -> list[ProcessConfig]:
    """One config per process, in start order (the worker first: it loads the model).
    With ``node``, only the processes placed on that node."""
    per_replica = resolve(topology, run_dir)
    groups = topology.groups()
    counts = {"gpu_worker": topology.total_gpu_workers, "scheduler": topology.total_replicas,
              "detokenizer": sum(g.detokenizers for g in groups),
              "tokenizer_worker": sum(g.tokenizer_workers for g in groups),
              "api_frontend": topology.roles.api_frontend,
              "kv_store": int(topology.kv_store is not None)}
    configs = []
    for role, count in counts.items():
        for index in range(count):
            placed_on = topology.node_of(role, index).name
            if node is not None and placed_on != node:
                continue
            group, replica = _owner(role, index, groups)
            configs.append(_role_config(
                role, topology, group, replica, groups, index=index, node=placed_on,
                addresses=per_replica[replica], security=topology.security,
                metrics_dir=metrics_dir))
    return configs
