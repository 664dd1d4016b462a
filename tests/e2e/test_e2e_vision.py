"""Images through the real processes on the tiny LLaVA checkpoint (tests/support/vision_zoo.py):
a chat request with a data: URL image gives HF LlavaForConditionalGeneration's greedy tokens
and logprobs (within 1e-4) and prompt ids; the same image again shares KV with the first
request while another image behind the same placeholder ids never does (and still equals
HF); an image request alone and inside a concurrent batch of text and image requests is
bitwise equal; a bad image is a 400 in OpenAI's shape naming the part; the text model
still refuses images."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random

import aiohttp
import pytest
import torch
from PIL import Image

from tests.support.image_host import ImageHost
from tests.support.server import CandorServer
from tests.support.vision_zoo import build_llava, hf_llava, text_only_tool_template
from tests.support.vision_zoo import random_image as image

MODEL = "tiny-llava"
NEW = 12


def data_url(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def chat(text: str, *images: Image.Image, system: str = "You are terse.") -> list[dict]:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(img)}} for img in images]
    return [{"role": "system", "content": system}, {"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("vision") / "llava")


@pytest.fixture(scope="module")
def hf(llava_dir):
    return hf_llava(llava_dir)


@pytest.fixture(scope="module")
def llava_server(llava_dir):
    srv = CandorServer(llava_dir, "--served-model-name", MODEL,
                       "--max-num-batched-tokens", "24").start()
    yield srv
    assert srv.stop() == 0


def hf_reference(hf, messages: list[dict], images: list, **processor_kwargs
                 ) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """(prompt ids, greedy ids, the log-softmax row of each) from HF on the same chat
    (``processor_kwargs``: passed to the processor's call, as HF users pass them)."""
    model, processor = hf
    as_hf = [{**m, "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
             if isinstance(m["content"], list) else m for m in messages]
    text = processor.apply_chat_template(as_hf, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=images or None, add_special_tokens=False, return_tensors="pt",
                       **processor_kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    n = inputs["input_ids"].shape[1]
    rows = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    return inputs["input_ids"][0].tolist(), out.sequences[0, n:].tolist(), rows


async def _chat(session, srv: CandorServer, messages: list[dict], **extra) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": True, "top_logprobs": 2,
            **extra}
    async with session.post(srv.base_url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


async def _one(srv, messages, **extra) -> dict:
    async with aiohttp.ClientSession() as session:
        status, payload = await _chat(session, srv, messages, **extra)
    assert status == 200, payload
    return payload


def _check_against_hf(payload: dict, want: tuple) -> None:
    prompt, ids, rows = want
    choice = payload["choices"][0]
    assert payload["prompt_token_ids"] == prompt
    assert payload["usage"]["prompt_tokens"] == len(prompt)  # the image placeholders count
    assert choice["token_ids"] == ids
    for entry, row, token in zip(choice["logprobs"]["content"], rows, ids):
        assert abs(entry["logprob"] - row[token].item()) < 1e-4
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            row.topk(2).values.tolist(), abs=1e-4)


async def test_a_chat_image_gives_hfs_greedy_tokens_and_logprobs(llava_server, hf):
    """The prompt (about 60 tokens, the image's 16 among them) is prefilled in chunks of
    at most 24, so the image's span is split across steps."""
    img = image(1)
    messages = chat("What is in this picture?", img)
    want = hf_reference(hf, messages, [img])
    assert len(set(want[1])) >= 3  # the random model is not degenerate
    _check_against_hf(await _one(llava_server, messages), want)
    two = chat("Compare these two.", image(2), image(3, (30, 60)))
    _check_against_hf(await _one(llava_server, two), hf_reference(hf, two, [image(2), image(3, (30, 60))]))
    llava_server.wait_all_blocks_free()


async def test_the_same_image_shares_kv_and_another_image_never_does(llava_server, hf):
    """A long system prompt before the image: the second request with the same image hits
    the cache past the image; one with another image (same placeholder ids) hits only the
    blocks before the image's span, and its tokens are HF's for its own image."""
    system = "You describe pictures for a catalogue of small coloured squares. " * 3
    cat, dog = image(10), image(11)
    first = await _one(llava_server, chat("Describe it.", cat, system=system))
    again = await _one(llava_server, chat("Describe it.", cat, system=system))
    other = await _one(llava_server, chat("Describe it.", dog, system=system))
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    prompt = first["prompt_token_ids"]
    image_id = hf[1].tokenizer.convert_tokens_to_ids("<image>")
    start = prompt.index(image_id)
    cached = lambda p: p["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert cached(first) == 0
    assert cached(again) >= start + 16  # the whole image span and past it
    assert 0 < cached(other) <= start  # only text blocks before the image
    _check_against_hf(other, hf_reference(hf, chat("Describe it.", dog, system=system), [dog]))
    llava_server.wait_all_blocks_free()


async def test_an_image_request_alone_and_in_a_batch_is_bitwise_equal(llava_server):
    messages = chat("Name the colours you see.", image(20))
    alone = await _one(llava_server, messages, seed=3, temperature=0.8)
    assert alone["candor"].get("deterministic") is True
    rng = random.Random(5)

    async def noise(session, k):
        await asyncio.sleep(rng.uniform(0, 0.2))
        kind = k % 3
        body = (chat("Tell me about it.", image(100 + k)) if kind == 0 else
                chat("And these?", image(200 + k), image(20)) if kind == 1 else
                [{"role": "user", "content": "Just text, " * (k + 1)}])
        status, payload = await _chat(session, llava_server, body, max_tokens=rng.randint(1, 10))
        assert status == 200, payload

    async with aiohttp.ClientSession() as session:
        async def probe():
            await asyncio.sleep(0.05)
            return await _chat(session, llava_server, messages, seed=3, temperature=0.8)
        results = await asyncio.gather(*(noise(session, k) for k in range(9)), probe())
    status, batched = results[-1]
    assert status == 200, batched
    assert batched["choices"][0] == alone["choices"][0]
    llava_server.wait_all_blocks_free()


@pytest.mark.parametrize("url,code", [("data:image/png;base64,AAAA", "invalid_image"),
                                      ("data:image/png;base64,!!!!", "invalid_image")])
async def test_a_bad_image_is_a_400_naming_the_part(llava_server, url, code):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    async with aiohttp.ClientSession() as session:
        status, payload = await _chat(session, llava_server, messages)
    assert status == 400, payload
    err = payload["error"]
    assert err["param"] == "messages[0].content[1]" and err["code"] == code
    assert err["type"] == "invalid_request_error" and err["message"].startswith("messages[0].content[1]: ")
    assert llava_server.health()[0] == 200


async def test_the_text_model_still_refuses_images(server):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What?"},
        {"type": "image_url", "image_url": {"url": data_url(image(0))}}]}]
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + "/v1/chat/completions",
                                json={"model": "tiny-llama", "messages": messages}) as resp:
            payload = await resp.json()
    assert resp.status == 400
    assert payload["error"]["param"] == "messages[0].content[1].type"
    assert payload["error"]["code"] == "unsupported_content"


