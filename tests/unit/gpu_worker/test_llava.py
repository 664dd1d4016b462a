"""LLaVA at the runner level against HF's LlavaForConditionalGeneration on the tiny seeded
checkpoint: greedy tokens equal and logprobs close, with the image's placeholder span split
over prefill chunks (pixels sent once, the rest from the encoder cache), two images in one
prompt, a prefix hit that starts inside the span; the encoder cache empties as spans end;
config refusals name their field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.model_config import UnsupportedConfig, load_config, parse_config
from gpu_worker.model_runner import ModelRunner
from protocol.ipc import ImageInput, SamplingParams, SeqChunk, StepPlan
from tests.support.vision_zoo import IMAGE_TOKEN, build_llava, hf_llava
from tests.support.vision_zoo import random_image as image
from tokenizer_worker.vision import VisionPrompt

NEW = 12
PARAMS = SamplingParams(temperature=0.0, logprobs=2)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = build_llava(tmp_path_factory.mktemp("llava") / "model")
    model, processor = hf_llava(path)
    return path, model, processor


def prompt(processor, text: str, images: list) -> tuple[list[int], list[ImageInput]]:
    """Our preprocessing (equal to HF's: tests/unit/tokenizer_worker/test_vision.py)."""
    vision = VisionPrompt(processor.tokenizer.name_or_path, processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    ids = processor.tokenizer.encode(text, add_special_tokens=False)
    return vision.expand(ids, images)


def hf_reference(model, processor, text: str, images: list) -> tuple[list[int], list[list[float]]]:
    """HF's greedy ids and, for each, the log-softmax row it was picked from."""
    inputs = processor(text=text, images=images or None, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    n = inputs["input_ids"].shape[1]
    ids = out.sequences[0, n:].tolist()
    rows = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return ids, [row[t].item() for row, t in zip(rows, ids)]


def run(runner: ModelRunner, ids: list[int], images: list[ImageInput], *, chunk: int,
        rid: str = "r", start: int = 0, blocks: list[int] | None = None, step0: int = 0
        ) -> tuple[list[int], list[float]]:
    """Prefill in ``chunk``-token pieces from ``start`` (the images a piece overlaps, the
    pixels with the first piece that needs them, as the scheduler sends them), then
    greedy decodes; (tokens, their logprobs)."""
    bs = runner.block_size
    blocks = blocks if blocks is not None else list(range(-(-(len(ids) + NEW) // bs)))
    sent: set[bytes] = set()
    out: list[int] = []
    lps: list[float] = []
    pos, step = start, step0
    new_sampling = {rid: PARAMS}
    while pos < len(ids):
        n = min(chunk, len(ids) - pos)
        overlapping = [im for im in images if im.offset < pos + n and im.offset + im.length > pos]
        carried = []
        for im in overlapping:
            carried.append(im if im.content_hash not in sent else
                           ImageInput(b"", im.shape, im.dtype, im.offset, im.length, im.content_hash))
            sent.add(im.content_hash)
        seq = SeqChunk(rid, ids[pos:pos + n], pos, blocks if pos == start else [], pos + n == len(ids),
                       kept_blocks=0 if pos == start else len(blocks), images=carried)
        result = runner.execute(StepPlan(step, [seq], new_sampling))
        new_sampling = {}
        step += 1
        pos += n
    out.append(result.sampled[0])
    lps.append(result.logprobs[0].token.logprob)
    while len(out) < NEW:
        result = runner.execute(StepPlan(step, [SeqChunk(rid, [out[-1]], len(ids) + len(out) - 1, [], True,
                                                         kept_blocks=len(blocks))]))
        step += 1
        out.append(result.sampled[0])
        lps.append(result.logprobs[0].token.logprob)
    return out, lps


TEXT_ONE = "USER: What is in " + IMAGE_TOKEN + " here? ASSISTANT:"
TEXT_TWO = "Compare " + IMAGE_TOKEN + " and " + IMAGE_TOKEN + " now"


@pytest.mark.parametrize("text,n_images,chunk", [(TEXT_ONE, 1, 5), (TEXT_ONE, 1, 64),
                                                  (TEXT_TWO, 2, 7)])
def test_greedy_and_logprobs_equal_hf(llava, text, n_images, chunk):
    path, model, processor = llava
    images = [image(k, (45 + 11 * k, 38)) for k in range(n_images)]
    want, want_lps = hf_reference(model, processor, text, images)
    ids, inputs = prompt(processor, text, images)
    runner = ModelRunner(str(path), block_size=8, num_blocks=64)
    got, lps = run(runner, ids, inputs, chunk=chunk)
    assert got == want
    assert np.allclose(lps, want_lps, atol=1e-4), (lps, want_lps)
    assert len(set(want)) >= 3  # the random model is not degenerate
    assert runner.images.encoded == n_images  # each image through the tower once
    assert len(runner.images) == 0  # every span fed: nothing kept


def test_images_change_the_output_and_text_is_unchanged(llava):
    """Another image behind the same ids gives other tokens; the text model alone (no
    image in the prompt) equals HF's too."""
    path, model, processor = llava
    runner = ModelRunner(str(path), block_size=8, num_blocks=64)
    a_ids, (a,) = prompt(processor, TEXT_ONE, [image(1)])
    b_ids, (b,) = prompt(processor, TEXT_ONE, [image(2)])
    assert a_ids == b_ids and a.content_hash != b.content_hash
    got_a, _ = run(runner, a_ids, [a], chunk=16, rid="a")
    got_b, _ = run(runner, b_ids, [b], chunk=16, rid="b", step0=100)
    assert got_a != got_b
    text = "USER: Hello there ASSISTANT:"
    want, _ = hf_reference(model, processor, text, [])
    ids, none = prompt(processor, text, [])
    assert none == [] and run(runner, ids, [], chunk=16, rid="t", step0=200)[0] == want


def test_a_prefix_hit_inside_the_span_uses_the_whole_image(llava):
    """A second request whose first 16 positions are cached (a hit that ends inside the
    image's span) starts at position 16 with the image's pixels: the tower encodes the whole
    image and only the span's remaining rows are spliced in; tokens equal HF's."""
    path, model, processor = llava
    img = image(5)
    want, _ = hf_reference(model, processor, TEXT_ONE, [img])
    ids, (im,) = prompt(processor, TEXT_ONE, [img])
    assert im.offset < 16 < im.offset + im.length
    runner = ModelRunner(str(path), block_size=8, num_blocks=64)
    first, _ = run(runner, ids, [im], chunk=64, rid="a")
    assert first == want
    blocks = list(range(-(-(len(ids) + NEW) // 8)))
    # the same blocks: blocks 0 and 1 (positions 0..15) hold the prompt's KV from request a
    runner.execute(StepPlan(50, [], released=["a"]))
    got, _ = run(runner, ids, [im], chunk=64, rid="b", start=16, blocks=blocks, step0=51)
    assert got == want


def test_bad_image_chunks_are_plan_errors(llava):
    path, _, processor = llava
    runner = ModelRunner(str(path), block_size=8, num_blocks=64)
    ids, (im,) = prompt(processor, TEXT_ONE, [image(0)])
    unsent = ImageInput(b"", im.shape, im.dtype, im.offset, im.length, im.content_hash)
    with pytest.raises(ValueError, match="never sent"):
        runner.execute(StepPlan(0, [SeqChunk("x", ids, 0, [0, 1, 2, 3, 4], True, images=[unsent])],
                                {"x": PARAMS}))
    wrong = ImageInput(im.pixels[:12], [3, 1, 1], "float32", im.offset, im.length, b"other")
    with pytest.raises(ValueError, match="shape"):
        runner.execute(StepPlan(1, [SeqChunk("y", ids, 0, [0, 1, 2, 3, 4], True, images=[wrong])],
                                {"y": PARAMS}))


def test_config_reads_the_feature_layer_and_refuses_what_it_cannot_serve(llava):
    path, _, _ = llava
    cfg = load_config(path)
    assert cfg.model_type == "llama" and cfg.vision is not None
    assert cfg.vision.feature_layers == [1] and cfg.vision.drop_cls  # -2 of 2 layers
    assert cfg.vision.tokens_per_image == 16 and cfg.eos_token_ids
    import json
    raw = json.loads((path / "config.json").read_text())
    for patch, field in [({"vision_config": {**raw["vision_config"], "model_type": "siglip_vision_model"}},
                          "vision_config.model_type"),
                         ({"vision_feature_select_strategy": "pooled"}, "vision_feature_select_strategy"),
                         ({"text_config": {**raw["text_config"], "model_type": "qwen2"}},
                          "text_config.model_type"),
                         ({"model_type": "llava_next"}, "model_type"),
                         ({"vision_feature_layer": -5}, "vision_feature_layer")]:
        with pytest.raises(UnsupportedConfig, match=field) as err:
            parse_config({**raw, **patch})
        assert "\n" not in str(err.value)
