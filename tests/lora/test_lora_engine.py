"""The LoRA engine contract: adapters loaded, listed, evicted (LRU) and removed; bad adapters refused with the reason;
requests with an adapter refused where LoRA is off; the scheduler's max_loras; prefix-cache isolation."""
import json
import logging

import pytest
import torch

from tests.lora.peft_adapters import ATTENTION, make_adapter
from pagedllm import LLM, SamplingParams
from pagedllm.config.resolve import resolve_lora_dtype
from pagedllm.lora.request import LoRAInUseError, LoRARequest

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def base(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-base"), "llama3")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return [make_adapter(base, folder / f"adapter-{seed}", rank=8, targets="all-linear", seed=seed)
            for seed in range(3)]


@pytest.fixture(scope="module")
def llm(base):
    return LLM(str(base), dtype="float32", kv_cache_memory="8MiB", enable_lora=True, max_loras=1, max_cpu_loras=2)


def prompt(seed: int, length: int = 20) -> dict:
    return {"prompt_token_ids": torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()}


def test_lru_of_max_cpu_loras_evicts_the_least_recently_used(llm, adapters):
    for lora_id in list(llm.list_loras()):
        llm.remove_lora(lora_id)
    first, second, third = (LoRARequest(f"a{i}", 10 + i, str(path)) for i, path in enumerate(adapters))
    assert llm.add_lora(first) and llm.add_lora(second)
    assert not llm.add_lora(first)   # loaded already: now the most recently used
    assert llm.list_loras() == {10, 11}
    assert llm.add_lora(third)
    assert llm.list_loras() == {10, 12}   # 11 was the least recently used
    llm.generate(prompt(0), GREEDY, use_tqdm=False, lora_request=second)   # loaded again on use, evicting 10
    assert llm.list_loras() == {11, 12}


def test_an_adapter_evicted_between_two_steps_of_the_same_rows_is_loaded_again(llm, adapters):
    """A step whose rows name the same adapters as the last step's keeps its row grouping, unless an adapter was
    dropped in between: here the adapter's last step and the next one are both one row of it, and it is evicted
    (its slot emptied) in between."""
    for lora_id in list(llm.list_loras()):
        llm.remove_lora(lora_id)
    first, second, third = (LoRARequest(f"e{i}", 40 + i, str(path)) for i, path in enumerate(adapters))
    one_token = {"prompt_token_ids": [7]}
    base = llm.generate(one_token, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    alone = llm.generate(one_token, GREEDY, use_tqdm=False, lora_request=first)[0].outputs[0].token_ids
    assert alone != base
    assert llm.add_lora(second) and llm.add_lora(third)
    assert 40 not in llm.list_loras()
    again = llm.generate(one_token, GREEDY, use_tqdm=False, lora_request=first)[0].outputs[0].token_ids
    assert again == alone
    for lora_id in list(llm.list_loras()):
        llm.remove_lora(lora_id)


def test_remove_lora_refuses_while_in_use_and_reports_unknown(llm, adapters):
    engine = llm.llm_engine
    lora = LoRARequest("busy", 20, str(adapters[0]))
    engine.add_request("busy-1", prompt(1), GREEDY, lora_request=lora)
    with pytest.raises(LoRAInUseError, match="in use by 1 unfinished request"):
        engine.remove_lora(20)
    engine.abort_request("busy-1")
    assert engine.remove_lora(20)
    assert 20 not in engine.list_loras()
    assert not engine.remove_lora(20)


def test_a_request_with_an_adapter_is_refused_without_enable_lora(base, adapters):
    plain = LLM(str(base), dtype="float32", kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="lora_request names an adapter, but this engine runs without LoRA"):
        plain.generate(prompt(0), GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters[0])))
    with pytest.raises(ValueError, match="enable_lora"):
        plain.llm_engine.add_lora(LoRARequest("a", 1, str(adapters[0])))


def test_draft_model_speculation_with_lora_is_refused_at_start_up(base):
    with pytest.raises(ValueError, match="'draft_model' does not run with enable_lora"):
        LLM(str(base), enable_lora=True, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                              "model": str(base)})


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


BAD_ADAPTERS = {
    # name: (how the folder is made from a good one, part of the error)
    "missing folder": (lambda folder: folder / "nowhere", "is not a directory"),
    "missing config": (lambda folder: (folder / "adapter_config.json").unlink() or folder, "adapter_config.json is missing"),
    "missing weights": (lambda folder: (folder / "adapter_model.safetensors").unlink() or folder,
                        "neither adapter_model.safetensors nor adapter_model.bin"),
    "DoRA": (lambda folder: _edit_config(folder, use_dora=True) or folder, "use_dora \\(DoRA\\) is not supported"),
    "bias": (lambda folder: _edit_config(folder, bias="all") or folder, "bias must be 'none', got 'all'"),
    "modules_to_save": (lambda folder: _edit_config(folder, modules_to_save=["lm_head"]) or folder,
                        "modules_to_save .* is not supported"),
    "unsupported target": (lambda folder: _edit_config(folder, target_modules=["q_proj", "embed_tokens"]) or folder,
                           "targets unsupported module\\(s\\) embed_tokens"),
}


