"""The scheduler on its own: no model, no device. `schedule()` is checked against its contract, and
`update_from_output` is fed hand-made runner outputs (what a runner would return for the step)."""
import pytest
import torch

from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import (DEAD_END, ModelRunnerOutput, SampledTokens, ScheduledRequest, Scheduler,
                                        SchedulerOutput)
from deepinfer.engine.speculative import Drafts, Speculation, SpeculativeDecoder
from deepinfer.engine.structured_masks import StructuredMasks
from deepinfer.logits_processor import LogitsProcessor
from deepinfer.models.interface import BlockGroup, CacheLayout, StateTensor
from deepinfer.sampling_params import SamplingParams
from engine_helpers import ToyTokenizer

LAYOUT = CacheLayout(slot_tensors=(StateTensor("ring", (4,), torch.int64, (0,)),),
                     block_groups=(BlockGroup("c4", 4, (StateTensor("entry", (1,), torch.int64, (0,)),)),),
                     max_rollback=0)
EOS = 1


def make(num_slots=4, num_blocks=64, block_size=4, max_num_seqs=4, budget=16, max_model_len=256, **kw) -> Scheduler:
    cache = CacheManager(LAYOUT, num_slots, {"c4": num_blocks}, block_size)
    return Scheduler(cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                     **kw)


def req(i: int, prompt_len: int, max_tokens: int = 4, **params) -> Request:
    return Request(request_id=f"r{i}", prompt=None, prompt_token_ids=[10 + i] * prompt_len,
                   params=SamplingParams(temperature=0, max_tokens=max_tokens, **params), arrival_index=i)


def emit(out: SchedulerOutput, token: int = 7, **drafts: Drafts) -> ModelRunnerOutput:
    """A runner's output for `out`: every sampled request emits `token` (log-probability -0.5)."""
    return ModelRunnerOutput(sampled={s.request_id: SampledTokens([token], [-0.5]) for s in out.sampled},
                             drafts=drafts)


def run(sched: Scheduler, reqs: list[Request], limit: int = 1000) -> list[SchedulerOutput]:
    for r in reqs:
        sched.add_request(r)
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        outs.append(out)
        sched.update_from_output(out, emit(out))
        assert len(outs) < limit
    return outs


# ------------------------------------------------------------------------------------ schedule()


def test_output_is_a_typed_contract():
    sched = make()
    sched.add_request(req(0, 5))
    out = sched.schedule()
    assert isinstance(out, SchedulerOutput) and out.step_id == 1
    (s,) = out.scheduled
    assert isinstance(s, ScheduledRequest)
    assert (s.context_len, s.token_ids, s.num_placeholders, s.sample, s.output_index) == (0, [10] * 5, 0, True, 0)
    assert out.num_scheduled_tokens == 5 and out.sampled == [s] and out.num_running == 1
    # what the runner reads is a snapshot: freeing the request's cache does not change the entry
    assert (s.slot, s.block_ids, s.num_known_tokens, s.constrained) == (s.request.slot, {"c4": [0]}, 5, False)
    sched.cache.free(s.request)
    assert s.slot is not None and s.block_ids == {"c4": [0]}


def test_token_budget_and_max_num_seqs():
    sched = make(budget=16, max_num_seqs=2)
    for i in range(4):
        sched.add_request(req(i, 10))
    out = sched.schedule()
    assert [(s.request_id, s.query_len, s.sample) for s in out.scheduled] == [("r0", 10, True), ("r1", 6, False)]
    assert out.num_waiting == 2 and out.num_running == 2
    sched.update_from_output(out, emit(out))
    out = sched.schedule()  # r0 decodes, r1 finishes its prompt; max_num_seqs keeps r2 waiting
    assert [(s.request_id, s.query_len) for s in out.scheduled] == [("r0", 1), ("r1", 4)]


def test_chunked_prefill_carries_positions_and_samples_once():
    sched = make(budget=16)
    r = req(0, 40, max_tokens=2)
    outs = run(sched, [r])
    chunks = [(o.scheduled[0].context_len, o.scheduled[0].query_len, o.scheduled[0].sample) for o in outs]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True)]
    assert r.output_token_ids == [7, 7] and r.finish_reason == "length"


