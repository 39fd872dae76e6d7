"""PenaltyState (device-resident token counts) against the reference `apply_penalties`: the same bits,
for mixed batches, over many steps, after a slot is restarted (preemption, reuse), in every float
dtype."""
import random

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.ops import sampler
from deepinfer_core.ops.penalties import PenaltyState, apply_penalties, wants_penalties

S = SamplingParams
BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
        torch.float16: torch.int16}
KINDS = [S(), S(repetition_penalty=1.3), S(repetition_penalty=0.7), S(frequency_penalty=0.37),
         S(presence_penalty=-0.45), S(frequency_penalty=-1.1, presence_penalty=0.3),
         S(repetition_penalty=1.17, frequency_penalty=0.21, presence_penalty=1.9), S(temperature=0),
         S(repetition_penalty=1.25, presence_penalty=-0.0), S(frequency_penalty=-0.0, presence_penalty=0.6)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def random_logits(g: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 4
    x[:, ::7] = 0.0                                     # exact zeros: the `row > 0` boundary
    x[:, 1::13] = -0.0                                  # x - (-0.0) turns these into +0.0
    x[:, 3::11] = x[:, 3::11].round()                   # exact small integers
    return x.to(dtype)


class Run:
    """Sequences in slots, with their prompt and output as Python lists (the reference's input)."""

    def __init__(self, seed: int, vocab: int, num_slots: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.state = PenaltyState(num_slots, vocab, "cpu")
        self.slot_of: list[int] = []
        self.params: list[SamplingParams] = []
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []

    def ids(self, n: int) -> list[int]:
        # A small alphabet for some sequences: many repeats, counts well above 1.
        top = self.vocab if self.rng.random() < 0.5 else 9
        return [self.rng.randrange(top) for _ in range(n)]

    def admit(self, slots: list[int], outputs_too: bool = False) -> None:
        """(Re)start these slots with fresh sequences; only penalised ones are started (as the engine)."""
        for s in slots:
            seq = {"params": self.rng.choice(KINDS), "prompt": self.ids(self.rng.randrange(0, 40)),
                   "output": self.ids(self.rng.randrange(1, 30)) if outputs_too else []}
            if s in self.slot_of:
                i = self.slot_of.index(s)
            else:
                i = len(self.slot_of)
                self.slot_of.append(s)
                self.params.append(None)
                self.prompts.append(None)
                self.outputs.append(None)
            self.params[i], self.prompts[i], self.outputs[i] = seq["params"], seq["prompt"], seq["output"]
        started = [i for i, s in enumerate(self.slot_of) if s in slots and wants_penalties(self.params[i])]
        self.state.start([self.slot_of[i] for i in started], [self.prompts[i] for i in started],
                         [self.outputs[i] for i in started])

    def check(self, g: torch.Generator, dtype: torch.dtype, slots_as_list: bool = False) -> None:
        logits = random_logits(g, len(self.slot_of), self.vocab, dtype)
        before = logits.clone()
        want = apply_penalties(logits, self.params, self.outputs, self.prompts)
        slots = self.slot_of if slots_as_list else torch.tensor(self.slot_of)
        got = self.state.apply(logits, slots, self.params)
        assert same_bits(got, want)
        assert same_bits(logits, before)                # the raw logits stay intact
        if not any(wants_penalties(p) for p in self.params):
            assert got is logits

    def step(self, tokens_per_row: int = 1) -> None:
        slots, tokens = [], []
        for i, s in enumerate(self.slot_of):
            for _ in range(tokens_per_row):
                t = self.ids(1)[0]
                self.outputs[i].append(t)
                slots.append(s)
                tokens.append(t)
        self.state.add(torch.tensor(slots), torch.tensor(tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("vocab", [50, 1000])
def test_state_matches_reference_bitwise(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    run = Run(seed=vocab + 1, vocab=vocab, num_slots=24)
    run.admit(random.Random(0).sample(range(24), 12))     # slots in a random order
    run.check(g, dtype)
    for step in range(6):
        run.step(tokens_per_row=1 + step % 3)             # several tokens a step: repeated slots in add
        run.check(g, dtype, slots_as_list=step % 2 == 1)
    # Preemption: a slot recomputed from its prompt + output so far; reuse: new sequences in old slots.
    run.admit(run.slot_of[:3], outputs_too=True)
    run.check(g, dtype)
    for _ in range(3):
        run.step()
        run.check(g, dtype)
    run.admit(run.slot_of[5:9])
    run.step()
    run.check(g, dtype)


def test_subset_of_slots_and_fully_penalised_batch():
    g = torch.Generator().manual_seed(5)
    state = PenaltyState(8, 30, "cpu")
    params = [S(frequency_penalty=0.5), S(repetition_penalty=1.5)]
    state.start([6, 2], [[1, 2, 3], [4]], [[5, 5], []])
    state.add(torch.tensor([6, 2, 2]), torch.tensor([7, 8, 8]))
    logits = random_logits(g, 2, 30, torch.float32)
    want = apply_penalties(logits, params, [[5, 5, 7], [8, 8]], [[1, 2, 3], [4]])
    assert same_bits(state.apply(logits, torch.tensor([6, 2]), params), want)
    # The same rows in a bigger batch with unpenalised rows around them.
    big = torch.cat([logits[1:], random_logits(g, 1, 30, torch.float32), logits[:1]])
    bp = [params[1], S(), params[0]]
    got = state.apply(big, torch.tensor([2, 0, 6]), bp)
    assert same_bits(got[0], want[1]) and same_bits(got[2], want[0]) and same_bits(got[1], big[1])


def test_rows_count_their_preceding_tokens_like_the_reference():
    """Speculative verification: row j of a verify chunk counts the chunk's first j drafts on top of
    its slot's outputs, as the reference does with those drafts appended (the same bits)."""
    g = torch.Generator().manual_seed(9)
    state = PenaltyState(4, 40, "cpu")
    params = [S(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2), S(), S(frequency_penalty=0.7)]
    outputs = [[5, 5, 9], [], [1]]
    state.start([3, 0], [[2, 3], [7]], [outputs[0], outputs[2]])
    drafts = [[9, 11, 5], [4], [1, 1]]
    rows = [(i, j) for i, d in enumerate(drafts) for j in range(len(d) + 1)]
    logits = random_logits(g, len(rows), 40, torch.float32)
    got = state.apply(logits, [[3, 1, 0][i] for i, _ in rows], [params[i] for i, _ in rows],
                      preceding=[drafts[i][:j] for i, j in rows])
    want = apply_penalties(logits, [params[i] for i, _ in rows], [outputs[i] + drafts[i][:j] for i, j in rows],
                           [[[2, 3], [], [7]][i] for i, _ in rows])
    assert same_bits(got, want)
    assert not same_bits(got[1], state.apply(logits[1:2], [3], params[:1])[0])   # the drafts did count


def test_exact_values():
    state = PenaltyState(2, 5, "cpu")
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5, 4.0], [1.0, 3.0, -2.0, 0.5, 4.0]])
    params = [S(repetition_penalty=2.0), S(presence_penalty=0.5, frequency_penalty=0.25)]
    state.start([0, 1], [[4], []], [[1], [1, 3]])
    state.add(torch.tensor([0, 1]), torch.tensor([2, 1]))
    assert state.apply(logits, torch.tensor([0, 1]), params).tolist() == [
        [1.0, 1.5, -4.0, 0.5, 2.0], [1.0, 3.0 - 0.5 - 0.5, -2.0, 0.5 - 0.5 - 0.25, 4.0]]


def test_lazy_allocation_and_noops():
    state = PenaltyState(4, 10, "cpu")
    state.add(torch.tensor([0, 1]), torch.tensor([3, 3]))     # nothing started: skipped
    logits = torch.zeros(2, 10)
    assert state.apply(logits, torch.tensor([0, 1]), [S(), S(temperature=0)]) is logits
    assert not state.allocated
    state.start([], [], [])
    assert not state.allocated
    with pytest.raises(RuntimeError, match="started"):
        state.apply(logits, torch.tensor([0, 1]), [S(), S(presence_penalty=1.0)])
    state.start([3], [[1]], [[]])
    assert state.allocated and state.counts.dtype == torch.int32 and state.prompt.dtype == torch.bool
    state.add(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    assert int(state.counts.sum()) == 0


def test_restart_clears_the_old_row():
    state = PenaltyState(3, 6, "cpu")
    state.start([1], [[0, 5]], [[2, 2]])
    state.add(torch.tensor([1, 1]), torch.tensor([3, 2]))
    assert state.counts[1].tolist() == [0, 0, 3, 1, 0, 0]
    state.start([1], [[4]], [[]])
    assert state.counts[1].tolist() == [0] * 6
    assert state.prompt[1].tolist() == [False, False, False, False, True, False]


def test_start_validates_on_the_host():
    state = PenaltyState(4, 10, "cpu")
    with pytest.raises(ValueError, match="vocab|\\[0, 10\\)"):
        state.start([0], [[10]], [[]])
    with pytest.raises(ValueError, match="\\[0, 10\\)"):
        state.start([0], [[]], [[-1]])
    with pytest.raises(ValueError, match="distinct"):
        state.start([1, 1], [[], []], [[], []])
    with pytest.raises(ValueError, match="distinct"):
        state.start([4], [[]], [[]])
    with pytest.raises(ValueError, match="slots"):
        state.start([0, 1], [[]], [[], []])
    with pytest.raises(ValueError, match="rows"):
        state.apply(torch.zeros(2, 10), torch.tensor([0]), [S(), S()])


def test_reference_is_still_exported_by_the_sampler_module():
    assert sampler.apply_penalties is apply_penalties


@pytest.mark.parametrize("rows_penalised", [[1], [0, 1, 2]])
def test_inplace_writes_the_same_bits_into_the_logits(rows_penalised):
    g = torch.Generator().manual_seed(9)
    state = PenaltyState(3, 40, "cpu")
    params = [S(repetition_penalty=1.4, frequency_penalty=0.3) if i in rows_penalised else S()
              for i in range(3)]
    state.start(rows_penalised, [[1, 2, 3]] * len(rows_penalised), [[4, 4, 5]] * len(rows_penalised))
    logits = random_logits(g, 3, 40, torch.float32)
    want = state.apply(logits, [0, 1, 2], params)
    got = state.apply(logits, torch.tensor([0, 1, 2]), params, inplace=True)
    assert got is logits and same_bits(logits, want)


@pytest.mark.parametrize("params,zero", [(S(repetition_penalty=1.25, presence_penalty=-0.0), "0.0"),
                                         (S(repetition_penalty=1.25, frequency_penalty=-0.0), "0.0"),
                                         (S(repetition_penalty=1.25), "-0.0")])
def test_signed_zero_penalties_like_the_reference(params, zero):
    # x - (-0.0 * n) turns a -0.0 logit into +0.0 in the reference; a +0.0 penalty leaves it alone.
    state = PenaltyState(1, 6, "cpu")
    state.start([0], [[1]], [[2]])
    logits = torch.tensor([[-0.0, 1.0, -0.0, 2.0, -0.0, -1.0]])
    want = apply_penalties(logits, [params], [[2]], [[1]])
    got = state.apply(logits, [0], [params])
    assert same_bits(got, want)
    assert str(got[0, 0].item()) == zero
