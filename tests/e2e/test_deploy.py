"""deploy/ is tested like code: topologies validate, the Kubernetes manifests agree with
the topology they carry, and every dashboard and alert query names a metric that a real
scrape of Candor contains. Also the topology validator's errors, one problem at a time."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from cluster.process_config import process_configs
from cluster.topology import ROLES, Topology, load_topology
from launcher.topology_check import TopologyError, check_topology
from tests.support.metrics_text import scrape
from tests.support.server import REPO

DEPLOY = REPO / "deploy"
METRIC = re.compile(r"\b(candor_[a-z0-9_]+)\b")


# ------------------------------------------------------------------ typed manifest views
class HttpGet(msgspec.Struct):
    path: str
    port: str | int


class Probe(msgspec.Struct):
    httpGet: HttpGet
    periodSeconds: int = 10
    failureThreshold: int = 3


class Resources(msgspec.Struct):
    requests: dict[str, str | int] = {}
    limits: dict[str, str | int] = {}


class ContainerPort(msgspec.Struct):
    containerPort: int
    name: str | None = None


class Container(msgspec.Struct):
    name: str
    image: str
    args: list[str]
    ports: list[ContainerPort]
    livenessProbe: Probe
    readinessProbe: Probe
    startupProbe: Probe | None = None
    resources: Resources = msgspec.field(default_factory=Resources)


class PodSpec(msgspec.Struct):
    containers: list[Container]
    terminationGracePeriodSeconds: int = 30


class Meta(msgspec.Struct):
    name: str = ""
    namespace: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class PodTemplate(msgspec.Struct):
    metadata: Meta
    spec: PodSpec


class Selector(msgspec.Struct):
    matchLabels: dict[str, str]


class StatefulSetSpec(msgspec.Struct):
    serviceName: str
    replicas: int
    selector: Selector
    template: PodTemplate


class ServicePort(msgspec.Struct):
    name: str
    port: int
    targetPort: str | int


class ServiceSpec(msgspec.Struct):
    selector: dict[str, str]
    ports: list[ServicePort]
    clusterIP: str | None = None


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


# ------------------------------------------------------------------ topologies
@pytest.mark.parametrize("path", sorted((DEPLOY / "topologies").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_topologies_validate_and_place_every_role(path):
    topology = load_topology(str(path))
    check_topology(topology, check_model=False)
    for node in topology.effective_nodes():
        check_topology(topology, node=node.name, check_model=False)
    roles = {c.role for n in topology.effective_nodes()
             for c in process_configs(topology, "/tmp/r", node=n.name)}
    assert roles == set(ROLES)


def test_the_cli_checks_a_topology(tiny_model_dir, tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(f"model: {{path: {tiny_model_dir}}}\n")
    out = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), str(good),
                          "--check"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr


BASE = "model: {{path: {model}}}\n"


@pytest.mark.parametrize("extra, message", [
    ("nodes:\n  - {name: a, roles: [api_frontend, tokenizer_worker, detokenizer, scheduler]}\n",
     "role gpu_worker is not placed on any node"),
    ("nodes:\n  - {name: a, roles: [api_frontend, tokeniser_worker]}\n",
     "tokeniser_worker"),
    ("addresses: {scheduler_in: 'tcp://127.0.0.1:5601', scheduler_pub: 'tcp://*:5601'}\n",
     "port 5601 on 127.0.0.1 is used by both scheduler_in and scheduler_pub"),
    ("http: {port: 5601}\naddresses: {scheduler_in: 'tcp://127.0.0.1:5601'}\n",
     "used by both scheduler_in and http.port"),
    ("nodes:\n  - {name: a, roles: [api_frontend, tokenizer_worker, detokenizer]}\n"
     "  - {name: b, host: 10.0.0.2, roles: [scheduler, gpu_worker]}\n",
     "scheduler_in is 'ipc:///run/scheduler-in-0' (ipc://, one host only)"),
    ("supervision: {restart: [scheduler]}\n", "scheduler holds state"),
    ("addresses: {scheduler_in: 'tcp://{hostname}:1'}\n", "unknown placeholder"),
])
def test_topology_problems_are_named_up_front(tiny_model_dir, tmp_path, extra, message):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE.format(model=tiny_model_dir) + extra)
    with pytest.raises((TopologyError, msgspec.ValidationError), match=re.escape(message)):
        check_topology(load_topology(str(path)))
    out = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), str(path)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_missing_model_and_unknown_node_are_named(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(f"model: {{path: {tmp_path / 'nope'}}}\n")
    with pytest.raises(TopologyError) as err:
        check_topology(load_topology(str(path)), node="engine")
    text = str(err.value)
    assert "has no config.json" in text and "--node 'engine' is not in this topology" in text


def test_several_nodes_need_a_node_name(tiny_model_dir):
    topo = load_topology(str(DEPLOY / "topologies" / "two-node.yaml"))
    topo = msgspec.structs.replace(topo, model=msgspec.structs.replace(
        topo.model, path=str(tiny_model_dir)))
    from launcher.launch import launch
    with pytest.raises(SystemExit, match="--node NAME"):
        launch(topo)


# ------------------------------------------------------------------ kubernetes
@pytest.mark.parametrize("manifest,front", [("candor.yaml", "candor"),
                                            ("disaggregated.yaml", "candor-pd")])
def test_kubernetes_manifests_agree_with_their_topology(manifest, front):
    docs = _docs(DEPLOY / "kubernetes" / manifest)
    config = _by_kind(docs, "ConfigMap")[0]
    topology = msgspec.yaml.decode(config["data"]["topology.yaml"], type=Topology)
    check_topology(topology, check_model=False)
    nodes = {n.name: n for n in topology.effective_nodes()}
    sets = {d["metadata"]["name"]: msgspec.convert(d["spec"], StatefulSetSpec)
            for d in _by_kind(docs, "StatefulSet")}
    services = {d["metadata"]["name"]: msgspec.convert(d["spec"], ServiceSpec)
                for d in _by_kind(docs, "Service")}
    started = set()
    for name, spec in sets.items():
        pod = spec.template
        assert spec.selector.matchLabels.items() <= pod.metadata.labels.items(), name
        (container,) = pod.spec.containers
        node = container.args[container.args.index("--node") + 1]
        started.add(node)
        assert container.args[:3] == ["python", "launch_cluster.py",
                                      "/etc/candor/topology.yaml"]
        # the node's host name is this pod's stable name under its headless Service
        assert nodes[node].host.startswith(f"{name}-0.{spec.serviceName}.")
        assert services[spec.serviceName].clusterIP == "None"
        ports = {p.name: p.containerPort for p in container.ports if p.name}
        assert ports["metrics"] == nodes[node].metrics_port
        # model loading gets its own budget, so liveness can be strict after it
        assert container.startupProbe is not None, name
        startup = container.startupProbe
        assert startup.periodSeconds * startup.failureThreshold >= 600, name
        for key in ("cpu", "memory"):
            assert key in container.resources.requests, (name, key)
        assert "memory" in container.resources.limits, name
        if "api_frontend" in nodes[node].roles:
            assert ports["http"] == topology.http_of(nodes[node]).port
            # liveness asks only the frontend (a loading or restarting engine must not
            # get healthy gateways restarted); readiness asks the whole topology
            assert container.livenessProbe.httpGet.path == "/live"
            assert container.readinessProbe.httpGet.path == "/health"
            assert pod.spec.terminationGracePeriodSeconds > topology.supervision.drain_timeout_s
        annotations = pod.metadata.annotations
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) in ports.values()
        # every tcp port this node binds is open in the pod and on its headless Service
        for cfg in process_configs(topology, "/run", node=node):
            addrs = [cfg.addresses.scheduler_in, cfg.addresses.scheduler_pub,
                     cfg.addresses.worker_in, cfg.addresses.worker_out,
                     *cfg.addresses.tokenizer_in, *cfg.addresses.detokenizer_in,
                     *cfg.addresses.frontend_results,
                     *cfg.addresses.node_status,
                     *(a for ranks in cfg.addresses.replica_kv_in for a in ranks)]
            for addr in addrs:
                if addr.startswith(f"tcp://{nodes[node].host}:"):
                    port = int(addr.rsplit(":", 1)[1])
                    assert port in {p.containerPort for p in container.ports}, (node, addr)
                    assert port in {p.port for p in services[spec.serviceName].ports}, addr
    assert started == set(nodes)
    # a prefill or decode pool's pods say which (llm-d's role label) and run only the
    # gpu_worker ranks of that role's replicas
    groups = topology.groups()
    for name, spec in sets.items():
        role = spec.template.metadata.labels.get("llm-d.ai/role")
        node = nodes[spec.template.spec.containers[0].args[-1]]
        if role is None:
            assert topology.disaggregation is None or "gpu_worker" not in node.roles, name
            continue
        replicas = {r for i in node.gpu_workers for r in groups[0].replica_ids()
                    if i in groups[0].ranks_of(r)}
        assert {topology.replica_role(r) for r in replicas} == {role}, name
        assert len(node.devices) == len(node.gpu_workers), name
    # the client-facing Service selects exactly the pods that serve HTTP, on their port
    front = services[front]
    selected = {spec.template.spec.containers[0].args[-1] for spec in sets.values()
                if front.selector.items() <= spec.template.metadata.labels.items()}
    assert selected == {n.name for n in topology.nodes_of("api_frontend")}
    for spec in sets.values():
        if spec.template.spec.containers[0].args[-1] in selected:
            assert front.ports[0].targetPort in {p.name for p in
                                                 spec.template.spec.containers[0].ports}
    (monitor,) = _by_kind(docs, "PodMonitor")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["path"] == "/metrics"
    for spec in sets.values():
        assert monitor["spec"]["selector"]["matchLabels"].items() \
            <= spec.template.metadata.labels.items()
        assert endpoint["port"] in {p.name for p in spec.template.spec.containers[0].ports}


# ------------------------------------------------------------------ prometheus + grafana
def _dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "candor-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= len(dash["panels"]) >= 12
    return exprs


def _alert_exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "candor-alerts.yml").read_text())
    alerts = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    assert {"CandorEngineDown", "CandorQueueGrowing", "CandorKVCacheFull",
            "CandorHighErrorRate"} <= set(alerts)
    return list(alerts.values())


def test_prometheus_config_loads_the_alert_rules():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    for rule_file in config["rule_files"]:
        assert (DEPLOY / "prometheus" / rule_file).is_file()
    assert all(job["job_name"].startswith("candor") for job in config["scrape_configs"])


async def test_every_dashboard_and_alert_query_uses_an_exported_metric(server):
    import aiohttp

    async with aiohttp.ClientSession() as session:  # make every labelled series exist
        for stream in (False, True):
            async with session.post(server.base_url + "/v1/completions", json={
                    "model": "tiny-llama", "prompt": "hi", "max_tokens": 3,
                    "stream": stream}) as resp:
                await resp.read()
    exported = scrape(server).sample_names()
    used = {m for e in _dashboard_exprs() + _alert_exprs() for m in METRIC.findall(e)}
    assert len(used) >= 20
    missing = sorted(m for m in used if m not in exported
                     and m not in ("candor_stream_errors_total",
                                   "candor_process_restarts_total"))
    assert not missing, f"queries use metrics Candor does not export: {missing}"
    # the two left out only appear once something failed; their help texts are declared
    from api_frontend.metrics import FrontendMetrics  # noqa: F401 - declares stream errors
    assert "candor_stream_errors" in (REPO / "api_frontend" / "metrics.py").read_text()
    assert "candor_process_restarts" in (REPO / "launcher" / "supervisor.py").read_text()


# ------------------------------------------------------------------ images and probes
def test_images_build_from_source_only():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv/" in ignored and ".git/" in ignored  # COPY . would take a GB otherwise
    cpu = (DEPLOY / "kubernetes" / "Dockerfile").read_text()
    cuda = (DEPLOY / "kubernetes" / "Dockerfile.cuda").read_text()
    assert "whl/cpu" in cpu and "flashinfer" not in cpu
    assert "whl/cu" in cuda and "pip install --no-cache-dir flashinfer-python" in cuda
    assert "import flashinfer" in cuda  # the build fails when it cannot be imported
    packages = sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests")
    assert {"protocol", "cluster", "api_frontend", "tokenizer_worker", "scheduler", "gpu_worker",
            "detokenizer"} <= set(packages)
    for text in (cpu, cuda):
        assert "COPY . " not in text
        for package in packages:  # every package the processes import, a new one too
            assert f"COPY {package} /app/{package}" in text, package


def test_live_answers_without_the_engine(server):
    status, body = server.get("/live")
    assert status == 200 and json.loads(body)["status"] == "live"


# ------------------------------------------------------------------ inference pool
POOL = DEPLOY / "kubernetes" / "inference-pool" / "candor-pool.yaml"


def _pool_metric_flags(docs: list[dict]) -> dict[str, str]:
    (epp,) = [d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"] == "candor-epp"]
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    return {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if a.endswith("-metric")
            or "-metric=" in a}


def test_inference_pool_manifests_fit_together():
    docs = _docs(POOL)
    (pool,) = _by_kind(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    replicas = next(d for d in _by_kind(docs, "Deployment")
                    if d["metadata"]["name"] == "candor-replica")
    pod = replicas["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = msgspec.convert(pod["spec"]["containers"][0], Container)
    ports = {p.containerPort for p in container.ports}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= ports
    assert container.livenessProbe.httpGet.path == "/live"
    assert container.readinessProbe.httpGet.path == "/health"
    assert container.startupProbe is not None
    # the pod runs a whole single-node topology
    (config,) = _by_kind(docs, "ConfigMap")
    topology = msgspec.yaml.decode(config["data"]["topology.yaml"], type=Topology)
    check_topology(topology, check_model=False)
    assert len(topology.effective_nodes()) == 1 and topology.http.port in ports
    assert topology.http.host == "0.0.0.0"
    # the picker the pool names exists and listens where the pool says
    ref = pool["spec"]["endpointPickerRef"]
    (svc,) = [d for d in _by_kind(docs, "Service") if d["metadata"]["name"] == ref["name"]]
    assert ref["port"]["number"] in {p["port"] for p in svc["spec"]["ports"]}
    (route,) = _by_kind(docs, "HTTPRoute")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    flags = _pool_metric_flags(docs)
    assert flags["--total-queued-requests-metric"] == "vllm:num_requests_waiting"
    assert flags["--kv-cache-usage-percentage-metric"] == "vllm:kv_cache_usage_perc"
    # LoRA affinity: the pods serve an adapter and the picker reads vLLM's LoRA gauge
    assert flags["--lora-info-metric"] == "vllm:lora_requests_info"
    assert topology.model.lora.enabled and topology.model.lora.modules


def test_a_live_scrape_carries_what_the_endpoint_picker_reads(server):
    """The model-server protocol: queued requests (gauge) and KV-cache utilisation (gauge,
    0..1), under the names the EPP is configured with; present before any traffic."""
    flags = _pool_metric_flags(_docs(POOL))
    wanted = [v for k, v in flags.items() if v and k != "--lora-info-metric"]  # its LoRA gauge: test_e2e_lora.py
    assert len(wanted) == 2
    now = scrape(server)
    for name in wanted:
        family = now.families.get(name)
        assert family is not None and family.type == "gauge", name
        values = [s.value for s in family.samples if s.name == name]
        assert values and all(v >= 0 for v in values), name
    usage = now.value("vllm:kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0


# ------------------------------------------------------------------ grafana variables
def _balanced(expr: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    in_string = False
    for ch in expr:
        if ch == '"':
            in_string = not in_string
        elif in_string:
            continue
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and not in_string


def test_dashboard_filters_by_datasource_instance_and_model():
    dash = json.loads((DEPLOY / "grafana" / "candor-dashboard.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for name in ("instance", "model_name"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"]
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert _balanced(expr), expr
            for selector in re.findall(r"\bcandor_[a-z0-9_]+(\{[^}]*\})?", expr):
                assert 'instance=~"$instance"' in selector, expr
                assert 'model_name=~"$model_name"' in selector, expr


def test_panels_over_failure_counters_show_zero_not_no_data():
    """Counters with a label appear only after their first event (a mid-stream error, a
    restart); until then the panel shows 0 rather than "no data"."""
    dash = json.loads((DEPLOY / "grafana" / "candor-dashboard.json").read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            if re.search(r"candor_(stream_errors|process_restarts|aborts)_total",
                         target["expr"]):
                assert target["expr"].rstrip().endswith("or vector(0)"), panel["title"]


def test_alert_rules_parse():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "candor-alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert _balanced(rule["expr"]), rule["alert"]
            assert rule["labels"]["severity"] in ("page", "ticket", "warning", "critical")
            assert rule["annotations"]["summary"], rule["alert"]
            assert re.fullmatch(r"\d+[smh]", str(rule.get("for", "0s"))), rule["alert"]


# Custom resources whose schemas are not part of Kubernetes itself (Prometheus operator,
# Gateway API and its Inference Extension): checked by the structural tests above.
_CRD_KINDS = {"PodMonitor", "InferencePool", "HTTPRoute"}


def test_manifests_validate_against_the_kubernetes_schemas():
    """Every built-in resource of the shipped manifests passes kubernetes-validate's strict
    check (offline: the schemas ship in the package), so a typo'd or unknown field fails."""
    import kubernetes_validate
    import yaml

    checked = set()
    for path in sorted((DEPLOY / "kubernetes").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            kind = doc["kind"]
            if kind in _CRD_KINDS:
                continue
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
            checked.add(kind)
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap"} <= checked, checked


def test_tensor_parallel_is_shown_on_one_host_and_across_machines():
    """Operators copy from deploy/topologies: TP on one host, and TP across machines
    with its traffic protection declared (the launcher refuses it otherwise)."""
    shipped = {p.name: load_topology(str(p)) for p in (DEPLOY / "topologies").glob("*.yaml")}
    tp = {name: t for name, t in shipped.items() if t.tensor_parallel > 1}
    spanning = {name for name, t in tp.items() if len(t.rank_nodes(0)) > 1}
    assert spanning and set(tp) - spanning, sorted(tp)
    for name in spanning:
        traffic = tp[name].security.tensor_parallel
        assert traffic is not None and tp[name].security.curve is not None, name
    one_host = next(t for name, t in tp.items() if name not in spanning)
    workers = [c for c in process_configs(one_host, "/tmp/r") if c.role == "gpu_worker"]
    assert [c.tp_interface for c in workers] == ["lo"] * one_host.tensor_parallel
    assert workers[0].tp_address.startswith("file:///tmp/r/")


PD_POOLS = DEPLOY / "kubernetes" / "inference-pool" / "candor-pd-pools.yaml"


def test_an_inference_pool_per_role_targets_pods_that_serve_the_api():
    """Each InferencePool selects one role's pool pods of disaggregated.yaml, and each of
    those pods runs frontends (its node names api_frontends) on the pool's target port;
    each pool has its own picker, and the route reaches both pools."""
    docs, pools_docs = _docs(DEPLOY / "kubernetes" / "disaggregated.yaml"), _docs(PD_POOLS)
    topology = msgspec.yaml.decode(_by_kind(docs, "ConfigMap")[0]["data"]["topology.yaml"],
                                   type=Topology)
    nodes = {n.name: n for n in topology.effective_nodes()}
    pods = [d["spec"]["template"] for d in _by_kind(docs, "StatefulSet")]
    pools = {p["metadata"]["name"]: p for p in _by_kind(pools_docs, "InferencePool")}
    assert set(pools) == {"candor-pd-prefill", "candor-pd-decode"}
    epps = {d["metadata"]["name"]: d for d in _by_kind(pools_docs, "Deployment")}
    services = {d["metadata"]["name"]: d for d in _by_kind(pools_docs, "Service")}
    groups = topology.groups()
    for name, pool in pools.items():
        assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
        role = name.rsplit("-", 1)[1]
        selector = pool["spec"]["selector"]["matchLabels"]
        assert selector["llm-d.ai/role"] == role
        chosen = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert chosen, name
        for pod in chosen:
            container = msgspec.convert(pod["spec"]["containers"][0], Container)
            node = nodes[container.args[-1]]
            assert node.api_frontends, node.name  # it serves the API itself
            replicas = {r for i in node.gpu_workers for r in groups[0].replica_ids()
                        if i in groups[0].ranks_of(r)}
            assert {topology.replica_role(r) for r in replicas} == {role}
            http = next(p for p in container.ports if p.name == "http")
            assert http.containerPort == topology.http_of(node).port
            assert {p["number"] for p in pool["spec"]["targetPorts"]} == {http.containerPort}
            assert container.readinessProbe.httpGet.path == "/health"
        ref = pool["spec"]["endpointPickerRef"]
        assert ref["port"]["number"] in {p["port"] for p in services[ref["name"]]["spec"]["ports"]}
        args = epps[ref["name"]]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--pool-name={name}" in args and "--pool-namespace=candor-pd" in args
    (route,) = _by_kind(pools_docs, "HTTPRoute")
    assert {(b["kind"], b["name"]) for b in route["spec"]["rules"][0]["backendRefs"]} == {
        ("InferencePool", name) for name in pools}
