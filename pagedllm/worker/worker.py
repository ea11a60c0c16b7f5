"""Worker: one rank of the engine's model. It sets its share of the threads, builds its shard of the model
and its ModelRunner, joins the tensor-parallel group, and runs the methods the executor calls by name.

Rank 0 lives in the engine process; ranks 1.. run `run_worker_process` in spawned processes, idle on
their control pipe (never in a collective) between calls.
"""
from __future__ import annotations

import logging
import pickle
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from pagedllm.config import EngineConfig
from pagedllm.config.resolve import resolve_lora_dtype
from pagedllm.distributed.parallel_state import (SINGLE_PROCESS, TensorParallelGroup,
                                                 destroy_tensor_parallel_group, init_tensor_parallel_group)
from pagedllm.lora.layer import LoRAModel
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.worker_manager import LoRAWorkerManager
from pagedllm.model.cascade import CascadeRule
from pagedllm.model.cascade_timing import AttentionShape
from pagedllm.model.llama import CausalLM
from pagedllm.model.quantized_matmul import QuantizedMatmul
from pagedllm.model.loader import Checkpoint, load_checkpoint
from pagedllm.model.pooling_checkpoint import build_pooling_model
from pagedllm.model.tensor_parallel import weight_shards
from pagedllm.worker.cascade_choice import CascadeChoice, choose_cascade, why_not_possible
from pagedllm.worker.draft_model import DraftModelProposer
from pagedllm.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.kv_disk_store import DiskKVStore, open_kv_cache_dir
from pagedllm.worker.kv_swap import DiskSwapSpace, RamSwapSpace
from pagedllm.worker.model_runner import ModelRunner, kv_bytes_per_block
from pagedllm.worker.pooling_runner import PoolingModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    """What every rank needs to build its part of the engine, resolved once by the engine (picklable)."""
    engine_config: EngineConfig
    device: torch.device            # rank 0's; rank r on CUDA takes cuda:r
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    max_model_len: int
    num_blocks: int | None          # the same on every rank, so the scheduler's block ids hold everywhere;
                                    # None: allocated after a profile run (allocate_kv_caches)
    num_threads: int | None = None  # torch threads of this rank; None leaves the process's setting
    port: int | None = None         # the tensor-parallel group's rendezvous port on 127.0.0.1