# ---------------------------------------------------------------- Responses and Messages


def _b64(img: Image.Image) -> str:
    return data_url(img).split(",", 1)[1]


def test_responses_input_image_through_the_openai_sdk(llava_server, hf):
    """An ``input_image`` part runs as chat's image_url part: HF's greedy tokens for the
    same conversation; a bad one is a 400 naming ``input[0].content[1]``; over the count
    limit likewise."""
    import openai

    client = openai.OpenAI(base_url=llava_server.base_url + "/v1", api_key="unused", max_retries=0)
    img = image(30)
    out = client.responses.create(
        model=MODEL, instructions="You are terse.", max_output_tokens=NEW, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is in this picture?"},
                                            {"type": "input_image", "image_url": data_url(img)}]}],
        extra_body={"ignore_eos": True})
    _, want, _ = hf_reference(hf, chat("What is in this picture?", img), [img])
    assert out.output_text == hf[1].tokenizer.decode(want, skip_special_tokens=True)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "x"},
                                         {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert err.value.body["param"] == "input[0].content[1]" and err.value.body["code"] == "invalid_image"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_image", "file_id": "file-123"}]}])
    assert err.value.body["param"] == "input[0].content[0].image_url"


def test_messages_image_block_through_the_anthropic_sdk(llava_server, hf):
    """An image block (source base64) runs as chat's image_url part: HF's greedy tokens;
    count_tokens counts its placeholders; a url source and a bad image are 400s naming
    the block, in Anthropic's error shape."""
    import anthropic

    client = anthropic.Anthropic(base_url=llava_server.base_url, api_key="unused", max_retries=0)
    img = image(31)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(img)}}]}]
    out = client.messages.create(model=MODEL, system="You are terse.", max_tokens=NEW,
                                 messages=messages, extra_body={"temperature": 0, "ignore_eos": True})
    prompt, want, _ = hf_reference(hf, chat("What is in this picture?", img), [img])
    assert out.content[0].text == hf[1].tokenizer.decode(want, skip_special_tokens=True)
    # (Anthropic's input_tokens leaves out the prefix-cache reads)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(prompt)
    counted = client.messages.count_tokens(model=MODEL, system="You are terse.", messages=messages)
    assert counted.input_tokens == len(prompt)
    bad = [{"role": "user", "content": [
        {"type": "text", "text": "x"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=bad)
    assert "messages[0].content[1]" in err.value.message and "cannot be decoded" in err.value.message
    remote = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=remote)
    assert "messages[0].content[0].source.url" in err.value.message
    assert "fetches no remote images (host 'example.com')" in err.value.message
    assert "--allowed-media-domains" in err.value.message


def test_limit_mm_per_prompt_and_image_size_flags(llava_dir):
    """``--limit-mm-per-prompt '{"image": 1}'``: two images are a 400 naming the second
    part and the flag; ``--max-image-pixels``: a larger image is a 400 naming its part."""
    srv = CandorServer(llava_dir, "--served-model-name", MODEL, "--limit-mm-per-prompt",
                       '{"image": 1}', "--max-image-pixels", "2000").start()
    try:
        status, body = srv.post_json("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 2, "messages": chat("Two?", image(1), image(2))})
        assert status == 400 and body["error"]["param"] == "messages[1].content[2]"
        assert body["error"]["code"] == "limit_exceeded" and "--limit-mm-per-prompt" in body["error"]["message"]
        status, body = srv.post_json("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 2, "messages": chat("Big?", image(1, (50, 50)))})
        assert status == 400 and body["error"]["param"] == "messages[1].content[1]"
        assert body["error"]["code"] == "image_too_large" and "limit of 2000" in body["error"]["message"]
        status, body = srv.post_json("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 2, "messages": chat("Small?", image(1, (40, 40)))})
        assert status == 200, body
        status, caps = srv.get("/v1/capabilities")
        import json
        limits = json.loads(caps)["limits"]
        assert limits["max_images_per_prompt"] == 1 and limits["max_image_pixels"] == 2000
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("flags", [["--tensor-parallel-size", "2"],
                                   ["--prefill-replicas", "1", "--decode-replicas", "1"]],
                         ids=["tp2", "prefill-decode"])
def test_tensor_parallel_and_prefill_decode_carry_images(llava_dir, hf, flags, tmp_path):
    """TP: every rank holds the whole vision tower and splices the same embeddings into its
    shard's step; P/D: the prefill replica computes the prompt with its image and hands the
    KV over, the decode replica continues. Both give HF's greedy tokens."""
    srv = CandorServer(llava_dir, "--served-model-name", MODEL, "--max-num-batched-tokens", "24",
                       *flags).start(log_path=tmp_path / "log")
    try:
        for seed in (40, 41):
            img = image(seed)
            messages = chat("What is in this picture?", img)
            status, payload = srv.post_json("/v1/chat/completions", {
                "model": MODEL, "messages": messages, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": True, "top_logprobs": 2})
            assert status == 200, payload
            _check_against_hf(payload, hf_reference(hf, messages, [img]))
        srv.wait_all_blocks_free()
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("patch,says", [
    ({"vision_config": {"model_type": "siglip_vision_model"}},
     "vision_config.model_type='siglip_vision_model' is not supported"),
    ({"model_type": "llava_next"}, "model_type='llava_next' is not supported"),
    ({"text_config": {"model_type": "qwen2"}}, "text_config.model_type='qwen2' is not supported"),
])
def test_an_unsupported_vision_config_is_refused_in_one_line_at_start(llava_dir, tmp_path, patch, says):
    import json
    import shutil
    import subprocess
    import sys

    from tests.support.server import REPO, free_port

    bad = tmp_path / "bad"
    shutil.copytree(llava_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    for key, value in patch.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (bad / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), "serve", "--model",
                           str(bad), "--port", str(free_port())], capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("candor: cannot serve ") and says in lines[0], lines


# ---------------------------------------------------------------- images in tool results


def _tool_chat(*result_parts: dict) -> list[dict]:
    """A tool call and its result (text and images), as chat's messages."""
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Take a photo of the garden."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "photo", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": list(result_parts)}]


def _tool_messages(*result_blocks: dict) -> list[dict]:
    """The same conversation in Anthropic's shape: the result is a tool_result block."""
    return [{"role": "user", "content": "Take a photo of the garden."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "photo",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                          "content": list(result_blocks)}]}]


def _messages_body(messages: list[dict], **extra) -> dict:
    return {"model": MODEL, "system": "You are terse.", "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "messages": messages, **extra}


def test_an_image_in_a_tool_result_is_rendered_in_place(llava_server, hf):
    """A chat ``tool`` message with an image_url part, and a Messages tool_result holding a
    text and an image block: the template renders the image inside the tool turn (as
    transformers' apply_chat_template does with this template); both give HF's greedy
    tokens for that conversation."""
    img = image(60)
    chat_messages = _tool_chat({"type": "text", "text": "Here it is:"},
                               {"type": "image_url", "image_url": {"url": data_url(img)}})
    want = hf_reference(hf, chat_messages, [img])
    _check_against_hf(asyncio.run(_one(llava_server, chat_messages)), want)
    status, body = llava_server.post_json("/v1/messages", _messages_body(_tool_messages(
        {"type": "text", "text": "Here it is:"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(img)}})))
    assert status == 200, body
    assert body["content"][0]["text"] == hf[1].tokenizer.decode(want[1], skip_special_tokens=True)
    assert body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"] == len(want[0])
    llava_server.wait_all_blocks_free()


def _function_call_output(*output: dict) -> list[dict]:
    """``_tool_chat``'s conversation as Responses input items (its system message goes in
    ``instructions``): the call's output is a list of content parts."""
    return [{"role": "user", "content": "Take a photo of the garden."},
            {"type": "function_call", "call_id": "call_1", "name": "photo", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": list(output)}]


def test_an_image_in_a_function_call_output_runs_as_chats_tool_image(llava_server, hf):
    """A Responses ``function_call_output`` whose ``output`` holds input_text and input_image
    parts (through the OpenAI SDK) is chat's tool message with those parts: HF's greedy
    tokens for that chat conversation, the same prompt length; a file_id image, an
    input_file part and a bad image are 400s naming the part under ``input[2].output[j]``."""
    import openai

    client = openai.OpenAI(base_url=llava_server.base_url + "/v1", api_key="unused", max_retries=0)
    img = image(61)
    want = hf_reference(hf, _tool_chat({"type": "text", "text": "Here it is:"},
                                       {"type": "image_url", "image_url": {"url": data_url(img)}}), [img])
    out = client.responses.create(
        model=MODEL, instructions="You are terse.", max_output_tokens=NEW, temperature=0,
        input=_function_call_output({"type": "input_text", "text": "Here it is:"},
                                    {"type": "input_image", "image_url": data_url(img), "detail": None}),
        extra_body={"ignore_eos": True})
    assert out.output_text == hf[1].tokenizer.decode(want[1], skip_special_tokens=True)
    assert out.usage.input_tokens == len(want[0])
    cases = [({"type": "input_image", "file_id": "file-123"}, "input[2].output[1].image_url", "file_id"),
             ({"type": "input_file", "file_data": "data:application/pdf;base64,AAAA"},
              "input[2].output[1].type", "'input_file' is not supported"),
             ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, "input[2].output[1]",
              "cannot be decoded")]
    for part, param, says in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, max_output_tokens=2, input=_function_call_output(
                {"type": "input_text", "text": "Here it is:"}, part))
        assert err.value.body["param"] == param and says in err.value.body["message"], err.value.body
    llava_server.wait_all_blocks_free()


def test_the_text_model_refuses_an_image_in_a_function_call_output(server):
    status, body = server.post_json("/v1/responses", {
        "model": "tiny-llama", "max_output_tokens": 2, "input": _function_call_output(
            {"type": "input_text", "text": "Here it is:"},
            {"type": "input_image", "image_url": data_url(image(0))})})
    assert status == 400, body
    assert (body["error"]["param"], body["error"]["code"]) == ("input[2].output[1].type",
                                                               "unsupported_content")


# ---------------------------------------------------------------- http(s) image URLs


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


HOSTED = image(50)


@pytest.fixture(scope="module")
def image_host():
    with ImageHost(_png(HOSTED), big_bytes=200_000) as host:
        yield host


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """The directory ``--allowed-local-media-path`` names (``inside/``): the hosted image,
    one past the byte limit, a symlink to a file beside the directory, a subdirectory;
    ``outside.png`` sits next to it."""
    root = tmp_path_factory.mktemp("media")
    inside = root / "inside"
    (inside / "sub").mkdir(parents=True)
    (inside / "cat.png").write_bytes(_png(HOSTED))
    (inside / "sub" / "cat.png").write_bytes(_png(HOSTED))
    (inside / "big.png").write_bytes(b"\x89PNG" + b"\0" * 200_000)
    (root / "outside.png").write_bytes(_png(HOSTED))
    (inside / "escape.png").symlink_to(root / "outside.png")
    return inside


@pytest.fixture(scope="module")
def media_server(llava_dir, media_dir, tmp_path_factory):
    """127.0.0.1 allowed, 2 s per fetch, 64 KiB per image, files under ``media_dir``; its
    chat template leaves images in tool messages out (as a template with text-only tool
    turns would)."""
    template = tmp_path_factory.mktemp("templates") / "text-only-tools.jinja"
    template.write_text(text_only_tool_template())
    srv = CandorServer(llava_dir, "--served-model-name", MODEL, "--allowed-media-domains",
                       "127.0.0.1", "--media-fetch-timeout", "2", "--max-image-bytes", "64KiB",
                       "--allowed-local-media-path", str(media_dir),
                       "--chat-template", str(template)).start()
    yield srv
    assert srv.stop() == 0


def _user(text: str, url: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_an_image_by_url_gives_the_tokens_of_the_same_image_inline(media_server, image_host):
    """The frontend fetches the URL and hands its bytes on as a data: URL: chat, Responses
    (input_image with an image_url string) and Messages (an image block with a url source)
    each answer bitwise as with the same image inline; a redirect to the listed host too."""
    inline = data_url(HOSTED)
    by_data = asyncio.run(_one(media_server, _user("What is in this picture?", inline)))
    for path in ("/cat.png", "/redirect-here"):
        before = image_host.hits.get("/cat.png", 0)
        by_url = asyncio.run(_one(media_server, _user("What is in this picture?", image_host.url(path))))
        assert image_host.hits["/cat.png"] == before + 1  # fetched, from the listed host
        assert by_url["prompt_token_ids"] == by_data["prompt_token_ids"]
        assert by_url["choices"][0]["token_ids"] == by_data["choices"][0]["token_ids"]
        assert by_url["choices"][0]["logprobs"] == by_data["choices"][0]["logprobs"]
    text = by_data["choices"][0]["message"]["content"]
    rendered = [media_server.post_json("/v1/chat/completions/render", {
        "model": MODEL, "messages": _user("What is in this picture?", url)})
        for url in (image_host.url("/cat.png"), inline)]
    assert rendered[0][0] == 200 and rendered[0] == rendered[1], rendered[0]
    counted = [media_server.post_json("/tokenize", {
        "model": MODEL, "messages": _user("What is in this picture?", url)})
        for url in (image_host.url("/cat.png"), inline)]
    assert counted[0][0] == 200 and counted[0] == counted[1], counted[0]
    assert counted[0][1]["tokens"] == by_data["prompt_token_ids"]

    def responses(url: str) -> dict:
        status, body = media_server.post_json("/v1/responses", {
            "model": MODEL, "instructions": "You are terse.", "max_output_tokens": NEW,
            "temperature": 0, "ignore_eos": True, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What is in this picture?"},
                {"type": "input_image", "image_url": url}]}]})
        assert status == 200, body
        return body

    got = [responses(u) for u in (image_host.url("/cat.png"), inline)]
    assert got[0]["output"][0]["content"][0]["text"] == got[1]["output"][0]["content"][0]["text"] == text
    assert got[0]["usage"]["input_tokens"] == got[1]["usage"]["input_tokens"]

    def messages(source: dict) -> dict:
        status, body = media_server.post_json("/v1/messages", _messages_body([
            {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image", "source": source}]}]))
        assert status == 200, body
        return body

    by_url = messages({"type": "url", "url": image_host.url("/cat.png")})
    by_data = messages({"type": "base64", "media_type": "image/png", "data": _b64(HOSTED)})
    assert by_url["content"] == by_data["content"] and by_url["content"][0]["text"] == text
    status, counted = media_server.post_json("/v1/messages/count_tokens", {
        "model": MODEL, "system": "You are terse.", "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": image_host.url("/cat.png")}}]}]})
    assert status == 200 and counted["input_tokens"] > 16, counted
    media_server.wait_all_blocks_free()