def test_decodes_go_before_prefill_chunks():
    sched = make(budget=8)
    old, new = req(0, 100), req(1, 2)
    sched.add_request(new)
    first = sched.schedule()
    sched.update_from_output(first, emit(first))  # `new` is now decoding
    sched.add_request(old)
    old.arrival_index = -1  # older than `new`, still prefilling
    out = sched.schedule()
    assert [(s.request_id, s.query_len) for s in out.scheduled] == [("r1", 1), ("r0", 7)]


def test_waiting_queue_is_first_come_first_served():
    sched = make(num_blocks=6, block_size=4, budget=64)
    first = req(0, 60, max_tokens=50)
    sched.add_request(first)
    out = sched.schedule()
    sched.update_from_output(out, emit(out))  # holds 4 of the 6 blocks
    big, small = req(1, 64), req(2, 4)  # big's first chunk needs 4 blocks, small's 1
    sched.add_request(big)
    sched.add_request(small)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0"]  # `small` would fit but does not overtake


def test_preemption_by_recompute_keeps_generated_tokens():
    # 4 blocks of 4 entries = 64 tokens of context in total; two requests of up to 44 tokens each.
    sched = make(num_blocks=4, block_size=4, budget=64)
    a, b = req(0, 20, max_tokens=24), req(1, 20, max_tokens=24)
    outs = run(sched, [a, b])
    preempted = [rid for o in outs for rid in o.preempted]
    assert preempted and set(preempted) == {"r1"}  # always the newest
    assert b.num_preemptions == len(preempted) and sched.num_preemptions == len(preempted)
    assert a.output_token_ids == [7] * 24 and b.output_token_ids == [7] * 24
    # after a preemption, b recomputes prompt + generated tokens from position 0, then continues
    resumed = [s for o in outs for s in o.scheduled if s.request is b and s.context_len == 0]
    assert len(resumed) == 1 + len(preempted)
    last = resumed[-1]
    assert last.token_ids[:20] == [11] * 20 and set(last.token_ids[20:]) <= {7}
    assert sched.cache.stats().slots_used == 0 and sched.cache.stats().blocks_used == {"c4": 0}


def test_preempting_itself_when_nothing_newer_runs():
    sched = make(num_slots=2, num_blocks=3, block_size=4, budget=64)  # 48 tokens of context in total
    a, b = req(0, 20, max_tokens=20), req(1, 8, max_tokens=20)
    outs = run(sched, [a, b])
    assert a.finish_reason == b.finish_reason == "length"
    assert not a.num_preemptions  # the oldest request is never the victim
    assert sum(len(o.preempted) for o in outs) == b.num_preemptions >= 1


def test_a_request_larger_than_the_pool_is_an_error_not_a_livelock():
    sched = make(num_blocks=2, block_size=4, budget=64)  # 32 tokens of context
    with pytest.raises(RuntimeError, match="more than the whole pool"):
        run(sched, [req(0, 30, max_tokens=10)])


def test_in_flight_tokens_become_placeholders():
    """Async pipeline: schedule the next step before the previous one's token is known."""
    sched = make()
    r = req(0, 3, max_tokens=3)
    sched.add_request(r)
    first = sched.schedule()
    second = sched.schedule()  # first step still in flight
    (s,) = second.scheduled
    assert (s.context_len, s.token_ids, s.num_placeholders, s.sample, s.output_index) == (3, [], 1, True, 1)
    assert r.num_pending_tokens == 2
    third = sched.schedule()
    assert third.scheduled[0].output_index == 2
    assert sched.schedule().is_empty  # max_tokens=3 already in flight: nothing more to schedule
    for out, token in ((first, 7), (second, 8), (third, 9)):
        sched.update_from_output(out, emit(out, token))
    assert r.output_token_ids == [7, 8, 9] and r.status is RequestStatus.FINISHED and r.num_pending_tokens == 0


def test_a_preempted_request_waits_for_its_in_flight_token():
    sched = make(num_blocks=2, block_size=4, budget=64)  # 32 tokens of context in total
    a, b = req(0, 19, max_tokens=10), req(1, 19, max_tokens=10)  # 1 block each, 2 at token 20
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    assert len(first.scheduled) == 2
    second = sched.schedule()  # both decode with a placeholder; b is preempted for a's block
    assert second.preempted == ["r1"] and [s.request_id for s in second.scheduled] == ["r0"]
    assert b.num_pending_tokens == 1 and b.status is RequestStatus.WAITING
    sched.update_from_output(first, emit(first))
    assert b.output_token_ids == [7]  # the token sampled before the preemption is kept
    sched.update_from_output(second, emit(second))
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, emit(out))
    assert a.output_token_ids == b.output_token_ids == [7] * 10


