"""logit_bias, allowed_token_ids and bad_words: hand-computed logits in the sampler, then the bundled model."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.engine.bad_words import bad_words_token_ids
from pagedllm.worker.input_batch import SamplingColumns
from pagedllm.worker.sampler import SamplingBatch, sample


def build(params: list[SamplingParams], logits: torch.Tensor, outputs: list[list[int]] | None = None,
          prompt: list[int] = (0, 0)) -> SamplingBatch:
    """A SamplingBatch for these rows (each with `prompt`, then its output), through the batch's columns."""
    outputs = outputs or [[] for _ in params]
    columns = SamplingColumns(len(params))
    for row, row_params in enumerate(params):
        columns.set_row(row, row_params, (), None)
    sequences = [[*prompt, *output] for output in outputs]
    token_ids = np.zeros((len(params), max(map(len, sequences)) + 1), np.int32)
    for row, sequence in enumerate(sequences):
        token_ids[row, :len(sequence)] = sequence
    return SamplingBatch.build(columns, np.arange(len(params)), token_ids, np.full(len(params), len(prompt)),
                               np.array(list(map(len, sequences))), logits.shape[1], logits.device)


def processed_logits(params: list[SamplingParams], logits: torch.Tensor, outputs=None) -> torch.Tensor:
    batch = build(params, logits, outputs)
    processed = logits.clone()
    batch.logit_controls.apply(processed)
    return processed


def test_rows_without_controls_cost_nothing():
    logits = torch.randn(3, 10)
    assert build([SamplingParams()] * 3, logits).logit_controls is None


def test_logit_bias_adds_to_its_rows_only():
    logits = torch.randn(3, 10)
    params = [SamplingParams(logit_bias={2: 5.0, 7: -1.5}), SamplingParams(), SamplingParams(logit_bias={0: 100})]
    expected = logits.clone()
    expected[0, 2] += 5.0
    expected[0, 7] -= 1.5
    expected[2, 0] += 100
    assert torch.equal(processed_logits(params, logits), expected)


def test_allowed_token_ids_leave_exactly_those_tokens():
    logits = torch.randn(2, 10)
    processed = processed_logits([SamplingParams(allowed_token_ids=[1, 4, 9]), SamplingParams()], logits)
    assert torch.isfinite(processed[0]).tolist() == [i in (1, 4, 9) for i in range(10)]
    assert torch.equal(processed[0, [1, 4, 9]], logits[0, [1, 4, 9]])
    assert torch.equal(processed[1], logits[1])


def test_bad_words_ban_the_token_that_would_complete_a_word():
    """vLLM's rule: one-token words always; longer ones only after all but their last token, in the output."""
    params = SamplingParams(bad_words_token_ids=[[5], [7, 3], [2, 7, 8], [9, 4]])
    logits = torch.zeros(4, 10)
    outputs = [[], [1, 7], [2, 7], [9, 0]]   # prompt tokens (0, 0) never count: [9, 4] stays possible after [9, 0]
    banned = processed_logits([params] * 4, logits, outputs) == -math.inf
    assert [row.nonzero().flatten().tolist() for row in banned] == [[5], [3, 5], [3, 5, 8], [5]]


def test_bias_cannot_revive_a_masked_token_and_greedy_follows_the_bias():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, allowed_token_ids=[1, 2], logit_bias={0: 100, 2: 50})
    assert sample(logits, build([params], logits)).token_ids.tolist() == [2]
    processed = processed_logits([params], logits)
    assert processed[0, 0] == -math.inf and processed[0, 2] == 51.0


@pytest.mark.kernels
@pytest.mark.parametrize("vocab", [49152, 1003])
def test_greedy_rows_under_controls_take_the_argmax_of_the_controlled_logits_and_leave_the_raw_ones(vocab):
    """The kernel's argmax against the controls written out in the test (mask, bans, biases, min_tokens' ban of
    the stop ids), with ties: the lowest id among equal maxima, as torch's argmax."""
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(12, vocab, generator=generator) * 4).round()   # many equal values
    top = logits.argmax(-1)
    allowed = list(range(200, 700, 3))
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={int(top[1]): -100, 17: 40.0}),
              SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=0, allowed_token_ids=allowed, logit_bias={203: 100, 5: 100}),
              SamplingParams(temperature=0, bad_words_token_ids=[[int(top[4])]]),
              SamplingParams(temperature=0, bad_words_token_ids=[[int(top[5])]], logit_bias={int(top[5]): 50}),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[int(top[6])]),
              SamplingParams(temperature=0, logit_bias={vocab - 1: 30.0, vocab - 2: 30.0}),
              SamplingParams(temperature=0, allowed_token_ids=[vocab - 1, 0]),
              *[SamplingParams(temperature=0, logit_bias={int(top[r]): -1.0}) for r in range(9, 12)]]
    expected = logits.clone()
    expected[1, top[1]] -= 100
    expected[1, 17] += 40
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[allowed] = False
    expected[2:4, outside] = -math.inf
    expected[3, 203] += 100   # 5 is outside: -inf stays
    expected[4, top[4]] = -math.inf
    expected[5, top[5]] = -math.inf
    expected[6, top[6]] = -math.inf
    expected[7, [vocab - 1, vocab - 2]] += 30   # a tie past the vectors: the lower id wins
    expected[8, 1:vocab - 1] = -math.inf
    for r in range(9, 12):
        expected[r, top[r]] -= 1.0   # the runner-up, often a tie among several
    columns = SamplingColumns(len(params))
    for row, row_params in enumerate(params):
        columns.set_row(row, row_params, (), None)
    token_ids = np.zeros((len(params), 4), np.int32)
    batch = SamplingBatch.build(columns, np.arange(len(params)), token_ids, np.full(len(params), 2),
                                np.full(len(params), 2), vocab, logits.device)
    raw = logits.clone()
    out = sample(raw, batch)
    assert out.token_ids.tolist() == expected.argmax(-1).tolist()
    assert torch.equal(raw, logits)
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1))


