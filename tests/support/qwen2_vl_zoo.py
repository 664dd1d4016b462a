"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``: a patch-merging vision tower with 2-D rotary
positions and a Qwen2 text model with M-RoPE), built with transformers' own classes and
saved with their processor (the slow PIL ``Qwen2VLImageProcessorPil``: torchvision is not
installed) and the project's tiny tokenizer with Qwen's ``<|vision_start|>``,
``<|image_pad|>``, ``<|vision_end|>`` and ``<|video_pad|>`` tokens. Seeded: two builds are
byte-identical; nothing is downloaded.

Images are resized to multiples of 28 (14-pixel patches merged 2x2) between
``MIN_PIXELS`` and ``MAX_PIXELS``: the tests' 45x38 image becomes 84x56, 6x4 patches,
3 x 2 = 6 tokens; a 100x70 one 112x56, 4 x 2 = 8 tokens; a 60x130 one 56x140, 2 x 5
(grids that are not square, so M-RoPE's height and width positions differ). Qwen2.5-VL's
56-pixel windows hold 2x2 merged tokens, so a 2 x 5 grid is cut into windows with a
ragged edge, and block 1 of 2 attends the whole image (``fullatt_block_indexes``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = ("<|vision_start|>", "<|image_pad|>",
                                                  "<|vision_end|>", "<|video_pad|>")
PATCH = 14
MERGE = 2
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 16
TEXT_KWARGS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "mrope_section": [2, 3, 3]})
VISION_KWARGS = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2,
                     patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48,
                       num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
                       temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
}


def _chat_template() -> str:
    """The tiny model's template, an image part rendered as Qwen's
    ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor expands the pad)."""
    from launcher.tiny_model import CHAT_TEMPLATE

    text = CHAT_TEMPLATE.read_text(encoding="utf-8")
    text_part = "{%- elif part.type == 'text' -%}"
    assert text_part in text
    return text.replace(text_part, "{%- elif part.type == 'image' -%}\n                {{- '"
                        + VISION_START + IMAGE_PAD + VISION_END + "' -}}\n            "
                        + text_part, 1)


def build_qwen2_vl(out: Path, family: str = "qwen2_vl", seed: int = 0, tie: bool = False,
                   **image_processor: object) -> Path:
    """Save the checkpoint (weights, config, processor) into ``out``; ``family``:
    ``qwen2_vl`` or ``qwen2_5_vl``; ``image_processor`` overrides its settings."""
    from tokenizers import AddedToken
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.utils import logging as hf_logging

    from launcher.tiny_model import BOS, EOT, PAD, build_tokenizer
    from tests.support.model_zoo import perturb

    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False)
                          for t in (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)])
    tokenizer.chat_template = _chat_template()
    vocab = tokenizer.convert_tokens_to_ids
    ids = dict(image_token_id=vocab(IMAGE_PAD), video_token_id=vocab(VIDEO_PAD),
               vision_start_token_id=vocab(VISION_START), vision_end_token_id=vocab(VISION_END))
    text = dict(vocab_size=len(tokenizer), bos_token_id=vocab(BOS), eos_token_id=vocab(EOT),
                pad_token_id=vocab(PAD), tie_word_embeddings=tie, **TEXT_KWARGS)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config, Qwen2VLForConditionalGeneration as Model
    else:
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model
    config = Config(text_config=text, vision_config=VISION_KWARGS[family],
                    tie_word_embeddings=tie, **ids)
    torch.manual_seed(seed)
    model = Model(config).to(torch.float32).eval()
    perturb(model, seed=seed)
    model.save_pretrained(out)
    settings = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                    merge_size=MERGE, **image_processor)
    # (as the hub's Qwen2-VL checkpoints: preprocessor_config.json names the processor;
    # Qwen2VLProcessor.save_pretrained needs a video processor, which needs torchvision)
    image_processor = Qwen2VLImageProcessorPil(**settings)
    image_processor.save_pretrained(out)
    path = out / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "processor_class": "Qwen2VLProcessor"}, indent=2))
    tokenizer.save_pretrained(out)
    return out


def make_processor(image_processor, tokenizer):
    """HF's ``Qwen2VLProcessor`` over these parts, without a video processor: transformers
    5 cannot check for one without torchvision (not installed here), and images need none."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = (
        lambda self, name, arg: None if arg is None else check(self, name, arg))
    try:
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                video_processor=None, chat_template=tokenizer.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def hf_qwen2_vl(path: Path):
    """(model, processor) as HF loads them, greedy for exactly the tokens asked."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare exactly n tokens
    return model, make_processor(Qwen2VLImageProcessorPil.from_pretrained(path),
                                 AutoTokenizer.from_pretrained(path))
