"""Token budget, chunked prefill mixed with decode, preemption by recompute."""

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence, SequenceStatus


def seq(n, rid):
    return Sequence(rid, list(range(1000, 1000 + n)), n, SamplingParams(), 10_000)


def complete(batch, token=7):
    """What the engine does after a forward pass: count computed tokens, sample where due."""
    for s, n in batch.entries:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(token)


def test_long_prompt_is_chunked_and_decodes_share_the_step():
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=32)
    short, long_ = seq(5, "short"), seq(100, "long")
    sched.add(short)
    sched.add(long_)
    b1 = sched.schedule()
    assert [(s.request_id, n) for s, n in b1.prefills] == [("short", 5), ("long", 27)]
    complete(b1)
    b2 = sched.schedule()
    assert [s.request_id for s in b2.decodes] == ["short"]  # decode of "short"...
    assert [(s.request_id, n) for s, n in b2.prefills] == [("long", 31)]  # ...next to a chunk
    assert b2.num_tokens == 32


def test_a_step_in_which_streams_decode_takes_the_decoding_budget():
    """A lone prompt takes the whole budget; once a stream decodes, a step (its token and a
    prompt's chunk together) takes no more than decoding_step_tokens."""
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=64, decoding_step_tokens=16)
    first, second = seq(100, "first"), seq(100, "second")
    sched.add(first)
    b1 = sched.schedule()
    assert [(s.request_id, n) for s, n in b1.prefills] == [("first", 64)]  # nothing decodes yet
    complete(b1)
    b2 = sched.schedule()
    assert [(s.request_id, n) for s, n in b2.prefills] == [("first", 36)]  # still no stream
    complete(b2)
    sched.add(second)
    b3 = sched.schedule()
    assert [s.request_id for s in b3.decodes] == ["first"]
    assert [(s.request_id, n) for s, n in b3.prefills] == [("second", 15)] and b3.num_tokens == 16


def test_preemption_frees_the_latest_sequence_and_requeues_it_first():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(7, "a"), seq(7, "b")  # 2 blocks each: the pool is full after admission
    sched.add(a)
    sched.add(b)
    complete(sched.schedule())  # both prefilled, each sampled a token (8 tokens: still 2 blocks)
    complete(sched.schedule())  # both decode; now 9 tokens each -> need a third block
    batch = sched.schedule()
    assert batch.preempted == [b]
    assert [s.request_id for s in batch.decodes] == ["a"]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert sched.waiting[0] is b and sched.num_preemptions == 1


def test_max_num_seqs_caps_the_running_batch():
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(3):
        sched.add(seq(4, f"r{i}"))
    batch = sched.schedule()
    assert len(batch.prefills) == 2 and len(sched.waiting) == 1


def test_abort_releases_blocks():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    s = seq(10, "x")
    sched.add(s)
    sched.schedule()
    assert bm.num_free_blocks == 5
    assert sched.abort("x") is s
    assert bm.num_free_blocks == 8 and s.finish_reason == "abort"



def test_overlapped_decode_is_the_ordinary_schedule_with_placeholders():
    """Scheduler.schedule_ahead (--async-scheduling): the decode step `schedule` makes, the
    running sequences' last tokens placeholders until they land."""
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(4, "a"), seq(4, "b")
    a.params = SamplingParams(max_tokens=2)
    for s in (a, b):
        sched.add(s)
    complete(sched.schedule())  # both prefilled (one block each), a first token each
    batch = sched.schedule_ahead(anyone, max_seqs=8, max_blocks=4)
    assert batch.decodes == [a, b] and bm.num_free_blocks == 0  # each took its second block
    sched.launched_ahead(batch)
    assert (a.token_ids[-1], b.token_ids[-1], a.num_computed_tokens) == (-1, -2, 5)
    # a's token in flight is its last (max_tokens=2): only b decodes next
    assert sched.schedule_ahead(anyone, max_seqs=8, max_blocks=4).decodes == [b]
    sched.landed(a, 41)
    assert a.token_ids[-1] == 41 and bm.cached_hashes() != []  # its full block published


