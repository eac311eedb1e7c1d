"""The mbarrier protocols of the Gluon attention kernels (forward, the backward's dK / dV and dQ), as
modelled in bench/gluon_attn_protocol_model.py, under random interleavings: no deadlock, no buffer read
before it is loaded or refilled while read. A model mutated the way a kernel bug would be (a release
barrier counting one consumer instead of both) trips the check."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "gluon_attn_protocol_model.py")


def _model():
    spec = importlib.util.spec_from_file_location("gluon_attn_protocol_model", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_schedules_hold():
    m = _model()
    for seed in range(600):
        rnd = random.Random(seed)
        tiles = [rnd.choice([0, 1, 2, 3, 4, 5, 6]) for _ in range(rnd.randint(1, 5))]
        m.simulate(tiles, rnd.randint(1, 4), rnd.choice([2, 3]), rnd.random() < 0.7, seed, rnd.random() < 0.5)
        m.simulate_dkdv(rnd.randint(0, 12), rnd.randint(1, 4), 2, seed)
        m.simulate_dkdv(rnd.randint(0, 12), rnd.randint(2, 4), 2, seed, pipelined=True)
        m.random_dkdv_skip(rnd, seed)
        m.simulate_dq(rnd.randint(0, 12), rnd.randint(2, 4), 2, seed)
        m._random_fused(rnd, seed)


def test_dkdv_turns_and_skipped_steps_hold():
    """The unpipelined dK / dV loop with turns (0, 1, 2 per step) and each consumer skipping leading query
    blocks of every head (GluonBwdConfig.skip_masked): two and three consumers, as the kernel takes them and
    with random prefixes, every consumer skipping all of a head's blocks included."""
    m = _model()
    for seed in range(1500):
        m.random_dkdv_skip(random.Random(seed), seed)
    for turns in (0, 1, 2):
        m.simulate_dkdv(6, 2, 3, 0, turns=turns, skip=(3, [3, 3, 3]))  # nothing but skipped steps
        m.simulate_dkdv(6, 1, 3, 1, turns=turns, skip=(3, [0, 1, 2]))


@pytest.mark.parametrize("waits", [(), ("q_ready",), ("do_ready",)], ids=["none", "q_only", "do_only"])
def test_a_skipped_step_that_does_not_wait_for_its_slot_is_caught(waits, monkeypatch):
    """A skipped step must wait for both of its slot's ready barriers before releasing it: released early,
    the producer refills the slot under another consumer or a parity wait passes a phase early and a later
    step reads another step's Q or dO. Dropping the dO wait is a rare race (a step's dO landing after the Q
    of the step that reuses its slot): the search runs until some schedule shows it."""
    m = _model()
    monkeypatch.setattr(m, "SKIP_WAITS", waits)
    with pytest.raises((AssertionError, RuntimeError)):
        for seed in range(20000):
            m.random_dkdv_skip(random.Random(seed), seed)


def test_pipelined_dkdv_needs_two_stages():
    """The pipelined dK / dV loop holds the previous step's Q / dO slot while it waits for the next: one
    stage deadlocks (the kernel asserts NUM_STAGES >= 2 with PIPELINE)."""
    m = _model()
    with pytest.raises(RuntimeError, match="deadlock"):
        m.simulate_dkdv(3, 1, 2, 0, pipelined=True)


def test_dq_needs_two_stages():
    """The pipelined dQ loop holds block j - 1's slot while it waits for block j: one stage deadlocks (the
    kernel asserts NUM_STAGES >= 2)."""
    m = _model()
    with pytest.raises(RuntimeError, match="deadlock"):
        m.simulate_dq(3, 1, 2, 0)


@pytest.mark.parametrize("which", ["dkdv", "dq", "dkdv-pipelined"])
def test_a_release_counting_one_consumer_is_caught(which, monkeypatch):
    m = _model()
    real = m.Barrier

    def barrier(count):  # every release barrier (count 2) completes on one arrival
        return real(1)

    monkeypatch.setattr(m, "Barrier", barrier)
    sims = {"dkdv": m.simulate_dkdv, "dq": m.simulate_dq,
            "dkdv-pipelined": lambda *a: m.simulate_dkdv(*a, pipelined=True)}
    sim = sims[which]
    with pytest.raises((AssertionError, RuntimeError)):  # a hazard, or a deadlock
        for seed in range(200):
            sim(8, 2, 2, seed)


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_fused_adds_in_the_fixed_order_on_one_sm(causal):
    """The fused kernel's turns: every query block gets every key block that sees it, in the fixed order,
    even with one SM (each CTA runs alone, after the ones it waits for) and one dQ buffer."""
    m = _model()
    added = m.simulate_fused(5, 3, 2, 2, 1, causal, 1, 1, 2, 0)
    assert added[(0, 4)] == ([2, 1, 0] if causal else [0, 1, 2])


def test_fused_causal_longest_first_would_deadlock(monkeypatch):
    """The causal turns run from the diagonal key block down: numbering CTAs longest first (key block 0 first,
    as the dK / dV kernel does) would make a started CTA wait for one not yet started; on few SMs that
    deadlocks. The fused kernel numbers them shortest first (_tile_coords with ORDERED)."""
    m = _model()
    real = m.fused_tile
    monkeypatch.setattr(m, "fused_tile",
                        lambda t, nb, n_bh, hg, causal, shift, lpt: real(t, nb, n_bh, hg, False, shift))
    with pytest.raises(RuntimeError, match="deadlock"):
        m.simulate_fused(6, 3, 1, 1, 1, True, 1, 1, 2, 0)


