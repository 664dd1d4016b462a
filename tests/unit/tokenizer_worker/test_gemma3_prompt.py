"""Gemma 3's image preprocessing equals Gemma3Processor's: a chat request's image parts
become the same prompt ids (``\\n\\n<start_of_image>``, the image token ``mm_tokens`` times,
``<end_of_image>\\n\\n``, expanded in the text before tokenizing) and pixel values, each
image's span marked ``whole``; a marker or image token the text spells itself is a 400
naming ``messages``; with pan-and-scan on, each image's crops and text are Gemma3Processor's."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from cluster.topology import ApiSpec
from protocol import ipc
from tests.support.gemma3_vision_zoo import BOI, IMAGE_TOKEN, MM_TOKENS, build_gemma3_vision
from tests.unit.tokenizer_worker.test_vision import _image, _url
from tokenization.tokenizer_files import CheckpointTokenizer
from tokenizer_worker.prepare import RequestPreparer
from tokenizer_worker.vision import Gemma3VisionPrompt, VisionPrompt, processor_problem


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return build_gemma3_vision(tmp_path_factory.mktemp("gemma3") / "model")


def _preparer(path) -> RequestPreparer:
    return RequestPreparer(CheckpointTokenizer(str(path)), 1024, ApiSpec(), 2051,
                           vision=VisionPrompt.for_checkpoint(path))


def _req(content) -> ipc.GenerateReq:
    return ipc.GenerateReq(rid="r", reply_to="ipc://x", sampling=ipc.SamplingParams(),
                           detok=ipc.DetokParams(), max_tokens=8,
                           messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": content}])


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_equals_gemma3_processor(gemma3_dir, n_images):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(gemma3_dir)
    imgs = [_image(k, (50 + 9 * k, 40)) for k in range(n_images)]
    content = [{"type": "text", "text": "What differs?"}]
    content += [{"type": "image_url", "image_url": {"url": _url(img)}} for img in imgs]
    out = _preparer(gemma3_dir).prepare(_req(content))
    assert isinstance(out, tuple), out
    tokenized, info = out
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What differs?"}]
                 + [{"type": "image"}] * n_images}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count(BOI) == n_images
    ref = processor(text=text, images=imgs or None, add_special_tokens=False, return_tensors="np")
    assert tokenized.prompt_token_ids == ref["input_ids"][0].tolist()
    assert info.prompt_tokens == len(tokenized.prompt_token_ids)
    types = ref["token_type_ids"][0].tolist()  # HF's bidirectional block: the image tokens
    assert [(im.offset, im.length, im.whole) for im in tokenized.images] == [
        (i, MM_TOKENS, True) for i, t in enumerate(types) if t and (i == 0 or not types[i - 1])]
    for k, im in enumerate(tokenized.images):
        pixels = np.frombuffer(im.pixels, dtype=np.float32).reshape(im.shape)
        assert np.array_equal(pixels, ref["pixel_values"][k])
    assert len({im.content_hash for im in tokenized.images}) == n_images


@pytest.mark.parametrize("text", [f"I typed {BOI} myself", f"I typed {IMAGE_TOKEN} myself"])
def test_a_marker_spelled_in_text_is_a_400(gemma3_dir, text):
    content = [{"type": "text", "text": text},
               {"type": "image_url", "image_url": {"url": _url(_image(0))}}]
    out = _preparer(gemma3_dir).prepare(_req(content))
    assert isinstance(out, ipc.RequestError) and out.status == 400
    assert out.param == "messages" and "may not contain" in out.message


PAS_MIN_CROP = 28  # (the default, 256, crops no image of this tiny model's size)


@pytest.fixture(scope="module")
def pas_dir(tmp_path_factory):
    return build_gemma3_vision(tmp_path_factory.mktemp("gemma3-pas") / "model", do_pan_and_scan=True,
                               pan_and_scan_min_crop_size=PAS_MIN_CROP)


@pytest.mark.parametrize("sizes, crops", [([(140, 56)], 3), ([(300, 56)], 4), ([(50, 130)], 3),
                                          ([(56, 56)], 0), ([(67, 56)], 0),
                                          ([(140, 56), (56, 56), (40, 100)], 6)],
                         ids=["wide", "capped", "tall", "square", "below-ratio", "three"])
def test_pan_and_scan_equals_gemma3_processor(pas_dir, sizes, crops):
    """The checkpoint's image processor sets do_pan_and_scan (and the min crop size; the
    rest are Gemma3Processor's defaults): the original and its crops, each ``whole``, with
    Gemma3Processor's "Here is the original image ... crops" text: its ids and pixels when
    called with the same settings."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(pas_dir)
    imgs = [_image(k, size) for k, size in enumerate(sizes)]
    content = [{"type": "text", "text": "What differs?"}]
    content += [{"type": "image_url", "image_url": {"url": _url(img)}} for img in imgs]
    out = _preparer(pas_dir).prepare(_req(content))
    assert isinstance(out, tuple), out
    tokenized, _ = out
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What differs?"}]
                 + [{"type": "image"}] * len(imgs)}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ref = processor(text=text, images=imgs, add_special_tokens=False, return_tensors="np",
                    do_pan_and_scan=True, pan_and_scan_min_crop_size=PAS_MIN_CROP)
    assert tokenized.prompt_token_ids == ref["input_ids"][0].tolist()
    types = ref["token_type_ids"][0].tolist()
    spans = [(i, MM_TOKENS, True) for i, t in enumerate(types) if t and (i == 0 or not types[i - 1])]
    assert [(im.offset, im.length, im.whole) for im in tokenized.images] == spans
    assert len(spans) == len(ref["pixel_values"]) == len(imgs) + crops
    for k, im in enumerate(tokenized.images):
        pixels = np.frombuffer(im.pixels, dtype=np.float32).reshape(im.shape)
        assert np.array_equal(pixels, ref["pixel_values"][k])


