"""Counters of a long run past the widths they once had to fit: params versions, request streams,
prompt-pool epochs and what carries them over the host channel.

A resumed run builds its pipeline at `first_version` = its step, so a run of 10,000 steps (or a
study that numbers versions up to 2**31 - 1) samples, evaluates and tags tokens at versions far
above 2**12 and 2**16. The sampler takes a request's stream as one 32-bit word: the streams are
hashed from (run seed, version, index, ...) and must stay in [0, 2**32) with every input one word.
The pipeline test runs the real `Pipeline` over a real `ContinuousBatcher` (a tiny random model)
with a train step that keeps the params, so every version decodes with the same weights and a
request's tokens depend only on its prompt and stream: two builds must agree token for token.
"""

import itertools
import types

import jax
import numpy as np
import pytest
from flax import nnx
from small_models import small_llama
from test_pipeline_real import prompt_source

from scalerl_jax.data.pool import PromptPool
from scalerl_jax.distributed.channel import decode, encode
from scalerl_jax.distributed.messages import (
    admission_from_message,
    admission_to_message,
    completion_from_message,
    completion_to_message,
    eval_item_from_message,
    eval_item_to_message,
)
from scalerl_jax.distributed.weight_push import transfer_uuid
from scalerl_jax.models import Transformer
from scalerl_jax.pipeline.config import PipelineConfig
from scalerl_jax.pipeline.generator import EVALUATION_DOMAIN, Admission, EvalItem, evaluation_seed, request_seed
from scalerl_jax.pipeline.group import Prompt
from scalerl_jax.pipeline.pipeline_rl import Pipeline
from scalerl_jax.sampler import Completion, ContinuousBatcher, Engine, EngineConfig

WORD = 2**32
# Inputs at the edges of the widths a counter could have been packed into.
BOUNDARIES = (0, 1, 2**12 - 1, 2**12, 2**16 - 1, 2**16, 2**31 - 1, 2**31, WORD - 1)
RUN_SEED = 2**31 + 5  # a run seed above int32, still one word
GROUPS, SAMPLES, STEPS = 2, 2, 2
MAX_NEW, MAX_LEN = 6, 24
EVAL_PROMPTS = [[5, 9, 13], [7, 3, 40, 2], [60, 61]]


def first_word(*entropy, spawn_key=()):
    """The first 32-bit word of a SeedSequence state: the hash the docstrings state."""
    return int(np.random.SeedSequence(list(entropy), spawn_key=spawn_key).generate_state(1)[0])


# ----------------------------------------------------------------------------- stream derivations


@pytest.mark.parametrize("value", BOUNDARIES)
def test_request_seed_is_the_four_word_hash_at_every_boundary(value):
    for base_seed, version, index, sample in {(value, 3, 1, 0), (7, value, 1, 0), (7, 3, value, 0), (7, 3, 1, value)}:
        seed = request_seed(base_seed, version, index, sample)
        assert seed == first_word(base_seed, version, index, sample)
        assert 0 <= seed < WORD and seed == request_seed(base_seed, version, index, sample)


@pytest.mark.parametrize("value", BOUNDARIES)
def test_evaluation_seed_is_the_five_word_hash_at_every_boundary(value):
    for run_seed, version, index in {(value, 4096, 1), (7, value, 1), (7, 4096, value)}:
        seed = evaluation_seed(run_seed, version, index)
        # The five words its docstring names: the entropy padded to NumPy's 4-word pool, then the tag.
        assert seed == first_word(run_seed, version, index, 0, EVALUATION_DOMAIN)
        assert 0 <= seed < WORD and seed == evaluation_seed(run_seed, version, index)


def neighbours(value):
    return [v for v in (value - 1, value, value + 1) if 0 <= v < WORD]


@pytest.mark.parametrize("value", BOUNDARIES)
def test_neighbouring_versions_and_indices_get_distinct_streams(value):
    pairs = list(itertools.product(neighbours(value), neighbours(value)))
    evaluation = {evaluation_seed(RUN_SEED, v, i) for v, i in pairs}
    training = {request_seed(RUN_SEED, v, i, s) for v, i in pairs for s in range(SAMPLES)}
    assert len(evaluation) == len(pairs) and len(training) == len(pairs) * SAMPLES
    assert not evaluation & training


