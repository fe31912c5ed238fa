"""The scheduler alone: no workers, no torch. Its decisions are checked exactly (which
sequence runs, which positions each work feeds, who is preempted), and its bookkeeping
from given outputs (what is emitted, where each sequence stands, who finishes)."""

from __future__ import annotations

import numpy as np
import pytest

from luced.engine.kv.budget import RESERVE_STEP, KVBudget
from luced.engine.kv.finished import FinishedPrefixes
from luced.engine.output import OutputBuilder, Sampled
from luced.engine.pooling import Pooler
from luced.engine.request import GenerationRequest, RequestHandle, Sequence, Status
from luced.engine.scheduler import Scheduler, StepResult, WorkOutput
from luced.engine.spec.ngram import PromptLookup
from luced.sampling_params import SamplingParams
from luced.text.tokenizer import Tokenizer

CHUNK = 8
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


class Maker:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tickets = 0

    def __call__(
        self, prompt_len: int, max_tokens: int = 50, stop: tuple[str, ...] = (), **params
    ) -> Sequence:
        self.tickets += 1
        prompt = [100 + (i % 50) for i in range(prompt_len)]
        req = GenerationRequest(
            f"r{self.tickets}", prompt, SamplingParams(**{"temperature": 0, **params}), stop=stop
        )
        out = OutputBuilder(self.tokenizer, stop, want_logprobs=False)
        return Sequence(
            RequestHandle(req, max_tokens),
            ticket=self.tickets,
            sampling=req.params.to_wire(),
            stops=frozenset({EOS}),
            out=out,
            tokens=list(prompt),
        )


@pytest.fixture
def make(tokenizer: Tokenizer) -> Maker:
    return Maker(tokenizer)


def scheduler(max_running: int = 4, step: int = 32, pool: int = 1000) -> Scheduler:
    return Scheduler(max_running=max_running, max_step_tokens=step, chunk=CHUNK, kv=KVBudget(pool))


def spans(batch) -> list[tuple[str, int, int, int]]:
    """Each work as (request, start, tokens fed, output rows)."""
    return [(w.seq.handle.request_id, w.start, len(w.tokens), w.n_out) for w in batch.works]


def out(*tokens: int) -> WorkOutput:
    return WorkOutput([Sampled(t) for t in tokens])


def test_admission_is_first_come_first_served_within_slots_and_kv(make) -> None:
    s = scheduler(max_running=2, pool=40)
    a, b, c = make(10), make(12), make(3)
    for seq in (a, b, c):
        s.add(seq)
    assert s.admit() == [a, b]  # two slots
    assert (a.slot, b.slot, c.slot) == (0, 1, -1)
    assert a.status is Status.RUNNING and c.status is Status.WAITING
    s.running.remove(b)  # as if b finished
    s.kv.release(1)
    big = make(31)
    s.waiting.appendleft(big)  # an older request that does not fit the pool beside a
    assert s.admit() == []  # ... and the younger c may not overtake it
    assert s.kv.held == {0: 10}


def test_a_request_not_ready_or_held_lets_later_ones_pass(make) -> None:
    s = scheduler()
    a, b = make(5), make(5)
    a.ready = False  # its grammar is still being built
    s.add(a)
    s.add(b)
    assert s.admit() == [b]
    a.ready = True
    assert s.admit(hold=lambda seq: seq is a) == []
    assert s.admit() == [a]


def test_prompt_chunks_end_at_absolute_multiples_of_the_chunk(make) -> None:
    """A prompt restored to position 5 is cut 5..8, 8..16, 16..20: the chunks a fresh
    prefill of the same prompt ends at, whatever the budget."""
    s = scheduler(step=64)
    seq = make(20)
    s.add(seq)
    s.admit()
    seq.computed = 5  # restored
    batches = []
    while seq.prefilling:
        batch = s.schedule()
        batches.append(spans(batch))
        s.update(batch, [out(7) if w.n_out else WorkOutput([]) for w in batch.works])
    assert batches == [[("r1", 5, 3, 0)], [("r1", 8, 8, 0)], [("r1", 16, 4, 1)]]
    assert seq.generated == [7] and seq.computed == 20


def test_decodes_come_first_and_prompt_chunks_fill_the_budget(make) -> None:
    s = scheduler(step=12)
    old, young = make(4), make(30)
    s.add(old)
    s.admit()
    batch = s.schedule()
    s.update(batch, [out(9)])  # old's prompt, then its first token
    s.add(young)
    s.admit()
    batch = s.schedule()
    assert spans(batch) == [("r1", 4, 1, 1), ("r2", 0, 8, 0)]  # 1 + 8 <= 12; next chunk waits
    s.update(batch, [out(10), WorkOutput([])])
    assert old.tokens[-2:] == [9, 10] and old.computed == 5 and young.computed == 8


