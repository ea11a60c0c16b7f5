"""SamplingParams validation and the batched sampler, checked against hand computations and torch references."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.model import kernels
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedllm.worker import sampler
from pagedllm.worker.input_batch import SamplingColumns
from pagedllm.worker.sampler import SamplingBatch, _apply_penalties, sample

# ---------------------------------------------------------------- SamplingParams

STOP_TEXT = st.text(alphabet="ab\n 好😀", min_size=1, max_size=4)
VALID = {
    "n": st.integers(1, 8),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(1e-3, 10),
    "temperature": st.floats(0.01, 5),
    "top_p": st.floats(1e-6, 1),
    "top_k": st.integers(-1, 1000),
    "min_p": st.floats(0, 1),
    "seed": st.none() | st.integers(0, 2**32),
    "stop": st.none() | STOP_TEXT | st.lists(STOP_TEXT, max_size=3),
    "stop_token_ids": st.none() | st.lists(st.integers(0, 50000), max_size=3),
    "max_tokens": st.none() | st.integers(20, 4096),
    "min_tokens": st.integers(0, 16),
    "logprobs": st.none() | st.integers(0, MAX_LOGPROBS),
    "prompt_logprobs": st.none() | st.integers(0, MAX_LOGPROBS),
    "logit_bias": st.none() | st.dictionaries(st.integers(0, 50000), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": st.none() | st.lists(st.integers(0, 50000), min_size=1, max_size=3),
    "bad_words": st.none() | st.lists(STOP_TEXT.filter(str.strip), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
}

INVALID = {
    "n": st.integers(max_value=0) | st.just(1.5) | st.just(True) | st.just("2"),
    "best_of": st.integers(-3, 0),
    "presence_penalty": st.floats(2.001, 1e6) | st.floats(-1e6, -2.001) | st.just(math.nan),
    "frequency_penalty": st.floats(2.001, 1e6) | st.floats(-1e6, -2.001) | st.just("high"),
    "repetition_penalty": st.floats(-1e6, 0) | st.just(math.inf),
    "temperature": st.floats(-1e6, -1e-9) | st.just("hot") | st.just(math.nan) | st.just(False),
    "top_p": st.floats(-1e6, 0) | st.floats(1.0001, 1e6) | st.just(None),
    "top_k": st.integers(max_value=-2) | st.just(2.0) | st.just(True),
    "min_p": st.floats(-1e6, -1e-9) | st.floats(1.0001, 1e6),
    "seed": st.just(1.5) | st.just("7"),
    "stop": st.just("") | st.just(["ok", ""]) | st.just([3]) | st.just(7),
    "stop_token_ids": st.just([-1]) | st.just(["2"]),
    "max_tokens": st.integers(max_value=0) | st.just(10.0),
    "min_tokens": st.integers(max_value=-1),
    "logprobs": st.integers(max_value=-1) | st.integers(MAX_LOGPROBS + 1, 10**6) | st.just(True),
    "prompt_logprobs": st.integers(max_value=-1) | st.integers(MAX_LOGPROBS + 1, 10**6) | st.just(1.0),
    "logit_bias": st.dictionaries(st.integers(0, 9), st.floats(100.01, 1e6), min_size=1) | st.just({"1": 1.0}),
    "allowed_token_ids": st.just([]) | st.just([-1]) | st.just(3),
    "bad_words": st.just([""]) | st.just(["  "]) | st.just("word") | st.just([7]),
    "ignore_eos": st.just(1) | st.just("yes"),
    "include_stop_str_in_output": st.just(None),
}


@settings(max_examples=200)
@given(st.fixed_dictionaries({}, optional=VALID))
def test_valid_params_are_accepted_and_normalised(kwargs):
    params = SamplingParams(**kwargs)
    assert isinstance(params.stop, list) and isinstance(params.stop_token_ids, list)
    assert params.top_k >= 0
    if kwargs.get("top_k") == -1:
        assert params.top_k == 0
    if isinstance(kwargs.get("stop"), str):
        assert params.stop == [kwargs["stop"]]


@settings(max_examples=300)
@given(st.sampled_from(sorted(INVALID)).flatmap(lambda name: st.tuples(st.just(name), INVALID[name])))
def test_invalid_params_are_rejected_naming_the_field(field_and_value):
    name, value = field_and_value
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_cross_field_checks():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="best_of must be 1"):
        SamplingParams(n=2, best_of=2, temperature=0)
    assert SamplingParams(n=2, temperature=0).n == 2
    SamplingParams(min_tokens=500, max_tokens=None)


def test_message_states_the_allowed_range():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)


def test_greedy_disables_truncation():
    params = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)
    assert params.is_greedy
    assert (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


def test_clone_and_children():
    params = SamplingParams(n=3, best_of=4, seed=10, stop=["x"])
    copy = params.clone()
    copy.stop.append("y")
    assert params.stop == ["x"] and copy.n == 3
    children = [params.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.best_of is None and c.stop == ["x"] for c in children)
    assert SamplingParams(n=2).for_child(1).seed is None


# ---------------------------------------------------------------- sampler helpers

def build(params, logits, prompts=None, outputs=None, eos=None, generators=None):
    """A SamplingBatch for these rows, through the persistent batch's columns as the runner fills them."""
    rows = len(params)
    prompts = prompts or [[] for _ in range(rows)]
    outputs = outputs or [[] for _ in range(rows)]
    columns = SamplingColumns(rows)
    for row, (row_params, row_eos, generator) in enumerate(zip(params, eos or [()] * rows,
                                                               generators or [None] * rows)):
        columns.set_row(row, row_params, row_eos, generator)
    sequences = [prompt + output for prompt, output in zip(prompts, outputs)]
    token_ids = np.zeros((rows, max(map(len, sequences), default=0) + 1), np.int32)
    for row, sequence in enumerate(sequences):
        token_ids[row, :len(sequence)] = sequence
    return SamplingBatch.build(columns, np.arange(rows), token_ids, np.array([len(p) for p in prompts]),
                               np.array([len(s) for s in sequences]), logits.shape[1], logits.device)


