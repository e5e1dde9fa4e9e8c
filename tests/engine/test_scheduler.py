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