@pytest.mark.parametrize("path, code, says", [
    ("/missing.png", "image_fetch_failed", "could not be fetched: HTTP 404"),
    ("/page.html", "invalid_image", "is not an image (Content-Type 'text/html')"),
    ("/big.png", "image_too_large", "limit of 65536 bytes (--max-image-bytes)"),
    ("/slow.png", "image_fetch_timeout", "took longer than 2s (--media-fetch-timeout)"),
    ("/redirect-away", "unsupported_image_url", "host 'localhost' is not in this deployment's "
     "--allowed-media-domains"),
])
def test_a_url_that_cannot_be_fetched_is_a_400_naming_the_part(media_server, image_host, path,
                                                                code, says):
    """(``/slow.png`` answers only after the test ends: the fetch's time limit ends it.)"""
    status, body = media_server.post_json("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": _user("What?", image_host.url(path))})
    assert status == 400, body
    err = body["error"]
    assert (err["param"], err["code"]) == ("messages[1].content[1]", code)
    assert err["message"].startswith("messages[1].content[1]: ") and says in err["message"], err
    assert media_server.health()[0] == 200


def test_url_errors_name_the_part_on_responses_and_messages(media_server, image_host):
    """The same refusals under each API's own names; an unlisted host is refused before any
    fetch, naming the host and the flag."""
    status, body = media_server.post_json("/v1/responses", {
        "model": MODEL, "max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "x"},
            {"type": "input_image", "image_url": image_host.url("/missing.png")}]}]})
    assert status == 400 and body["error"]["param"] == "input[0].content[1]", body
    assert "HTTP 404" in body["error"]["message"]
    unlisted = f"http://localhost:{image_host.port}/cat.png"
    status, body = media_server.post_json("/v1/responses", {
        "model": MODEL, "max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": unlisted}]}]})
    assert status == 400 and body["error"]["param"] == "input[0].content[0].image_url", body
    assert body["error"]["code"] == "unsupported_image_url"
    assert "host 'localhost' is not in this deployment's --allowed-media-domains" in body["error"]["message"]
    status, body = media_server.post_json("/v1/messages", _messages_body([{"role": "user", "content": [
        {"type": "text", "text": "x"},
        {"type": "image", "source": {"type": "url", "url": image_host.url("/page.html")}}]}]))
    assert status == 400 and body["type"] == "error", body
    assert body["error"]["message"].startswith("messages[0].content[1]: the URL http://127.0.0.1:")
    status, body = media_server.post_json("/v1/messages", _messages_body([{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": unlisted}}]}]))
    assert status == 400 and "messages[0].content[0].source.url" in body["error"]["message"], body
    assert "host 'localhost'" in body["error"]["message"]


def test_a_template_that_leaves_tool_images_out_is_a_400_naming_the_block(media_server, image_host):
    """The server's template renders no image in a tool turn: an image there (chat's tool
    message, a Messages tool_result's image block, by URL or inline) is a 400 naming it,
    never an image silently dropped from the prompt."""
    status, body = media_server.post_json("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": _tool_chat(
            {"type": "text", "text": "Here it is:"},
            {"type": "image_url", "image_url": {"url": image_host.url("/cat.png")}})})
    assert status == 400, body
    assert (body["error"]["param"], body["error"]["code"]) == ("messages[3].content[1]", "unsupported_content")
    assert "does not place this image in the prompt (an image in a 'tool' message)" in body["error"]["message"]
    for source in ({"type": "url", "url": image_host.url("/cat.png")},
                   {"type": "base64", "media_type": "image/png", "data": _b64(HOSTED)}):
        status, body = media_server.post_json("/v1/messages", _messages_body(_tool_messages(
            {"type": "text", "text": "Here it is:"}, {"type": "image", "source": source})))
        assert status == 400, body
        assert body["error"]["message"].startswith("messages[2].content[0].content[1]: the chat "
                                                   "template does not place this image"), body


def test_capabilities_say_whether_media_is_fetched_but_not_from_where(media_server, media_dir,
                                                                       llava_server):
    """The operator's allow-list (hosts, local directory) is not published: /v1/capabilities
    says only whether remote fetch and local files are on; a refused host is not told the
    list either."""
    for srv, on in ((media_server, True), (llava_server, False)):
        status, raw = srv.get("/v1/capabilities")
        assert status == 200
        caps = json.loads(raw)
        for limits in (caps["limits"], caps["policy"]["limits"]):
            assert limits["remote_media_fetch"] is on and limits["local_media_files"] is on
            assert "allowed_media_domains" not in limits and "allowed_local_media_path" not in limits
        assert b"127.0.0.1" not in raw and str(media_dir).encode() not in raw
    status, body = media_server.post_json("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": _user("What?", "http://example.com/a.png")})
    assert status == 400 and "127.0.0.1" not in body["error"]["message"], body


# ---------------------------------------------------------------- file:// URLs


def test_a_local_file_gives_the_tokens_of_the_same_image_inline(media_server, media_dir):
    """``file://`` under ``--allowed-local-media-path`` (a subdirectory, ``localhost`` as the
    host, a ``..`` that stays inside): bitwise the answer of the same image as a data: URL,
    on chat and Responses."""
    by_data = asyncio.run(_one(media_server, _user("What is in this picture?", data_url(HOSTED))))
    for url in (f"file://{media_dir}/cat.png", f"file://localhost{media_dir}/sub/cat.png",
                f"file://{media_dir}/sub/../cat.png"):
        by_file = asyncio.run(_one(media_server, _user("What is in this picture?", url)))
        assert by_file["prompt_token_ids"] == by_data["prompt_token_ids"]
        assert by_file["choices"][0]["token_ids"] == by_data["choices"][0]["token_ids"]
        assert by_file["choices"][0]["logprobs"] == by_data["choices"][0]["logprobs"]
    status, body = media_server.post_json("/v1/responses", {
        "model": MODEL, "instructions": "You are terse.", "max_output_tokens": NEW,
        "temperature": 0, "ignore_eos": True, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is in this picture?"},
            {"type": "input_image", "image_url": f"file://{media_dir}/cat.png"}]}]})
    assert status == 200, body
    assert body["output"][0]["content"][0]["text"] == by_data["choices"][0]["message"]["content"]
    media_server.wait_all_blocks_free()


