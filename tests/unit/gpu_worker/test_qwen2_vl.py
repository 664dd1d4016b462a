"""Qwen2-VL and Qwen2.5-VL with images at the runner level against HF's classes on the tiny
seeded checkpoints (tests/support/qwen2_vl_zoo.py): our preprocessing gives HF
processor's ids, patches and grids; M-RoPE positions of any chunking (and the decode
delta) equal HF's ``get_rope_index``; the tower's embeddings equal HF's
``get_image_features``; greedy tokens equal and logprobs within 1e-4 with one and two
images of different sizes, with prefill chunks that split images; config refusals name
their field."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch

from gpu_worker.model_config import UnsupportedConfig, load_config, parse_config
from gpu_worker.model_runner import ModelRunner
from gpu_worker.mrope import positions as mrope_positions
from protocol.ipc import ImageInput, SamplingParams, SeqChunk, StepPlan
from tests.support.qwen2_vl_zoo import IMAGE_PAD, VISION_END, VISION_START, build_qwen2_vl, hf_qwen2_vl
from tests.support.vision_zoo import random_image as image
from tokenizer_worker.vision import VisionPrompt

NEW = 10
PARAMS = SamplingParams(temperature=0.0, logprobs=2)
MARK = VISION_START + IMAGE_PAD + VISION_END
TEXT_ONE = "USER: A preamble of text before the picture. What is in " + MARK + " here? ASSISTANT:"
TEXT_TWO = "Compare " + MARK + " and then " + MARK + " now, briefly please"
# (width, height) -> token grid (rows x columns, after smart_resize): 100x70 -> 2x4,
# 45x38 -> 2x3, 60x130 -> 5x2
SIZES = [(100, 70), (45, 38), (60, 130)]
FAMILIES = ["qwen2_vl", "qwen2_5_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def qwen(request, tmp_path_factory):
    path = build_qwen2_vl(tmp_path_factory.mktemp(request.param) / "model", request.param)
    model, processor = hf_qwen2_vl(path)
    return path, model, processor


def prompt(path, processor, text: str, images: list) -> tuple[list[int], list[ImageInput]]:
    vision = VisionPrompt.for_checkpoint(path)
    ids = processor.tokenizer.encode(vision.expand_text(text, images), add_special_tokens=False)
    return vision.expand(ids, images)


def hf_inputs(processor, text: str, images: list):
    return processor(text=text, images=images or None, add_special_tokens=False, return_tensors="pt")


def hf_reference(model, processor, text: str, images: list) -> tuple[list[int], list[float]]:
    inputs = hf_inputs(processor, text, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    n = inputs["input_ids"].shape[1]
    ids = out.sequences[0, n:].tolist()
    rows = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return ids, [row[t].item() for row, t in zip(rows, ids)]


def shift_before(images: list[ImageInput], pos: int) -> int:
    """The scheduler's SeqChunk.rope_shift (SchedRequest.rope_shift)."""
    return sum(im.rope_gain for im in images if im.offset + im.length <= pos)


def chunk(ids, images, lo, hi, new_blocks=(), kept_blocks=0) -> SeqChunk:
    overlapping = [im for im in images if im.offset < hi and im.offset + im.length > lo]
    return SeqChunk("r", ids[lo:hi], lo, list(new_blocks), hi == len(ids), kept_blocks,
                    images=overlapping, rope_shift=shift_before(images, lo))