@pytest.mark.parametrize("run_seed", [0, 2**16, RUN_SEED, WORD - 1])
def test_evaluation_and_training_streams_differ_for_the_same_numbers(run_seed):
    for version, index in itertools.product(BOUNDARIES, (0, 1, 2**12, WORD - 1)):
        evaluation = evaluation_seed(run_seed, version, index)
        assert all(evaluation != request_seed(run_seed, version, index, sample) for sample in range(16))
        # Nor with the tag in the sample's place (a four-word tagged hash would coincide there).
        assert evaluation != request_seed(run_seed, version, index, EVALUATION_DOMAIN)


def test_the_old_evaluation_streams_left_the_word_at_version_4096():
    # `(version << 20) + index` fitted 32 bits up to version 4095 only.
    assert (4095 << 20) + 2**20 - 1 == WORD - 1 and 4096 << 20 == WORD
    assert 0 <= evaluation_seed(0, 4096, 0) < WORD


@pytest.mark.parametrize(
    "derive, arity", [(request_seed, 4), (evaluation_seed, 3)], ids=["request_seed", "evaluation_seed"]
)
@pytest.mark.parametrize("bad", [-1, WORD, WORD + 1])
def test_an_input_outside_one_word_is_refused(derive, arity, bad):
    # A second word would alias: SeedSequence splits 2**32 into (0, 1), as version 0, index 1 reads.
    for position in range(arity):
        args = [3] * arity
        args[position] = bad
        with pytest.raises(ValueError, match=r"must be in \[0, 2\*\*32\)"):
            derive(*args)


# ----------------------------------------------------------------------------- the host channel


def test_large_versions_and_streams_cross_the_host_channel_unchanged():
    item = EvalItem(job=2**31 - 1, index=WORD - 1, prompt=(5, 6), seed=WORD - 1, version=2**31 - 1)
    assert eval_item_from_message(decode(encode(eval_item_to_message(item)))) == item
    admission = Admission(group_id=2**40, prompt=Prompt(2**31, (1, 2)), version=2**31 - 1, index=2**20)
    assert admission_from_message(decode(encode(admission_to_message(admission)))) == admission
    versions = [2**31 - 1, 2**31, 2**32 + 1]  # tags past int32 and uint32
    completion = Completion(
        request_id=("eval", 2**31, WORD - 1),
        prompt_tokens=[5],
        tokens=[2, 3, 4],
        logprobs=[-1.0, -0.5, -0.25],
        versions=versions,
        sampled=[True] * 3,
        interrupted=False,
        truncated=False,
        num_think_tokens=0,
        num_answer_tokens=3,
        finish_reason="stop",
        think_budget=-1,
    )
    back = completion_from_message(decode(encode(completion_to_message(completion))), [5])
    assert back == completion and back.versions == versions


def test_weight_transfer_ids_at_version_2_31_minus_1():
    # version << 32 | generator << 16 | owner, by hand.
    assert transfer_uuid(2**31 - 1, 1, 2) == (2**31 - 1) * 2**32 + 1 * 2**16 + 2


# ----------------------------------------------------------------------------- the prompt pool


def test_prompt_pool_crosses_epoch_2_32():
    pool = PromptPool(5, seed=3, npr_threshold=None)
    state = pool.state_dict()
    state.update(epoch=WORD - 1, order=[4, 3, 2, 1, 0], position=5)  # the last epoch ran out
    pool.load_state_dict(state)
    drawn = pool.next_prompts(5)
    assert sorted(drawn) == [0, 1, 2, 3, 4] and pool.epoch == WORD
    assert pool.metrics()["data/pool_epoch"] == float(WORD)


# ----------------------------------------------------------------------------- the real pipeline


class SeedRecordingBatcher(ContinuousBatcher):
    """A ContinuousBatcher that notes each request's stream and prompt."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests = {}

    def add_request(self, request):
        self.requests[request.request_id] = (tuple(request.prompt_tokens), request.seed)
        super().add_request(request)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama and its engine, compiled once for the module."""
    config = small_llama()
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    engine = Engine(graphdef, config, EngineConfig(num_slots=4, max_len=MAX_LEN, chunk_size=4))
    return types.SimpleNamespace(engine=engine, params=params)


