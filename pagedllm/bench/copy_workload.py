"""Copy-heavy chat prompts: quote code back, edit a text, summarise it. Their answers repeat long spans of
the prompt, which is where n-gram speculation pays. The texts are this package's own sources and module
docstrings, so the workload needs no download and is the same on every machine."""
from __future__ import annotations

import ast
import random
import textwrap
from pathlib import Path

import pagedllm
from pagedllm.bench.workload import BenchRequest

_SOURCES = ("kv/manager.py", "kv/block_pool.py", "engine/scheduler.py", "engine/detokenizer.py",
            "worker/input_batch.py", "sampling_params.py")


def _functions_and_docstrings() -> tuple[list[str], list[str]]:
    """Every function's source (5-30 lines, dedented as one would paste a method) and every docstring of 200+
    characters in the sources."""
    root = Path(pagedllm.__file__).parent
    functions, docstrings = [], []
    for name in _SOURCES:
        source = (root / name).read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and 5 <= node.end_lineno - node.lineno < 30:
                functions.append(textwrap.dedent(ast.get_source_segment(source, node, padded=True)))
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= 200:
                    docstrings.append(text)
    return functions, docstrings


def copy_heavy_workload(tokenizer, num: int, max_tokens: int, seed: int = 0) -> list[BenchRequest]:
    """num chat prompts in turn: quote a function back, edit a text (rename a word), summarise a text."""
    rng = random.Random(seed)
    functions, docstrings = _functions_and_docstrings()
    requests = []
    for index in range(num):
        kind = index % 3
        if kind == 0:
            content = f"Repeat this Python function exactly, in a code block:\n\n{rng.choice(functions)}"
        elif kind == 1:
            content = ("Rewrite the following text word for word, but write 'block' as 'page' everywhere:\n\n"
                       f"{rng.choice(docstrings)}")
        else:
            content = f"Summarise this text, quoting its key sentences:\n\n{rng.choice(docstrings)}"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        requests.append(BenchRequest(ids, max_tokens))
    return requests
