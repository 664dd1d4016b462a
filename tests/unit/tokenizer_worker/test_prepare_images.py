"""The tokenizer worker's request preparation with images: a chat request's image_url parts
become TokenizedReq.images (pixels as float32 bytes + shape, spans over the expanded
placeholders, equal to LlavaProcessor's ids), the token count includes the placeholders,
and every bad image is a 400 naming its part (never a 500); a placeholder spelled in
text without an image, and an image for a text-only model, are refused too."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from cluster.topology import ApiSpec, RequestLimits
from protocol import ipc
from tests.support.vision_zoo import IMAGE_TOKEN, build_llava, text_only_tool_template
from tests.unit.tokenizer_worker.test_vision import _image, _url
from tokenization.tokenizer_files import CheckpointTokenizer
from tokenizer_worker.prepare import RequestPreparer
from tokenizer_worker.vision import VisionPrompt


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("vision") / "llava")


def _preparer(path, **limits) -> RequestPreparer:
    api = ApiSpec(limits=RequestLimits(**limits))
    return RequestPreparer(CheckpointTokenizer(str(path)), 1024, api, 2049,
                           vision=VisionPrompt.for_checkpoint(path))


def _req(content, rid="r") -> ipc.GenerateReq:
    return ipc.GenerateReq(rid=rid, reply_to="ipc://x", sampling=ipc.SamplingParams(),
                           detok=ipc.DetokParams(), max_tokens=8,
                           messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": content}])


def test_image_parts_become_the_requests_images(llava_dir):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(llava_dir)
    imgs = [_image(1), _image(2, (60, 30))]
    content = [{"type": "text", "text": "What differs?"},
               {"type": "image_url", "image_url": {"url": _url(imgs[0])}},
               {"type": "image_url", "image_url": {"url": _url(imgs[1]), "detail": "low"}}]
    out = _preparer(llava_dir).prepare(_req(content))
    assert isinstance(out, tuple), out
    tokenized, info = out
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What differs?"},
                                             {"type": "image"}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ref = processor(text=text, images=imgs, add_special_tokens=False, return_tensors="np")
    assert tokenized.prompt_token_ids == ref["input_ids"][0].tolist()
    assert info.prompt_tokens == len(tokenized.prompt_token_ids)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    at = [i for i, t in enumerate(tokenized.prompt_token_ids) if t == image_id]
    assert [(im.offset, im.length) for im in tokenized.images] == [(at[0], 16), (at[16], 16)]
    assert at == list(range(at[0], at[0] + 32))  # (the template puts them side by side)
    for k, im in enumerate(tokenized.images):
        pixels = np.frombuffer(im.pixels, dtype=np.float32).reshape(im.shape)
        assert im.dtype == "float32" and np.array_equal(pixels, ref["pixel_values"][k])
    # on the wire: raw bytes, decoded by the scheduler's typed decoder (never pickle)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(tokenized), type=ipc.TokenizedReq)
    assert wire.images == tokenized.images


@pytest.mark.parametrize("url,code,says", [
    ("data:image/png;base64,AAAA", "invalid_image", "cannot be decoded"),
    ("data:image/png;base64,@@@", "invalid_image", "not valid base64"),
    ("https://example.com/x.png", "invalid_image", "remote image URL reached"),
    (None, "image_too_large", "more than this deployment's limit of 100"),
])
def test_a_bad_image_is_a_400_naming_its_part(llava_dir, url, code, says):
    url = url or _url(_image(0, (20, 20)))  # 400 pixels
    content = [{"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": url}}]
    out = _preparer(llava_dir, max_image_pixels=100).prepare(_req(content))
    assert isinstance(out, ipc.RequestError)
    assert (out.status, out.param, out.code) == (400, "messages[1].content[1]", code)
    assert out.message.startswith("messages[1].content[1]: ") and says in out.message


def test_placeholders_without_images_are_refused(llava_dir):
    prep = _preparer(llava_dir)
    out = prep.prepare(_req("spell " + IMAGE_TOKEN + " myself"))
    assert isinstance(out, ipc.RequestError) and out.param == "messages" and out.status == 400
    out = prep.prepare(ipc.GenerateReq(rid="p", reply_to="ipc://x", sampling=ipc.SamplingParams(),
                                       detok=ipc.DetokParams(), prompt="a " + IMAGE_TOKEN))
    assert isinstance(out, ipc.RequestError) and out.param == "prompt"


def test_the_image_byte_limit_is_the_deployments(llava_dir):
    content = [{"type": "image_url", "image_url": {"url": _url(_image(0))}}]
    out = _preparer(llava_dir, max_image_bytes=64).prepare(_req(content))
    assert isinstance(out, ipc.RequestError) and out.code == "image_too_large"
    assert "limit of 64" in out.message and out.param == "messages[1].content[0]"


def test_a_text_only_model_refuses_an_image(tiny_model_dir):
    prep = RequestPreparer(CheckpointTokenizer(str(tiny_model_dir)), 1024, ApiSpec(), None,
                           vision=VisionPrompt.for_checkpoint(tiny_model_dir))
    assert prep.vision is None
    content = [{"type": "image_url", "image_url": {"url": _url(_image(0))}}]
    out = prep.prepare(_req(content))
    assert isinstance(out, ipc.RequestError) and out.param == "messages[1].content[0]"


def _tool_turn(image_url: str) -> list[dict]:
    """A tool call whose result is text and an image, as chat's tool message."""
    return [{"role": "user", "content": "Take a photo."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "photo", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [
                {"type": "text", "text": "Here it is:"},
                {"type": "image_url", "image_url": {"url": image_url}}]}]