def keep_params(state, batch):
    """A train step that changes nothing: every version decodes with the same weights."""
    return state, {"train/loss": 0.0}


def run_resumed(tiny, first_version):
    """A pipeline resumed at `first_version`: STEPS steps, an evaluation of EVAL_PROMPTS before
    the first step and after each. Returns (result, step records, {version: eval completions},
    the batcher's requests)."""
    params = jax.device_put(jax.tree.map(lambda x: x.copy(), tiny.params), jax.devices()[0])
    batcher = SeedRecordingBatcher(tiny.engine, params, version=first_version, seed=RUN_SEED)
    records, evaluations = [], {}

    def on_start(sample_eval):
        evaluations[first_version] = sample_eval(first_version, EVAL_PROMPTS)

    def on_step(record, sample_eval):
        records.append(record)
        evaluations[record.version + 1] = sample_eval(record.version + 1, EVAL_PROMPTS)

    pipeline = Pipeline(
        PipelineConfig(
            max_new_tokens=MAX_NEW,
            max_seq_len=MAX_LEN,
            min_length_bucket=MAX_LEN,
            k=1,
            prompts_per_step=GROUPS,
            samples_per_prompt=SAMPLES,
            num_steps=STEPS,
            temperature=1.0,
            stop_tokens=(1,),
            seed=RUN_SEED,
            first_version=first_version,
            poll_s=0.01,
        ),
        batcher=batcher,
        prompt_source=prompt_source(),
        reward_fn=lambda prompt, completions: [float(sum(c.tokens) % 2) for c in completions],
        train_step=keep_params,
        train_state=types.SimpleNamespace(params=tiny.params),
        on_step=on_step,
        on_start=on_start,
    )
    return pipeline.run(), records, evaluations, batcher.requests


def training_tokens(records, requests):
    """{(prompt, stream): tokens} of every trained completion."""
    return {
        requests[completion.request_id]: completion.tokens
        for record in records
        for group in record.groups
        for completion in group.completions
    }


@pytest.mark.parametrize("first_version", [4095, 4096, 2**16, 2**31 - 1])
def test_resumed_pipeline_samples_evaluates_and_tags_at_large_versions(tiny, first_version):
    result, records, evaluations, requests = run_resumed(tiny, first_version)
    last = first_version + STEPS
    assert result.version == last and result.steps == STEPS and result.stop_reason == "num_steps"
    assert [r.version for r in records] == list(range(first_version, last))

    # Evaluations: every prompt sampled once per version, each token tagged with that version.
    assert sorted(evaluations) == list(range(first_version, last + 1))
    for version, completions in evaluations.items():
        assert [c.prompt_tokens for c in completions] == EVAL_PROMPTS
        for c in completions:
            assert 1 <= len(c.tokens) <= MAX_NEW and c.versions == [version] * len(c.tokens)

    # Training: G groups x n completions per step, tagged between admission and the trained version.
    for record in records:
        assert len(record.groups) == GROUPS
        assert len(record.first_versions) == GROUPS * SAMPLES and set(record.lags) <= {0, 1}
        for group in record.groups:
            assert len(group.completions) == SAMPLES and group.admit_version >= first_version
            for c in group.completions:
                assert 1 <= len(c.tokens) <= MAX_NEW
                assert group.admit_version <= c.versions[0] and c.versions == sorted(c.versions)
                assert c.versions[-1] <= record.version

    # Streams: one word each, none shared between requests (evaluation or training).
    seeds = [seed for _, seed in requests.values()]
    assert all(0 <= seed < WORD for seed in seeds) and len(set(seeds)) == len(seeds)
    assert len(requests) == len(EVAL_PROMPTS) * (STEPS + 1) + SAMPLES * result.counts.admitted

    # A second build with the same seeds draws the same tokens.
    _, records_again, evaluations_again, requests_again = run_resumed(tiny, first_version)
    assert {v: [c.tokens for c in cs] for v, cs in evaluations_again.items()} == {
        v: [c.tokens for c in cs] for v, cs in evaluations.items()
    }
    first, second = training_tokens(records, requests), training_tokens(records_again, requests_again)
    common = first.keys() & second.keys()
    # Groups admitted before the first push have the same admission version in both builds.
    assert len(common) >= SAMPLES * GROUPS
    assert all(first[key] == second[key] for key in common)
