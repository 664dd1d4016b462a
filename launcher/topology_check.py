"""Up-front validation of a topology, so a bad file fails at start with every problem
named, not on the first request (or on the other machine, an hour later).

msgspec already rejects unknown keys, unknown role names and out-of-range numbers while
decoding; this module checks what needs the whole picture: placement of roles on nodes,
ipc:// sockets that would cross machines, ports used twice on a host, the model path.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

from cluster.topology import (BINDERS, CONNECTORS, PLACED_BY_INDEX, ROLES, ResolvedAddresses,
                              Topology, resolve)

RESTARTABLE = ("tokenizer_worker", "detokenizer")  # stateless: a restart loses nothing


class TopologyError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _placement(topology: Topology, problems: list[str]) -> None:
    nodes = topology.effective_nodes()
    names = [n.name for n in nodes]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"node name {name!r} is used twice")
    for role in ROLES:
        on = [n.name for n in nodes if role in n.roles]
        if not on:
            problems.append(f"role {role} is not placed on any node")
        elif role in PLACED_BY_INDEX and (len(on) > 1 or any(
                n.instances(role) is not None for n in topology.nodes_of(role))):
            _instance_placement(topology, role, problems)
        elif len(on) > 1:
            problems.append(f"role {role} is placed on several nodes {on}; all instances "
                            "of a role run on one node (except gpu_worker and api_frontend, "
                            "whose nodes name theirs)")
    for node in nodes:
        for role in sorted({r for r in node.roles if node.roles.count(r) > 1}):
            problems.append(f"node {node.name!r} lists role {role} twice")
        if node.devices and "gpu_worker" not in node.roles:
            problems.append(f"node {node.name!r} lists devices but runs no gpu_worker")
        for role, key in PLACED_BY_INDEX.items():
            if node.instances(role) is not None and role not in node.roles:
                problems.append(f"node {node.name!r} lists {key} but runs no {role}")
        if node.http_port is not None and "api_frontend" not in node.roles:
            problems.append(f"node {node.name!r} sets http_port but runs no api_frontend")
    for role in topology.supervision.restart:
        if role not in RESTARTABLE:
            problems.append(f"supervision.restart: {role} holds state that a restart would "
                            f"lose; only {', '.join(RESTARTABLE)} can be restarted")


_INSTANCES = {"gpu_worker": "indices replica * tensor_parallel + rank",
              "api_frontend": "indices 0..roles.api_frontend - 1"}
_ALL = {"gpu_worker": "every model's replicas x ranks", "api_frontend": "roles.api_frontend"}


def _instance_placement(topology: Topology, role: str, problems: list[str]) -> None:
    """gpu_worker ranks and api_frontends may span nodes when each such node names its
    instances (``gpu_workers`` / ``api_frontends``) and together they name every one
    once; a replica whose ranks span nodes then needs a fixed tcp rendezvous and a
    declared protection for its traffic."""
    key = PLACED_BY_INDEX[role]
    nodes = topology.nodes_of(role)
    total = topology.total_gpu_workers if role == "gpu_worker" \
        else topology.roles.api_frontend
    if any(n.instances(role) is None for n in nodes):
        problems.append(f"{role} is placed on several nodes {[n.name for n in nodes]}: "
                        f"each must list its {key} ({_INSTANCES[role]})")
        return
    named = sorted(i for n in nodes for i in n.instances(role))
    if named != list(range(total)):
        problems.append(f"the nodes' {key} name {named}; they must name each of "
                        f"0..{total - 1} once ({_ALL[role]})")
        return
    if role == "gpu_worker":
        _tensor_parallel_traffic(topology, problems)


def _host_addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """``host`` as an IP address, or what its name resolves to here (empty: it does not)."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return sorted({ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}, key=str)


