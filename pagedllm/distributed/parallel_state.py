"""One tensor-parallel group: which rank this process is, and the collectives the model calls.

The group is an object handed to the model rather than module state, so an engine without tensor
parallelism (the SINGLE_PROCESS group) can live in the same process as rank 0 of one with it.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A hung (not dead) peer fails a collective after this long; a dead peer closes its sockets and
# fails it at once. Generous, as one prefill step of a large model may take minutes on a CPU.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def get_open_port() -> int:
    """A free TCP port on the loopback interface, for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's tensor, in place."""
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's tensor joined along dim, on rank 0; None on the other ranks."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.is_first_rank else None
        dist.gather(tensor, parts, dst=0)
        return torch.cat(parts, dim=dim) if self.is_first_rank else None


SINGLE_PROCESS = TensorParallelGroup(rank=0, world_size=1)


def init_tensor_parallel_group(group: TensorParallelGroup, port: int, device: torch.device) -> None:
    """Joins `group`'s process group, which rendezvouses on 127.0.0.1:port (gloo on CPU, NCCL on CUDA);
    blocks until every rank has joined. One per process: it is torch.distributed's default group."""
    if dist.is_initialized():
        raise RuntimeError("this process already holds a tensor-parallel group (one engine with "
                           "tensor_parallel_size > 1 per process); shut the other engine down first")
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=group.rank,
                            world_size=group.world_size, timeout=COLLECTIVE_TIMEOUT)
    logger.debug("rank %d of %d joined the %s group on port %d", group.rank, group.world_size,
                 dist.get_backend(), port)


def destroy_tensor_parallel_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
