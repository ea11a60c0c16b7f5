"""Data parallelism on Ray: data_parallel_size engine replicas behind AsyncLLM's interface.

Each replica (ray_replica.EngineReplica) is an async Ray actor holding the whole model, its own
KV cache and its own step loop, placed by ray_placement.py. `DPAsyncLLM` is the engine client
the OpenAI server drives over them:

- a request goes where dp_router.choose_replica says: with data_parallel_routing prefix, to the live replica
  holding the longest cached prefix of its prompt (known from the block hashes each replica reports, asked for
  as the request is routed) unless it is over the load-imbalance bound; otherwise, and with least-loaded, to
  the replica with the fewest requests in flight (sent from here and not yet finished), ties to the one that
  was given fewer so far; its outputs stream back;
- abort (or closing a stream) reaches the replica that owns the request and frees its blocks;
- stats() sums every live replica's figures (stats.combine_stats), so KV usage is used blocks over all
  blocks, and keeps each replica's own figures and the router's choices beside them (DataParallelStats);
- a replica that dies (killed, its node lost) fails only the requests it held, with
  EngineRequestError, and is skipped from then on; when none is left, requests get EngineDeadError;
- max_waiting_requests bounds the requests sent to replicas that have not yet had an output back;
- a LoRA adapter is added to (and removed from) every live replica, so a request with it can go to any.

Ray is an optional extra (`pip install pagedllm[ray]`), imported (ray_placement.import_ray) only when used.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagedllm.config import EngineConfig
from pagedllm.engine.dp_router import (ROUTING_REASONS, CachedBlocksMirror, RouteCandidate, choose_replica,
                                       prompt_block_hashes)
from pagedllm.engine.input_processor import CheckedPrompt, PromptType, cache_salt_of, prefix_cache_salt, tokenize_prompt
from pagedllm.engine.lora_adapters import lora_cache_salt
from pagedllm.engine.pooling import check_pooling_params
from pagedllm.engine.protocol import EngineClient, EngineDeadError, EngineRequestError
from pagedllm.engine.ray_placement import import_ray, place_replicas
from pagedllm.engine.ray_replica import ReplicaInfo, ReplicaStats
from pagedllm.engine.stats import DataParallelStats, EngineStats, combine_stats
from pagedllm.lora.request import LoRAInUseError, LoRARequest
from pagedllm.model.config import ModelConfig
from pagedllm.model.loader import load_checkpoint
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    """The front's record of one replica actor."""
    index: int
    actor: object           # the Ray actor handle
    info: ReplicaInfo
    alive: bool = True
    num_in_flight: int = 0  # requests sent to it and not finished
    num_routed: int = 0     # requests ever sent to it
    request_ids: set[str] = field(default_factory=set)
    routed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROUTING_REASONS, 0))   # by reason
    cached_blocks: CachedBlocksMirror = field(default_factory=CachedBlocksMirror)   # from its block-hash reports
    reports_started: int = 0
    reports_applied: int = 0   # the number of the last report applied to cached_blocks
    reporting: asyncio.Lock = field(default_factory=asyncio.Lock)   # one report in flight


