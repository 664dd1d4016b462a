"""A tiny random Gemma 3 image-text checkpoint (``Gemma3ForConditionalGeneration``: a
SigLIP vision tower, Gemma 3's pooling projector and a tiny Gemma 3 text model), built
with transformers' own classes and saved with its processor (``Gemma3ImageProcessor`` +
the project's tiny tokenizer with Gemma 3's ``<start_of_image>``, ``<image_soft_token>``
and ``<end_of_image>`` tokens), for parity tests against HF. Seeded: two builds are
byte-identical; nothing is downloaded.

56x56 images in 14-pixel patches give a 4x4 grid that the projector pools 2x2 into
``MM_TOKENS`` = 4 image tokens; the text model slides a window of 16 on its even layers,
so an image past position 16 meets a window that cuts its causal prefix (the
bidirectional block must still reach the image's later tokens)."""

from __future__ import annotations

from pathlib import Path

import torch

BOI, IMAGE_TOKEN, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
IMAGE_SIZE = 56
PATCH = 14
MM_TOKENS = 4
TEXT_KWARGS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   query_pre_attn_scalar=16, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                "full_attention"],
                   max_position_embeddings=1024, hidden_activation="gelu_pytorch_tanh",
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1000000.0}})
VISION_KWARGS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH,
                     vision_use_head=False)


def _chat_template() -> str:
    """The tiny model's template, an image part rendered as ``<start_of_image>`` (as Gemma
    3's own template does; the processor expands it)."""
    from launcher.tiny_model import CHAT_TEMPLATE

    text = CHAT_TEMPLATE.read_text(encoding="utf-8")
    text_part = "{%- elif part.type == 'text' -%}"
    assert text_part in text
    return text.replace(text_part, "{%- elif part.type == 'image' -%}\n                {{- '"
                        + BOI + "' -}}\n            " + text_part, 1)


def build_gemma3_vision(out: Path, seed: int = 0, **image_processor: object) -> Path:
    """Save the checkpoint (weights, config, processor) into ``out``; ``image_processor``
    overrides the image processor's settings (e.g. ``do_pan_and_scan=True``)."""
    from tokenizers import AddedToken
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor,
                              Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig)
    from transformers.utils import logging as hf_logging

    from launcher.tiny_model import BOS, EOT, PAD, build_tokenizer
    from tests.support.model_zoo import EMBED_STD, perturb

    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in (BOI, IMAGE_TOKEN, EOI)])
    tokenizer.chat_template = _chat_template()
    # (Gemma3Processor reads them as the tokenizer's boi_token, image_token and eoi_token)
    tokenizer._set_model_specific_special_tokens({"boi_token": BOI, "image_token": IMAGE_TOKEN,
                                                  "eoi_token": EOI})
    vocab = tokenizer.convert_tokens_to_ids
    text = Gemma3TextConfig(vocab_size=len(tokenizer), bos_token_id=vocab(BOS), eos_token_id=vocab(EOT),
                            pad_token_id=vocab(PAD), **TEXT_KWARGS)
    config = Gemma3Config(text_config=text, vision_config=SiglipVisionConfig(**VISION_KWARGS),
                          mm_tokens_per_image=MM_TOKENS, boi_token_index=vocab(BOI),
                          eoi_token_index=vocab(EOI), image_token_index=vocab(IMAGE_TOKEN))
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    perturb(model, seed=seed, embed_std=EMBED_STD["gemma3_text"])
    model.save_pretrained(out)
    settings = dict(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, **image_processor)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(**settings), tokenizer=tokenizer,
                                image_seq_length=MM_TOKENS, chat_template=tokenizer.chat_template)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def hf_gemma3(path: Path):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare exactly n tokens
    return model, AutoProcessor.from_pretrained(path)