@pytest.mark.parametrize("field, value, message", [
    ("logit_bias", {1: 100.5}, r"logit_bias values must be in \[-100, 100\]"),
    ("logit_bias", {-1: 1}, "logit_bias must be >= 0"),
    ("logit_bias", {1: math.nan}, "logit_bias must be a finite number"),
    ("logit_bias", [1], "logit_bias must be a dict"),
    ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list"),
    ("allowed_token_ids", [1, -2], "allowed_token_ids must be >= 0"),
    ("bad_words", ["ok", " "], "bad_words must hold only non-blank strings"),
    ("bad_words", "word", "bad_words must be a list"),
])
def test_invalid_controls_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


# ---------------------------------------------------------------- the bundled model

PROMPT = "The lighthouse keeper climbed the stairs and"


LLM_SETTINGS = dict(kv_cache_memory="64MiB", max_model_len=256)


def greedy(llm, max_tokens: int = 12, **controls) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **controls)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def test_bias_of_minus_100_bans_a_token_and_plus_100_forces_one(llm):
    plain = greedy(llm)
    banned = greedy(llm, logit_bias={plain[0]: -100})
    assert plain[0] not in banned and banned != plain
    forced = 1234
    assert forced not in plain
    assert greedy(llm, logit_bias={forced: 100}) == [forced] * 12


def test_allowed_token_ids_restrict_sampled_output(llm):
    allowed = [11, 260, 314, 1234, 4000]
    params = SamplingParams(temperature=5.0, seed=7, max_tokens=40, ignore_eos=True, allowed_token_ids=allowed)
    outputs = llm.generate([PROMPT, PROMPT + " then", PROMPT + " so"], params, use_tqdm=False)
    tokens = [token for output in outputs for token in output.outputs[0].token_ids]
    assert len(tokens) == 120 and set(tokens) <= set(allowed)
    assert len(set(tokens)) > 1   # a draw over the allowed tokens, not one forced token


def test_bad_words_ban_sequences_not_their_first_tokens(llm):
    """A word of several tokens that greedy would write: its last token is banned only right after the others,
    so the output keeps everything up to that token."""
    tokenizer = llm.get_tokenizer()
    plain = greedy(llm, max_tokens=24)
    for start in range(len(plain) - 1):
        word = tokenizer.decode(plain[start:start + 2])
        if word.strip() and plain[start:start + 2] in bad_words_token_ids(tokenizer, [word]):
            break
    else:
        pytest.fail(f"no two-token word in {tokenizer.decode(plain)!r}")
    sequences = bad_words_token_ids(tokenizer, [word])
    assert all(len(sequence) == 2 for sequence in sequences)
    banned = greedy(llm, max_tokens=24, bad_words=[word])
    assert banned[:start + 1] == plain[:start + 1]   # the word's first token still came
    assert banned[start + 1] != plain[start + 1]
    pairs = {tuple(banned[i:i + 2]) for i in range(len(banned) - 1)}
    assert not pairs & {tuple(sequence) for sequence in sequences}


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    for field, value in (("logit_bias", {10**6: 1.0}), ("allowed_token_ids", [3, 10**6])):
        with pytest.raises(ValueError, match=f"{field} must name token ids below the vocabulary size 49152"):
            llm.generate(PROMPT, SamplingParams(**{field: value}), use_tqdm=False)


def test_bad_words_token_ids_are_checked_too(llm):
    with pytest.raises(ValueError, match="bad_words_token_ids must be a list of non-empty token-id lists"):
        SamplingParams(bad_words_token_ids=[[]])
    with pytest.raises(ValueError, match="bad_words_token_ids must be >= 0"):
        SamplingParams(bad_words_token_ids=[[3, -1]])
    with pytest.raises(ValueError, match="bad_words_token_ids must name token ids below the vocabulary size"):
        llm.generate(PROMPT, SamplingParams(bad_words_token_ids=[[10**6]]), use_tqdm=False)