@pytest.mark.parametrize("budget", [1, 3, 16])
def test_everything_finishes_under_pressure(budget):
    sched = make(num_slots=3, num_blocks=10, block_size=2, budget=budget, max_num_seqs=3)
    reqs = [req(i, 1 + (7 * i) % 23, max_tokens=1 + i % 5) for i in range(12)]
    run(sched, reqs, limit=5000)
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    stats = sched.cache.stats()
    assert stats.slots_used == 0 and stats.blocks_used == {"c4": 0}


# --------------------------------------------------------------------------- update_from_output()


def _outputs(**kw) -> OutputProcessor:
    return OutputProcessor(ToyTokenizer(), {EOS}, max_model_len=kw.get("max_model_len", 256))


def _one_step(sched: Scheduler, r: Request) -> SchedulerOutput:
    sched.add_request(r)
    return sched.schedule()


def test_update_appends_tokens_finishes_at_max_tokens_and_frees_the_cache():
    sched = make(outputs=_outputs())
    r = req(0, 3, max_tokens=2)
    out = _one_step(sched, r)
    assert sched.update_from_output(out, emit(out, 5)) == []
    assert r.output_token_ids == [5] and r.sum_logprob == -0.5 and r.first_token_time is not None
    assert r.num_pending_tokens == 0 and r.num_computed_tokens == 3
    out = sched.schedule()
    assert out.scheduled[0].token_ids == [5]  # the appended token is the next input
    assert sched.update_from_output(out, emit(out, 6)) == [r]
    assert (r.finish_reason, r.text, r.output_token_ids) == ("length", ToyTokenizer().decode([5, 6]), [5, 6])
    assert not sched.has_unfinished() and r.request_id not in sched.requests
    assert sched.cache.stats().slots_used == 0


def test_eos_and_stop_tokens_apply_only_after_min_tokens():
    for params, tokens, expected in [
        (dict(), [EOS], ("stop", None, 1)),  # EOS: kept in the tokens, not in the text
        (dict(ignore_eos=True, max_tokens=2), [EOS, EOS], ("length", None, 2)),
        (dict(stop_token_ids=[9]), [9], ("stop", 9, 1)),
        (dict(stop_token_ids=[9], min_tokens=2), [9, 9], ("stop", 9, 2)),  # the first 9 is before min_tokens
    ]:
        sched = make(outputs=_outputs())
        r = req(0, 2, **{"max_tokens": 8, **params})
        out = _one_step(sched, r)
        for token in tokens:
            sched.update_from_output(out, emit(out, token))
            out = sched.schedule()
        assert (r.finish_reason, r.stop_reason, len(r.output_token_ids)) == expected, params
        kept = r.output_token_ids[:-1] if r.finish_reason == "stop" else r.output_token_ids
        assert r.text == ToyTokenizer().decode(kept)  # a stop token stays out of the text


def test_stop_strings_cut_the_text_and_max_model_len_ends_a_request():
    tok = ToyTokenizer()
    sched = make(outputs=_outputs())
    r = req(0, 2, max_tokens=10, stop=["cd"])
    out = _one_step(sched, r)
    for ch in "abcde":
        done = sched.update_from_output(out, emit(out, tok.encode(ch)[0]))
        out = sched.schedule()
    assert done == [] and r.finish_reason == "stop" and r.stop_reason == "cd"
    assert r.text == "ab" and len(r.output_token_ids) == 4  # "d" completed the stop string
    sched = make(outputs=_outputs(max_model_len=4), max_model_len=4)
    r = req(1, 3, max_tokens=10)
    out = _one_step(sched, r)
    assert sched.update_from_output(out, emit(out)) == [r] and r.finish_reason == "length"


