"""The pooling runner (``--runner pooling``) against sentence-transformers on the same
checkpoint, driven like the scheduler drives it: prompts cut into prefill chunks of any
size, chunks of several requests in one step, a request fed again from position 0 (a
recompute after preemption). Each pooling mode's vector must match: cosine >= 0.99999."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from cluster.pooling import PoolingConfig, UnsupportedPooling, read_pooling_config
from cluster.topology import Topology
from launcher.topology_check import TopologyError, check_topology
from gpu_worker.model_runner import ModelRunner
from launcher.tiny_model import build_tiny_model
from protocol.ipc import PoolingParams, SamplingParams, SeqChunk, StepPlan
from tests.support.embedding_zoo import build_embedding_model, hf_last_token, st_encode

pytest.importorskip("sentence_transformers")

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Embeddings map text to vectors " * 6,
         "hi",
         "A much longer passage, so that it spans several blocks and several chunks: " * 5]
BLOCK = 8


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _ids(path, texts):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    return [tok(t)["input_ids"] for t in texts]


def _cos(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def pool_all(runner: ModelRunner, prompts: list[list[int]], chunk: int,
             dims: dict[int, int] | None = None, recompute: int | None = None) -> list[np.ndarray]:
    """Every prompt pooled, each fed in chunks of ``chunk`` tokens, all requests' chunks
    side by side in each step; prompt ``recompute`` has its first chunk fed twice (as
    after a preemption)."""
    dims = dims or {}
    blocks, next_block = {}, 0
    for i, p in enumerate(prompts):
        n = -(-len(p) // BLOCK)
        blocks[i] = list(range(next_block, next_block + n))
        next_block += n
    fed = {i: 0 for i in range(len(prompts))}
    out: dict[int, np.ndarray] = {}
    step, sent = 0, set()
    replayed = False
    while len(out) < len(prompts):
        seqs, new_sampling, new_pooling = [], {}, {}
        for i, p in enumerate(prompts):
            if i in out:
                continue
            start = fed[i]
            n = min(chunk, len(p) - start)
            last = start + n == len(p)
            kept = len(blocks[i]) if i in sent else 0
            seqs.append(SeqChunk(f"r{i}", p[start:start + n], start,
                                 [] if kept else blocks[i], last, kept))
            if i not in sent:
                new_sampling[f"r{i}"] = SamplingParams()
                new_pooling[f"r{i}"] = PoolingParams(dims.get(i))
                sent.add(i)
            fed[i] = start + n
            if i == recompute and not replayed and start > 0:
                fed[i], replayed = 0, True  # fed again from the start: the sum restarts
        result = runner.execute(StepPlan(step, seqs, new_sampling, new_pooling=new_pooling))
        step += 1
        finishing = [s for s in seqs if s.sample]
        assert result.sampled == [0] * len(finishing)
        assert len(result.pooled) == len(finishing)
        for s, data in zip(finishing, result.pooled):
            i = int(s.rid[1:])
            if fed[i] == len(prompts[i]):
                out[i] = np.frombuffer(data, dtype="<f4")
    runner.execute(StepPlan(step, [], released=[f"r{i}" for i in range(len(prompts))]))
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", ["lasttoken", "mean", "cls"])
def test_every_pooling_mode_matches_sentence_transformers_at_any_chunking(
        tokenizer_dir, tmp_path, mode):
    path = build_embedding_model(tmp_path / f"st-{mode}", tokenizer_dir, pooling=mode,
                                 normalize=mode != "cls")
    config = read_pooling_config(str(path))
    assert config.method == {"lasttoken": "last", "mean": "mean", "cls": "cls"}[mode]
    assert config.normalize == (mode != "cls")
    reference = st_encode(path, TEXTS)
    prompts = _ids(path, TEXTS)
    runner = ModelRunner(str(path), block_size=BLOCK, num_blocks=64, pooling=config)
    assert runner.model.lm_head is None
    for chunk in (1000, 7, 3):
        got = pool_all(runner, prompts, chunk, recompute=3)
        for text, ours, ref in zip(TEXTS, got, reference):
            assert ours.shape == ref.shape
            assert _cos(ours, ref) >= 0.99999, (mode, chunk, text)
            np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_matryoshka_dimensions_cut_then_normalise(tokenizer_dir, tmp_path):
    path = build_embedding_model(tmp_path / "st-mrl", tokenizer_dir, pooling="mean",
                                 matryoshka_dimensions=[16, 32, 64])
    config = read_pooling_config(str(path))
    assert config.matryoshka and config.matryoshka_dimensions == [16, 32, 64]
    assert config.check_dimensions(32) is None
    assert "16, 32, 64" in config.check_dimensions(20)
    reference = st_encode(path, TEXTS, truncate_dim=16, normalize_embeddings=True)
    runner = ModelRunner(str(path), block_size=BLOCK, num_blocks=64, pooling=config)
    got = pool_all(runner, _ids(path, TEXTS), 5, dims={i: 16 for i in range(len(TEXTS))})
    for ours, ref in zip(got, reference):
        assert ours.shape == (16,)
        assert abs(np.linalg.norm(ours) - 1.0) < 1e-5
        assert _cos(ours, ref) >= 0.99999


def test_a_causal_lm_without_sentence_transformers_files_pools_its_last_token(tokenizer_dir):
    """vLLM's default for a decoder checkpoint: last token, L2-normalised; the LM head in
    the checkpoint is skipped, not loaded."""
    config = read_pooling_config(str(tokenizer_dir))
    assert (config.method, config.normalize) == ("last", True) and not config.matryoshka
    assert "dimensions" in config.check_dimensions(8)
    prompts = _ids(tokenizer_dir, TEXTS)
    runner = ModelRunner(str(tokenizer_dir), block_size=BLOCK, num_blocks=64, pooling=config)
    for ours, ids in zip(pool_all(runner, prompts, 6), prompts):
        assert _cos(ours, hf_last_token(tokenizer_dir, ids)) >= 0.99999


def test_modules_candor_does_not_compute_are_refused_naming_them(tokenizer_dir, tmp_path):
    import json
    path = build_embedding_model(tmp_path / "st-max", tokenizer_dir, pooling="max")
    with pytest.raises(UnsupportedPooling, match="pooling mode 'max'"):
        read_pooling_config(str(path))
    modules = json.loads((path / "modules.json").read_text())
    modules[1]["type"] = "sentence_transformers.models.Dense"
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedPooling, match="module 'Dense'"):
        read_pooling_config(str(path))


def test_dimensions_need_a_declared_matryoshka_model():
    plain = PoolingConfig("last", True, 64, "test")
    assert "does not declare Matryoshka" in plain.check_dimensions(32)
    anysize = PoolingConfig("last", True, 64, "test", matryoshka=True)
    assert anysize.check_dimensions(1) is None and anysize.check_dimensions(64) is None
    assert "1..64" in anysize.check_dimensions(65)


def test_the_launcher_refuses_what_it_would_serve_wrongly(tokenizer_dir, tmp_path, capsys):
    """Before any process starts: a head-less checkpoint is pooling under --runner auto and
    refused for generation, and LoRA adapters over it too; a pooling it does not compute is
    refused naming it; a pooling it serves is said in one line."""
    from launcher.preflight import check_model_config
    from cluster.topology import load_topology

    def topology(path, runner):
        yaml = tmp_path / f"{path.name}-{runner}.yaml"
        yaml.write_text(f"model: {{path: {path}, runner: {runner}}}\n")
        return load_topology(str(yaml))

    st = build_embedding_model(tmp_path / "st-last", tokenizer_dir)
    assert topology(st, "auto").model.runner_kind() == "pooling"
    assert topology(tokenizer_dir, "auto").model.runner_kind() == "generate"
    with pytest.raises(SystemExit, match="no language-model head.*--runner pooling"):
        check_model_config(topology(st, "generate"))
    check_model_config(topology(st, "auto"))
    lora = msgspec.yaml.decode(f"model: {{path: {st}, lora: {{enabled: true}}}}".encode(),
                               type=Topology)
    with pytest.raises(TopologyError, match="adapters apply to generation.*pooling model"):
        check_topology(lora, check_model=False)
    assert "embeddings by last pooling, L2-normalised, 64 dimensions" in capsys.readouterr().err
    mx = build_embedding_model(tmp_path / "st-max", tokenizer_dir, pooling="max")
    with pytest.raises(SystemExit, match="cannot pool .*pooling mode 'max'"):
        check_model_config(topology(mx, "pooling"))
