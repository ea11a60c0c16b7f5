"""Tiny random pooling checkpoints for the pooling tests: BERT-family and Qwen3 models, sentence-transformers
folders around them, and cross-encoders (*ForSequenceClassification). Nothing is downloaded."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
from transformers import (AutoModel, AutoModelForSequenceClassification, AutoTokenizer, BertConfig, BertTokenizer,
                          Qwen3Config, XLMRobertaConfig)

WORDS = ("the cat sat on mat paged memory blocks attention cache query key value dog runs fast slow "
         "red green blue sky sea tree house book read write model token embed score rank").split()
QUERY = "where does the cat sit"
DOCUMENTS = ["the cat sat on the mat", "blue sky", "a dog runs fast on the mat", "cache blocks", "the cat"]
_QWEN3_SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)


def randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Default init leaves norms at one and biases at zero: that would hide an unused norm or bias."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(mean=1.0 if "norm" in name.lower() else 0.0, std=0.2)
    return model.eval()


def word_piece_tokenizer() -> BertTokenizer:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz,.",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
    return BertTokenizer(vocab={token: index for index, token in enumerate(vocab)}, do_lower_case=True)


def encoder_config(family: str, vocab_size: int, **extra):
    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=128, **extra)
    if family == "bert":
        return BertConfig(**shape, type_vocab_size=2)
    # pad_token_id 0 is the word-piece vocabulary's [PAD]: positions start at 1
    return XLMRobertaConfig(**shape, type_vocab_size=1, pad_token_id=0)


def save_sentence_transformer(model_folder: Path, folder: Path, pooling_mode: str, normalize: bool = True,
                              **st_config) -> Path:
    word = Transformer(str(model_folder))
    if word.tokenizer.pad_token is None:
        word.tokenizer.pad_token = word.tokenizer.eos_token
    modules = [word, Pooling(word.get_embedding_dimension(), pooling_mode=pooling_mode)]
    SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu").save(str(folder))
    if st_config:
        path = folder / "config_sentence_transformers.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **st_config}))
    return folder


def encoder_model_folder(folder: Path, family: str) -> Path:
    """A bare BertModel or XLMRobertaModel with a word-piece tokenizer."""
    tokenizer = word_piece_tokenizer()
    randomise(AutoModel.from_config(encoder_config(family, len(tokenizer)))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def qwen3_model_folder(folder: Path, tokenizer_dir: Path) -> Path:
    """A bare Qwen3Model (as Qwen3-Embedding keeps its weights) with the bundled tokenizer's vocabulary."""
    randomise(AutoModel.from_config(Qwen3Config(**_QWEN3_SHAPE))).save_pretrained(folder)
    _copy_tokenizer_without_chat_template(tokenizer_dir, folder)
    return folder


def _copy_tokenizer_without_chat_template(tokenizer_dir: Path, folder: Path) -> None:
    """sentence-transformers 6 renders texts through a tokenizer's chat template when it has one; pagedllm, as
    vLLM, embeds the text as given: the references must see the same tokens."""
    for file in tokenizer_dir.iterdir():
        if file.name != "chat_template.jinja":
            shutil.copy(file, folder / file.name)


def cross_encoder_folder(tmp_path: Path, family: str, hf_tokenizer_dir: Path) -> Path:
    folder = tmp_path / f"cross-{family}"
    if family == "qwen3":
        # transformers finds each sequence's last token by the padding id: the tokenizer pads with it too.
        folder.mkdir(parents=True)
        _copy_tokenizer_without_chat_template(hf_tokenizer_dir, folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.pad_token = tokenizer.eos_token
        config = Qwen3Config(**_QWEN3_SHAPE, num_labels=1, pad_token_id=tokenizer.pad_token_id)
        randomise(AutoModelForSequenceClassification.from_config(config)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder
    tokenizer = word_piece_tokenizer()
    config = encoder_config(family, len(tokenizer), num_labels=1)
    randomise(AutoModelForSequenceClassification.from_config(config)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if family != "bert":   # RoBERTa's tokenizers give no token types: the model has one
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        settings["model_input_names"] = ["input_ids", "attention_mask"]
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder
