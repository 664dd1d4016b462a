"""What each child process is told: one config per OS process, typed by its role.

Every config shares a small envelope (who the process is, where it runs, its sockets,
the CURVE keys, the metrics directory); each role's struct adds only the topology
slices that role reads, so a role's ``__main__`` decodes its own type and nothing else.
The role is the msgspec tag: decoding one role's JSON as another's type fails, and
``role`` travels in the JSON for the launcher and the tests that read command lines.
"""

from __future__ import annotations

import msgspec

from cluster.topology import (LOCAL_NODE, ApiSpec, DisaggregationSpec, EngineSpec, HttpSpec,
                              ReplicaRole, ResolvedAddresses, RouterSpec, SecuritySpec,
                              SupervisionSpec, Topology, resolve)


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


class FrontendConfig(ProcessConfig, kw_only=True, tag="api_frontend"):
    """HTTP, API policy, the served names, supervision thresholds for /health, and the
    replicas it routes between."""

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
    prefill_replicas: int = 0  # disaggregation: replicas 0..this-1 prefill, the rest decode


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
    disaggregation: DisaggregationSpec | None = None

    @property
    def replica_role(self) -> ReplicaRole:
        """colocated, or this replica's half of a prefill/decode split."""
        split = self.disaggregation
        if split is None:
            return "colocated"
        return "prefill" if self.replica < split.prefill_replicas else "decode"


class SchedulerConfig(ReplicaConfig, kw_only=True, tag="scheduler"):
    pass


class WorkerConfig(ReplicaConfig, kw_only=True, tag="gpu_worker"):
    """The checkpoint to load and how; ``index`` = replica * tensor_parallel + rank."""

    model_path: str
    max_model_len: int | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    tp_interface: str | None = None  # the interface the collectives bind to (Topology)

    @property
    def tp_rank(self) -> int:
        return self.index % self.tensor_parallel

    @property
    def tp_address(self) -> str:
        return self.addresses.tp_rendezvous


def _role_config(role: str, topology: Topology, replica: int, **envelope) -> ProcessConfig:
    model = topology.model
    path = model.resolved_path()
    if role == "api_frontend":
        return FrontendConfig(
            **envelope, model_path=path, served_model_name=model.name(),
            served_model_aliases=model.names()[1:], max_model_len=model.max_model_len,
            http=topology.http, api=topology.api, supervision=topology.supervision,
            nodes=[n.name for n in topology.effective_nodes()],
            replicas=topology.replicas, router=topology.router,
            prefill_replicas=topology.disaggregation.prefill_replicas
            if topology.disaggregation is not None else 0)
    if role == "tokenizer_worker":
        return TokenizerConfig(**envelope, model_path=path, max_model_len=model.max_model_len,
                               api=topology.api)
    if role == "detokenizer":
        return DetokenizerConfig(**envelope, model_path=path)
    engine = dict(engine=topology.engine, tensor_parallel=topology.tensor_parallel,
                  replica=replica, disaggregation=topology.disaggregation)
    if role == "scheduler":
        return SchedulerConfig(**envelope, **engine)
    return WorkerConfig(**envelope, **engine, model_path=path,
                        max_model_len=model.max_model_len, dtype=model.dtype,
                        load_format=model.load_format, tp_interface=topology.tp_interface(replica))


def process_configs(topology: Topology, run_dir: str, node: str | None = None,
                    metrics_dir: str | None = None) -> list[ProcessConfig]:
    """One config per process, in start order (the worker first: it loads the model).
    With ``node``, only the processes placed on that node."""
    per_replica = resolve(topology, run_dir)
    tp = topology.tensor_parallel
    counts = {"gpu_worker": topology.replicas * tp, "scheduler": topology.replicas,
              "detokenizer": topology.roles.detokenizer,
              "tokenizer_worker": topology.roles.tokenizer_worker,
              "api_frontend": topology.roles.api_frontend}
    configs = []
    for role, count in counts.items():
        for index in range(count):
            placed_on = topology.node_of(role, index).name
            if node is not None and placed_on != node:
                continue
            replica = {"gpu_worker": index // tp, "scheduler": index}.get(role, 0)
            configs.append(_role_config(
                role, topology, replica, index=index, node=placed_on,
                addresses=per_replica[replica], security=topology.security,
                metrics_dir=metrics_dir))
    return configs