def test_preprocessing_equals_hf_processor(qwen):
    path, _, processor = qwen
    images = [image(k, SIZES[k]) for k in range(2)]
    ids, inputs = prompt(path, processor, TEXT_TWO, images)
    want = hf_inputs(processor, TEXT_TWO, images)
    assert ids == want["input_ids"][0].tolist()
    grids = want["image_grid_thw"].tolist()
    assert [im.grid for im in inputs] == [[t, h // 2, w // 2] for t, h, w in grids]
    assert [im.length for im in inputs] == [t * h * w // 4 for t, h, w in grids] == [8, 6]
    pixels = np.concatenate([np.frombuffer(im.pixels, np.float32).reshape(im.shape) for im in inputs])
    assert np.array_equal(pixels, want["pixel_values"].numpy())
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    for im in inputs:
        assert ids[im.offset - 1] != image_id and set(ids[im.offset:im.offset + im.length]) == {image_id}


@pytest.mark.parametrize("size", [1, 3, 7, 64])
def test_mrope_positions_of_any_chunking_equal_hfs_rope_index(qwen, size):
    path, model, processor = qwen
    images = [image(k, SIZES[k]) for k in range(2)]
    ids, inputs = prompt(path, processor, TEXT_TWO, images)
    want = hf_inputs(processor, TEXT_TWO, images)
    hf_pos, delta = model.model.get_rope_index(want["input_ids"], want["mm_token_type_ids"],
                                               image_grid_thw=want["image_grid_thw"])
    assert hf_pos[1].tolist() != hf_pos[2].tolist()  # image tokens' rows and columns differ
    got: list[list[int]] = [[], [], []]
    for lo in range(0, len(ids), size):
        flat, axes = mrope_positions(chunk(ids, inputs, lo, min(len(ids), lo + size)))
        for a in range(3):
            got[a] += axes[a] if axes else flat
    assert got == hf_pos[:, 0].tolist()
    n = len(ids)
    decode = mrope_positions(SeqChunk("r", [1], n, [], True, rope_shift=shift_before(inputs, n)))
    assert decode == ([n + int(delta)], None)


def test_the_tower_equals_hfs_image_features(qwen):
    path, model, processor = qwen
    images = [image(k, SIZES[k]) for k in range(3)]
    text = TEXT_TWO.replace("then", MARK + " then")
    _, inputs = prompt(path, processor, text, images)
    want = hf_inputs(processor, text, images)
    with torch.no_grad():
        hf_out = model.model.get_image_features(want["pixel_values"], want["image_grid_thw"]).pooler_output
    runner = ModelRunner(str(path), block_size=8, num_blocks=16)
    with torch.no_grad():
        for im, ref in zip(inputs, hf_out):
            pixels = torch.from_numpy(np.frombuffer(im.pixels, np.float32).reshape(im.shape).copy())
            assert runner.model.vision.input_problem(im) is None
            got = runner.model.vision.embed(pixels, im)
            assert got.shape == ref.shape
            assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def run(runner: ModelRunner, ids: list[int], images: list[ImageInput], *, size: int,
        step0: int = 0) -> tuple[list[int], list[float]]:
    bs = runner.block_size
    blocks = list(range(-(-(len(ids) + NEW) // bs)))
    out: list[int] = []
    lps: list[float] = []
    new_sampling = {"r": PARAMS}
    step = step0
    for lo in range(0, len(ids), size):
        hi = min(len(ids), lo + size)
        seq = chunk(ids, images, lo, hi, new_blocks=blocks if lo == 0 else [],
                    kept_blocks=0 if lo == 0 else len(blocks))
        result = runner.execute(StepPlan(step, [seq], new_sampling))
        new_sampling = {}
        step += 1
    out.append(result.sampled[0])
    lps.append(result.logprobs[0].token.logprob)
    shift = shift_before(images, len(ids))
    while len(out) < NEW:
        pos = len(ids) + len(out) - 1
        result = runner.execute(StepPlan(step, [SeqChunk("r", [out[-1]], pos, [], True,
                                                         kept_blocks=len(blocks), rope_shift=shift)]))
        step += 1
        out.append(result.sampled[0])
        lps.append(result.logprobs[0].token.logprob)
    return out, lps


@pytest.mark.parametrize("deterministic", [None, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("text,n_images,size", [(TEXT_ONE, 1, 64), (TEXT_ONE, 1, 5),
                                                 (TEXT_TWO, 2, 3)])
def test_greedy_and_logprobs_equal_hf(qwen, text, n_images, size, deterministic):
    path, model, processor = qwen
    images = [image(k, SIZES[k]) for k in range(n_images)]
    want, want_lps = hf_reference(model, processor, text, images)
    ids, inputs = prompt(path, processor, text, images)
    runner = ModelRunner(str(path), block_size=8, num_blocks=64, deterministic=deterministic)
    assert runner.deterministic == (deterministic is None)
    got, lps = run(runner, ids, inputs, size=size)
    assert got == want
    assert np.allclose(lps, want_lps, atol=1e-4), (lps, want_lps)
    assert len(set(want)) >= 3  # the random model is not degenerate
    assert runner.images.encoded == n_images and len(runner.images) == 0


def test_plain_positions_would_not_do(qwen):
    """Without M-RoPE's positions (every row at its index) the first logprob moves far
    past the tolerance: the parity above checks the positions, not just the splice."""
    path, model, processor = qwen
    img = image(0, SIZES[0])
    _, want_lps = hf_reference(model, processor, TEXT_ONE, [img])
    ids, inputs = prompt(path, processor, TEXT_ONE, [img])
    runner = ModelRunner(str(path), block_size=8, num_blocks=64)
    flat = [msgspec_replace(im, grid=[]) for im in inputs]
    runner.model.vision.input_problem = lambda im: None
    embed = runner.model.vision.embed
    runner.model.vision.embed = lambda pixels, im: embed(pixels, inputs[0])
    _, lps = run(runner, ids, flat, size=64)
    assert abs(lps[0] - want_lps[0]) > 1e-3


def msgspec_replace(im: ImageInput, **changes) -> ImageInput:
    return msgspec.structs.replace(im, **changes)


def test_an_image_whose_grid_does_not_match_is_a_plan_error(qwen):
    path, _, processor = qwen
    ids, (im,) = prompt(path, processor, TEXT_ONE, [image(0, SIZES[0])])
    runner = ModelRunner(str(path), block_size=8, num_blocks=64)
    bad = msgspec_replace(im, grid=[1, 2, 2])  # (its span and patches are a 2x4 grid's)
    with pytest.raises(ValueError, match="grid gives 4"):
        runner.execute(StepPlan(0, [SeqChunk("x", ids, 0, list(range(8)), True, images=[bad])],
                                {"x": PARAMS}))


def test_config_reads_the_image_path_and_refuses_what_it_cannot_serve(qwen):
    path, _, _ = qwen
    cfg = load_config(path)
    assert cfg.model_type == "qwen2" and cfg.vision is not None and cfg.vision.merge_size == 2
    assert cfg.rope.mrope_section == [2, 3, 3] and cfg.qkv_bias and not cfg.o_bias
    raw = json.loads((path / "config.json").read_text())
    bad_section = json.loads(json.dumps(raw))
    bad_section["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(UnsupportedConfig, match="mrope_section"):
        parse_config(bad_section)
    bad_width = json.loads(json.dumps(raw))
    key = "hidden_size" if raw["model_type"] == "qwen2_vl" else "out_hidden_size"
    bad_width["vision_config"][key] = 32
    with pytest.raises(UnsupportedConfig, match="vision_config"):
        parse_config(bad_width)


def test_the_hubs_flat_config_layout_reads_the_same(qwen):
    """The hub's Qwen2-VL configs keep the text model's fields at the top, with
    ``rope_scaling`` ``{"type": "mrope"}`` and the tower's ``in_chans``."""
    path, _, _ = qwen
    raw = json.loads((path / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**raw, **{k: v for k, v in text.items() if k != "model_type"},
            "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    flat["vision_config"] = {**raw["vision_config"], "in_chans": 3}
    flat["vision_config"].pop("in_channels")
    assert parse_config(flat) == load_config(path)
