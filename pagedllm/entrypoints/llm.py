"""The offline API: `LLM(...).generate(prompts, sampling_params)`, shaped like vLLM's."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import EngineStats
from pagedllm.entrypoints.score_utils import pair_up, plan_scoring
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import (EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict]


class LLM:
    """Loads a model once and generates for whole lists of prompts with continuous batching.

    `model` may be a Hugging Face model folder, a GGUF file, or a name already in the
    local Hugging Face cache; None uses the bundled SmolLM2-135M-Instruct.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", block_size: int = 16,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 kv_cache_memory: int | str | None = None, seed: int = 0, **engine_kwargs):
        unknown = set(engine_kwargs) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        config = EngineConfig(model=model, dtype=dtype, block_size=block_size, max_num_seqs=max_num_seqs,
                              max_model_len=max_model_len, kv_cache_memory=kv_cache_memory, seed=seed,
                              **engine_kwargs)
        self.llm_engine = LLMEngine(config)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generates for every prompt; returns outputs in input order. lora_request: the adapter of every prompt,
        or a list with one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts; "
                                 "pass one SamplingParams or one per prompt")
        final_only = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        return self._run(prompts, final_only, use_tqdm, _per_prompt(lora_request, len(prompts)))

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.llm_engine.tokenizer
        prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(
                        conversation, add_generation_prompt=add_generation_prompt, chat_template=chat_template)}
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """Beam search for each prompt; beams share KV blocks. Returns outputs in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        return [BeamSearchOutput([BeamSearchSequence(output.prompt_token_ids + beam.token_ids, beam.logprobs,
                                                     beam.cumulative_logprob, beam.text, beam.finish_reason,
                                                     len(output.prompt_token_ids))
                                  for beam in output.outputs])
                for output in self._run(prompts, [params] * len(prompts), False,
                                        _per_prompt(lora_request, len(prompts)))]

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """A pooling model's result for every prompt (`outputs.data`, a tensor), in input order."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return self._run(prompts, [pooling_params or PoolingParams()] * len(prompts), use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeddings (`outputs.embedding`, a list of floats) of an embedding model, in input order;
        PoolingParams(dimensions=..., normalize=...) as the model allows."""
        params = pooling_params or PoolingParams()
        if params.task != "embed":
            raise ValueError(f"embed takes PoolingParams with task 'embed', got {params.task!r}")
        return [EmbeddingRequestOutput.from_base(output) for output in self.encode(prompts, params, use_tqdm)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Relevance of each pair (one text against a list, or two lists pairwise): a cross-encoder's score,
        or for an embedding model the cosine of the two embeddings."""
        engine = self.llm_engine
        plan = plan_scoring(engine.tokenizer, engine.pooling, pair_up(data_1, data_2))
        outputs = self._run(plan.prompts, [plan.params] * len(plan.prompts), use_tqdm)
        return [ScoringRequestOutput(pair.request_id, ScoringOutput(pair.score), pair.prompt_token_ids)
                for pair in plan.scores(outputs)]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter now (LLMEngine.add_lora); requests may also name one not yet loaded."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def stats(self) -> EngineStats:
        """KV-cache figures (blocks total / free / used / cached / shared, utilisation, prefix hit
        rate) and queue sizes, derived from the engine's state now."""
        return self.llm_engine.stats()

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams | BeamSearchParams | PoolingParams],
             use_tqdm: bool, lora_requests: list[LoRARequest | None] | None = None
             ) -> list[RequestOutput | PoolingRequestOutput]:
        engine = self.llm_engine
        request_ids = []
        try:
            for prompt, params, lora_request in zip(prompts, params_list, lora_requests or [None] * len(prompts)):
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, params, lora_request=lora_request)
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
                ) -> list[LoRARequest | None]:
    """vLLM's lora_request argument: one adapter for every prompt, or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompts; "
                             "pass one LoRARequest or one per prompt")
        return list(lora_request)
    raise ValueError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