FEATURE_FIELDS = ["top_k", "top_p", "log_min_p", "repetition_penalties", "seen_tokens", "frequency_penalties",
                  "presence_penalties", "output_counts", "min_tokens_rows", "min_tokens_ids", "logit_controls"]


@pytest.mark.parametrize("params, fields", [
    (SamplingParams(temperature=0.8), []),
    (SamplingParams(temperature=0.8, top_k=5), ["top_k"]),
    (SamplingParams(temperature=0.8, top_p=0.5), ["top_p"]),
    (SamplingParams(temperature=0.8, min_p=0.1), ["log_min_p"]),
    (SamplingParams(repetition_penalty=1.2), ["repetition_penalties", "seen_tokens"]),
    (SamplingParams(presence_penalty=0.5), ["frequency_penalties", "presence_penalties", "output_counts"]),
    (SamplingParams(frequency_penalty=-0.5), ["frequency_penalties", "presence_penalties", "output_counts"]),
    (SamplingParams(min_tokens=3), ["min_tokens_rows", "min_tokens_ids"]),
    (SamplingParams(logit_bias={3: 1.0}), ["logit_controls"]),
])
def test_a_step_builds_the_tensors_of_the_features_its_rows_use_only(params, fields):
    """The step gathers a feature's columns only where some row's flags name it: one row using a feature among
    plain ones (greedy and sampled) builds exactly that feature's tensors, also once rows have moved (a finished
    request's row is filled by the last row, flags and all)."""
    logits = torch.randn(4, 10)
    plain = [SamplingParams(temperature=0), SamplingParams(temperature=0.7)]
    for order in ([params, *plain], [*plain, params]):
        columns = SamplingColumns(4)
        for row, row_params in enumerate([SamplingParams(temperature=0), *order]):
            columns.set_row(row, row_params, (1,), None)
        columns.move_row(3, 0)   # row 0 leaves: the last row takes its place
        token_ids = np.zeros((3, 4), np.int32)
        batch = SamplingBatch.build(columns, np.arange(3), token_ids, np.full(3, 1), np.full(3, 2), 10, logits.device)
        assert [field for field in FEATURE_FIELDS if getattr(batch, field) is not None] == fields
        assert batch.num_top_logprobs is None and batch.seeded_rows == []
    with_logprobs = build([SamplingParams(logprobs=2), SamplingParams(temperature=0)], logits[:2])
    assert with_logprobs.num_top_logprobs == 2
    seeded = build([SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0)], logits[:2],
                   generators=[torch.Generator().manual_seed(1), None])
    assert [row for row, _ in seeded.seeded_rows] == [0]
    mixed, greedy_only = build(plain, logits[:2]), build([SamplingParams(temperature=0)] * 2, logits[:2])
    assert mixed.temperatures is not None and mixed.greedy is not None   # a draw divides and picks rows by these
    assert greedy_only.all_greedy and greedy_only.temperatures is None and greedy_only.greedy is None