def _gen(messages: list[dict], **extra) -> ipc.GenerateReq:
    return ipc.GenerateReq(rid="t", reply_to="ipc://x", sampling=ipc.SamplingParams(),
                           detok=ipc.DetokParams(), max_tokens=8, messages=messages, **extra)


def test_an_image_in_a_tool_message_is_rendered_where_the_template_puts_it(llava_dir):
    """transformers' apply_chat_template with the LLaVA test template renders an image part
    of a tool message in place, in the tool turn; Candor's prompt ids are the processor's."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(llava_dir)
    img = _image(5)
    out = _preparer(llava_dir).prepare(_gen(_tool_turn(_url(img))))
    assert isinstance(out, tuple), out
    as_hf = _tool_turn("")
    as_hf[2]["content"][1] = {"type": "image"}
    text = processor.apply_chat_template(as_hf, add_generation_prompt=True, tokenize=False)
    assert "<|start_header_id|>tool<|end_header_id|>\n\nHere it is:" + IMAGE_TOKEN in text
    ref = processor(text=text, images=[img], add_special_tokens=False, return_tensors="np")
    assert out[0].prompt_token_ids == ref["input_ids"][0].tolist()
    assert len(out[0].images) == 1 and out[0].images[0].length == 16


def test_a_template_that_drops_tool_images_is_a_400_naming_the_part(llava_dir):
    api = ApiSpec(allow_request_chat_template=True)
    prep = RequestPreparer(CheckpointTokenizer(str(llava_dir)), 1024, api, 2049,
                           vision=VisionPrompt.for_checkpoint(llava_dir))
    user_image = {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                              {"type": "image_url", "image_url": {"url": _url(_image(6))}}]}
    out = prep.prepare(_gen([*_tool_turn(_url(_image(5))), user_image],
                            chat_template=text_only_tool_template()))
    assert isinstance(out, ipc.RequestError) and out.status == 400
    assert (out.param, out.code) == ("messages[2].content[1]", "unsupported_content")
    assert "does not place this image" in out.message and "'tool' message" in out.message
    # the user's image alone renders: the same template serves it
    out = prep.prepare(_gen([_tool_turn("")[0], user_image], chat_template=text_only_tool_template()))
    assert isinstance(out, tuple), out