def test_a_dead_row_ends_the_request_after_the_tokens_before_it():
    sched = make()
    r = req(0, 2, max_tokens=8)
    out = _one_step(sched, r)
    done = sched.update_from_output(out, ModelRunnerOutput({"r0": SampledTokens([], [], dead=True)}))
    assert done == [r] and r.finish_reason == DEAD_END and "masked" in r.error and r.output_token_ids == []


def test_tokens_of_a_request_finished_while_its_step_ran_are_discarded():
    sched = make()
    a, b = req(0, 2), req(1, 2)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert sched.apply_failures({"r0": ("error", "its grammar broke")}) == [a]  # e.g. found while filling masks
    assert sched.update_from_output(out, emit(out)) == []
    assert (a.finish_reason, a.error, a.output_token_ids, a.num_pending_tokens) == ("error", "its grammar broke", [], 0)
    assert b.output_token_ids == [7]


def test_logprob_entries_hold_the_sampled_token_then_the_top_k():
    sched = make(outputs=_outputs())
    r = req(0, 2, logprobs=2)
    out = _one_step(sched, r)
    result = SampledTokens([5], [-1.0], ranks=[2], top=[[(6, -0.5), (5, -1.0)]])
    sched.update_from_output(out, ModelRunnerOutput({"r0": result}))
    (entry,) = r.logprobs
    assert list(entry) == [5, 6] and (entry[5].rank, entry[6].rank, entry[6].logprob) == (2, 1, -0.5)
    assert entry[5].decoded_token == ToyTokenizer().decode([5])


class Allow(LogitsProcessor):
    """Tracks every request; `accept` completes the constraint at `done`, fails at `fail`; drafts
    are valid up to the first `bad` token."""

    def __init__(self, done=None, fail=None, bad=None):
        self.done, self.fail, self.bad = done, fail, bad
        self.failures, self.accepted, self.removed = {}, [], []

    def add_request(self, request_id, sampling_params):
        return True

    def remove_request(self, request_id):
        self.removed.append(request_id)

    def fill_bitmask(self, request_ids, bitmask, draft_tokens=None):
        pass

    def accept(self, request_id, token_ids):
        self.accepted += token_ids
        if token_ids == [self.fail]:
            self.failures[request_id] = ("error", "cannot continue")
        return token_ids == [self.done]

    def count_valid_draft(self, request_id, draft_tokens):
        return draft_tokens.index(self.bad) if self.bad in draft_tokens else len(draft_tokens)

    def pop_failures(self):
        out, self.failures = self.failures, {}
        return out


def test_logits_processors_see_each_token_and_can_end_the_request():
    for processor, expected in [(Allow(done=7), ("stop", [7])), (Allow(fail=7), ("error", []))]:
        sched = make(masks=StructuredMasks([processor], vocab_size=64))
        r = req(0, 2)
        r.processors = (0,)  # what admission records
        out = _one_step(sched, r)
        assert out.scheduled[0].constrained
        sched.update_from_output(out, emit(out, 7))
        assert (r.finish_reason, r.output_token_ids) == expected  # a failing token is discarded
        assert processor.accepted == [7] and processor.removed == ["r0"]


# ------------------------------------------------------------------------------- speculative decoding


class NoDrafts:
    """A drafter the scheduler never calls (drafts come in through the runner output here)."""

    features = None
    context_window = 0

    def propose(self, requests, features):
        return [None] * len(requests)

    def forget(self, request_id):
        pass


class KeepFirst:
    """A verification policy that verifies `n` drafts of every request and records what it saw."""

    def __init__(self, n):
        self.n, self.seen = n, []

    def plan(self, confidences, draft_seconds):
        return [self.n] * len(confidences)

    def observe(self, confidences, num_verified, num_accepted):
        self.seen.append((list(confidences), num_verified, num_accepted))


def _speculative(k=4, policy=None, **kw) -> Scheduler:
    spec = SpeculativeDecoder(Speculation(NoDrafts(), k, policy), sampler=None, accelerator=None, max_model_len=256)
    return make(speculator=spec, **kw)


def _drafts(tokens) -> Drafts:
    return Drafts(list(tokens), [0.9 - 0.1 * i for i in range(len(tokens))])