def draw_many(row_logits, params, draws=2000):
    """One batched call with the same row repeated: the empirical distribution of one request."""
    logits = row_logits.unsqueeze(0).repeat(draws, 1)
    return sample(logits, build([params] * draws, logits)).token_ids


def assert_matches(token_ids, probs):
    """Pearson chi-square against the expected probs; the bound is far in the tail for these sizes."""
    counts = torch.bincount(token_ids, minlength=probs.numel()).double()
    expected = probs.double() * token_ids.numel()
    assert counts[expected == 0].sum() == 0, "drew a token that has probability 0"
    support = expected > 0
    chi2 = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, counts, expected)


PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])
LOGITS = PROBS.log()  # the zero probability becomes -inf: a token no setting may pick


@pytest.fixture(autouse=True)
def _fixed_rng():
    torch.manual_seed(1234)


# ---------------------------------------------------------------- sampler

def test_greedy_is_argmax():
    logits = torch.randn(16, 100)
    out = sample(logits, build([SamplingParams(temperature=0)] * 16, logits))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.top_logprobs is None


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 50) * 3
    out = sample(logits, build([SamplingParams(top_k=1)] * 64, logits))
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(top_k=2), [0, 1]),
    (SamplingParams(top_p=0.6), [0, 1]),
    (SamplingParams(top_p=0.75), [0, 1, 2]),
    (SamplingParams(top_p=0.1), [0]),
    (SamplingParams(min_p=0.3), [0, 1, 2]),
    (SamplingParams(min_p=0.2, top_k=4), [0, 1, 2, 3]),
    (SamplingParams(top_k=3, top_p=0.5), [0, 1]),
    (SamplingParams(), [0, 1, 2, 3, 4]),
])
def test_truncation_keeps_exactly_the_allowed_tokens_in_proportion(params, kept):
    expected = torch.zeros_like(PROBS)
    expected[kept] = PROBS[kept] / PROBS[kept].sum()
    assert_matches(draw_many(LOGITS, params), expected)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution_matches_softmax(temperature):
    row_logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -3.0])
    tokens = draw_many(row_logits, SamplingParams(temperature=temperature), draws=20000)
    assert_matches(tokens, torch.softmax(row_logits / temperature, -1))


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3)
    batch = build([params], logits, prompts=[[0, 4]], outputs=[[1, 1, 2]])
    processed = logits.clone()
    _apply_penalties(processed, batch)
    # repetition on prompt+output ids {0, 1, 2, 4}: positive / 2, negative * 2;
    # then output counts {1: 2, 2: 1}: frequency 0.5 * count and presence 0.3.
    expected = [2.0 / 2, -1.0 * 2 - 0.5 * 2 - 0.3, 0.5 / 2 - 0.5 - 0.3, 3.0, -2.0 * 2, 0.0]
    assert processed[0].tolist() == pytest.approx(expected)


def test_penalties_apply_per_row_and_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 1.5]] * 3)
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=2.0),
              SamplingParams(temperature=0, presence_penalty=2.0)]
    out = sample(logits, build(params, logits, prompts=[[0]] * 3, outputs=[[], [], [0, 1]]))
    assert out.token_ids.tolist() == [0, 1, 2]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 3)
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    outputs = [[], [7], [7, 7]]
    out = sample(logits, build([params] * 3, logits, outputs=outputs, eos=[(0,)] * 3))
    assert out.token_ids.tolist() == [2, 2, 0]


