"""Qwen2-VL's prompt expansion in the tokenizer worker (QwenVisionPrompt) on the tiny
checkpoint: found from the hub's layout (a preprocessor_config.json naming the processor,
no processor_config.json); an image token spelled in text, a missing image or an image
the resize cannot take are ImageErrors (400s), never crashes; a tokenizer without the
image token is refused in one line. (Equality with HF's processor: test_qwen2_vl.py.)"""

from __future__ import annotations

import json

import pytest

from cluster.checkpoint import has_processor, takes_images
from tests.support.qwen2_vl_zoo import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, build_qwen2_vl
from tests.support.vision_zoo import random_image as image
from tokenizer_worker.images import ImageError
from tokenizer_worker.vision import QwenVisionPrompt, VisionPrompt, processor_problem

MARK = VISION_START + IMAGE_PAD + VISION_END


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl") / "model")


def test_the_hub_layout_is_found(qwen_dir):
    assert not (qwen_dir / "processor_config.json").exists()
    assert takes_images(str(qwen_dir)) and has_processor(str(qwen_dir))
    vision = VisionPrompt.for_checkpoint(qwen_dir)
    assert isinstance(vision, QwenVisionPrompt) and vision.image_token == IMAGE_PAD


def test_each_image_token_becomes_its_images_token_count(qwen_dir):
    vision = VisionPrompt.for_checkpoint(qwen_dir)
    text = vision.expand_text(f"a {MARK} b {MARK} c", [image(0, (100, 70)), image(1, (60, 130))])
    assert text == f"a {VISION_START}{IMAGE_PAD * 8}{VISION_END} b {VISION_START}{IMAGE_PAD * 10}{VISION_END} c"


@pytest.mark.parametrize("text,images,match", [
    (f"{MARK} and {IMAGE_PAD} typed", 1, "may not contain"),
    (f"{MARK} and a {VIDEO_PAD}", 1, "video input is not served"),
    ("no image here", 1, "one run per image"),
    (MARK, 0, "may not contain"),
])
def test_a_placeholder_mismatch_is_an_image_error(qwen_dir, text, images, match):
    vision = VisionPrompt.for_checkpoint(qwen_dir)
    imgs = [image(k, (100, 70)) for k in range(images)]
    with pytest.raises(ImageError, match=match) as err:
        expanded = vision.expand_text(text, imgs)
        ids = _ids(qwen_dir, expanded)
        vision.expand(ids, imgs)
    assert err.value.param == "messages"


def _ids(qwen_dir, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir).encode(text, add_special_tokens=False)


def test_an_image_the_resize_cannot_take_is_an_image_error(qwen_dir):
    """smart_resize refuses an aspect ratio past 200 (a ValueError inside transformers)."""
    vision = VisionPrompt.for_checkpoint(qwen_dir)
    with pytest.raises(ImageError, match="aspect ratio"):
        vision.expand_text(MARK, [image(0, (402, 2))])


def test_a_tokenizer_without_the_image_token_is_refused_in_one_line(qwen_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(qwen_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["image_token_id"] = 7  # an ordinary token, not an added one
    (copy / "config.json").write_text(json.dumps(config))
    problem = processor_problem(copy)
    assert problem is not None and "\n" not in problem and "image_token_id" in problem
    with pytest.raises(ValueError, match="image_token_id"):
        VisionPrompt.for_checkpoint(copy)


def test_a_preprocessor_config_without_a_processor_class_takes_no_images(qwen_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(qwen_dir, copy)
    pre = json.loads((copy / "preprocessor_config.json").read_text())
    pre.pop("processor_class")
    (copy / "preprocessor_config.json").write_text(json.dumps(pre))
    assert not takes_images(str(copy)) and VisionPrompt.for_checkpoint(copy) is None


def test_a_transformers_4_preprocessor_config_reads_its_pixel_bounds(qwen_dir, tmp_path):
    """The hub's Qwen2-VL preprocessor_config.json (transformers 4) sets ``min_pixels`` and
    ``max_pixels`` rather than ``size``: the same bounds, the same token counts."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(qwen_dir, copy)
    pre = json.loads((copy / "preprocessor_config.json").read_text())
    size = pre.pop("size")
    pre.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    (copy / "preprocessor_config.json").write_text(json.dumps(pre))
    ours, hub = VisionPrompt.for_checkpoint(qwen_dir), VisionPrompt.for_checkpoint(copy)
    sizes = [(100, 70), (45, 38), (60, 130), (400, 400), (20, 20)]
    assert [hub.tokens_per_image(h, w) for w, h in sizes] == \
        [ours.tokens_per_image(h, w) for w, h in sizes] == [8, 6, 10, 16, 4]
