"""Gemma 3 with images at the runner level against HF's Gemma3ForConditionalGeneration on
the tiny seeded checkpoint (tests/support/gemma3_vision_zoo.py): greedy tokens equal and
logprobs within 1e-4 with one and two images, with prefill chunks that end at image
boundaries, through the batch-invariant kernel path and the torch path; the image tokens'
bidirectional block matters (without it the logprobs move by far more than 1e-4); a chunk
that splits an image is a plan error; config refusals name their field."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gpu_worker.model_config import UnsupportedConfig, load_config, parse_config
from gpu_worker.model_runner import ModelRunner
from protocol.ipc import ImageInput, SamplingParams, SeqChunk, StepPlan
from tests.support.gemma3_vision_zoo import BOI, MM_TOKENS, build_gemma3_vision, hf_gemma3
from tests.support.vision_zoo import random_image as image
from tokenizer_worker.vision import VisionPrompt

NEW = 10
PARAMS = SamplingParams(temperature=0.0, logprobs=2)
# the images sit past the sliding window of 16: its layers cut their causal prefix
TEXT_ONE = "USER: A long preamble of text, so the image sits past the window. What is in " \
           + BOI + " here? ASSISTANT:"
TEXT_TWO = "Compare " + BOI + " and then " + BOI + " now, briefly please"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = build_gemma3_vision(tmp_path_factory.mktemp("gemma3") / "model")
    model, processor = hf_gemma3(path)
    return path, model, processor


def prompt(path, processor, text: str, images: list) -> tuple[list[int], list[ImageInput]]:
    """Our preprocessing (equal to HF's: tests/unit/tokenizer_worker/test_gemma3_prompt.py)."""
    vision = VisionPrompt.for_checkpoint(path)
    ids = processor.tokenizer.encode(vision.expand_text(text, images), add_special_tokens=False)
    return vision.expand(ids, images)


def hf_reference(model, processor, text: str, images: list) -> tuple[list[int], list[float]]:
    inputs = processor(text=text, images=images or None, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    n = inputs["input_ids"].shape[1]
    ids = out.sequences[0, n:].tolist()
    rows = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return ids, [row[t].item() for row, t in zip(rows, ids)]


def pieces(n: int, images: list[ImageInput], chunk: int) -> list[tuple[int, int]]:
    """Chunks of at most ``chunk`` positions that never end inside an image (the
    scheduler's rule: SchedRequest.chunk_size)."""
    out, pos = [], 0
    while pos < n:
        end = min(n, pos + chunk)
        for im in images:
            if im.offset < end < im.offset + im.length:
                end = im.offset if im.offset > pos else im.offset + im.length
        out.append((pos, end))
        pos = end
    return out


def run(runner: ModelRunner, ids: list[int], images: list[ImageInput], *, chunk: int,
        rid: str = "r", step0: int = 0) -> tuple[list[int], list[float]]:
    bs = runner.block_size
    blocks = list(range(-(-(len(ids) + NEW) // bs)))
    out: list[int] = []
    lps: list[float] = []
    new_sampling = {rid: PARAMS}
    step = step0
    for lo, hi in pieces(len(ids), images, chunk):
        overlapping = [im for im in images if im.offset < hi and im.offset + im.length > lo]
        seq = SeqChunk(rid, ids[lo:hi], lo, blocks if lo == 0 else [], hi == len(ids),
                       kept_blocks=0 if lo == 0 else len(blocks), images=overlapping)
        result = runner.execute(StepPlan(step, [seq], new_sampling))
        new_sampling = {}
        step += 1
    out.append(result.sampled[0])
    lps.append(result.logprobs[0].token.logprob)
    while len(out) < NEW:
        result = runner.execute(StepPlan(step, [SeqChunk(rid, [out[-1]], len(ids) + len(out) - 1, [], True,
                                                         kept_blocks=len(blocks))]))
        step += 1
        out.append(result.sampled[0])
        lps.append(result.logprobs[0].token.logprob)
    return out, lps


@pytest.mark.parametrize("deterministic", [None, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("text,n_images,chunk", [(TEXT_ONE, 1, 64), (TEXT_ONE, 1, 5),
                                                  (TEXT_TWO, 2, 7)])
def test_greedy_and_logprobs_equal_hf(gemma3, text, n_images, chunk, deterministic):
    path, model, processor = gemma3
    images = [image(k, (45 + 11 * k, 38)) for k in range(n_images)]
    want, want_lps = hf_reference(model, processor, text, images)
    ids, inputs = prompt(path, processor, text, images)
    assert [im.length for im in inputs] == [MM_TOKENS] * n_images and all(im.whole for im in inputs)
    runner = ModelRunner(str(path), block_size=8, num_blocks=64, deterministic=deterministic)
    assert runner.deterministic == (deterministic is None)
    got, lps = run(runner, ids, inputs, chunk=chunk)
    assert got == want
    assert np.allclose(lps, want_lps, atol=1e-4), (lps, want_lps)
    assert len(set(want)) >= 3  # the random model is not degenerate
    assert runner.images.encoded == n_images and len(runner.images) == 0


def test_the_bidirectional_block_matters(gemma3):
    """Causal attention alone over the image tokens moves the first logprob far past the
    parity tolerance: the parity above checks the block, not just the splice."""
    path, model, processor = gemma3
    img = image(1)
    _, want_lps = hf_reference(model, processor, TEXT_ONE, [img])
    ids, inputs = prompt(path, processor, TEXT_ONE, [img])
    runner = ModelRunner(str(path), block_size=8, num_blocks=64)
    runner._image_spans = lambda prefills: None  # noqa: SLF001 - the block turned off
    _, lps = run(runner, ids, inputs, chunk=64)
    assert abs(lps[0] - want_lps[0]) > 1e-2


def test_a_chunk_that_splits_an_image_is_a_plan_error(gemma3):
    path, _, processor = gemma3
    ids, (im,) = prompt(path, processor, TEXT_ONE, [image(0)])
    runner = ModelRunner(str(path), block_size=8, num_blocks=64)
    cut = im.offset + 2
    with pytest.raises(ValueError, match="bidirectional span"):
        runner.execute(StepPlan(0, [SeqChunk("x", ids[:cut], 0, list(range(8)), False, images=[im])],
                                {"x": PARAMS}))


def test_config_reads_the_image_path_and_refuses_what_it_cannot_serve(gemma3):
    path, _, _ = gemma3
    cfg = load_config(path)
    assert cfg.model_type == "gemma3_text" and cfg.vision is not None
    assert cfg.vision.family == "gemma3" and cfg.vision.bidirectional
    assert cfg.vision.tokens_per_image == MM_TOKENS and cfg.tie_word_embeddings
    raw = json.loads((path / "config.json").read_text())
    for patch, field in [({"vision_config": {**raw["vision_config"], "model_type": "clip_vision_model"}},
                          "vision_config.model_type"),
                         ({"mm_tokens_per_image": 5}, "mm_tokens_per_image"),
                         ({"mm_tokens_per_image": 9}, "mm_tokens_per_image"),
                         ({"text_config": {**raw["text_config"], "model_type": "llama"}},
                          "text_config.model_type"),
                         ({"image_token_index": 10**6}, "image_token_index")]:
        with pytest.raises(UnsupportedConfig, match=field) as err:
            parse_config({**raw, **patch})
        assert "\n" not in str(err.value)


def test_a_hub_style_config_reads_transformers_defaults():
    """google/gemma-3-4b-it's config.json lists few text fields: the rest are
    Gemma3TextConfig's defaults (global layers on rope_theta 1e6 scaled linearly by 8,
    local ones on 10000, every sixth layer global), as transformers reads it."""
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
           "mm_tokens_per_image": 256, "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "model_type": "gemma3_text", "num_hidden_layers": 34,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16,
                             "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    cfg = parse_config(raw)
    assert (cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (262208, 8, 4, 256)
    assert cfg.scale == 256**-0.5 and cfg.tie_word_embeddings and cfg.eos_token_ids == [1, 106]
    windows = [layer.window for layer in cfg.layers]
    assert windows[5] is None and windows[11] is None and windows[0] == 1024
    (glob, loc) = (cfg.ropes[cfg.layers[5].rope], cfg.ropes[cfg.layers[0].rope])
    assert (glob.theta, glob.type, glob.factor) == (1e6, "linear", 8.0)
    assert (loc.theta, loc.type) == (10000.0, "default")
    assert cfg.vision.tokens_per_image == 256 and cfg.vision.image_token_id == 262144
    with pytest.raises(UnsupportedConfig, match="text_config"):
        parse_config({**raw, "text_config": None})