def test_extreme_values_stay_valid_distributions():
    """Values SamplingParams accepts but float32 cannot hold must not mask every token or make NaN (which
    argmax would turn into token 0 every time)."""
    logits = LOGITS.flip(0)   # token 0 is the impossible one, token 5 the best
    best_only = draw_many(logits, SamplingParams(temperature=1.0, top_p=1e-300), draws=200)
    assert set(best_only.tolist()) == {5}
    for params in (SamplingParams(temperature=1e300, min_tokens=1, stop_token_ids=[1]),
                   SamplingParams(temperature=1.0, repetition_penalty=1e-300)):
        rows = logits.unsqueeze(0).repeat(200, 1)
        drawn = sample(rows, build([params] * 200, rows, prompts=[[2, 3]] * 200)).token_ids
        assert 0 not in drawn.tolist() and len(set(drawn.tolist())) > 1, (params, drawn)


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.3, top_k=3, repetition_penalty=1.5, logprobs=5),
              SamplingParams(logprobs=2), SamplingParams(temperature=0), SamplingParams(logprobs=0)]
    out = sample(logits, build(params, logits, outputs=[[1, 2]] * 4))
    reference = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, reference.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.logprobs.dtype == torch.float32
    assert out.top_logprobs.shape == (4, 5)
    assert torch.allclose(out.top_logprobs, reference.gather(1, out.top_logprob_ids))
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    assert torch.equal(out.top_logprob_ids[:, 0], logits.argmax(-1))


def test_top_logprobs_only_when_a_row_asks():
    logits = torch.randn(2, 10)
    out = sample(logits, build([SamplingParams(logprobs=0), SamplingParams()], logits))
    assert out.top_logprob_ids.shape == out.top_logprobs.shape == (2, 0)
    out = sample(logits, build([SamplingParams(), SamplingParams()], logits))
    assert out.top_logprob_ids is None and out.top_logprobs is None


def test_low_precision_input_and_caller_logits_untouched():
    logits = torch.randn(3, 40).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.3, temperature=0.7, min_p=0.1)] * 3
    out = sample(logits, build(params, logits, outputs=[[0, 1]] * 3))
    assert torch.equal(logits, before)
    assert out.logprobs.dtype == torch.float32


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(6, 20)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=5)] * 3
    out = sample(logits, build(params, logits))
    assert torch.equal(out.token_ids[0::2], logits[0::2].argmax(-1))
    top5 = logits[1::2].topk(5).indices
    assert (top5 == out.token_ids[1::2, None]).any(-1).all()


def run_seeded(seed, step_logits, others, position):
    """The seeded row's tokens over the steps, with `others` rows around it in the batch."""
    generator = torch.Generator().manual_seed(seed)
    other_generators = [torch.Generator().manual_seed(100 + i) if p.seed is not None else None
                        for i, p in enumerate(others)]
    params = list(others)
    params.insert(position, SamplingParams(seed=seed, top_p=0.9))
    generators = list(other_generators)
    generators.insert(position, generator)
    tokens = []
    for logits in step_logits:
        batch_logits = torch.randn(len(params), logits.numel())
        batch_logits[position] = logits
        out = sample(batch_logits, build(params, batch_logits, generators=generators))
        tokens.append(out.token_ids[position].item())
    return tokens


def test_seeded_rows_ignore_the_rest_of_the_batch():
    step_logits = [torch.randn(64) for _ in range(12)]
    alone = run_seeded(7, step_logits, [], 0)
    crowd = [SamplingParams(), SamplingParams(seed=3), SamplingParams(temperature=0),
             SamplingParams(top_k=4, seed=5)]
    assert run_seeded(7, step_logits, crowd, 0) == alone
    assert run_seeded(7, step_logits, crowd, 3) == alone
    assert run_seeded(7, step_logits, crowd[:2], 2) == alone
    assert run_seeded(8, step_logits, [], 0) != alone