@pytest.mark.parametrize("kind", BAD_ADAPTERS)
def test_bad_adapters_are_refused_with_the_reason(kind, llm, base, tmp_path):
    make_folder, reason = BAD_ADAPTERS[kind]
    folder = make_folder(make_adapter(base, tmp_path / "adapter", rank=8, targets=ATTENTION))
    with pytest.raises(ValueError, match=reason):
        llm.llm_engine.add_lora(LoRARequest("bad", 30, str(folder)))
    with pytest.raises(ValueError, match=reason):   # also when a request names it first
        llm.generate(prompt(0), GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 31, str(folder)))
    assert 30 not in llm.list_loras() and 31 not in llm.list_loras()


def test_an_adapter_saved_as_bin_runs_as_its_safetensors_copy(llm, base, tmp_path):
    made = [make_adapter(base, tmp_path / kind, rank=8, seed=5, safe_serialization=kind == "safetensors")
            for kind in ("safetensors", "bin")]
    assert (made[1] / "adapter_model.bin").is_file() and not (made[1] / "adapter_model.safetensors").exists()
    outputs = [llm.generate(prompt(3), GREEDY, use_tqdm=False, lora_request=LoRARequest(f"f{i}", 70 + i, str(path)))
               for i, path in enumerate(made)]
    assert outputs[0][0].outputs[0].token_ids == outputs[1][0].outputs[0].token_ids


def test_adapters_of_another_base_or_too_large_are_refused(llm, make_tiny_model_dir, base, tmp_path):
    wider = make_tiny_model_dir(tmp_path, "llama3", hidden_size=32)
    with pytest.raises(ValueError, match="does not fit this base model: model.layers.0.self_attn.k_proj lora_A is "
                                         "\\[8, 32\\] and lora_B \\[16, 8\\], the base needs \\[r, 64\\] and \\[32, r\\]"):
        llm.llm_engine.add_lora(LoRARequest("wider", 40, str(make_adapter(wider, tmp_path / "wider", rank=8))))
    with pytest.raises(ValueError, match="has rank 32 at model.layers.0.self_attn.k_proj, over max_lora_rank 16"):
        llm.llm_engine.add_lora(LoRARequest("big", 41, str(make_adapter(base, tmp_path / "big", rank=32))))
    with pytest.raises(ValueError, match="lm_head"):   # an embedding / lm_head LoRA is refused from its weights too
        llm.llm_engine.add_lora(LoRARequest("head", 42, str(make_adapter(base, tmp_path / "head", rank=8,
                                                                        targets=["q_proj", "lm_head"]))))


def test_max_loras_1_runs_one_adapter_per_step_and_both_finish(llm, adapters):
    steps = []
    engine = llm.llm_engine
    engine.step_listeners.append(steps.append)
    try:
        loras = [LoRARequest(f"s{i}", 50 + i, str(path)) for i, path in enumerate(adapters[:2])]
        prompts = [prompt(seed) for seed in range(4)]
        together = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[loras[0], loras[1], loras[0], None])
    finally:
        engine.step_listeners.remove(steps.append)
    assert max(step.num_loras for step in steps) == 1
    alone = [llm.generate(p, GREEDY, use_tqdm=False, lora_request=lora)[0]
             for p, lora in zip(prompts, [loras[0], loras[1], loras[0], None])]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_prefix_cache_hits_within_an_adapter_never_across(llm, adapters):
    engine = llm.llm_engine
    first, second = (LoRARequest(f"p{i}", 60 + i, str(path)) for i, path in enumerate(adapters[:2]))
    shared = prompt(99, length=50)   # three full blocks of 16

    def hits_after(lora_request) -> int:
        before = engine.stats().kv_cache.prefix_cache_hits
        llm.generate(shared, GREEDY, use_tqdm=False, lora_request=lora_request)
        return engine.stats().kv_cache.prefix_cache_hits - before

    assert hits_after(first) == 0
    assert hits_after(first) == 48   # its own blocks: all three full ones
    assert hits_after(second) == 0   # another adapter's KV differs for the same tokens
    assert hits_after(None) == 0     # and the base model's
    assert hits_after(second) == 48


@pytest.mark.parametrize("lora_dtype, dtype, model_dtype, device, expected", [
    ("auto", "auto", torch.float32, "cpu", torch.bfloat16),       # float32 chosen for speed: adapters in bfloat16
    ("auto", "float32", torch.float32, "cpu", torch.float32),     # float32 asked for: adapters keep it
    ("auto", "auto", torch.bfloat16, "cpu", torch.bfloat16),
    ("auto", "auto", torch.float32, "cuda", torch.float32),       # CUDA's auto is the checkpoint's own dtype
    ("float32", "auto", torch.float32, "cpu", torch.float32),     # named: as named
])
def test_lora_dtype_auto_follows_the_model_unless_the_engine_chose_float32(lora_dtype, dtype, model_dtype, device,
                                                                           expected):
    assert resolve_lora_dtype(lora_dtype, dtype, model_dtype, torch.device(device)) == expected


def test_the_start_up_log_names_the_dtype_the_adapters_are_held_in(base, caplog):
    """lora_dtype auto resolves per engine (bfloat16 where the engine chose float32 on a CPU): the log says what the
    workers hold, read here from the worker's LoRA model, and what was asked."""
    caplog.set_level(logging.INFO, logger="pagedllm.engine.lora_adapters")
    auto = LLM(str(base), kv_cache_memory="8MiB", enable_lora=True)
    held = str(auto.llm_engine.runner.lora.lora_model.dtype).removeprefix("torch.")
    assert f"adapters in {held} (lora_dtype auto)" in caplog.text