def test_fused_writer_without_dq_empty_is_caught(monkeypatch):
    """A consumer that does not wait for the writer to read its dQ partial overwrites it."""
    m = _model()
    real = m.Barrier

    class NeverBlocks(real):
        def passes(self, parity):
            return self.count == 1 or super().passes(parity)  # dq_empty (count 1) never holds a consumer

    monkeypatch.setattr(m, "Barrier", NeverBlocks)
    with pytest.raises(AssertionError, match="overwrote"):
        for seed in range(200):
            m.simulate_fused(6, 2, 1, 1, 1, False, 2, 1, 2, seed)


def test_fused_split_d_stores_dk_only_after_both_dq_products():
    """With dQ split by columns each consumer's dQ products read both consumers' K: storing dK over K
    without the k_free barrier overwrites K under the other consumer's last dQ product."""
    m = _model()
    for seed in range(50):
        m.simulate_fused(4, 2, 1, 1, 1, False, 2, 1, 2, seed, split_d=True)
    with pytest.raises(AssertionError, match="stored dK over its K"):
        for seed in range(200):
            m.simulate_fused(4, 2, 1, 1, 1, False, 2, 1, 2, seed, split_d=True, k_free_wait=False)


def test_fused_shift_adds_from_the_home_key_block():
    """The shifted order (GluonFusedConfig.shift, not causal): with 5 query blocks and 3 key blocks, key block
    n's CTA starts at query block ceil(5 n / 3) = 0, 2, 4, and query block mb's turns run from its home
    floor(3 mb / 5) down, wrapping around; every block still gets every key block, once, on any schedule."""
    m = _model()
    for seed in range(50):
        added = m.simulate_fused(5, 3, 2, 2, 1, False, 3, 1, 2, seed, split_d=seed % 2 == 0, shift=True,
                                 early_turn=seed % 3 == 0)
        assert added[(0, 0)] == [0, 2, 1]
        assert added[(1, 1)] == [0, 2, 1]
        assert added[(0, 2)] == [1, 0, 2]
        assert added[(3, 3)] == [1, 0, 2]
        assert added[(2, 4)] == [2, 1, 0]


def test_fused_shift_needs_a_head_on_the_gpu_at_once():
    """In the shifted order a CTA can wait for one of its head numbered after it: with fewer SMs than key
    blocks the started CTAs can all wait for one that cannot start (attention_gluon_bwd.fused_shift keeps
    the plain order there)."""
    m = _model()
    with pytest.raises(RuntimeError, match="deadlock"):
        m.simulate_fused(4, 3, 1, 1, 1, False, 2, 1, 2, 0, shift=True)
    m.simulate_fused(4, 3, 1, 1, 1, False, 3, 1, 2, 0, shift=True)


def test_fused_shift_with_two_launches_at_once_needs_half_the_sms():
    """Two launches of the shifted order at once (two streams) share the SMs: with a head's key blocks more
    than half the SMs each grid can have a head partly started and all its started CTAs waiting (a
    deadlock on some schedules); with at most half (attention_gluon_bwd.fused_shift) none on any."""
    m = _model()
    deadlocks = 0
    for seed in range(40):
        try:
            m.simulate_fused(3, 3, 3, 1, 1, False, 4, 1, 2, seed, shift=True, grids=2)
        except RuntimeError as e:
            assert "deadlock" in str(e)
            deadlocks += 1
    assert deadlocks > 0
    for seed in range(40):
        added = m.simulate_fused(3, 2, 3, 1, 1, False, 4, 1, 2, seed, shift=True, grids=2,
                                 early_turn=seed % 2 == 0, split_d=seed % 3 == 0)
        assert len(added) == 2 and all(len(a) == 9 for a in added)


def test_fused_plain_order_needs_no_head_on_the_gpu():
    """The plain order (what the fused kernel runs where the shifted order does not apply): a CTA waits only
    for CTAs numbered before it, so on fewer SMs than a head's key blocks, and with two launches at once
    sharing them, no schedule deadlocks and every block adds its key blocks ascending (the shifted order
    deadlocks on these schedules)."""
    m = _model()
    for seed in range(40):
        sms = 1 + seed % 3
        added = m.simulate_fused(3, 5, 3, 1, 1, False, sms, 1 + seed % 2, 2, seed, grids=2,
                                 early_turn=seed % 2 == 0, split_d=seed % 3 == 0)
        assert len(added) == 2
        for a in added:
            assert len(a) == 9 and all(order == [0, 1, 2, 3, 4] for order in a.values())
    with pytest.raises(RuntimeError, match="deadlock"):
        m.simulate_fused(3, 5, 3, 1, 1, False, 2, 1, 2, 0, grids=2, shift=True)


def test_fused_shift_is_chosen_only_where_a_head_fits():
    from safeops.kernels import attention_gluon_bwd as KB

    cfg = dataclasses.replace(KB.FUSED_CONFIGS[128], shift=True)
    assert KB.fused_shift(cfg, False, 66, 132)
    assert not KB.fused_shift(cfg, False, 67, 132)
    assert not KB.fused_shift(cfg, True, 4, 132)
    assert not KB.fused_shift(dataclasses.replace(cfg, shift=False), False, 4, 132)


def test_fused_causal_longest_first_with_ascending_turns():
    """GluonFusedConfig.causal_lpt: CTAs numbered longest first with each query block's turns ascending from
    key block 0 wait only for CTAs numbered before them: no deadlock even on one SM, and every block gets
    its key blocks 0 .. n_hi in that order."""
    m = _model()
    for seed in range(50):
        added = m.simulate_fused(6, 3, 2, 2, 2, True, 1 + seed % 4, 1 + seed % 2, 2, seed,
                                 split_d=seed % 2 == 0, lpt=True, early_turn=seed % 3 == 0)
        assert added[(0, 5)] == [0, 1, 2]
        assert added[(3, 2)] == [0, 1]
        assert added[(1, 0)] == [0]
