"""Structured outputs offline: every output checked by an independent reference (jsonschema, re), the
grammar state's token API, the compile cache, and a request that waits for its grammar without
holding the batch (the scheduler with a grammar that has not compiled yet)."""
from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv.manager import KVCacheManager
from pagedllm.step import ModelRunnerOutput
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.request_grammar import RequestGrammar, allocate_bitmask

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "age"]}
CHAT = [{"role": "user", "content": "Describe a person."}]


# float32: the exact path, so a plain row's tokens cannot depend on the batch through rounding.
LLM_SETTINGS = dict(dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)


def _texts(llm, params_list):
    outputs = llm.chat([CHAT] * len(params_list), params_list, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


def _so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def test_params_need_exactly_one_valid_spec():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object, got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "string"}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs json is not a valid JSON schema: .*objec"):
        StructuredOutputsParams(json={"type": "objec"})
    with pytest.raises(ValueError, match="structured_outputs json must be a JSON schema, got text that is not"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs regex is not a valid regular expression"):
        StructuredOutputsParams(regex="a(b")
    with pytest.raises(ValueError, match="structured_outputs grammar is not a valid EBNF grammar: .*foo"):
        StructuredOutputsParams(grammar="root ::= foo")
    with pytest.raises(ValueError, match="structured_outputs choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_every_kind_matches_its_spec_greedy_and_sampled(llm):
    grammar = 'root ::= "colour: " ("red" | "green" | "blue") ", size: " [0-9] [0-9]?'
    cases = [
        _so(json=PERSON), _so(json=json.dumps(PERSON)), _so(regex=r"[0-9]{3}-[a-z]{2,4}"),
        _so(choice=["yes", "no", "maybe so"]), _so(grammar=grammar), _so(json_object=True),
    ]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=7, max_tokens=200, structured_outputs=so)
                  for so in cases]
        (person, person2, code, choice, ebnf, anything) = _texts(llm, params)
        for text, reason in (person, person2):
            assert reason == "stop"
            jsonschema.validate(json.loads(text), PERSON)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", code[0]) and code[1] == "stop"
        assert choice[0] in ("yes", "no", "maybe so")
        assert re.fullmatch(r"colour: (red|green|blue), size: [0-9][0-9]?", ebnf[0]), ebnf
        if anything[1] == "stop":   # a long free-form object may run into max_tokens
            assert isinstance(json.loads(anything[0]), dict)


def test_max_tokens_mid_structure_is_length(llm):
    [(text, reason)] = _texts(llm, [SamplingParams(temperature=0, max_tokens=4, structured_outputs=_so(json=PERSON))])
    assert reason == "length"
    with pytest.raises(ValueError):
        json.loads(text)


def test_rows_without_a_grammar_are_unchanged_in_a_mixed_batch(llm):
    plain = SamplingParams(temperature=0, max_tokens=24)
    [alone] = _texts(llm, [plain])
    mixed = _texts(llm, [SamplingParams(temperature=0, max_tokens=24, structured_outputs=_so(regex="[a-z]{30}")),
                         plain, SamplingParams(temperature=0, max_tokens=24, structured_outputs=_so(json=PERSON))])
    assert mixed[1] == alone
    assert re.fullmatch("[a-z]{1,30}", mixed[0][0]) and mixed[0][1] in ("length", "stop")


def test_parallel_samples_each_follow_the_grammar(llm):
    # The schema bounds a document to ~60 tokens (a name of up to 20 characters, three tags), so 100 tokens
    # let every sample close its document: each must end by the grammar, not by the length.
    params = SamplingParams(temperature=1.0, n=4, seed=3, max_tokens=100, structured_outputs=_so(json=PERSON))
    [output] = llm.chat(CHAT, params, use_tqdm=False)
    for sample in output.outputs:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), PERSON)


def test_a_spec_compiles_once(llm):
    manager = llm.llm_engine.structured_output
    schema = {"type": "object", "properties": {"unique_field_for_this_test": {"type": "boolean"}},
              "required": ["unique_field_for_this_test"]}
    before = manager.num_compiles
    texts = _texts(llm, [SamplingParams(temperature=0, max_tokens=30, structured_outputs=_so(json=schema))] * 3)
    assert manager.num_compiles == before + 1
    for text, _ in texts:
        assert isinstance(json.loads(text)["unique_field_for_this_test"], bool)


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(llm, monkeypatch):
    manager = llm.llm_engine.structured_output

    def broken(key):
        raise RuntimeError("compiler broke")
    monkeypatch.setattr(manager, "_compile", broken)
    failing = SamplingParams(temperature=0, max_tokens=8, structured_outputs=_so(regex="[a-z]{1,5}x{1,9}"))
    outputs = llm.chat([CHAT, CHAT], [failing, SamplingParams(temperature=0, max_tokens=8)], use_tqdm=False)
    assert "compiler broke" in outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == 8


def test_grammar_state_accepts_fills_and_rolls_back(llm):
    tokenizer = llm.get_tokenizer()
    engine = llm.llm_engine
    manager = StructuredOutputManager(tokenizer, engine.model_config.vocab_size, engine.model_config.eos_token_ids)
    grammar = manager.request_grammar(_so(regex="ab[0-9]"))
    eos = engine.model_config.eos_token_ids[0]
    array, view = allocate_bitmask(3, manager.bitmask_words)

    def allowed(row: int, token_id: int) -> bool:
        return bool((int(array[row, token_id // 32]) >> (token_id % 32)) & 1)

    grammar.fill_bitmask(view, 0)
    assert not allowed(0, eos)   # the empty string does not match: no stop yet
    ids = tokenizer.encode("ab7", add_special_tokens=False)
    assert grammar.accept_tokens(ids) == len(ids)
    grammar.fill_bitmask(view, 1)
    assert allowed(1, eos) and array[1].tolist().count(0) > 0   # complete: the stop token, little else
    grammar.rollback(len(ids))
    grammar.fill_bitmask(view, 2)
    assert (array[2] == array[0]).all()
    wrong = tokenizer.encode("zz", add_special_tokens=False)
    assert grammar.accept_tokens(wrong) == 0
    assert grammar.accept_tokens(ids + [eos]) == len(ids) + 1 and grammar.is_terminated
    manager.shutdown()


class _PendingGrammar(RequestGrammar):
    """A grammar whose compile the test finishes by hand; its bitmask allows everything."""

    def __init__(self):
        super().__init__(Future())

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = -1

    def accept_tokens(self, token_ids):
        return len(token_ids)

    @property
    def is_terminated(self):
        return False


class _AllowAll:
    def grammar_bitmask(self, grammars):
        array, view = allocate_bitmask(len(grammars), 4)
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(view, row)
        return array


def test_a_request_waits_for_its_grammar_without_holding_the_batch():
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64,
                          structured_output=_AllowAll())
    constrained = Request("grammar", list(range(10, 18)), SamplingParams(temperature=0), (2,), 8, arrival_time=0.0)
    constrained.grammar = grammar = _PendingGrammar()
    plain = Request("plain", list(range(50, 56)), SamplingParams(temperature=0), (2,), 8, arrival_time=1.0)
    scheduler.add_request(constrained)
    scheduler.add_request(plain)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"plain": 6}   # the earlier request waits, the later one runs
    assert first.grammar_bitmask is None
    scheduler.update_from_output(first, ModelRunnerOutput(["plain"], [100], [-0.1]))
    grammar.compiled.set_result(None)
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"plain": 1, "grammar": 8}
    assert second.grammar_request_ids == ["grammar"] and second.grammar_bitmask.shape == (1, 4)
