"""The scheduler on its own: no model, no device. A fake 'runner' appends a fixed token per sample."""
import pytest
import torch

from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from deepinfer.models.interface import BlockGroup, CacheLayout, StateTensor
from deepinfer.sampling_params import SamplingParams

LAYOUT = CacheLayout(slot_tensors=(StateTensor("ring", (4,), torch.int64, (0,)),),
                     block_groups=(BlockGroup("c4", 4, (StateTensor("entry", (1,), torch.int64, (0,)),)),),
                     max_rollback=0)


def make(num_slots=4, num_blocks=64, block_size=4, max_num_seqs=4, budget=16, max_model_len=256) -> Scheduler:
    cache = CacheManager(LAYOUT, num_slots, {"c4": num_blocks}, block_size)
    return Scheduler(cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)


def req(i: int, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(request_id=f"r{i}", prompt=None, prompt_token_ids=[10 + i] * prompt_len,
                   params=SamplingParams(temperature=0, max_tokens=max_tokens), arrival_index=i)


def complete(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[Request]:
    """What the engine's update does, minus the model: one token per sampled request."""
    done = []
    for s in out.scheduled:
        if not s.sample:
            continue
        r = s.request
        r.num_pending_tokens -= 1
        if r.is_finished:
            continue
        r.output_token_ids.append(token)
        if len(r.output_token_ids) >= r.params.max_tokens:
            r.finish("length")
            sched.finish_request(r)
            done.append(r)
    return done


def run(sched: Scheduler, reqs: list[Request], limit: int = 1000) -> list[SchedulerOutput]:
    for r in reqs:
        sched.add_request(r)
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        outs.append(out)
        complete(sched, out)
        assert len(outs) < limit
    return outs


def test_output_is_a_typed_contract():
    sched = make()
    sched.add_request(req(0, 5))
    out = sched.schedule()
    assert isinstance(out, SchedulerOutput) and out.step_id == 1
    (s,) = out.scheduled
    assert isinstance(s, ScheduledRequest)
    assert (s.context_len, s.token_ids, s.num_placeholders, s.sample, s.output_index) == (0, [10] * 5, 0, True, 0)
    assert out.num_scheduled_tokens == 5 and out.sampled == [s] and out.num_running == 1


def test_token_budget_and_max_num_seqs():
    sched = make(budget=16, max_num_seqs=2)
    for i in range(4):
        sched.add_request(req(i, 10))
    out = sched.schedule()
    assert [(s.request_id, s.query_len, s.sample) for s in out.scheduled] == [("r0", 10, True), ("r1", 6, False)]
    assert out.num_waiting == 2 and out.num_running == 2
    complete(sched, out)
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
    complete(sched, sched.schedule())  # `new` is now decoding
    sched.add_request(old)
    old.arrival_index = -1  # older than `new`, still prefilling
    out = sched.schedule()
    assert [(s.request_id, s.query_len) for s in out.scheduled] == [("r1", 1), ("r0", 7)]


def test_waiting_queue_is_first_come_first_served():
    sched = make(num_blocks=6, block_size=4, budget=64)
    first = req(0, 60, max_tokens=50)
    sched.add_request(first)
    complete(sched, sched.schedule())  # holds 4 of the 6 blocks
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
    for out in (first, second, third):
        complete(sched, out)
    assert r.output_token_ids == [7, 7, 7] and r.status is RequestStatus.FINISHED


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
    complete(sched, first)
    assert b.output_token_ids == [7]  # the token sampled before the preemption is kept
    complete(sched, second)
    while sched.has_unfinished():
        complete(sched, sched.schedule())
    assert a.output_token_ids == b.output_token_ids == [7] * 10


@pytest.mark.parametrize("budget", [1, 3, 16])
def test_everything_finishes_under_pressure(budget):
    sched = make(num_slots=3, num_blocks=10, block_size=2, budget=budget, max_num_seqs=3)
    reqs = [req(i, 1 + (7 * i) % 23, max_tokens=1 + i % 5) for i in range(12)]
    run(sched, reqs, limit=5000)
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    stats = sched.cache.stats()
    assert stats.slots_used == 0 and stats.blocks_used == {"c4": 0}
