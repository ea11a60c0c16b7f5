"""The scheduler's choice for a step written as the plain data the workers apply (pagedllm/step.py): a request
they do not hold comes whole, a running one as what it gained since its last step (vLLM v1's new and cached
request data)."""
from __future__ import annotations

from collections.abc import Callable

from pagedllm.engine.request import Request
from pagedllm.kv.manager import KVCacheManager
from pagedllm.step import CachedRequestData, NewRequestData, SchedulerOutput


def describe_scheduled(scheduled: list[tuple[Request, int]], out: SchedulerOutput, kv: KVCacheManager,
                       on_prefill_done: Callable[[Request, int, SchedulerOutput], None] | None = None) -> None:
    """Fills the step's requests, token counts, block copies and disk work. on_prefill_done(request, num_new,
    out) runs for each request whose KV reaches its last token in this step, right after its own entry (the
    scheduler forks parallel samples there, so they follow their first sample in the workers' batch)."""
    block_table = kv.get_block_table
    rewritten = kv.take_rewritten_entries()   # copy on write or a rollback changed these requests' tables
    cached: CachedRequestData = out.scheduled_cached_reqs
    add_decode_id, add_decode_token = cached.decode_request_ids.append, cached.decode_token_ids.append
    add_id, add_tokens = cached.request_ids.append, cached.new_token_ids.append
    add_start, add_blocks = cached.block_table_starts.append, cached.new_block_ids.append
    add_computed = cached.num_computed_tokens.append
    num_scheduled = out.num_scheduled_tokens
    for request, num_new in scheduled:
        request_id = request.request_id
        table = block_table(request_id)
        tokens = request.all_token_ids
        num_tokens, num_blocks = len(tokens), len(table)
        sent = request.worker_num_tokens
        if not sent:
            out.scheduled_new_reqs.append(new_request_data(request, table))
        elif is_plain_decode(request, num_tokens, num_blocks, rewritten):   # its id and its token
            add_decode_id(request_id)
            add_decode_token(tokens[-1])
        else:
            start = request.worker_num_blocks
            if rewritten and request_id in rewritten:
                start = min(start, rewritten[request_id])
            add_id(request_id)
            add_tokens(tokens[sent:])
            add_start(start)
            add_blocks(table[start:])
            add_computed(request.num_computed_tokens)
        request.worker_num_tokens, request.worker_num_blocks = num_tokens, num_blocks
        num_scheduled[request_id] = num_new
        if on_prefill_done is not None and request.num_computed_tokens + num_new == num_tokens:
            on_prefill_done(request, num_new, out)
    out.total_num_scheduled_tokens = sum(num_scheduled.values())
    out.block_copies = kv.take_block_copies()
    out.disk_work = kv.tiers.take_work()


def is_plain_decode(request: Request, num_tokens: int, num_blocks: int, rewritten: dict[str, int]) -> bool:
    """One token since its last step, the workers hold all before it, its table unchanged: the step sends
    only its id and its token."""
    sent = request.worker_num_tokens
    return (bool(sent) and sent == num_tokens - 1 == request.num_computed_tokens
            and num_blocks == request.worker_num_blocks and request.request_id not in rewritten)


def new_request_data(request: Request, table: list[int], sample_with: str | None = None) -> NewRequestData:
    """A request the workers do not hold, whole; sample_with: the request whose logits row it samples from."""
    return NewRequestData(request.request_id, list(request.all_token_ids), request.num_prompt_tokens,
                          request.sampling_params, request.eos_token_ids, list(table),
                          request.num_computed_tokens, sample_with, request.lora_request)