def test_overlapped_decode_is_refused_unchanged_where_schedule_would_do_more():
    bm = BlockManager(3, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = seq(4, "a")
    sched.add(a)
    complete(sched.schedule())  # a holds 1 block and needs a second for its next token
    before = (bm.num_free_blocks, list(a.block_table), a.num_computed_tokens, list(a.token_ids))
    sched.add(seq(4, "c"))
    assert sched.schedule_ahead(anyone, max_seqs=8, max_blocks=4) is None  # c would be admitted
    sched.waiting.clear()
    assert sched.schedule_ahead(lambda s: False, max_seqs=8, max_blocks=4) is None  # not eligible
    assert sched.schedule_ahead(anyone, max_seqs=8, max_blocks=1) is None  # over the graph's width
    assert sched.schedule_ahead(anyone, max_seqs=0, max_blocks=4) is None  # no bucket
    held = bm.allocate_blocks(2)
    assert sched.schedule_ahead(anyone, max_seqs=8, max_blocks=4) is None  # schedule would preempt
    assert (bm.num_free_blocks, list(a.block_table), a.num_computed_tokens, list(a.token_ids)) == \
        (before[0] - 2,) + before[1:]
    bm.release_blocks(held)
    assert sched.schedule_ahead(anyone, max_seqs=8, max_blocks=4).decodes == [a]


def anyone(seq):
    return True


def propose(sched, most):
    """The propose phase (Speculator.propose_drafts) with a proposer of `most` drafts: the rooms."""
    rooms = []
    for s, room in sched.draft_rooms():
        rooms.append((s.request_id, room))
        s.draft_token_ids = [5] * max(0, min(room, most))
    return rooms


def test_drafts_are_proposed_before_schedule_within_the_budget_each_leaves_the_next():
    """Each decode's room is what the budget leaves after its earlier neighbours' drafts and
    one token for every later sequence; schedule runs the attached drafts and adds none."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    for rid in "abc":
        sched.add(seq(3, rid))
    complete(sched.schedule())  # prefilled, a token each: each decodes next
    assert propose(sched, 4) == [("a", 7), ("b", 3), ("c", 0)]  # 10 - 1 - 2; 10 - 5 - 1 - 1; nothing left
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch.prefills] == [("a", 5), ("b", 4)]  # 1 + drafts, verified
    assert [s.request_id for s in batch.decodes] == ["c"] and batch.num_tokens == 10


def test_drafts_leave_a_block_for_each_later_sequence_and_none_are_proposed_where_schedule_preempts():
    sched = Scheduler(BlockManager(3, 4), max_num_seqs=8, max_num_batched_tokens=64)
    for rid in "ab":
        sched.add(seq(3, rid))
    complete(sched.schedule())  # one block each, its 4th token still to compute there; 1 block free
    assert propose(sched, 8) == [("a", 0), ("b", 4)]  # a's drafts would need the block kept for b
    assert [(s.request_id, n) for s, n in sched.schedule().entries] == [("b", 5), ("a", 1)]
    tight = Scheduler(BlockManager(2, 4), max_num_seqs=8, max_num_batched_tokens=64)
    for rid in "cd":
        tight.add(seq(4, rid))
    complete(tight.schedule())  # both blocks full: c's next token needs a block, d is preempted for it
    assert propose(tight, 8) == []
    assert tight.schedule().preempted == [tight.waiting[0]]


def test_schedule_cuts_drafts_that_no_longer_fit_rather_than_preempt():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8)
    a = seq(3, "a")
    sched.add(a)
    complete(sched.schedule())
    a.draft_token_ids = [5] * 20  # past the budget: cut to 7
    sched.computed(batch := sched.schedule())
    assert batch.prefills == [(a, 8)] and len(a.draft_token_ids) == 7
    sched.reject_drafts(a, 0)  # none kept: 4 tokens computed, two blocks, the correction next
    a.token_ids.append(8)
    held = bm.allocate_blocks(bm.num_free_blocks)
    a.draft_token_ids = [5] * 4  # they would need a third block, none is free: the decode runs alone
    assert sched.schedule().decodes == [a] and a.draft_token_ids == [] and not sched.waiting
    bm.release_blocks(held)
