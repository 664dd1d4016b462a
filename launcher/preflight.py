"""What the launcher settles before any process starts: each check fails in one line
naming the problem (a checkpoint the worker cannot serve or split, a broken chat
template, a busy HTTP port, an unreadable key file), and the defaults left to the
machine are filled in and said. The role packages are imported here, inside the
functions, only to run their own validators."""

from __future__ import annotations

import errno
import os
import socket

import msgspec

from cluster.checkpoint import effective_max_model_len, has_processor
from cluster.generation_config import GenerationConfigError, sampling_defaults
from launcher.supervisor import say
from cluster.topology import EngineGroup, HttpSpec, NodeSpec, Topology


def check_chat_template(topology: Topology) -> None:
    """A broken --chat-template fails here, in one line, before any process starts."""
    from tokenization.chat_template import ChatTemplateError
    from tokenization.template_source import load_server_template
    try:
        load_server_template(topology.api.chat_template, topology.api.limits.max_template_bytes)
    except ChatTemplateError as err:
        raise SystemExit("candor: " + " ".join(str(err).split())) from None


def check_port_free(http: HttpSpec) -> None:
    """Fail in one line when something already listens on the HTTP port.

    The frontends bind with SO_REUSEPORT so that they can share the port, and a second
    server doing the same would silently split the traffic with the first. This probe
    binds without SO_REUSEPORT, which any existing listener on the port refuses."""
    try:
        infos = socket.getaddrinfo(http.host or None, http.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise SystemExit(f"candor: cannot resolve http.host {http.host!r}: {err}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
        try:
            probe.bind(addr)
            probe.listen(1)
        except OSError as err:
            why = "is already in use" if err.errno == errno.EADDRINUSE else f"fails: {err}"
            raise SystemExit(f"candor: port {http.port} on {http.host} {why} (another "
                             "server listens there); choose another --port / http.port") \
                from None


def resolve_api_keys(topology: Topology, flag_keys: list[str]) -> list[str]:
    """Keys from flags, CANDOR_API_KEY / VLLM_API_KEY and ``http.api_key_file``."""
    from api_frontend.auth import collect_keys
    files = [topology.http.api_key_file] if topology.http.api_key_file else []
    try:
        return collect_keys(flag_keys, files, dict(os.environ))
    except OSError as err:
        raise SystemExit(f"candor: cannot read the API key file: {err}") from None


def check_model_config(topology: Topology) -> None:
    """Refuse a checkpoint the gpu_worker cannot serve exactly, in one line naming the
    field and value, before any process starts (the parsers are torch-free); say how a
    pooling model pools."""
    for group in topology.groups():
        _check_model(group, _tp_keys(topology, group))
    if topology.api.chat_template is not None and all(g.runner == "pooling" for g in topology.groups()):
        say("--chat-template (api.chat_template) is unused: this deployment serves pooling "
            "models only, whose routes render no chat template (vLLM's score templates are "
            "not read; a Qwen3-Reranker's prompt is built in: docs/api.md, \"Score, rerank "
            "and classify\")")


def _tp_keys(topology: Topology, group: EngineGroup) -> dict[int, str]:
    """Each TP size the group's replicas run -> the topology key that set it."""
    split = topology.disaggregation if group.index == 0 else None
    if split is None:
        return {group.tensor_parallel: "tensor_parallel"}
    keys: dict[int, str] = {}
    for role in ("prefill", "decode"):
        own = getattr(split, f"{role}_tensor_parallel")
        keys.setdefault(own or group.tensor_parallel,
                        f"disaggregation.{role}_tensor_parallel" if own else "tensor_parallel")
    return keys


def _check_model(group: EngineGroup, tp_keys: dict[int, str]) -> None:
    from cluster.pooling import UnsupportedPooling, auto_runner, read_pooling_config
    from gpu_worker.model_config import UnsupportedConfig, load_config

    path = group.model.resolved_path()
    if not os.path.isfile(os.path.join(path, "config.json")):
        return  # another node holds the checkpoint; its launcher checks it
    from gpu_worker.tp_shard import shard_problems
    try:
        cfg = load_config(path)
    except UnsupportedConfig as err:
        raise SystemExit(f"candor: cannot serve {path}: {err}") from None
    _check_quantization(group.model.quantization, path)
    for size, key in tp_keys.items():
        problems = shard_problems(cfg, size, key)
        if problems:
            raise SystemExit(f"candor: cannot split {path} over {size} ranks: "
                             f"{'; '.join(problems)}")
    if group.runner == "generate" and (auto_runner(path) == "pooling" or cfg.encoder is not None):
        raise SystemExit(f"candor: {path} has no language-model head (a base model, a "
                         "classifier or an encoder): serve it with --runner pooling "
                         "(runner: pooling)")
    context = effective_max_model_len(path, group.model.max_model_len)
    if cfg.encoder is not None and group.engine.max_num_batched_tokens < context:
        raise SystemExit(f"candor: {path} is a bidirectional encoder, whose prompts are "
                         "computed whole in one step: --max-num-batched-tokens "
                         f"{group.engine.max_num_batched_tokens} is below its context "
                         f"({context} tokens); raise it or lower --max-model-len")
    _check_images(cfg, path, group.engine.max_num_batched_tokens)
    if group.runner == "pooling":
        try:
            pooling = read_pooling_config(path)
        except (UnsupportedPooling, OSError, ValueError) as err:
            raise SystemExit(f"candor: cannot pool {path}: {err}") from None
        if pooling.task == "classify":
            say(f"{group.model.name()!r}: {pooling.dimension} classification logits "
                f"({pooling.source})")
            return
        say(f"{group.model.name()!r}: embeddings by {pooling.method} pooling"
            f"{', L2-normalised' if pooling.normalize else ''}, {pooling.dimension} "
            f"dimensions ({pooling.source})")


def _check_images(cfg, path: str, max_num_batched_tokens: int) -> None:
    """A vision checkpoint's image preprocessing must be one Candor mirrors (no pan-and-
    scan crops), and a step must hold a whole Gemma 3 image: its tokens attend each other
    both ways, so the scheduler never splits one over chunks."""
    if cfg.vision is None or not has_processor(path):
        return
    from tokenizer_worker.vision import processor_problem

    problem = processor_problem(path)
    if problem is not None:
        raise SystemExit(f"candor: cannot take images for {path}: {problem}")
    if cfg.vision.bidirectional and max_num_batched_tokens < cfg.vision.tokens_per_image:
        raise SystemExit(f"candor: {path}'s images are {cfg.vision.tokens_per_image} tokens each, "
                         "computed in one step (they attend each other both ways): "
                         f"--max-num-batched-tokens {max_num_batched_tokens} is below that; "
                         "raise it")


def _check_quantization(asked: str | None, path: str) -> None:
    """``--quantization`` names the format the checkpoint is in (vLLM's names and
    aliases); Candor quantizes nothing at load, so an unquantized checkpoint is refused."""
    if asked is None:
        return
    from cluster.checkpoint import read_model_config
    from gpu_worker.quantization.spec import QUANTIZATION_NAMES
    stored = (read_model_config(path).get("quantization_config") or {}).get("quant_method")
    if stored is None:
        raise SystemExit(f"candor: --quantization {asked}: {path} is not quantized (no "
                         "quantization_config), and Candor does not quantize weights at load")
    if QUANTIZATION_NAMES[asked] != str(stored).lower():
        raise SystemExit(f"candor: --quantization {asked}: {path} is quantized with {stored} "
                         "(its quantization_config.quant_method)")


def check_lora_adapters(topology: Topology) -> None:
    """Refuse a --lora-modules adapter the gpu_worker could not serve (not a PEFT LoRA
    directory, DoRA, other target modules, a rank past --max-lora-rank, shapes that do not
    fit the base model), in one line naming it, before any process starts (torch-free).
    Run where the ranks run: the adapters' files are read there."""
    lora = topology.model.lora
    path = topology.model.resolved_path()
    if not lora.enabled or not lora.modules or not os.path.isfile(os.path.join(path, "config.json")):
        return
    from gpu_worker.lora.peft_files import AdapterError, read_adapter
    from gpu_worker.model_config import load_config

    base = load_config(path)
    for module in lora.modules:
        try:
            read_adapter(module.resolved_path(), base, lora.max_lora_rank)
        except AdapterError as err:
            raise SystemExit(f"candor: cannot serve LoRA adapter {module.name!r}: "
                             + " ".join(str(err).split())) from None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def settle_defaults(topology: Topology, node: NodeSpec) -> Topology:
    """Fill what the operator left to the machine, saying what was chosen and why:
    the gpu_worker's threads (left unset: the worker's governor follows the cores the
    other processes leave idle; an operator's OMP_NUM_THREADS wins) and the sampling defaults of
    ``model.generation_config``. The device and the KV cache size are the gpu_worker's
    to settle (it sees the device and the memory left after loading); it logs them."""
    engine, api = topology.engine, topology.api
    if "gpu_worker" in node.roles and engine.worker_threads is None:
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            say(f"gpu_worker threads: {os.environ['OMP_NUM_THREADS']} (OMP_NUM_THREADS)")
        else:  # gpu_worker.thread_governor: what the other processes leave idle
            say(f"gpu_worker threads: adaptive, 1 to {_usable_cores()} (the cores the other "
                "processes leave idle, for steps that run faster with them; "
                "--worker-threads to fix)")
    model_dir = topology.model.resolved_path()
    if not api.sampling_defaults.items() and os.path.isdir(model_dir):
        try:
            defaults = sampling_defaults(topology.model.generation_config, model_dir)
        except GenerationConfigError as err:
            raise SystemExit(f"candor: {err}") from None
        if defaults.items():
            say("sampling defaults for requests that omit them, from "
                f"{defaults.source}: " + ", ".join(f"{k}={v}" for k, v in
                                                   defaults.items().items()))
        api = msgspec.structs.replace(api, sampling_defaults=defaults)
    return msgspec.structs.replace(topology, engine=engine, api=api)