@pytest.mark.kernels
@pytest.mark.parametrize("vocab", [16, 49152, 1003])
def test_logits_summary_kernel_matches_logsumexp_and_argmax(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=generator) * 20
    logits[1, 5] = logits[1, vocab - 2] = logits[1].max() + 1   # a tie: the first position wins
    logits[2, :vocab // 2] = -math.inf                          # masked half
    logits[3] = 7.0                                             # all equal: position 0
    logits[4, -1] = 1e4                                         # maximum in the tail past the vectors
    normaliser, best = sampler.normaliser_and_argmax(logits, need_argmax=True)
    torch.testing.assert_close(normaliser, torch.logsumexp(logits, dim=-1, keepdim=True), atol=1e-5, rtol=1e-6)
    assert best.tolist() == logits.argmax(dim=-1).tolist()


# ---------------------------------------------------------------- top-k / top-p without a sort

# Float32 arithmetic decides a token whose mass above lies this close to top_p either way: the kernel sums
# exp(logit - peak) evaluated in float32 (relative error under 2e-6 per token: 1e-7 of the polynomial, and the
# rounding of logit - peak, up to 32 * 2^-24 in the 32 logits it resolves), so the fraction of the mass above a
# token errs by under twice that; the full sort's float32 softmax and cumulative sum err less.
MASS_TOLERANCE = 1e-5


def kept_by_definition(logits: torch.Tensor, top_k: int, top_p: float, tolerance: float = MASS_TOLERANCE
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, vocab] bool twice, written from the definition in float64: order each row by falling logit, the
    lower id first among equal ones; keep the first top_k; of those, keep a token while the probability
    (renormalised over them) of the tokens before it is below top_p, the first one always. Second: the tokens
    whose mass above is within `tolerance` of top_p, which float32 may decide either way."""
    kept = torch.zeros(logits.shape, dtype=torch.bool)
    near_cut = torch.zeros(logits.shape, dtype=torch.bool)
    for r, row in enumerate(logits.double().numpy()):
        order = np.lexsort((np.arange(row.size), -row))[:top_k]
        probs = np.exp(row[order] - row[order[0]])
        probs /= probs.sum()
        mass_above = np.cumsum(probs) - probs
        keep = mass_above < top_p
        keep[0] = True
        kept[r, torch.from_numpy(order[keep])] = True
        near = np.abs(mass_above - top_p) <= tolerance if top_p < 1.0 else np.zeros(len(order), bool)
        near[0] = False
        near_cut[r, torch.from_numpy(order[near])] = True
    finite = torch.isfinite(logits)
    return kept & finite, near_cut & finite


def truncation_cases():
    """(name, logits, top_k, top_p): random rows peaked and flat, ties at the cut, rows that are all one value (the
    whole row is one bucket: the sort the kernel falls back to), masked tokens, a vocabulary past the vectors."""
    generator = torch.Generator().manual_seed(27)
    cases = []
    for vocab in (49152, 1003):
        for scale in (0.8, 4.0):
            random = torch.randn(8, vocab, generator=generator) * scale
            for top_k, top_p in ((vocab, 0.9), (vocab, 0.5), (vocab, 0.999), (vocab, 1e-30), (vocab, 0.0),
                                 (50, 1.0), (1, 1.0), (1000, 0.9), (7, 0.6), (vocab - 1, 0.95)):
                cases.append((f"random-{vocab}-x{scale}-k{top_k}-p{top_p}", random, top_k, top_p))
        ties = (torch.randn(8, vocab, generator=generator) * 2).round()   # a few values, thousands of each
        for top_k, top_p in ((vocab, 0.9), (vocab, 0.3), (100, 1.0), (100, 0.7)):
            cases.append((f"ties-{vocab}-k{top_k}-p{top_p}", ties, top_k, top_p))
        flat = torch.full((3, vocab), 1.5)
        for top_k, top_p in ((vocab, 0.3), (vocab, 0.9), (10, 0.5)):   # p * vocab not near a whole number
            cases.append((f"flat-{vocab}-k{top_k}-p{top_p}", flat, top_k, top_p))
        masked = torch.randn(4, vocab, generator=generator) * 3
        masked[:, ::3] = -math.inf
        masked[1, :vocab - 5] = -math.inf   # five tokens left, fewer than top_k
        for top_k, top_p in ((vocab, 0.9), (20, 0.8)):
            cases.append((f"masked-{vocab}-k{top_k}-p{top_p}", masked, top_k, top_p))
    far = torch.randn(2, 4096, generator=generator) * 40   # mass 32 logits below the peak and more
    cases.append(("spread-p0.99999", far, 4096, 0.99999))
    return cases


def columns_for(logits: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sampler's per-row columns for the whole batch: top_k (vocab when off), top_p (inf when off)."""
    rows, vocab = logits.shape
    return (None if top_k >= vocab else torch.full((rows, 1), top_k, dtype=torch.int64),
            None if top_p >= 1.0 else torch.full((rows, 1), top_p, dtype=torch.float32))


@pytest.mark.parametrize("truncate", [pytest.param("kernel", marks=pytest.mark.kernels), "sort"])
@pytest.mark.parametrize("name, logits, top_k, top_p", [pytest.param(*case, id=case[0]) for case in truncation_cases()])
def test_top_k_top_p_keep_the_tokens_their_definition_keeps(truncate, name, logits, top_k, top_p):
    truncated = logits.clone()
    if truncate == "kernel":
        sampler._apply_top_k_top_p(truncated, *columns_for(logits, top_k, top_p))
    else:   # the formula other devices take, which the kernel replaced on CPU
        sampler._top_k_top_p_by_sort(truncated, *columns_for(logits, top_k, top_p))
    kept = torch.isfinite(truncated)
    # The sort's float32 cumulative sum errs by up to one rounding per token summed.
    tolerance = MASS_TOLERANCE if truncate == "kernel" else logits.shape[1] * 2.0 ** -24
    expected, near_cut = kept_by_definition(logits, top_k, top_p, tolerance)
    differ = kept != expected
    assert not (differ & ~near_cut).any(), (name, (differ & ~near_cut).nonzero()[:5].tolist())
    assert torch.equal(truncated[kept], logits[kept])   # what stays is not touched


def test_the_kernel_runs_on_cpu_where_built():
    assert (sampler._CPU_TRUNCATE is not None) == (kernels.kernels is not None)


@pytest.mark.kernels
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_p=0.9, seed=11),
                                    SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=12),
                                    SamplingParams(temperature=0.6, top_p=0.8, min_p=0.05, seed=13),
                                    SamplingParams(temperature=1.0, top_k=3, seed=14)])
