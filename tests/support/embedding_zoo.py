"""Tiny embedding checkpoints written by sentence-transformers itself, and its encodings
as the reference (nothing is downloaded).

A zoo checkpoint (``tests/support/model_zoo.py``: a random tiny decoder with the project's
tokenizer) is wrapped by sentence-transformers' own ``Transformer`` + ``Pooling`` (+
``Normalize``) modules and saved with ``SentenceTransformer.save``: ``modules.json``,
``1_Pooling/config.json`` and a base-model checkpoint (``Qwen3Model``: no LM head, tensor
names without the ``model.`` prefix), exactly what a hub embedding model holds.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import model_zoo
from tests.support.server import CandorServer, free_port


def build_embedding_model(out: Path, tokenizer_dir: Path, *, arch: str = "qwen3",
                          pooling: str = "lasttoken", normalize: bool = True,
                          matryoshka_dimensions: list[int] | None = None) -> Path:
    """A sentence-transformers checkpoint in ``out``; ``matryoshka_dimensions`` is written
    into config.json (vLLM's convention) when given."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    base = model_zoo.build(arch, out.parent / f"{out.name}-base", tokenizer_dir=tokenizer_dir)
    # sentence-transformers 6 renders plain strings through a chat template when the
    # tokenizer has one; an embedding checkpoint has none (and Candor, like vLLM,
    # tokenizes an input as given)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    transformer = models.Transformer(str(base))
    modules = [transformer, models.Pooling(transformer.get_embedding_dimension(),
                                           pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    if matryoshka_dimensions is not None:
        config = json.loads((out / "config.json").read_text())
        config["matryoshka_dimensions"] = matryoshka_dimensions
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def st_encode(path: Path, texts: list[str], **kwargs):
    """sentence-transformers' embeddings of ``texts`` (float32 numpy rows)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, convert_to_numpy=True, **kwargs)


def hf_last_token(path: Path, ids: list[int]):
    """Plain transformers: the final hidden state of the last token, L2-normalised
    (vLLM's default pooling for a decoder checkpoint without sentence-transformers
    files)."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1).numpy()


def two_model_server(topo_dir: Path, model_dir: Path, generate: str, embed: list[str],
                     generate_len: int, embed_len: int) -> CandorServer:
    """A started topology serving ``model_dir`` twice behind one frontend: as generation
    model ``generate`` and, with ``runner: pooling`` and no sentence-transformers files
    (last token + L2), as embedding model ``embed`` (its names); each has its own context."""
    port = free_port()
    topo = topo_dir / "two-models.yaml"
    topo.write_text(f"""
model: {{path: {model_dir}, served_model_name: {generate}, max_model_len: {generate_len}}}
models:
  - model: {{path: {model_dir}, served_model_name: [{', '.join(embed)}], runner: pooling,
             max_model_len: {embed_len}}}
http: {{port: {port}}}
""")
    return CandorServer.from_topology(topo, port).start()