def test_pan_and_scan_settings_come_from_the_image_processor(pas_dir):
    vision = VisionPrompt.for_checkpoint(pas_dir)
    assert vision.pan_and_scan == {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": PAS_MIN_CROP,
                                   "pan_and_scan_max_num_crops": 4,
                                   "pan_and_scan_min_ratio_to_activate": 1.2}
    assert [vision.crops(_image(0, size)) for size in ((140, 56), (300, 56), (56, 56))] == [3, 4, 0]


def test_the_launcher_refuses_what_it_cannot_serve(gemma3_dir, tmp_path):
    """Before any process starts, in one line: a step too small for a whole image (its
    tokens attend each other both ways, so they are computed together)."""
    from cluster.topology import load_topology
    from launcher.preflight import check_model_config

    def topology(path, batched):
        yaml = tmp_path / f"{path.name}-{batched}.yaml"
        yaml.write_text(f"model: {{path: {path}}}\nengine: {{max_num_batched_tokens: {batched}}}\n")
        return load_topology(str(yaml))

    big = tmp_path / "big"  # (the config alone is read: 70 / 14 = 5, 25 tokens an image)
    shutil.copytree(gemma3_dir, big)
    raw = json.loads((big / "config.json").read_text())
    raw["vision_config"]["image_size"], raw["mm_tokens_per_image"] = 70, 25
    (big / "config.json").write_text(json.dumps(raw))
    check_model_config(topology(big, 25))
    with pytest.raises(SystemExit, match="images are 25 tokens each.*"
                                         "--max-num-batched-tokens 24 is below") as err:
        check_model_config(topology(big, 24))
    assert "\n" not in str(err.value)


def test_a_template_that_drops_an_image_is_a_400(gemma3_dir):
    """A template whose output holds fewer markers than images: refused, never an image
    silently left out (the marker-count check names ``messages``)."""
    vision = VisionPrompt.for_checkpoint(gemma3_dir)
    assert vision.image_token == BOI and vision.soft_token == IMAGE_TOKEN  # (Gemma3Processor's names)
    one = f"look {BOI} here"
    assert vision.expand_text(one, [_image(0), _image(1)]) == one  # unexpanded: refused next
    from tokenizer_worker.images import ImageError

    with pytest.raises(ImageError, match="one run of 4 per image"):
        vision.expand(CheckpointTokenizer(str(gemma3_dir)).encode(one, add_special_tokens=False),
                      [_image(0), _image(1)])


def test_image_tokens_missing_from_the_tokenizer_are_refused(gemma3_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(gemma3_dir, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["eoi_token_index"] = 7  # an ordinary token, not an added one
    (bad / "config.json").write_text(json.dumps(raw))
    problem = processor_problem(bad)
    assert problem is not None and "eoi_token_index" in problem and "\n" not in problem
