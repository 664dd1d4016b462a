"""The BERT-family encoder (gpu_worker/models/encoder.py) against transformers on tiny
random BERT, RoBERTa and XLM-R checkpoints built with transformers' own classes: the
pooled final hidden states (cls, mean) and a cross-encoder's classification logits, for
several whole prompts in one step, with and without a second segment (token type 1)."""

from __future__ import annotations

import pytest
import torch

from cluster.pooling import PoolingConfig, read_pooling_config
from gpu_worker.model_config import load_config
from gpu_worker.model_runner import ModelRunner
from protocol.ipc import PoolingParams, SamplingParams, SeqChunk, StepPlan
from tests.support import encoder_zoo

ARCHS = list(encoder_zoo.ARCHS)
BLOCK = 8
# prompts of the tiny vocabulary's ids (5..), the second has a second segment from 6 on
PROMPTS = [[2, 119, 111, 109, 113, 112, 115, 61, 3], [2, 40, 41, 42, 3, 50, 51, 52, 53, 3],
           [2, 100, 3], [2] + list(range(5, 80)) + [3]]
SPLITS = [None, 5, None, 40]


def _run(runner: ModelRunner, prompts, splits, types_ok: bool) -> list[torch.Tensor]:
    """Every prompt whole, all in one step; the pooled vectors."""
    seqs, sampling, pooling, block = [], {}, {}, 0
    for i, p in enumerate(prompts):
        n = -(-len(p) // BLOCK)
        seqs.append(SeqChunk(f"r{i}", list(p), 0, list(range(block, block + n)), True, 0))
        block += n
        sampling[f"r{i}"] = SamplingParams()
        pooling[f"r{i}"] = PoolingParams(second_segment=splits[i] if types_ok else None)
    result = runner.execute(StepPlan(0, seqs, sampling, new_pooling=pooling))
    return [torch.frombuffer(bytearray(v), dtype=torch.float32) for v in result.pooled]


def _types(p, split):
    return [0] * len(p) if split is None else [0] * split + [1] * (len(p) - split)


@pytest.fixture(scope="module", params=ARCHS)
def base(request, tmp_path_factory):
    return request.param, encoder_zoo.build(request.param, tmp_path_factory.mktemp("enc") / request.param)


@pytest.mark.parametrize("method", ["cls", "mean"])
def test_pooled_hidden_states_match_transformers(base, method):
    name, path = base
    typed = encoder_zoo.ARCHS[name][3]["type_vocab_size"] > 1
    runner = ModelRunner(str(path), block_size=BLOCK, num_blocks=64,
                         pooling=PoolingConfig(method, False, 64, "test"))
    got = _run(runner, PROMPTS, SPLITS, typed)
    for p, split, vector in zip(PROMPTS, SPLITS, got):
        hidden = encoder_zoo.hf_hidden(path, p, _types(p, split) if typed else None)
        want = hidden[0] if method == "cls" else hidden.mean(dim=0)
        torch.testing.assert_close(vector, want, atol=2e-5, rtol=1e-5)


def test_an_encoder_prompt_alone_or_in_a_batch_pools_to_the_same_bits(base):
    _, path = base
    runner = ModelRunner(str(path), block_size=BLOCK, num_blocks=64,
                         pooling=PoolingConfig("mean", False, 64, "test"))
    together = _run(runner, PROMPTS, SPLITS, False)
    for i, p in enumerate(PROMPTS):
        alone = _run(runner, [p], [None], False)[0]
        assert torch.equal(alone, together[i])


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_logits_match_transformers(name, num_labels, tmp_path):
    path = encoder_zoo.build(name, tmp_path / name, classifier=True, num_labels=num_labels)
    config = read_pooling_config(str(path))
    assert (config.task, config.dimension, config.method) == ("classify", num_labels, "cls")
    typed = encoder_zoo.ARCHS[name][3]["type_vocab_size"] > 1
    runner = ModelRunner(str(path), block_size=BLOCK, num_blocks=64, pooling=config)
    got = _run(runner, PROMPTS, SPLITS, typed)
    for p, split, logits in zip(PROMPTS, SPLITS, got):
        want = encoder_zoo.hf_logits(path, p, _types(p, split) if typed else None)
        torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-5)


def test_roberta_positions_start_after_the_padding_id(tmp_path):
    path = encoder_zoo.build("roberta", tmp_path / "r", tokenizer=False)
    cfg = load_config(path)
    assert (cfg.encoder.position_offset, cfg.max_position_embeddings) == (2, 128)


@pytest.mark.parametrize("num_labels", [1, 2])
def test_a_decoder_sequence_classifier_matches_transformers(num_labels, tmp_path):
    """Qwen3ForSequenceClassification (the converted form of a yes/no reranker such as
    Qwen3-Reranker: ``score`` = lm_head[yes] - lm_head[no]): its last token's logits."""
    import transformers

    from tests.support import model_zoo

    config = transformers.Qwen3Config(**{**model_zoo._COMMON, "num_labels": num_labels})
    torch.manual_seed(0)
    model = transformers.Qwen3ForSequenceClassification(config).float()
    model_zoo.perturb(model)
    model.eval().save_pretrained(tmp_path)
    pooling = read_pooling_config(str(tmp_path))
    assert (pooling.task, pooling.method, pooling.dimension) == ("classify", "last", num_labels)
    runner = ModelRunner(str(tmp_path), block_size=BLOCK, num_blocks=64, pooling=pooling)
    prompts = [[1, 7, 9, 11, 300], [1, 40, 41], list(range(6, 90))]  # (5 is the pad id)
    got = _run(runner, prompts, [None] * 3, False)
    for p, logits in zip(prompts, got):
        with torch.no_grad():
            want = model(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-5)
    assert runner.deterministic  # the head runs one row at a time