class DPAsyncLLM(EngineClient):
    """The engine client over Ray engine replicas. The tokenizer and model config are read here (the weights are
    not), the limits come from the replicas, and prompts are checked by a replica's own engine, so the front
    refuses exactly what a replica would."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, model_config: ModelConfig, replicas: list[Replica],
                 placement_group, owns_ray: bool, max_waiting_requests: int | None = None):
        self._ray = import_ray()
        self.replicas = replicas
        self.max_waiting_requests = max_waiting_requests
        self._placement_group = placement_group
        self._owns_ray = owns_ray
        self._owner: dict[str, Replica] = {}
        self._loras: dict[int, LoRARequest] = {}   # adapters added on every replica, by id
        self._num_waiting = 0   # sent to a replica, no output back yet
        self._dead: EngineDeadError | None = None
        self._closed = False
        self.config, self.tokenizer, self.model_config = config, tokenizer, model_config
        self.max_model_len = replicas[0].info.max_model_len
        self.pooling = None   # pooling models serve with data_parallel_size 1
        self.routing = config.data_parallel_routing
        self.balance_abs_threshold = config.data_parallel_balance_abs_threshold

    @classmethod
    def from_config(cls, config: EngineConfig, max_waiting_requests: int | None = None) -> DPAsyncLLM:
        """Joins the Ray cluster (RAY_ADDRESS, one started with `ray start`, or else a new local one), places
        one replica per bundle and waits until every replica has loaded the model."""
        ray = import_ray()
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
        try:
            return cls._start(ray, config, owns_ray, max_waiting_requests)
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise

    @classmethod
    def _start(cls, ray, config: EngineConfig, owns_ray: bool, max_waiting_requests: int | None) -> DPAsyncLLM:
        # config and tokenizer; weights stay unread
        checkpoint = load_checkpoint(config.model, config.quantization, config.runner, config.pooler_config,
                                     config.hf_overrides)
        if checkpoint.pooling is not None:
            raise ValueError("pooling models (embeddings, scores) serve with data_parallel_size 1")
        actors, infos, group = place_replicas(ray, config)
        replicas = [Replica(index, actor, info) for index, (actor, info) in enumerate(zip(actors, infos))]
        return cls(config, checkpoint.tokenizer, checkpoint.config, replicas, group, owns_ray, max_waiting_requests)

    @property
    def num_waiting_requests(self) -> int:
        return self._num_waiting

    def check_prompt(self, prompt: PromptType, params: SamplingParams) -> CheckedPrompt:
        """Blocks for one Ray call to a replica: the server calls it synchronously, and a prompt check takes a
        tokenizer pass, not an engine step."""
        for replica in self._live_replicas():
            try:
                checked = self._ray.get(replica.actor.check_prompt.remote(prompt, params))
            except self._ray.exceptions.RayActorError as exc:
                self._mark_dead(replica, exc)
                continue
            if isinstance(checked, ValueError):
                raise checked
            return checked
        raise self._no_replica_left()

    def check_pooling_prompt(self, prompt: PromptType, params: PoolingParams) -> tuple[list[int], list[int]]:
        """Always refused, as a generating model's own engine refuses it: pooling models serve with
        data_parallel_size 1."""
        check_pooling_params(params, self.pooling)
        raise ValueError("pooling models (embeddings, scores) serve with data_parallel_size 1")

    async def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead

    def local_engine(self) -> None:
        return None   # each replica's engine lives in its own Ray actor

    def describe(self) -> str:
        info = self.replicas[0].info
        return (f"(dtype {info.dtype}) with {len(self.replicas)} Ray engine replicas, each with "
                f"{info.num_kv_blocks} KV blocks of {info.block_size} tokens")

    def replica_of(self, request_id: str) -> Replica | None:
        """The replica that holds the request, while it is in flight."""
        return self._owner.get(request_id)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """As AsyncLLM.generate, on the live replica the router picks. Closing or cancelling the iterator
        aborts the request on its replica; the replica dying raises EngineRequestError."""
        if self._dead is not None:
            raise self._dead
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_capacity()
        self._owner[request_id] = None   # taken while it is routed
        self._num_waiting += 1
        replica = None
        waiting, done = True, False   # done: the replica holds nothing more of this request
        try:
            replica = await self._route(prompt, lora_request)
            self._owner[request_id] = replica
            replica.request_ids.add(request_id)
            replica.num_in_flight += 1
            stream = replica.actor.generate.options(num_returns="streaming").remote(
                prompt, sampling_params, request_id, priority, lora_request)
            async for ref in stream:
                item = await ref
                if waiting:
                    waiting = False
                    self._num_waiting -= 1
                if isinstance(item, Exception):
                    done = True
                    raise item
                done = item.finished
                yield item
            done = True   # ended by an abort on the replica
        except self._ray.exceptions.RayActorError as exc:
            done = True
            if self._closed:
                raise EngineDeadError("engine shut down") from exc
            self._mark_dead(replica, exc)
            raise EngineRequestError(request_id, f"engine replica {replica.index} died") from exc
        finally:
            if waiting:
                self._num_waiting -= 1
            del self._owner[request_id]
            if replica is not None:
                replica.num_in_flight -= 1
                replica.request_ids.discard(request_id)
                if not done and replica.alive and not self._closed:
                    # No await here: this also runs while the caller's task is being cancelled.
                    replica.actor.abort.remote(request_id)

    async def _route(self, prompt: PromptType, lora_request: LoRARequest | None) -> Replica:
        """The live replica for the prompt (dp_router.choose_replica), counted as routed there. With prefix
        routing the replicas' block hashes are brought up to date first (a ValueError for a prompt that cannot
        be tokenized is the one the replica would raise)."""
        hashes: dict[bytes, list[int]] = {}
        if self.routing == "prefix":
            hashes = self._prompt_block_hashes(prompt, lora_request)
            if any(hashes.values()):
                await asyncio.gather(*(self._refresh_cached_blocks(replica) for replica in self._live_replicas()))
        live = self._live_replicas()
        if not live:
            raise self._no_replica_left()
        candidates = [RouteCandidate(replica.index, replica.num_in_flight, replica.num_routed,
                                     replica.cached_blocks.num_leading_held(hashes.get(replica.info.block_hash_root,
                                                                                       [])))
                      for replica in live]
        chosen, reason = choose_replica(candidates, self.balance_abs_threshold)
        replica = self.replicas[chosen.index]
        replica.num_routed += 1
        replica.routed[reason] += 1
        return replica

    def _prompt_block_hashes(self, prompt: PromptType, lora_request: LoRARequest | None) -> dict[bytes, list[int]]:
        """The prompt's block hashes in each live replica's chain (by root: one chain when they share it), under the
        key its engine caches it under: its salt, rope-length key and adapter (as LLMEngine.add_request keys it)."""
        _, token_ids = tokenize_prompt(prompt, self.tokenizer, self.model_config.vocab_size)
        extra_key = lora_cache_salt(prefix_cache_salt(cache_salt_of(prompt), self.model_config, len(token_ids),
                                                      self.max_model_len), lora_request)
        roots = {replica.info.block_hash_root for replica in self._live_replicas()}
        block_size = self.replicas[0].info.block_size
        return {root: prompt_block_hashes(token_ids, extra_key, block_size, root) for root in roots}

    async def _refresh_cached_blocks(self, replica: Replica) -> None:
        """Applies a block-hash report of the replica's that was asked for after this call began: one report is in
        flight at a time, and the callers that arrive meanwhile share the next one."""
        arrived = replica.reports_started
        async with replica.reporting:
            if replica.reports_applied > arrived or not replica.alive:
                return
            replica.reports_started += 1
            try:
                report = await replica.actor.block_hash_report.remote()
            except self._ray.exceptions.RayActorError as exc:
                self._mark_dead(replica, exc)
                return
            replica.cached_blocks.apply(report)
            replica.reports_applied = replica.reports_started

    async def abort(self, request_id: str) -> None:
        """Drops the request on its replica (freeing its blocks); its stream ends quietly."""
        replica = self._owner.get(request_id)
        if replica is None or not replica.alive or self._closed:
            return
        try:
            await replica.actor.abort.remote(request_id)
        except self._ray.exceptions.RayActorError as exc:
            self._mark_dead(replica, exc)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Adds the adapter on every live replica: usable once all have it. If one refuses it (ValueError, raised
        here with the reason), the replicas that took it drop it again."""
        live = self._live_replicas()
        results = await self._on_replicas(live, lambda actor: actor.add_lora.remote(lora_request))
        refusal = next((result for result in results.values() if isinstance(result, ValueError)), None)
        if refusal is not None:
            added = [replica for replica, result in results.items() if result is True]
            await self._on_replicas(added, lambda actor: actor.remove_lora.remote(lora_request.lora_int_id))
            raise refusal
        if not results:
            raise self._no_replica_left()
        self._loras[lora_request.lora_int_id] = lora_request
        return any(results.values())

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Removes the adapter from every live replica; False if none had it. While a replica still runs a
        request with it, LoRAInUseError, and the replicas that had dropped it take it back, so it stays whole."""
        live = self._live_replicas()
        results = await self._on_replicas(live, lambda actor: actor.remove_lora.remote(lora_int_id))
        in_use = next((result for result in results.values() if isinstance(result, LoRAInUseError)), None)
        if in_use is not None:
            removed = [replica for replica, result in results.items() if result is True]
            if lora_int_id in self._loras:
                await self._on_replicas(removed, lambda actor: actor.add_lora.remote(self._loras[lora_int_id]))
            raise in_use
        self._loras.pop(lora_int_id, None)
        return any(results.values())

    async def list_loras(self) -> set[int]:
        """The adapters every live replica holds."""
        results = await self._on_replicas(self._live_replicas(), lambda actor: actor.list_loras.remote())
        return set.intersection(*results.values()) if results else set()

    async def replica_stats(self) -> dict[int, ReplicaStats]:
        """Each live replica's own figures, by replica index."""
        results = await self._on_replicas(self._live_replicas(), lambda actor: actor.stats.remote())
        return {replica.index: stats for replica, stats in results.items()}

    async def _on_replicas(self, replicas: list[Replica], call: Callable) -> dict[Replica, object]:
        """call(actor) on each replica at once: their results, without the replicas found dead meanwhile. A result
        may be an exception object the replica returned (a refused adapter): it is a result like any other."""
        async def outcome(replica: Replica) -> tuple[bool, object]:
            try:
                return True, await call(replica.actor)
            except self._ray.exceptions.RayActorError as exc:
                return False, exc

        outcomes = await asyncio.gather(*(outcome(replica) for replica in replicas))
        results = {}
        for replica, (alive, result) in zip(replicas, outcomes):
            if alive:
                results[replica] = result
            else:
                self._mark_dead(replica, result)
        return results

    async def stats(self) -> EngineStats:
        """The live replicas' figures combined (see combine_stats), with each one's own and the router's choices."""
        stats = await self.replica_stats()
        if not stats:
            raise self._no_replica_left()
        per_replica = {index: replica.engine for index, replica in stats.items()}
        routed = {replica.index: dict(replica.routed) for replica in self.replicas}
        return dataclasses.replace(combine_stats(list(per_replica.values())),
                                   data_parallel=DataParallelStats(self.routing, per_replica, routed))

    async def shutdown(self) -> None:
        """Stops every replica (their in-flight requests raise EngineDeadError here), then the actors, their
        placement group and, if this front started it, Ray itself."""
        if self._closed:
            return
        self._closed = True
        self._dead = self._dead or EngineDeadError("engine shut down")
        live = self._live_replicas()
        await asyncio.gather(*(replica.actor.shutdown.remote() for replica in live), return_exceptions=True)
        for replica in self.replicas:
            self._ray.kill(replica.actor)
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(self._placement_group)
        if self._owns_ray:
            self._ray.shutdown()

    def _live_replicas(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.alive]

    def _mark_dead(self, replica: Replica, cause: BaseException) -> None:
        if not replica.alive:
            return
        replica.alive = False
        logger.error("engine replica %d (node %s) died: failing its %d in-flight requests; new requests go to the "
                     "%d replicas left (%s)", replica.index, replica.info.node_id[:12], len(replica.request_ids),
                     len(self._live_replicas()), cause)

    def _no_replica_left(self) -> EngineDeadError:
        self._dead = EngineDeadError(f"all {len(self.replicas)} engine replicas died")
        return self._dead
