"""`pagedllm bench embed`: embedding throughput (inputs/s, tokens/s) of pagedllm's pooling runner against
sentence-transformers, on the same model, inputs and thread count, side by side in one run.

Without a model it writes a random all-MiniLM-L6-v2-shaped BERT (6 layers, hidden 384, 12 heads, a 30,522-entry
word-piece vocabulary) as a sentence-transformers folder (mean pooling, Normalize): the shape of the most used
embedding checkpoints, with nothing downloaded. The inputs are random words of that vocabulary, one token each.
Each side embeds every input once to warm up, then `--rounds` times timed; the best round is reported, and
the largest difference between the two sides' embeddings is printed as a check that they computed the same.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pagedllm.config import DTYPES

_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_MINILM_SHAPE = dict(vocab_size=30522, hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                     num_attention_heads=12, max_position_embeddings=512, type_vocab_size=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a sentence-transformers folder (default: a random MiniLM-shaped BERT written for the run)")
    parser.add_argument("--num-inputs", type=int, default=256, help="texts embedded per round (default: 256)")
    parser.add_argument("--words", type=int, default=100,
                        help="words per text, one token each with the default model (default: 100)")
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch (default: 32)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side; the best counts (default: 3)")
    parser.add_argument("--dtype", choices=DTYPES[1:], default="float32",
                        help="both sides compute in it (default: float32)")


def _minilm_folder(folder: Path) -> list[str]:
    """Writes the random MiniLM-shaped sentence-transformers folder; returns its whole-word tokens."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizer

    words = [f"w{index}" for index in range(_MINILM_SHAPE["vocab_size"] - len(_SPECIAL))]
    torch.manual_seed(0)
    BertModel(BertConfig(**_MINILM_SHAPE)).save_pretrained(folder / "bert")
    vocab = {token: index for index, token in enumerate(_SPECIAL + words)}
    BertTokenizer(vocab=vocab).save_pretrained(folder / "bert")
    word = Transformer(str(folder / "bert"))
    modules = [word, Pooling(word.get_embedding_dimension(), pooling_mode="mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder / "st"))
    return words


def _best_seconds(embed, rounds: int) -> tuple[float, np.ndarray]:
    embed()   # warm-up: first-call allocations, oneDNN primitive creation
    best, result = float("inf"), None
    for _ in range(rounds):
        started = time.perf_counter()
        result = embed()
        best = min(best, time.perf_counter() - started)
    return best, result


def run(args: argparse.Namespace) -> None:
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM

    with tempfile.TemporaryDirectory() as scratch:
        if args.model is None:
            words, folder = _minilm_folder(Path(scratch)), str(Path(scratch) / "st")
        else:
            words, folder = "the quick brown fox jumps over a lazy dog".split(), args.model
        rng = random.Random(0)
        texts = [" ".join(rng.choices(words, k=args.words)) for _ in range(args.num_inputs)]
        dtype = getattr(torch, args.dtype)
        reference = SentenceTransformer(folder, device="cpu", model_kwargs={"dtype": dtype})
        num_tokens = sum(len(ids) for ids in reference.tokenizer(texts)["input_ids"])
        llm = LLM(folder, dtype=args.dtype, kv_cache_memory="1GiB")
        ours_seconds, ours = _best_seconds(
            lambda: np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]), args.rounds)
        theirs_seconds, theirs = _best_seconds(
            lambda: reference.encode(texts, batch_size=args.batch_size, convert_to_numpy=True), args.rounds)
    print(f"{args.num_inputs} inputs, {num_tokens} tokens, dtype {args.dtype}, {torch.get_num_threads()} threads, "
          f"best of {args.rounds} rounds")
    print(f"{'':<34}{'seconds':>10}{'inputs/s':>12}{'tokens/s':>12}")
    for name, seconds in (("pagedllm", ours_seconds), (f"sentence-transformers (batch {args.batch_size})",
                                                        theirs_seconds)):
        print(f"{name:<34}{seconds:>10.3f}{args.num_inputs / seconds:>12.1f}{num_tokens / seconds:>12.0f}")
    print(f"largest difference between the two sides' embeddings: {np.abs(ours - theirs.astype(np.float32)).max():.2e}")