def _tensor_parallel_traffic(topology: Topology, problems: list[str]) -> None:
    """Ranks of one replica on several nodes talk outside CURVE (the torch.distributed
    store and gloo/NCCL): the topology must say how that traffic is protected, and every
    host involved must lie in the network it names."""
    spanning = {r: nodes for r in range(topology.total_replicas)
                if len(nodes := topology.rank_nodes(r)) > 1}
    if not spanning:
        return
    template = topology.addresses.tp_rendezvous
    if "{port}" in template or not template.startswith("tcp://"):
        problems.append("addresses.tp_rendezvous needs a fixed port when ranks span nodes "
                        "(e.g. tcp://{host}:29500); a file:// store and {port} are one "
                        "launcher's only")
    traffic = topology.security.tensor_parallel
    if traffic is None:
        r, nodes = next(iter(spanning.items()))
        problems.append(
            f"the tensor-parallel ranks of replica {r} span nodes {[n.name for n in nodes]}: "
            "their torch.distributed rendezvous (a TCP store any host reaching its port "
            "can join) and gloo/NCCL traffic are plain, outside CURVE; declare how they are "
            "protected with security.tensor_parallel: {protection: private_network | tunnel, "
            "network: CIDR} (see the README, 'Who may talk to it')")
        return
    try:
        network = ipaddress.ip_network(traffic.network, strict=False)
    except ValueError as err:
        problems.append(f"security.tensor_parallel.network: {err}")
        return
    hosts = {n.host: f"node {n.name!r}" for nodes in spanning.values() for n in nodes}
    rendezvous = urlsplit(template).hostname or ""
    if rendezvous and "{" not in rendezvous:
        hosts.setdefault(rendezvous, "addresses.tp_rendezvous")
    for host, what in hosts.items():
        found = _host_addresses(host)
        if not found:
            problems.append(f"security.tensor_parallel: cannot resolve {what}'s host "
                            f"{host!r} to check that it lies in {network}")
        elif outside := [str(a) for a in found if a not in network]:
            problems.append(f"security.tensor_parallel: {what}'s host {host!r} "
                            f"({', '.join(outside)}) is outside the declared "
                            f"{traffic.protection} network {network}")


def _addresses(topology: Topology, problems: list[str]) -> list[ResolvedAddresses] | None:
    try:
        return resolve(topology, "/run")
    except KeyError as err:
        problems.append(f"an address template uses the unknown placeholder {err}; "
                        "known: {run_dir} {host} {i} {r} (and {n} {node} in node_status, "
                        "{port} in tp_rendezvous)")
    except (ValueError, IndexError) as err:
        problems.append(str(err))
    return None


PER_REPLICA = ("scheduler_in", "scheduler_pub", "worker_in", "worker_out")


def _bound_addresses(topology: Topology, replicas: list[ResolvedAddresses]):
    """(label, address, node that binds it, nodes that connect to it)."""
    out = []
    resolved = replicas[0]
    for key, binder in BINDERS.items():
        if key in PER_REPLICA:
            value = [getattr(ra, key) for ra in replicas] if len(replicas) > 1 \
                else getattr(resolved, key)
        else:
            value = getattr(resolved, key)
        values = value if isinstance(value, list) else [value]
        connect_nodes = {n.name for r in CONNECTORS[key] for n in topology.nodes_of(r)}
        for i, addr in enumerate(values):
            label = f"{key}[{i}]" if isinstance(value, list) else key
            bind_node = topology.node_of(binder, i if key not in PER_REPLICA else None).name
            out.append((label, addr, bind_node, connect_nodes))
    senders = {n.name for n in topology.nodes_of("gpu_worker")}
    for r, ranks in enumerate(resolved.replica_kv_in):
        for k, addr in enumerate(ranks):
            node = topology.node_of("gpu_worker", topology.groups()[0].ranks_of(r)[k]).name
            out.append((f"kv_in[{r}][{k}]", addr, node, senders))
    if topology.kv_store is not None:  # ranks and schedulers <-> the store, both ways
        store = topology.node_of("kv_store").name
        engine = {n.name for r in ("scheduler", "gpu_worker") for n in topology.nodes_of(r)}
        out.append(("kv_store", resolved.kv_store, store, engine))
        group_of = {r: g for g in topology.groups() for r in g.replica_ids()}
        for r, ra in enumerate(replicas):
            for k, addr in enumerate(ra.kv_store_rank_in):
                node = topology.node_of("gpu_worker", group_of[r].ranks_of(r)[k]).name
                out.append((f"kv_store_rank_in[{r}][{k}]", addr, node, {store}))
    listeners = {n.name for role in CONNECTORS["node_status"] for n in topology.nodes_of(role)}
    for node, addr in zip(topology.effective_nodes(), resolved.node_status):
        out.append((f"node_status[{node.name}]", addr, node.name, listeners))
    return out


def _sockets(topology: Topology, resolved: list[ResolvedAddresses], problems: list[str]) -> None:
    hosts = {n.name: n.host for n in topology.effective_nodes()}
    ports: dict[tuple[str, int], str] = {}

    def claim(host: str, port: int, label: str) -> None:
        key = (host, port)
        if key in ports:
            problems.append(f"port {port} on {host} is used by both {ports[key]} and {label}")
        else:
            ports[key] = label

    for label, addr, bind_node, connect_nodes in _bound_addresses(topology, resolved):
        scheme = addr.split("://", 1)[0]
        if scheme == "ipc":
            crossing = sorted(connect_nodes - {bind_node})
            if crossing:
                problems.append(f"{label} is {addr!r} (ipc://, one host only) but node(s) "
                                f"{crossing} must reach node {bind_node!r}: use tcp://")
        elif scheme == "tcp":
            try:
                parts = urlsplit(addr)
                port = parts.port
            except ValueError:
                port = None
            if port is None:
                problems.append(f"{label} is {addr!r}: a tcp:// address needs host:port")
                continue
            host = parts.hostname or ""
            claim(hosts[bind_node] if host in ("*", "0.0.0.0", "") else host, port, label)
        else:
            problems.append(f"{label} is {addr!r}: only ipc:// and tcp:// are supported")
    fronts = topology.nodes_of("api_frontend")
    for frontend in fronts:  # each node's frontends on its own port (and host)
        http = topology.http_of(frontend)
        wildcard = http.host in ("0.0.0.0", "::", "") or len(fronts) > 1
        claim(frontend.host if wildcard else http.host, http.port, "http.port"
              if frontend.http_port is None else f"nodes[{frontend.name}].http_port")
    for node in topology.effective_nodes():
        if node.metrics_port is not None:
            claim(node.host, node.metrics_port, f"nodes[{node.name}].metrics_port")


def _model(topology: Topology, problems: list[str]) -> None:
    for i, group in enumerate(topology.groups()):
        label = "model.path" if i == 0 else f"models[{i - 1}].model.path"
        path = group.model.resolved_path()
        if os.path.isfile(path) and path.endswith(".gguf"):
            continue  # checked whole when the launcher prepares it (launcher.gguf_checkpoint)
        for name in ("config.json", "tokenizer.json"):
            if not os.path.isfile(os.path.join(path, name)):
                problems.append(f"{label} {path!r} has no {name}: not a HF checkpoint "
                                "directory")
                break


def _served_names(topology: Topology, problems: list[str]) -> None:
    """Requests reach a model by name: one name may answer for one model only."""
    seen: dict[str, int] = {}
    for group in topology.groups():
        for name in group.model.names():
            if name in seen and seen[name] != group.index:
                problems.append(f"served model name {name!r} names two models; each "
                                "model needs its own names (served_model_name)")
            seen[name] = group.index