def test_a_verification_rolls_back_the_rejected_drafts_and_stores_the_next_ones():
    sched = _speculative(k=4)
    r = req(0, 5, max_tokens=10)
    out = _one_step(sched, r)
    sched.update_from_output(out, emit(out, 7, r0=_drafts([20, 21, 22, 23])))  # prefill: 1 token + 4 drafts
    assert r.draft_token_ids == [20, 21, 22, 23] and r.num_computed_tokens == 5
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.token_ids, s.draft_token_ids, s.query_len, s.is_decode) == ([7], [20, 21, 22, 23], 5, True)
    assert r.num_computed_tokens == 10  # the drafts' positions are written too
    assert sched.schedule().is_empty  # a request with a step in flight waits for it
    # the target accepts 20 and 21, then replaces 22 by 30
    result = ModelRunnerOutput({"r0": SampledTokens([20, 21, 30], [-0.1] * 3)}, drafts={"r0": _drafts([31, 32])})
    assert sched.update_from_output(out, result) == []
    assert r.output_token_ids == [7, 20, 21, 30]
    assert r.num_computed_tokens == 5 + 1 + 2  # the anchor and the two accepted drafts; 30 is the next input
    assert r.draft_token_ids == [31, 32] and (r.num_drafts_verified, r.num_drafts_accepted) == (4, 2)
    stats = sched.speculator.stats
    assert (stats.num_verifications, stats.num_drafts_verified, stats.num_drafts_accepted) == (1, 4, 2)
    assert stats.num_tokens_emitted == 3 and stats.acceptance_by_position == [1.0, 1.0, 0.0, 0.0]
    out = sched.schedule()
    assert (out.scheduled[0].context_len, out.scheduled[0].token_ids) == (8, [30])


def test_drafts_never_pass_max_tokens_and_stop_mid_run():
    sched = _speculative(k=4, outputs=_outputs())
    r = req(0, 5, max_tokens=4, stop_token_ids=[21])
    out = _one_step(sched, r)
    sched.update_from_output(out, emit(out, 7, r0=_drafts([20, 21, 22, 23])))
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [20, 21]  # 1 output + 2 drafts + 1 target token = max_tokens
    sched.update_from_output(out, ModelRunnerOutput({"r0": SampledTokens([20, 21, 40], [-0.1] * 3)}))
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == ([7, 20, 21], "stop", 21)  # 40 is discarded
    assert r.draft_token_ids == [] and sched.speculator.stats.num_drafts_accepted == 2


def test_drafts_the_grammar_rejects_are_dropped():
    sched = _speculative(k=4, masks=StructuredMasks([Allow(bad=22)], vocab_size=64))
    r = req(0, 5, max_tokens=10)
    r.processors = (0,)
    out = _one_step(sched, r)
    sched.update_from_output(out, emit(out, 7, r0=_drafts([20, 21, 22, 23])))
    assert r.draft_token_ids == [20, 21] and r.drafts.confidence == pytest.approx([0.9, 0.8])


def test_a_verification_policy_trims_drafts_and_limits_the_next_proposal():
    policy = KeepFirst(1)
    sched = _speculative(k=4, policy=policy)
    r = req(0, 5, max_tokens=10)
    out = _one_step(sched, r)
    assert out.scheduled[0].draft_limit == 4  # never planned: the configured maximum
    sched.update_from_output(out, emit(out, 7, r0=_drafts([20, 21, 22])))
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.draft_token_ids == [20] and r.num_drafts_planned == 1 and s.draft_limit == 2
    sched.update_from_output(out, ModelRunnerOutput({"r0": SampledTokens([33], [-0.1])}))  # draft 20 rejected
    assert policy.seen == [([pytest.approx(0.9)], 1, 0)]
    assert r.output_token_ids == [7, 33] and r.num_computed_tokens == 6


def test_preemption_drops_the_drafts():
    sched = _speculative(k=2, num_blocks=2, block_size=4, budget=64)  # 32 tokens of context
    a, b = req(0, 17, max_tokens=10), req(1, 17, max_tokens=10)  # one block each; a's drafts reach token 20
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, emit(out, 7, r0=_drafts([20, 21]), r1=_drafts([20, 21])))
    out = sched.schedule()  # a's drafts need its second block: b is preempted
    assert out.preempted == ["r1"] and b.drafts is None and b.num_computed_tokens == 0
    assert out.scheduled[0].draft_token_ids == [20, 21]