def test_seeded_draws_from_the_kernel_s_distribution_equal_the_definition_s(params):
    """Where the kept set is the same, the distribution is the same to the bit, so a seed draws the same token."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 49152, generator=generator) * 3
    batch = build([params] * 16, logits)
    by_kernel = sampler.probabilities(logits.clone(), batch)
    reference = logits / params.temperature
    kept, _ = kept_by_definition(reference, params.top_k or 49152, params.top_p)
    reference = reference.masked_fill(~kept, -math.inf)
    if params.min_p:
        reference = reference.masked_fill(reference < reference.amax(-1, keepdim=True) + math.log(params.min_p),
                                          -math.inf)
    reference = reference.softmax(-1)
    same = ((by_kernel > 0) == (reference > 0)).all(-1)   # rows with a token at float32's edge may differ
    assert same.sum() >= 12, same
    assert torch.equal(by_kernel[same], reference[same])
    seeded = lambda: [(row, torch.Generator().manual_seed(params.seed + row)) for row in range(16)]   # noqa: E731
    assert torch.equal(sampler.draw(by_kernel, seeded())[same], sampler.draw(reference, seeded())[same])


def test_a_seed_draws_the_same_tokens_and_only_tokens_with_mass():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0, 0.0]] * 400)
    seeded = lambda seed: [(row, torch.Generator().manual_seed(seed * 1000 + row)) for row in range(400)]  # noqa: E731
    first = sampler.draw(probs, seeded(1))
    assert torch.equal(first, sampler.draw(probs, seeded(1)))
    assert not torch.equal(first, sampler.draw(probs, seeded(2)))
    assert set(first.tolist()) == {1, 3, 4}
    unnormalised = sampler.draw(probs * 7, seeded(1))   # the draw scales with the row's total
    assert torch.equal(unnormalised, first)