def _lora(topology: Topology, problems: list[str]) -> None:
    """LoRA settings that cannot work together (the adapters' files are checked by the
    launcher of a node that holds them, against the base model's config)."""
    model = topology.model
    lora = model.lora
    if not lora.enabled:
        given = [k for k in ("modules", "allow_runtime_updates", "allowed_dirs") if getattr(lora, k)]
        if given:
            problems.append(f"model.lora.{given[0]} needs model.lora.enabled: true")
        return
    if model.runner_kind() == "pooling":
        problems.append("model.lora: adapters apply to generation; this model runs as a "
                        "pooling model (runner: pooling), which serves none")
    if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        problems.append(f"model.lora.max_cpu_loras ({lora.max_cpu_loras}) must be at least "
                        f"max_loras ({lora.max_loras})")
    names = [m.name for m in lora.modules]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"model.lora.modules: the adapter name {name!r} is used twice")
    for name in sorted(set(names) & set(model.names())):
        problems.append(f"model.lora.modules: the adapter name {name!r} is the base model's "
                        "served name")
    for d in lora.allowed_dirs:
        if not os.path.isabs(os.path.expanduser(d)):
            problems.append(f"model.lora.allowed_dirs: {d!r} is not an absolute path")


def _security(topology: Topology, problems: list[str]) -> None:
    """CURVE key files must exist where the topology says (checked with the model, on
    the machine that starts a node)."""
    curve = topology.security.curve
    if curve is None:
        return
    try:
        files = [curve.server_secret_path(), curve.server_public_path(),
                 curve.client_secret_path()]
        keys_dir = curve.authorized_keys_path()
    except ValueError as err:
        problems.append(str(err))
        return
    for path in files:
        if not os.path.isfile(path):
            problems.append(f"security.curve: key file {path!r} does not exist "
                            "(candor keygen DIR writes a key directory)")
    if not os.path.isdir(keys_dir):
        problems.append(f"security.curve: authorized keys directory {keys_dir!r} does "
                        "not exist")


def _disaggregation(topology: Topology, problems: list[str]) -> None:
    split = topology.disaggregation
    if split is not None and split.replicas != topology.replicas:
        problems.append(f"replicas is {topology.replicas} but disaggregation names "
                        f"{split.prefill_replicas} prefill + {split.decode_replicas} decode "
                        f"replicas; set replicas: {split.replicas}")
    if split is not None and topology.model.lora.enabled:
        problems.append("disaggregation does not serve LoRA adapters yet (a decode replica "
                        "would not know the adapter): turn one of them off")
    if split is not None and topology.model.runner_kind() == "pooling":
        problems.append("disaggregation splits generation: a pooling model (runner: "
                        "pooling) has no decode to hand over")
    if split is not None and topology.models:
        problems.append("disaggregation serves one model: a topology with `models` cannot "
                        "split prefill and decode yet")


def _kv_store(topology: Topology, problems: list[str]) -> None:
    if topology.kv_store is None:
        return
    if topology.disaggregation is not None:
        problems.append("kv_store: a shared KV store does not serve a prefill/decode split "
                        "yet (decode replicas take their prompt KV from the prefill replica); "
                        "drop one of kv_store and disaggregation")
    on = [n.name for n in topology.nodes_of("kv_store")]
    if len(on) > 1:
        problems.append(f"role kv_store is placed on several nodes {on}; there is one store")


def check_topology(topology: Topology, node: str | None = None,
                   check_model: bool = True) -> None:
    """Raise ``TopologyError`` naming every problem found, or return quietly."""
    problems: list[str] = []
    _disaggregation(topology, problems)
    _kv_store(topology, problems)
    _placement(topology, problems)
    _served_names(topology, problems)
    names = [n.name for n in topology.effective_nodes()]
    if node is not None and node not in names:
        problems.append(f"--node {node!r} is not in this topology; nodes: {names}")
    if not problems:  # the address checks need a sound placement
        resolved = _addresses(topology, problems)
        if resolved is not None:
            _sockets(topology, resolved, problems)
    _lora(topology, problems)
    if check_model:
        _model(topology, problems)
        if node is not None or len(names) == 1:  # key files are per machine
            _security(topology, problems)
    if problems:
        raise TopologyError(problems)
