"""Scheduling through the engine on a real (tiny) model: tokens unchanged by preemption and chunking, batching,
abort, errors. The scheduler alone, without a model, is tested in test_scheduler.py."""
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.request import RequestStatus

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-scheduler"), "llama")


def make_llm(tiny_dir, **kwargs):
    options = dict(dtype="float32", kv_cache_memory="4MiB", block_size=16)
    return LLM(str(tiny_dir), **{**options, **kwargs})


def prompts(count, base_len=20):
    return [{"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(base_len + 9 * i)]} for i in range(count)]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_repeated_preemption_changes_no_token(tiny_dir):
    roomy = token_ids(make_llm(tiny_dir).generate(prompts(8), GREEDY, use_tqdm=False))
    # One block of 16 tokens here is 2 layers x K,V x 16 x 2 heads x 16 dims x 4 bytes = 8 KiB;
    # 12 blocks hold 192 tokens while the 8 requests need about 720 at their peak.
    tight = make_llm(tiny_dir, kv_cache_memory=12 * 8 * 1024)
    assert tight.llm_engine.kv_manager.pool.num_blocks == 12
    assert token_ids(tight.generate(prompts(8), GREEDY, use_tqdm=False)) == roomy
    assert tight.llm_engine.scheduler.num_preemptions >= 3
    assert tight.llm_engine.kv_manager.pool.num_used_blocks == 0


def test_chunked_prefill_matches_one_shot_and_keeps_decodes_going(tiny_dir):
    long_prompt = {"prompt_token_ids": [(i * 13) % 250 + 3 for i in range(300)]}
    one_shot = make_llm(tiny_dir).generate(long_prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(tiny_dir, max_num_batched_tokens=64)
    engine = llm.llm_engine
    engine.add_request("short", prompts(1)[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    engine.add_request("long", long_prompt, GREEDY)
    short = engine.parents["short"].children[0].request
    long = engine.parents["long"].children[0].request
    chunks = 0
    while long.num_output_tokens == 0:
        before = short.num_output_tokens
        engine.step()
        chunks += 1
        assert short.num_output_tokens == before + 1, "the decoding request must not stall"
    assert chunks >= 300 // 64
    while engine.has_unfinished_requests():
        engine.step()
    assert long.output_token_ids == one_shot


def test_new_request_gets_its_first_token_before_running_ones_finish(tiny_dir):
    engine = make_llm(tiny_dir).llm_engine
    for i, prompt in enumerate(prompts(3)):
        engine.add_request(f"old{i}", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(5):
        engine.step()
    engine.add_request("new", prompts(4)[3], GREEDY)
    first_token_step = None
    for step in range(1, 40):
        finished = {o.request_id for o in engine.step() if o.finished}
        new = engine.parents["new"].children[0].request
        if first_token_step is None and new.num_output_tokens:
            first_token_step = step
            assert not finished and all(f"old{i}" in engine.parents for i in range(3))
        if not engine.has_unfinished_requests():
            break
    assert first_token_step == 1


@pytest.mark.parametrize("where", ["waiting", "running", "preempted"])
def test_abort_frees_blocks_at_once(tiny_dir, where):
    llm = make_llm(tiny_dir, kv_cache_memory=12 * 8 * 1024, max_num_seqs=8 if where != "waiting" else 1)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts(4)):
        engine.add_request(str(i), prompt, GREEDY)
    target = None
    for _ in range(200):
        engine.step()
        states = {rid: p.children[0].request.status for rid, p in engine.parents.items()}
        wanted = {"waiting": RequestStatus.WAITING, "running": RequestStatus.RUNNING,
                  "preempted": RequestStatus.PREEMPTED}[where]
        target = next((rid for rid, status in states.items() if status is wanted), None)
        if target is not None:
            break
    assert target is not None, f"no request reached state {where}"
    request = engine.parents[target].children[0].request
    held = len(engine.kv_manager.block_tables.get(target, []))
    free_before = engine.kv_manager.pool.num_free_blocks
    engine.abort_request(target)
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert target not in engine.kv_manager.block_tables
    assert engine.kv_manager.pool.num_free_blocks == free_before + held
    assert request not in engine.scheduler.running and request not in engine.scheduler.waiting
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_requests_that_can_never_fit_are_refused_with_the_numbers(tiny_dir):
    llm = make_llm(tiny_dir, max_model_len=128, kv_cache_memory=4 * 8 * 1024)
    with pytest.raises(ValueError, match=r"prompt \(100 tokens\) \+ max_tokens \(40\) = 140 exceeds max_model_len \(128\)"):
        llm.generate({"prompt_token_ids": [5] * 100}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"= 100 tokens need more KV blocks than the whole cache has \(4 blocks"):
        llm.generate({"prompt_token_ids": [5] * 60}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_request_whose_processing_raises_fails_alone(tiny_dir, fail_request_at):
    llm = make_llm(tiny_dir)
    fail_request_at("bad", 3)
    engine = llm.llm_engine
    for rid, prompt in zip(("a", "bad", "b"), prompts(3)):
        engine.add_request(rid, prompt, GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert "injected failure" in finals["bad"].error
    assert all(len(finals[rid].outputs[0].token_ids) == 40 for rid in ("a", "b"))
    expected = token_ids(make_llm(tiny_dir).generate([prompts(3)[0], prompts(3)[2]], GREEDY, use_tqdm=False))
    assert [finals["a"].outputs[0].token_ids, finals["b"].outputs[0].token_ids] == expected
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_priority_policy_runs_the_most_urgent_first(tiny_dir):
    llm = make_llm(tiny_dir, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("later", prompts(1)[0], params, priority=5)
    engine.add_request("urgent", prompts(2)[1], params, priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "later"]


def test_without_chunked_prefill_a_prompt_is_prefilled_whole(tiny_dir):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_llm(tiny_dir, enable_chunked_prefill=False, max_num_batched_tokens=64)
    llm = make_llm(tiny_dir, enable_chunked_prefill=False, max_model_len=512, max_num_batched_tokens=512)
    engine = llm.llm_engine
    engine.add_request("long", {"prompt_token_ids": [3 + i % 250 for i in range(300)]}, GREEDY)
    engine.step()
    assert engine.last_step_stats.num_tokens == 300
