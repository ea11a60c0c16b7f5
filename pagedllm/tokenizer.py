"""Text <-> token ids for the engine, backed by a Hugging Face fast tokenizer loaded from local files only."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import jinja2
import tokenizers
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class Tokenizer:
    """Wraps a Hugging Face fast tokenizer; adds the chat template and EOS facts the engine needs."""

    def __init__(self, hf: PreTrainedTokenizerBase):
        self.hf = hf
        self.eos_token_id: int | None = hf.eos_token_id
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size = len(hf)
        self.all_special_ids: set[int] = set(hf.all_special_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.hf.convert_tokens_to_string(tokens)

    def apply_chat_template(
        self,
        conversation: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools=None,
        **kwargs,
    ) -> list[int]:
        """Token ids of the rendered conversation; the template writes its own special tokens, so none
        are added."""
        text = self.apply_chat_template_text(
            conversation, add_generation_prompt, chat_template, tools, **kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def apply_chat_template_text(
        self,
        conversation: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools=None,
        **kwargs,
    ) -> str:
        """Render the conversation with chat_template, or the model's own template.

        Templates come with downloaded models, so they are untrusted code: transformers renders them in
        jinja2.sandbox.ImmutableSandboxedEnvironment (transformers/utils/chat_template_utils.py), which
        blocks attribute tricks that would reach Python internals. Extra kwargs become template variables.
        """
        if chat_template is None and not self.hf.chat_template:
            raise ValueError("This model has no chat template; pass one as chat_template")
        try:
            return self.hf.apply_chat_template(
                conversation,
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except jinja2.TemplateError:   # the template refused the conversation, or the sandbox refused it
            raise
        except Exception as exc:   # the template's own bug ({{ 1/0 }}): the model's fault, not the caller's
            raise ValueError(f"the model's chat template failed: {type(exc).__name__}: {exc}") from exc


def load_tokenizer_from_folder(folder: Path) -> Tokenizer:
    """Load the tokenizer saved beside a model, never running code shipped with it."""
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{folder} has no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})")
    try:
        return Tokenizer(AutoTokenizer.from_pretrained(folder, trust_remote_code=False, local_files_only=True))
    except ValueError as exc:
        # transformers' own message asks for trust_remote_code=True, which pagedllm never passes.
        if _ships_tokenizer_code(folder):
            raise ValueError(f"{folder}: its tokenizer is custom code (auto_map in tokenizer_config.json), "
                             "and pagedllm never runs code from a model folder") from exc
        raise


def _ships_tokenizer_code(folder: Path) -> bool:
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("auto_map"))


def load_tokenizer_from_gguf(path: Path) -> Tokenizer:
    """Load the tokenizer (and its chat template) stored in a GGUF file's metadata.

    transformers rebuilds it from the GGUF vocabulary in seconds, so the result is saved once under
    tokenizer_cache_dir() and later loads read that copy in a fraction of the time.
    """
    cached = tokenizer_cache_dir() / _gguf_cache_key(path)
    if cached.is_dir():
        return load_tokenizer_from_folder(cached)
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False,
                                       local_files_only=True)
    _save_to_cache(hf, cached)
    return Tokenizer(hf)


def tokenizer_cache_dir() -> Path:
    """Where converted GGUF tokenizers are kept: $PAGEDLLM_CACHE_DIR, else $XDG_CACHE_HOME/pagedllm, else
    ~/.cache/pagedllm; always under a tokenizers/ folder so nothing else is touched."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "pagedllm"
    )
    return Path(root) / "tokenizers"


def _gguf_cache_key(path: Path) -> str:
    """Changes whenever the file, or the code that converts its tokenizer, changes."""
    stat = path.stat()
    versions = f"{transformers.__version__}|{tokenizers.__version__}"
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{versions}"
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


def _save_to_cache(hf: PreTrainedTokenizerBase, target: Path) -> None:
    """Save through a temporary folder renamed into place, so readers never see a half-written entry.

    Caching is only a speed-up: an unwritable cache, or another process winning the race, is not an error.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=target.parent, prefix=".partial-")
    except OSError:
        return
    try:
        hf.save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
