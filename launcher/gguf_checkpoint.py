"""``candor serve --model FILE.gguf``: a GGUF file served as it is.

Every role reads a model directory (config.json, tokenizer.json, the chat template), so
before any process starts the launcher gives a GGUF file one, under
``~/.cache/candor/gguf/`` (``CANDOR_GGUF_CACHE``): config.json from the file's metadata
as llama.cpp reads it (``gpu_worker.gguf.config``), pointing at the file
(``gpu_worker.gguf.prepared``), and the tokenizer and chat template from the metadata,
converted once by transformers' GGUF tokenizer (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``, ``tokenization.gguf_tokenizer``, in a process of its own: the launcher stays free of torch), or copied
from ``--tokenizer DIR``. The weights stay in the file: the gpu_worker reads them from it.

The file is checked at every start (header, types, names, shapes against its metadata:
``GGUFCheckpoint.open``, well under a second) and refused in one line; the tokenizer is
converted once per file, tokenizer source and transformers version (a few seconds); a
start with a prepared directory reads the file's header only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from launcher.supervisor import say
from cluster.topology import EngineSpec, ModelSpec, Topology
from gpu_worker.gguf.prepared import POINTER, pointer
from gpu_worker.gguf.reader import GGUFError
from gpu_worker.gguf.tensors import GGUFCheckpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")
TOKENIZER_DIRS = ("additional_chat_templates",)


def is_gguf(path: str | os.PathLike) -> bool:
    """A file named *.gguf, or any file that starts with GGUF's magic."""
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        return False
    if path.endswith(".gguf"):
        return True
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"


def served_name(path: str) -> str:
    """The default served name: a GGUF file's name without .gguf, a directory's name."""
    name = os.path.basename(path.rstrip("/"))
    return name[:-len(".gguf")] if is_gguf(path) and name.endswith(".gguf") else name


def cache_root(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("CANDOR_GGUF_CACHE"):
        return Path(os.path.expanduser(env["CANDOR_GGUF_CACHE"]))
    base = env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "candor" / "gguf"


def prepare_gguf_models(topology: Topology, environ: dict[str, str] | None = None) -> Topology:
    """The topology with each GGUF model's path replaced by its prepared directory (and
    the file's name as its served name where none was given). A file that cannot be
    served exits in one line."""
    model = _prepared_spec(topology.model, "model", environ)
    models = [msgspec.structs.replace(served, model=_prepared_spec(served.model, f"models[{i}].model", environ),
                                      engine=_prepared_draft(served.engine, environ))
              for i, served in enumerate(topology.models)]
    return msgspec.structs.replace(topology, model=model, models=models,
                                   engine=_prepared_draft(topology.engine, environ))


def _prepared_draft(engine: EngineSpec, environ: dict[str, str] | None) -> EngineSpec:
    """A speculative draft model given as a GGUF file gets its prepared directory too."""
    spec = engine.speculative_config
    if spec is None or spec.model is None or not is_gguf(spec.model):
        return engine
    try:
        directory = prepare(spec.model, None, environ)
    except GGUFError as err:
        raise SystemExit(f"candor: cannot serve the draft model {err}") from None
    return msgspec.structs.replace(
        engine, speculative_config=msgspec.structs.replace(spec, model=str(directory)))


def _prepared_spec(spec: ModelSpec, label: str, environ: dict[str, str] | None) -> ModelSpec:
    path = spec.resolved_path()
    if not is_gguf(path):
        if spec.tokenizer is not None:
            raise SystemExit(f"candor: {label}.tokenizer (--tokenizer) is taken for a GGUF model only; "
                             f"{path} is a checkpoint directory, whose tokenizer is its own")
        return spec
    tokenizer = None if spec.tokenizer is None else os.path.abspath(os.path.expanduser(spec.tokenizer))
    try:
        directory = prepare(path, tokenizer, environ)
    except GGUFError as err:
        raise SystemExit(f"candor: cannot serve {err}") from None
    return msgspec.structs.replace(spec, path=str(directory), tokenizer=None,
                                   served_model_name=spec.served_model_name or served_name(path))


def prepare(gguf_path: str, tokenizer: str | None = None, environ: dict[str, str] | None = None) -> Path:
    """The prepared directory of ``gguf_path`` (made now if there is none yet)."""
    checkpoint = GGUFCheckpoint.open(gguf_path)  # every start: refuse a bad file before anything runs
    if tokenizer is not None and not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
        raise GGUFError(f"{gguf_path}: --tokenizer {tokenizer} has no tokenizer.json")
    source = pointer(gguf_path)
    identity = json.dumps([source, tokenizer and _identity(tokenizer), _version("transformers")])
    root = cache_root(environ)
    directory = root / f"{Path(gguf_path).stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
    config = {**checkpoint.config, POINTER: source}
    if not (directory / "tokenizer.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        _build(directory, gguf_path, tokenizer)
    config_path = directory / "config.json"
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    if not config_path.is_file() or config_path.read_text() != text:  # the config follows this code
        _write_atomically(config_path, text)
    return directory


def _build(directory: Path, gguf_path: str, tokenizer: str | None) -> None:
    """The tokenizer files, written beside ``directory`` and moved in whole."""
    partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        if tokenizer is not None:
            _copy_tokenizer(tokenizer, partial)
            say(f"{gguf_path}: tokenizer and chat template from {tokenizer} (--tokenizer)")
        else:
            say(f"{gguf_path}: building its tokenizer from the file's metadata (once; kept in {directory})")
            _convert_tokenizer(gguf_path, partial)
        try:
            os.rename(partial, directory)
        except OSError:  # another launcher prepared it meanwhile
            if not (directory / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _convert_tokenizer(gguf_path: str, out: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tokenization.gguf_tokenizer", gguf_path, str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise GGUFError(f"{gguf_path}: its tokenizer cannot be built from the metadata "
                        f"({lines[-1].strip() if lines else f'exit {proc.returncode}'}); "
                        "pass the model's HF tokenizer directory with --tokenizer")


def _copy_tokenizer(source: str, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy2(os.path.join(source, name), out / name)
    for name in TOKENIZER_DIRS:
        if os.path.isdir(os.path.join(source, name)):
            shutil.copytree(os.path.join(source, name), out / name)


def _identity(directory: str) -> list:
    """What a tokenizer directory's files are, as far as a cache needs to know."""
    out = []
    for name in TOKENIZER_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            stat = os.stat(path)
            out.append([name, stat.st_size, stat.st_mtime_ns])
    return out


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