def test_the_oldest_prefill_goes_first_and_whole_chunks_only(make) -> None:
    s = scheduler(step=CHUNK + 4)
    a, b = make(20), make(20)
    for seq in (a, b):
        s.add(seq)
    s.admit()
    batch = s.schedule()
    assert spans(batch) == [("r1", 0, 8, 0)]  # b's chunk of 8 does not fit beside it
    s.update(batch, [WorkOutput([])])
    b.computed = 16  # say b got most of its prompt shared: a 4-token chunk fits now
    assert spans(s.schedule()) == [("r1", 8, 8, 0), ("r2", 16, 4, 1)]


def test_a_full_pool_preempts_the_newest_and_it_resumes_by_recomputing(make) -> None:
    """Two sequences of 20-token prompts in a pool of 50: growing past it, the older one
    makes the newer give its KV up. The newer waits in its place (before later arrivals),
    keeps its slot (its sampler lives there), and is recomputed: its prompt and its output
    but the last token, fed without sampling, before it decodes that last token."""
    s = scheduler(step=64, pool=50)
    a, b = make(20), make(20)
    for seq in (a, b):
        s.add(seq)
    s.admit()
    for _ in range(3):  # prompts (chunks of 8), first tokens
        batch = s.schedule()
        s.update(batch, [out(11) if w.n_out else WorkOutput([]) for w in batch.works])
    assert a.generated == b.generated == [11]
    late = make(5)
    s.add(late)
    while b.status is Status.RUNNING:
        batch = s.schedule()
        s.update(batch, [out(12) for _ in batch.works])
    assert batch.preempted == [b] and b.slot == 1 and b.computed == 0
    assert list(s.waiting) == [b, late] and s.preemptions == 1
    made = len(b.generated)
    assert b.feed_end == 20 + made - 1 and b.prefilling
    s.running.remove(a)  # a finishes: room again
    s.kv.release(a.slot)
    assert s.admit() == [b, late]
    assert b.slot == 1 and late.slot == 0
    recompute = s.schedule()
    assert [w for w in spans(recompute) if w[0] == "r2"] == [("r2", 0, 8, 0)]


def test_a_finished_sequence_is_kept_and_gives_way_before_anyone_is_preempted(make) -> None:
    """A pool of 60: a finishes and its prompt's 20 positions stay in a kept lane
    (engine/kv/finished.py; its output's are freed); b's admission fits beside it; when b
    grows past the room, the kept lane is given up, not b."""
    s = scheduler(step=64, pool=60)
    kept = FinishedPrefixes(s.kv, 4, limit=60)
    s.keep = lambda seq: kept.lane_for(seq.prompt[: seq.computed])
    a = make(20, max_tokens=5)
    s.add(a)
    s.admit()
    while a.status is Status.RUNNING:
        batch = s.schedule()
        result = s.update(batch, [out(11) if w.n_out else WorkOutput([]) for w in batch.works])
    assert result.kept == [(a, 4)] and s.kv.held == {4: 20} and a.computed == 24
    b = make(35, max_tokens=30)
    s.add(b)
    assert s.admit() == [b] and not s.kv.evicted
    while b.status is Status.RUNNING and not s.kv.evicted:
        batch = s.schedule()
        s.update(batch, [out(12) if w.n_out else WorkOutput([]) for w in batch.works])
    assert s.kv.evicted == [4] and b.status is Status.RUNNING and s.preemptions == 0


def test_a_preempted_sequence_returns_once_the_running_cannot_push_it_out_again(make) -> None:
    """a (20 prompt tokens, up to 50 more) holds 30 positions of a pool of 90; b, preempted
    with 24 positions to recompute, would fit beside it now (54), but not beside what a may
    still grow to (70): it waits for a instead of being recomputed twice. A new request
    behind it waits too (first come, first served)."""
    s = scheduler(pool=90)
    a = make(20)
    s.add(a)
    s.admit()
    assert s.kv.grow(a.slot, 30)
    b, c = make(20), make(3)
    b.tokens += [7, 8, 9, 10, 11]  # it had generated 5 tokens
    b.slot = 1  # the workers keep its sampler there
    s.add(b)
    s.add(c)
    assert s.admit() == []
    s.finish(a, StepResult())
    assert s.admit() == [b, c] and b.slot == 1


def test_a_preempted_sequence_that_generated_nothing_starts_over(make) -> None:
    s = scheduler()
    a = make(16)
    s.add(a)
    s.admit()
    batch = s.schedule()
    s.update(batch, [WorkOutput([])])  # its first chunk
    s.preempt(a, batch)
    assert (a.slot, a.computed, a.generated) == (-1, 0, []) and list(s.waiting) == [a]
    assert s.admit() == [a] and spans(s.schedule()) == [("r1", 0, 8, 0)]


def test_kv_grows_a_decode_window_ahead(make) -> None:
    s = scheduler(step=64)
    seq = make(4)
    s.add(seq)
    s.admit()
    s.update(s.schedule(), [out(5)])
    s.window = lambda q: (6, "draft")
    batch = s.schedule()
    assert spans(batch) == [("r1", 4, 1, 1)] and batch.works[0].window == 6
    assert s.kv.held[seq.slot] == 4 + 6 + RESERVE_STEP


def test_stop_token_string_and_max_tokens_finish(make) -> None:
    s = scheduler()
    by_eos, by_len, by_string = make(3), make(3, max_tokens=2), make(3, stop=("ab",))
    for seq in (by_eos, by_len, by_string):
        s.add(seq)
    s.admit()
    (a,), (b,) = by_string.out.tokenizer.encode("a"), by_string.out.tokenizer.encode("b")
    firsts = s.update(s.schedule(), [out(EOS), out(40), out(a)])
    assert firsts.finished == [by_eos] and by_eos.handle.finish_reason == "stop"
    result = s.update(s.schedule(), [out(41), out(b)])
    assert result.finished == [by_len, by_string]
    assert by_len.handle.finish_reason == "length" and by_len.generated == [40, 41]
    assert by_string.handle.stop_string == "ab"
    assert not s.running and s.kv.used == 0


def test_a_cancelled_sequence_leaves_at_the_next_update(make) -> None:
    s = scheduler()
    a, b = make(3), make(3)
    for seq in (a, b):
        s.add(seq)
    s.admit()
    batch = s.schedule()
    a.handle.cancel()
    result = s.update(batch, [out(5), out(6)])
    assert result.finished == [a] and a.handle.finish_reason == "abort"
    assert [q.handle.request_id for q in s.running] == ["r2"]
    c = make(3)
    s.add(c)
    assert s.cancel_waiting(c) and not s.waiting


def test_a_greedy_window_keeps_the_accepted_proposals_and_the_targets_token(make) -> None:
    """Window [anchor, p1, p2, p3]: the target's rows agree with p1 and p2, not p3; it
    emits p1, p2 and its own token after p2; the KV keeps anchor, p1, p2 (the next span
    starts there and rolls the rest back)."""
    s = scheduler()
    seq = make(4)
    seq.speculates = True
    seq.lookup = PromptLookup()
    s.add(seq)
    s.admit()
    s.update(s.schedule(), [out(20)])
    s.window = lambda q: (4, "run")
    batch = s.schedule()
    (work,) = batch.works
    work.tokens, work.n_out = [20, 21, 22, 23], 4  # the proposer's window
    s.update(batch, [out(21, 22, 30, 99)])
    assert seq.generated == [20, 21, 22, 30]
    assert seq.computed == 4 + 3 and seq.tokens[seq.computed] == 30
    assert s.block_sizes[4] == 1 and seq.handle.spec == {
        "drafts": 1,
        "draft_tokens": 3,
        "accepted_tokens": 2,
    }
    s.window = lambda q: (1, "")
    assert spans(s.schedule()) == [("r1", 7, 1, 1)]


def test_a_sampled_window_uses_the_workers_accepted_count(make) -> None:
    s = scheduler()
    seq = make(4, temperature=0.8)
    s.add(seq)
    s.admit()
    s.update(s.schedule(), [out(20)])
    s.window = lambda q: (3, "draft")
    batch = s.schedule()
    batch.works[0].tokens, batch.works[0].n_out = [20, 21, 22], 3
    s.update(batch, [WorkOutput([Sampled(21), Sampled(40)], accepted=1)])
    assert seq.generated == [20, 21, 40] and seq.computed == 4 + 2


def test_a_recurrent_replay_rewinds_to_the_window_start(make) -> None:
    s = scheduler()
    s.recurrent, s.select_rollback = True, False
    seq = make(4)
    s.add(seq)
    s.admit()
    s.update(s.schedule(), [out(20)])
    s.window = lambda q: (3, "draft")
    batch = s.schedule()
    batch.works[0].tokens, batch.works[0].n_out = [20, 21, 22], 3
    s.update(batch, [out(21, 50, 51)])  # p1 accepted, p2 not: the target's token is 50
    assert seq.generated == [20, 21, 50] and seq.computed == 4  # the state kept at 4
    s.window = lambda q: (1, "")
    assert spans(s.schedule()) == [("r1", 4, 2, 0)]  # anchor and p1 fed again, then 50


# -- embeddings -----------------------------------------------------------------------------


def embedding(make: Maker, n: int, kind: str) -> Sequence:
    """An embedding sequence of n input tokens, pooled by `kind` (as Intake.sequence)."""
    seq = make(n, max_tokens=0)
    seq.pooler = Pooler(kind, n)
    return seq


def pooled_rows(batch) -> list[WorkOutput]:
    """What the workers give back: a pooling work's row is [its end, its start] here."""
    return [
        WorkOutput([], pooled=np.array([w.start + len(w.tokens), w.start], np.float32))
        if w.pool
        else out(7)
        if w.n_out
        else WorkOutput([])
        for w in batch.works
    ]


def run(s: Scheduler, *seqs: Sequence) -> list[list[tuple[str, int, int, str]]]:
    """Steps until every `seqs` finished: each step's works as (request, start, fed, pool)."""
    steps = []
    while not all(q.handle.finished for q in seqs):
        batch = s.schedule()
        steps.append(
            [(w.seq.handle.request_id, w.start, len(w.tokens), w.pool) for w in batch.works]
        )
        s.update(batch, pooled_rows(batch))
    return steps


@pytest.mark.parametrize(
    ("kind", "pools", "vector"),
    [
        ("mean", ["sum", "sum", "sum"], [(8 + 16 + 20) / 20, (0 + 8 + 16) / 20]),
        ("cls", ["first", "", ""], [8, 0]),
        ("last", ["", "", "last"], [20, 16]),
    ],
)
def test_an_embedding_pools_its_chunks_and_ends_with_its_input(make, kind, pools, vector) -> None:
    """A 20-token input runs as a prompt does (chunks of 8 at absolute multiples), samples
    nothing, asks each chunk for what its pooling needs, and ends with the vector."""
    s = scheduler(step=64)
    seq = embedding(make, 20, kind)
    s.add(seq)
    s.admit()
    steps = run(s, seq)
    assert [w[1:3] for (w,) in steps] == [(0, 8), (8, 8), (16, 4)]
    assert [w[3] for (w,) in steps] == pools
    assert seq.handle.finish_reason == "stop" and seq.generated == []
    assert seq.handle.embedding.tolist() == pytest.approx(vector)
    assert seq.status is Status.FINISHED and s.running == [] and s.kv.held == {}


def test_an_encoders_input_is_one_span_beside_the_decodes(make) -> None:
    """An encoder sees its whole input at once: one span past the chunk, in a step beside
    a decoding sequence (whose token comes first)."""
    s = scheduler(step=64)
    s.encoder = True
    dec = make(4)
    s.add(dec)
    s.admit()
    s.update(s.schedule(), [out(9)])
    a, b = embedding(make, 20, "cls"), embedding(make, 30, "mean")
    s.add(a)
    s.add(b)
    s.admit()
    steps = run(s, a, b)
    assert steps == [[("r1", 4, 1, ""), ("r2", 0, 20, "first"), ("r3", 0, 30, "sum")]]
    assert a.handle.embedding.tolist() == [20, 0] and b.handle.embedding.tolist() == [1, 0]
    assert s.running == [dec] and dec.generated == [9, 7]


def test_a_preempted_embedding_pools_again_from_its_start(make) -> None:
    """Preempted after its first chunk, an embedding forgets that chunk's row: run again
    from position 0, its mean counts every row once."""
    s = scheduler(step=64)
    seq = embedding(make, 20, "mean")
    s.add(seq)
    s.admit()
    batch = s.schedule()
    s.update(batch, pooled_rows(batch))
    s.preempt(seq, batch)
    assert seq.computed == 0 and seq.slot == -1 and s.admit() == [seq]
    assert [w[1] for (w,) in run(s, seq)] == [0, 8, 16]
    assert seq.handle.embedding.tolist() == pytest.approx([(8 + 16 + 20) / 20, 24 / 20])
