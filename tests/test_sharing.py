"""KV block sharing: parallel sampling forks, copy-on-write, beam search, prefix caching."""
import math

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.worker.model_runner import kv_bytes_per_block


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-sharing"), "llama")


def run_to_completion(engine):
    """Steps the engine until idle; returns per-step (tokens computed, KV usage) pairs."""
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append((engine.last_step_stats.num_tokens, engine.kv_manager.usage()))
    return steps


def test_parallel_samples_share_one_prefill_and_copy_only_the_partial_block(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8)
    engine = llm.llm_engine
    copies = []
    take = engine.kv_manager.take_block_copies
    engine.kv_manager.take_block_copies = lambda: copies.extend(c := take()) or c
    prompt = list(range(10, 31))       # 21 tokens: 2 full blocks + 5 tokens in a partial one
    n, max_tokens = 4, 12
    engine.add_request("p", {"prompt_token_ids": prompt},
                       SamplingParams(n=n, temperature=1.0, seed=5, max_tokens=max_tokens, ignore_eos=True))
    steps = run_to_completion(engine)
    # One prefill of the prompt, then each child computes every token it sampled except the last.
    assert sum(tokens for tokens, _ in steps) == len(prompt) + n * (max_tokens - 1)
    assert steps[0][0] == len(prompt)
    # While all four decode: the 2 full prompt blocks are shared, each child has its own third block.
    _, usage = steps[1]
    assert usage.num_shared_blocks == 2
    assert usage.num_logical_blocks == n * 3 and usage.num_used_blocks == 2 + n
    # Copy-on-write: the shared partial block was copied for n - 1 children (the last writes in place).
    assert len(copies) == n - 1 and len({src for src, _ in copies}) == 1
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_parallel_samples_equal_each_sample_run_alone(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8)
    prompt = {"prompt_token_ids": list(range(40, 61))}
    together = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10,
                                                   ignore_eos=True), use_tqdm=False)[0].outputs
    for child in together:
        alone = llm.generate(prompt, SamplingParams(temperature=1.0, seed=11 + child.index, max_tokens=10,
                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert child.token_ids == alone.token_ids


def test_prefix_cache_skips_the_common_prefix_and_changes_nothing(tiny_dir):
    block_size = 8
    common = list(range(100, 150))                       # 50 tokens: 6 full blocks
    first, second = common + [7, 8, 9], common + [3, 4]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cached = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=block_size)
    engine = cached.llm_engine
    cached.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    engine.add_request("second", {"prompt_token_ids": second}, params)
    engine.step()
    hit = (len(common) // block_size) * block_size
    assert engine.last_step_stats.num_tokens == len(second) - hit
    run_to_completion(engine)
    usage = engine.kv_manager.usage()
    assert usage.prefix_cache_hits == hit
    assert usage.prefix_cache_queries == len(first) + len(second)
    with_cache = cached.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0].outputs[0].token_ids
    plain = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=block_size,
                enable_prefix_caching=False)
    without = plain.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert with_cache == without


def test_identical_prompt_recomputes_only_its_last_token(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8)
    prompt = {"prompt_token_ids": list(range(60, 92))}     # exactly 4 blocks
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request("again", prompt, params)
    engine.step()
    assert engine.last_step_stats.num_tokens == 8   # the last block is recomputed, for its last token
    run_to_completion(engine)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == first


def test_cache_salt_shares_blocks_only_within_a_salt(tiny_dir):
    """vLLM's prompt key: the same prompt under another salt computes everything again (no hit), under
    the same salt only its last token; outputs are the same either way."""
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = list(range(60, 92))                           # exactly 4 blocks
    answers = []
    for request_id, salt, computed in (("first", "alice", 32), ("intruder", "bob", 32), ("unsalted", None, 32),
                                       ("again", "alice", 8)):
        prompt = {"prompt_token_ids": tokens} | ({"cache_salt": salt} if salt else {})
        hits_before = engine.kv_manager.prefix_cache_hits
        engine.add_request(request_id, prompt, params)
        engine.step()
        assert engine.last_step_stats.num_tokens == computed, request_id
        assert engine.kv_manager.prefix_cache_hits - hits_before == 32 - computed
        answers.append(final_token_ids(engine))
    assert all(answer == answers[0] for answer in answers)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt_token_ids": tokens, "cache_salt": ""}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt keys must be among cache_pins, cache_salt, prompt, prompt_token_ids"):
        llm.generate({"prompt_token_ids": tokens, "cache_salts": "x"}, params, use_tqdm=False)


def final_token_ids(engine) -> list[int]:
    """Steps the engine until idle; the output token ids of the one request that finished."""
    (finished,) = [output for _ in iter(engine.has_unfinished_requests, False) for output in engine.step()
                   if output.finished]
    return finished.outputs[0].token_ids


