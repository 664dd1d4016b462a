"""Image preprocessing equals the checkpoint's HF processor: the expanded prompt ids and
the pixel values of LlavaProcessor on the same rendered text and images, for one and two
images; the content hash tells different images apart; a count mismatch is refused."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tests.support.vision_zoo import IMAGE_TOKEN, build_llava
from tokenizer_worker.images import ImageError, ImageLimits
from tokenizer_worker.vision import VisionPrompt, image_parts


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import AutoProcessor

    path = build_llava(tmp_path_factory.mktemp("vision") / "llava")
    processor = AutoProcessor.from_pretrained(path)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    return VisionPrompt(path, image_id), processor


def _image(seed: int, size=(50, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def _url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("n_images", [1, 2])
def test_equals_the_hf_processor(llava, n_images):
    vision, processor = llava
    content = [{"type": "text", "text": "Compare"}]
    for k in range(n_images):
        content.append({"type": "image_url", "image_url": {"url": _url(_image(k, (50 + 9 * k, 40)))}})
    messages, images = image_parts([{"role": "user", "content": content}], ImageLimits())
    assert messages[0]["content"][1:] == [{"type": "image"}] * n_images
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count(IMAGE_TOKEN) == n_images
    ids = processor.tokenizer.encode(text, add_special_tokens=False)
    expanded, inputs = vision.expand(ids, images)
    ref = processor(text=text, images=images, add_special_tokens=False, return_tensors="np")
    assert expanded == ref["input_ids"][0].tolist()
    assert len(inputs) == n_images
    for k, one in enumerate(inputs):
        pixels = np.frombuffer(one.pixels, dtype=one.dtype).reshape(one.shape)
        assert np.array_equal(pixels, ref["pixel_values"][k])
        assert one.length == 16
        assert expanded[one.offset:one.offset + one.length] == [vision.image_token_id] * 16
    assert len({one.content_hash for one in inputs}) == n_images


def test_same_image_same_hash_and_other_image_other_hash(llava):
    vision, processor = llava
    ids = [7, vision.image_token_id, 9]
    _, (a,) = vision.expand(ids, [_image(3)])
    _, (b,) = vision.expand(ids, [_image(3)])
    _, (c,) = vision.expand(ids, [_image(4)])
    assert a.content_hash == b.content_hash != c.content_hash


def test_image_token_count_must_match(llava):
    vision, _ = llava
    with pytest.raises(ImageError, match="2 image token"):
        vision.expand([vision.image_token_id, 5, vision.image_token_id], [_image(0)])
    with pytest.raises(ImageError, match="0 image token"):
        vision.expand([5, 6], [_image(0)])


def test_a_bad_part_is_named(llava):
    content = [{"type": "text", "text": "x"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(ImageError, match=r"messages\[1\].content\[1\]: the image cannot be decoded"):
        image_parts([{"role": "system", "content": "s"}, {"role": "user", "content": content}],
                    ImageLimits())
    with pytest.raises(ImageError, match=r"messages\[0\].content\[0\].image_url needs a string"):
        image_parts([{"role": "user", "content": [{"type": "image_url", "image_url": 3}]}],
                    ImageLimits())