class Worker:
    def __init__(self, args: WorkerArgs, rank: int = 0, checkpoint: Checkpoint | None = None):
        """checkpoint: the one the caller has opened already (rank 0); else it is opened here."""
        config = args.engine_config
        self.engine_config = config
        self.kv_disk_store: DiskKVStore | None = None   # opened by open_kv_disk_tier
        tp_size = config.tensor_parallel_size
        self.rank = rank
        self.previous_num_threads = torch.get_num_threads()   # restored at shutdown (rank 0 shares the process)
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        self.device = args.device
        if self.device.type == "cuda":
            self.device = torch.device("cuda", (self.device.index or 0) + rank)
            torch.cuda.set_device(self.device)
        self.port, self.joined = args.port, False
        self.group = TensorParallelGroup(rank, tp_size) if tp_size > 1 else SINGLE_PROCESS
        checkpoint = checkpoint or load_checkpoint(config.model, config.quantization, config.runner,
                                                   config.pooler_config, config.hf_overrides)
        weights = checkpoint.weights
        if tp_size > 1:   # read as this rank's parts, each cut as it is read
            weights = weights.sharded(weight_shards(checkpoint.config, rank, tp_size))
        # The runner kind follows the checkpoint, chosen once when it was loaded.
        if checkpoint.pooling is None:
            matmul = QuantizedMatmul(config.activation_dtype, config.batch_invariant, self.device)
            model, runner_class = CausalLM(checkpoint.config, weights, args.dtype, self.device, args.max_model_len,
                                           self.group, matmul=matmul), ModelRunner
        else:
            model, runner_class = build_pooling_model(checkpoint.config, checkpoint.pooling, weights, args.dtype,
                                                      self.device, args.max_model_len), PoolingModelRunner
        del checkpoint, weights
        runner_kwargs = {"lora": self._lora(model, args)} if config.lora_config is not None else {}
        self.model_runner = runner_class(model, args.num_blocks, config.block_size, args.kv_cache_dtype,
                                        self.device, config.seed, args.max_model_len, config.max_num_seqs,
                                        attention_backend=config.attention_backend, dtype=args.dtype,
                                        drafter=self._drafter(args), **runner_kwargs)

    def _drafter(self, args: WorkerArgs) -> DraftModelProposer | None:
        """The draft model and its KV pool, for draft_model speculation (tensor parallel size 1 only)."""
        spec = args.engine_config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        if args.num_blocks is None:
            raise ValueError("draft_model speculation needs kv_cache_memory set: the KV pool is not sized by a "
                             "profile run when a draft model shares it")
        checkpoint = load_checkpoint(spec.model, spec.quantization)
        matmul = QuantizedMatmul(batch_invariant=args.engine_config.batch_invariant, device=self.device)
        model = CausalLM(checkpoint.config, checkpoint.weights, args.dtype, self.device, args.max_model_len,
                         matmul=matmul)
        return DraftModelProposer(model, args.num_blocks, args.engine_config.block_size, args.kv_cache_dtype,
                                  self.device)

    def _lora(self, model: CausalLM, args: WorkerArgs) -> LoRAWorkerManager:
        """Wraps the model's projections for LoRA and makes the manager of this rank's adapters."""
        lora_config = args.engine_config.lora_config
        dtype = resolve_lora_dtype(lora_config.lora_dtype, args.engine_config.dtype, args.dtype, self.device)
        lora_model = LoRAModel(model, model.config, lora_config.max_loras, lora_config.max_lora_rank, dtype, self.device,
                               self.rank, self.group.world_size)
        return LoRAWorkerManager(lora_model, lora_config)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.model_runner.lora.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_runner.lora.remove(lora_id)

    def list_loras(self) -> set[int]:
        return self.model_runner.lora.list()

    def init_distributed(self) -> None:
        """Joins the tensor-parallel group, once every rank has built its model (so a rank that fails to
        load is reported from its pipe, not met as a rendezvous that never completes)."""
        if self.group.world_size > 1:
            init_tensor_parallel_group(self.group, self.port, self.device)
            self.joined = True

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on this rank's runner: every rank applies the same plain step data to its own batch;
        only rank 0 samples, so only its result matters."""
        return self.model_runner.execute_model(scheduler_output)

    def choose_cascade_attention(self) -> CascadeChoice:
        """enable_cascade_attention resolved for this rank's runner (auto times the kernels here: called on rank 0
        alone, while the other ranks wait, and its rule handed to every rank with use_cascade_rule)."""
        runner, config = self.model_runner, self.engine_config
        model = runner.model
        impossible = why_not_possible(runner.attention_backend.uses_cpu_kernels, runner.attention_backend.name,
                                      not isinstance(runner, PoolingModelRunner),
                                      sum(layer.sliding_window is None for layer in model.attention_layers))
        shape = AttentionShape(model.config.num_attention_heads // self.group.world_size, model.num_kv_heads,
                               model.config.head_dim, runner.dtype, runner.kv_cache_dtype, runner.block_size)
        return choose_cascade(config.enable_cascade_attention, config.batch_invariant, impossible, shape)

    def use_cascade_rule(self, rule: CascadeRule | None) -> None:
        self.model_runner.cascade_rule = rule

    def profile_run(self, num_tokens: int, num_seqs: int) -> int:
        return self.model_runner.profile_run(num_tokens, num_seqs)

    def allocate_kv_caches(self, num_blocks: int) -> None:
        self.model_runner.allocate_kv_caches(num_blocks)

    def open_kv_disk_tier(self, identity: dict) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """Opens --kv-cache-dir for this identity; returns its root hash and the blocks it holds (LRU first)."""
        config = self.model_runner.model.config
        root_hash = open_kv_cache_dir(self.engine_config.kv_cache_dir, identity)
        payload = kv_bytes_per_block(config, self.engine_config.block_size, self.model_runner.kv_cache_dtype)
        # Read ahead at most a pool's worth of blocks: more could not be loaded before the first were used.
        num_blocks = self.model_runner.kv_caches[0][0].data.shape[0]
        store = DiskKVStore(self.engine_config.kv_cache_dir, payload, read_ahead_blocks=num_blocks)
        self.kv_disk_store = self.model_runner.kv_disk_store = store
        return root_hash, store.list_blocks()

    def open_kv_swap_space(self) -> None:
        """Where swapped-out blocks go: the disk tier's directory if it is open, else host RAM."""
        runner = self.model_runner
        runner.kv_swap_space = DiskSwapSpace(self.kv_disk_store) if self.kv_disk_store is not None else RamSwapSpace()

    def flush_kv_disk_tier(self) -> None:
        """Waits until every queued block write and delete is on disk."""
        if self.kv_disk_store is not None:
            self.kv_disk_store.flush()

    def kv_disk_bytes_moved(self) -> tuple[int, int, int]:
        """(bytes read, bytes written, stale files removed at start-up) by the disk tier."""
        store = self.kv_disk_store
        return (store.bytes_read, store.bytes_written, store.stale_files_removed) if store is not None else (0, 0, 0)

    def check_health(self) -> None:
        """Answering at all is the check: a rank that can run this is alive and idle."""

    def shutdown(self) -> None:
        torch.set_num_threads(self.previous_num_threads)
        if self.kv_disk_store is not None:
            self.kv_disk_store.close()
            self.kv_disk_store = self.model_runner.kv_disk_store = self.model_runner.kv_swap_space = None
        if self.joined:
            destroy_tensor_parallel_group()
            self.joined = False


def run_worker_process(args: WorkerArgs, rank: int, conn: Connection) -> None:
    """A spawned rank's life: build the worker, say "ready", then run (method, args, kwargs) calls from the
    pipe, answering (None, None) or (None, error text), until told to stop (None) or the engine's end of the
    pipe closes. A failed call ends the process: its peers' collectives then fail on the closed sockets
    instead of waiting for it."""
    try:
        worker = Worker(args, rank)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            call = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):   # the engine process is gone
            break
        if call is None:
            break
        method, method_args, method_kwargs = call
        try:
            getattr(worker, method)(*method_args, **method_kwargs)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return
        conn.send(("done", None))
    worker.shutdown()