@pytest.mark.parametrize("name, code, says", [
    ("../outside.png", "unsupported_image_url", "is not inside this deployment's --allowed-local-media-path"),
    ("escape.png", "unsupported_image_url", "is not inside this deployment's --allowed-local-media-path"),
    ("missing.png", "image_fetch_failed", "no such file"),
    ("sub", "image_fetch_failed", "not a regular file"),
    ("big.png", "image_too_large", "limit of 65536 bytes (--max-image-bytes)"),
], ids=["dotdot", "symlink-escape", "missing", "directory", "too-big"])
def test_a_local_file_that_may_not_be_read_is_a_400_naming_the_part(media_server, media_dir, name,
                                                                    code, says):
    status, body = media_server.post_json("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": _user("What?", f"file://{media_dir}/{name}")})
    assert status == 400, body
    err = body["error"]
    assert (err["param"], err["code"]) == ("messages[1].content[1]", code), err
    assert err["message"].startswith("messages[1].content[1]: ") and says in err["message"], err
    assert str(media_dir.parent / "outside.png") not in err["message"]  # (the resolved target)
    assert media_server.health()[0] == 200


def test_a_file_url_without_the_flag_is_a_400(llava_server, media_dir):
    status, body = llava_server.post_json("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": _user("What?", f"file://{media_dir}/cat.png")})
    assert status == 400, body
    err = body["error"]
    assert (err["param"], err["code"]) == ("messages[1].content[1].image_url.url", "unsupported_image_url")
    assert "reads no local files" in err["message"] and "--allowed-local-media-path" in err["message"]


def test_a_file_url_naming_another_host_is_a_400(media_server, media_dir):
    status, body = media_server.post_json("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2,
        "messages": _user("What?", f"file://elsewhere.example{media_dir}/cat.png")})
    assert status == 400, body
    assert body["error"]["param"] == "messages[1].content[1].image_url.url", body
    assert "host 'elsewhere.example'" in body["error"]["message"]
