"""Engine replicas placed on Ray: one placement group with a bundle per replica (a GPU per tensor-parallel rank
where the cluster has GPUs, an equal share of its CPUs), spread across the cluster's nodes where there are several,
each bundle holding one EngineReplica actor (engine/ray_replica.py). vLLM's CoreEngineActorManager does this for
its Ray data parallelism.

Ray is an optional extra (`pip install pagedllm[ray]`), imported only when data parallelism is used.
"""
from __future__ import annotations

import logging
import os

from pagedllm.config import EngineConfig
from pagedllm.engine.ray_replica import EngineReplica, ReplicaInfo

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_SECONDS = 600   # generous bound on placing, then on loading, every replica; then fail loudly


def import_ray():
    """Ray with usage statistics off (they would leave the machine); a clear error when not installed."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError as exc:
        raise ImportError("distributed_executor_backend 'ray' needs Ray: pip install 'pagedllm[ray]'") from exc
    return ray


def place_replicas(ray, config: EngineConfig) -> tuple[list, list[ReplicaInfo], object]:
    """Places data_parallel_size replica actors and waits until every one has loaded the model: (the actors, their
    infos, the placement group). On any failure the actors are killed and the group removed before it raises."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    size = config.data_parallel_size
    bundle = replica_bundle(config, ray.cluster_resources())
    group = placement_group([bundle] * size, strategy="SPREAD")
    try:
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"could not place {size} replicas of {bundle} in {PLACEMENT_TIMEOUT_SECONDS}s; "
                               f"the Ray cluster has {ray.available_resources()} free") from None
        actor_class = ray.remote(EngineReplica)
        actors = [actor_class.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote(config, int(bundle["CPU"])) for index in range(size)]
        try:
            infos = ray.get([actor.info.remote() for actor in actors], timeout=PLACEMENT_TIMEOUT_SECONDS)
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise
    except BaseException:
        remove_placement_group(group)
        raise
    logger.info("%d engine replicas on Ray, %s each, on nodes %s", size, bundle,
                ", ".join(info.node_id[:12] for info in infos))
    return actors, infos, group


def replica_bundle(config: EngineConfig, cluster_resources: dict[str, float]) -> dict[str, float]:
    """One replica's resources: a GPU per tensor parallel rank where the cluster has GPUs (and the device is
    not forced to cpu), and an equal share of the cluster's CPUs (at least one) for the torch threads."""
    size = config.data_parallel_size
    num_cpus = int(cluster_resources.get("CPU", 0))
    if num_cpus < size:
        raise ValueError(f"data_parallel_size ({size}) needs at least one CPU per replica; "
                         f"the Ray cluster has {num_cpus}")
    bundle = {"CPU": num_cpus // size}
    num_gpus = int(cluster_resources.get("GPU", 0))
    if num_gpus and config.device != "cpu":
        gpus = getattr(config, "tensor_parallel_size", 1)
        if num_gpus < size * gpus:
            raise ValueError(f"data_parallel_size ({size}) x tensor_parallel_size ({gpus}) needs {size * gpus} "
                             f"GPUs; the Ray cluster has {num_gpus}")
        bundle["GPU"] = gpus
    return bundle
