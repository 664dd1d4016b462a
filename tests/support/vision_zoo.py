"""A tiny random LLaVA-1.5-style checkpoint (CLIP vision tower + MLP projector + the tiny
Llama text model), built with transformers' own classes and saved with its processor
(CLIPImageProcessor + the project's tiny tokenizer with an ``<image>`` token), for parity
tests against HF. Seeded: two builds are byte-identical; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

import torch

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH = 8  # (32 / 8)^2 = 16 image tokens per image
TEXT_KWARGS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=1024, tie_word_embeddings=False)
VISION_KWARGS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH,
                     projection_dim=32)


def _chat_template() -> str:
    """The tiny model's template, an image part rendered as the processor's ``<image>``
    (as LLaVA's own templates do)."""
    from launcher.tiny_model import CHAT_TEMPLATE

    text = CHAT_TEMPLATE.read_text(encoding="utf-8")
    text_part = "{%- elif part.type == 'text' -%}"
    assert text_part in text
    return text.replace(text_part, "{%- elif part.type == 'image' -%}\n                {{- '"
                        + IMAGE_TOKEN + "' -}}\n            " + text_part, 1)


def text_only_tool_template() -> str:
    """The tiny LLaVA template, except that a tool message's images are not rendered (as a
    template whose tool turns take text only would)."""
    text = _chat_template()
    for old, new in (("{%- macro render_content(content) -%}",
                      "{%- macro render_content(content, role='') -%}"),
                     ("part.type == 'image'", "part.type == 'image' and role != 'tool'"),
                     ("render_content(message.content)",
                      "render_content(message.content, message.role)")):
        assert old in text
        text = text.replace(old, new)
    return text


def build_llava(out: Path, seed: int = 0) -> Path:
    """Save the checkpoint (weights, config, processor) into ``out``."""
    from tokenizers import AddedToken
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    from transformers.utils import logging as hf_logging

    from launcher.tiny_model import BOS, EOT, PAD, build_tokenizer
    from tests.support.model_zoo import perturb

    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tokenizer.chat_template = _chat_template()
    vocab = tokenizer.convert_tokens_to_ids
    image_id = vocab(IMAGE_TOKEN)
    text = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=vocab(BOS), eos_token_id=vocab(EOT),
                       pad_token_id=vocab(PAD), **TEXT_KWARGS)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**VISION_KWARGS), text_config=text,
                         image_token_index=image_id, projector_hidden_act="gelu",
                         vision_feature_select_strategy="default", vision_feature_layer=-2,
                         image_seq_length=(IMAGE_SIZE // PATCH) ** 2)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    perturb(model, seed=seed)
    model.save_pretrained(out)
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               patch_size=PATCH, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, image_token=IMAGE_TOKEN,
                               chat_template=tokenizer.chat_template)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def hf_llava(path: Path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare exactly n tokens
    return model, AutoProcessor.from_pretrained(path)


def hf_greedy(model, processor, text: str, images: list, n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) from HF on ``text`` (with its ``<image>`` markers)."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


def random_image(seed: int, size=(45, 38)) -> Image.Image:
    """A seeded RGB image of random pixels, ``size`` (width, height): the tests' images."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")