def test_a_yes_no_reranker_converted_to_a_classifier_scores_as_its_lm_heads_yes_no_softmax(tmp_path):
    """Qwen3-Reranker style: a causal LM judged by P("yes") = softmax([l_no, l_yes])[1] at
    the last position. Converted as vLLM's ``classifier_from_token`` does (one ``score``
    row = lm_head[yes] - lm_head[no]), the served score sigmoid(logit) equals that
    probability computed from transformers' logits of the causal LM."""
    import transformers

    from tests.support import model_zoo

    causal = model_zoo.build("qwen3", tmp_path / "lm")
    lm = model_zoo.hf_model(causal)
    yes, no = 300, 301  # the tiny vocabulary's stand-ins for "yes" and "no"
    config = transformers.Qwen3Config.from_pretrained(causal)
    config.architectures, config.num_labels = ["Qwen3ForSequenceClassification"], 1
    seq = transformers.Qwen3ForSequenceClassification(config).float()
    seq.model.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        seq.score.weight.copy_(lm.lm_head.weight[yes] - lm.lm_head.weight[no])
    seq.save_pretrained(tmp_path / "seq-cls")
    pooling = read_pooling_config(str(tmp_path / "seq-cls"))
    runner = ModelRunner(str(tmp_path / "seq-cls"), block_size=BLOCK, num_blocks=64, pooling=pooling)
    prompts = [[1, 7, 9, 11, 300, 12], list(range(6, 70))]
    got = _run(runner, prompts, [None, None], False)
    for p, logit in zip(prompts, got):
        with torch.no_grad():
            last = lm(torch.tensor([p])).logits[0, -1]
        want = torch.softmax(torch.stack([last[no], last[yes]]), dim=0)[1]
        torch.testing.assert_close(torch.sigmoid(logit[0]), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_original_yes_no_reranker_under_hf_overrides_scores_as_its_lm_heads_yes_no_softmax(
        tied, tmp_path, tiny_model_dir):
    """Qwen3-Reranker as published (a Qwen3ForCausalLM) with vLLM's --hf-overrides: the
    launcher's overridden config makes it a one-label classifier whose ``score`` row is
    made at load time from the LM head's "yes" and "no" rows (the embedding table's when
    tied), so sigmoid(logit) equals transformers' softmax([l_no, l_yes])[1] on the
    causal LM."""
    from transformers import AutoTokenizer

    from launcher.hf_overrides import prepare
    from tests.support import reranker_zoo

    lm = reranker_zoo.build(tmp_path / "lm", tiny_model_dir, tied=tied)
    served, _ = prepare(str(lm), reranker_zoo.HF_OVERRIDES,
                        {"CANDOR_HF_OVERRIDES_CACHE": str(tmp_path / "cache")})
    pooling = read_pooling_config(str(served))
    assert (pooling.task, pooling.method, pooling.dimension, pooling.labels,
            pooling.pair_format) == ("classify", "last", 1, ["yes"], "qwen3_reranker")
    cfg = load_config(served)
    tok = AutoTokenizer.from_pretrained(lm)
    assert (cfg.score_token_ids, cfg.score_two_way) == (tok.convert_tokens_to_ids(["no", "yes"]), True)
    texts = ["<|im_start|>user\nis paris in france? yes<|im_end|>", "the quick brown fox no",
             "a" * 50]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    runner = ModelRunner(str(served), block_size=BLOCK, num_blocks=64, pooling=pooling)
    got = _run(runner, prompts, [None] * len(prompts), False)
    want = reranker_zoo.reference_scores(lm, texts)
    assert max(want) - min(want) > 0.01  # the rows differ: the check can fail
    for logit, p in zip(got, want):
        assert logit.shape == (1,)
        torch.testing.assert_close(torch.sigmoid(logit[0]).item(), p, atol=1e-5, rtol=0)


def test_no_post_processing_serves_the_lm_heads_rows_of_its_tokens_as_labels(tmp_path, tiny_model_dir):
    """vLLM's other conversion (``"method": "no_post_processing"``): one label per token,
    its logit the causal LM's logit of that token at the last position."""
    from transformers import AutoTokenizer

    from launcher.hf_overrides import prepare
    from tests.support import model_zoo, reranker_zoo

    lm = reranker_zoo.build(tmp_path / "lm", tiny_model_dir, tied=False)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["yes", "no", "<|im_end|>"], "method": "no_post_processing"}
    served, _ = prepare(str(lm), overrides, {"CANDOR_HF_OVERRIDES_CACHE": str(tmp_path / "c")})
    pooling = read_pooling_config(str(served))
    assert (pooling.dimension, pooling.labels, pooling.pair_format) == (3, ["yes", "no", "<|im_end|>"], None)
    tok = AutoTokenizer.from_pretrained(lm)
    ids = tok.convert_tokens_to_ids(["yes", "no", "<|im_end|>"])
    prompts = [[1, 7, 9, 11, 300, 12], list(range(6, 70))]
    runner = ModelRunner(str(served), block_size=BLOCK, num_blocks=64, pooling=pooling)
    got = _run(runner, prompts, [None, None], False)
    causal = model_zoo.hf_model(lm)
    for p, logits in zip(prompts, got):
        with torch.no_grad():
            last = causal(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(logits, last[ids], atol=2e-5, rtol=1e-5)