def test_stats_are_derived_from_the_pool(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": list(range(10, 30))},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    kv = llm.stats().kv_cache
    assert kv.num_used_blocks == math.ceil(20 / 8)
    assert kv.num_tokens_stored == 20
    assert kv.utilization == pytest.approx(20 / 24)
    assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
    run_to_completion(engine)
    kv = llm.stats().kv_cache
    assert kv.num_used_blocks == 0 and kv.num_cached_idle_blocks == 20 // 8


# transformers' beam search and ours coincide when no beam can end early: EOS is not a stop
# (ignore_eos here, eos_token_id=None there), so every beam runs to max_tokens, all finished
# beams have the same length, and length_penalty / early_stopping cannot reorder them.
@pytest.fixture(scope="module")
def bundled(bundled_reference):
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory="128MiB")   # the float path: exact
    bundled_reference.generation_config.eos_token_id = None
    return llm, bundled_reference


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers(bundled, width):
    llm, reference = bundled
    tokenizer = llm.get_tokenizer()
    texts = ["The best way to learn programming is", "Once upon a time", "Paged memory"]
    prompts = [tokenizer.encode(text) for text in texts]
    max_tokens = 12
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True, length_penalty=0.7)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        expected = reference.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                      max_new_tokens=max_tokens, do_sample=False, length_penalty=0.7,
                                      early_stopping=True, pad_token_id=0, output_scores=True,
                                      return_dict_in_generate=True)
        assert [seq.output_token_ids for seq in output.sequences] == \
            [row[len(prompt):].tolist() for row in expected.sequences]
        ours = torch.tensor([seq.cum_logprob / max_tokens ** 0.7 for seq in output.sequences])
        # a sum of max_tokens log-probabilities, each within the suite's 1e-4, then divided by the penalty
        atol = max_tokens * 1e-4 / max_tokens ** 0.7
        torch.testing.assert_close(ours, expected.sequences_scores.float(), atol=atol, rtol=0)
        assert all(seq.text == tokenizer.decode(seq.output_token_ids) for seq in output.sequences)
    assert llm.stats().kv_cache.num_used_blocks == 0


def test_beam_search_in_a_cache_too_small_for_all_its_beams_still_ends_with_the_same_beams(bundled):
    """Three blocks of 8 tokens hold one 24-token beam, not two: beams are preempted, and a beam that waits
    for a preempted sibling makes way for it instead of holding its blocks for ever."""
    roomy, _ = bundled
    per_block = kv_bytes_per_block(roomy.llm_engine.model_config, 8, torch.float32)
    small = LLM(dtype="float32", quantization="none", block_size=8, kv_cache_memory=3 * per_block, max_model_len=24)
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}
    params = BeamSearchParams(beam_width=2, max_tokens=17, ignore_eos=True)
    beams = [sequence.output_token_ids for sequence in small.beam_search(prompt, params)[0].sequences]
    assert beams == [sequence.output_token_ids for sequence in roomy.beam_search(prompt, params)[0].sequences]
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert small.stats().kv_cache.num_used_blocks == 0


def test_beams_share_blocks_and_dropped_beams_free_theirs(bundled):
    llm, _ = bundled
    engine = llm.llm_engine
    peak = {"used": 0, "logical": 0}
    step = engine.step

    def observed_step():
        result = step()
        usage = engine.kv_manager.usage()
        if usage.num_logical_blocks > peak["logical"]:
            peak.update(used=usage.num_used_blocks, logical=usage.num_logical_blocks)
        return result

    engine.step = observed_step
    try:
        prompt = llm.get_tokenizer().encode("Write a long story about a lighthouse keeper. " * 8)
        llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=4, max_tokens=20))
    finally:
        del engine.step
    assert peak["used"] < peak["logical"] / 2    # 4 beams over a long shared prompt
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_a_beam_search_is_an_ordinary_engine_request_beside_sampled_ones(bundled):
    """Beams are engine requests: while a search runs the engine has unfinished requests, other requests step
    in the same batches, and each result equals the one it gets alone."""
    llm, _ = bundled
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    beam_prompt = {"prompt_token_ids": tokenizer.encode("The best way to learn programming is")}
    plain_prompt = {"prompt_token_ids": tokenizer.encode("Once upon a time")}
    beams, greedy = BeamSearchParams(beam_width=3, max_tokens=12), SamplingParams(temperature=0, max_tokens=20)
    alone_beams = [sequence.output_token_ids for sequence in llm.beam_search(beam_prompt, beams)[0].sequences]
    alone_plain = llm.generate(plain_prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("beams", beam_prompt, beams)
    engine.add_request("plain", plain_prompt, greedy)
    finished, shared_steps = {}, 0
    while "beams" not in finished:
        assert engine.has_unfinished_requests()
        plain_running = "plain" in engine.parents
        finished.update((output.request_id, output) for output in engine.step() if output.finished)
        shared_steps += plain_running and engine.last_step_stats.num_seqs > 1
    while engine.has_unfinished_requests():
        finished.update((output.request_id, output) for output in engine.step() if output.finished)
    assert [beam.token_ids for beam in finished["beams"].outputs] == alone_beams
    assert finished["plain"].outputs[0].token_ids == alone_plain
    assert shared_steps >= 10 and engine.kv_manager.pool.num_used_blocks == 0
