"""Deterministic tiny Llama checkpoint for tests and local runs.

Everything (tokenizer, weights, configs) is derived from files kept in this folder and
fixed seeds, so two builds are byte-identical and nothing is ever downloaded. The
weights are random but drawn with a large std so greedy decoding produces varied
tokens with clear margins (parity tests against HF need no near-ties).

Building needs ``transformers``/``tokenizers``; the serving runtime does not.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.txt"
CHAT_TEMPLATE = HERE / "chat_template.jinja"

BOS = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PAD = "<|pad|>"
# Control tokens: ids 0..5, skipped by skip_special_tokens.
SPECIAL_TOKENS = [BOS, END_OF_TEXT, START_HEADER, END_HEADER, EOT, PAD]
# Single tokens but not "special": they must survive skip_special_tokens=True so that a
# tool-call parser sees them in the detokenized text (as Qwen2.5/Hermes do).
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
VOCAB_SIZE = 2048

WEIGHT_STD = 0.3
WEIGHT_SEED = 0

MODEL_KWARGS = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    tie_word_embeddings=True,
)


def build_tokenizer():
    """Train the byte-level BPE on corpus.txt and wrap it for ``save_pretrained``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocab is {tok.get_vocab_size()}, expected {VOCAB_SIZE}")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        model_max_length=MODEL_KWARGS["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE.read_text(encoding="utf-8"),
    )


def init_weights(model, *, seed: int = WEIGHT_SEED, std: float = WEIGHT_STD) -> None:
    """Re-draw every parameter from one seeded generator, in name order.

    Norm weights are 1 and biases / matrices are N(0, std). Independent of torch's
    global RNG and of HF's own init, so the bytes only depend on (seed, std, shapes).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def build_tiny_model(out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Build the tiny checkpoint into ``out_dir`` (HF layout) and return its path.

    Written to a temporary sibling first and renamed into place, so a crash never leaves
    a half-built directory behind.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True)")
    out.parent.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    vocab = tokenizer.convert_tokens_to_ids
    eos_ids = [vocab(EOT), vocab(END_OF_TEXT)]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=vocab(BOS),
        eos_token_id=eos_ids,
        pad_token_id=vocab(PAD),
        dtype="float32",
        **MODEL_KWARGS,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    init_weights(model)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos_ids, pad_token_id=config.pad_token_id
    )

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    return out


__all__ = ["build_tiny_model", "build_tokenizer", "init_weights", "SPECIAL_TOKENS", "TOOL_TOKENS"]
