"""A model of the Gluon attention kernels' mbarrier protocols, run on random interleavings. The forward
(safeops/kernels/attention_gluon.py): the TMA producer, NUM_WG consumer warpgroups, the K / V rings, the Q
buffers reused for O, the pingpong turns, and several tiles per program (the persistent grid). The
backward's dK / dV and dQ kernels (safeops/kernels/attention_gluon_bwd.py): one tile per program, a Q / dO
or K / V ring released by both consumers. The fused backward: the whole grid, CTAs started in tile order on
a limited number of SMs, each CTA's dQ partials passed to its writer, the writers adding in turn.

Each agent is a transcription of its partition's barrier operations, in the kernel's order; the checks are
that no interleaving deadlocks, that a consumer always reads the block it expects, and that the producer
never refills a slot a consumer is still reading. It is a hand-written model, not the kernel: change it
with the kernel's protocol. A mutation (an empty barrier counting one consumer, a pingpong parity flipped,
the Q-buffer wait dropped) deadlocks or trips a check.

    python3 bench/gluon_attn_protocol_model.py [--runs 3000]
"""

from __future__ import annotations

import argparse
import random


class Barrier:
    """An mbarrier: ``count`` arrivals complete a phase; ``wait(parity)`` passes once the phase of that
    parity has completed (so a fresh barrier passes a wait on parity 1 at once)."""

    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, 0, 0

    def arrive(self) -> None:
        self.pending += 1
        assert self.pending <= self.count
        if self.pending == self.count:
            self.pending, self.phase = 0, self.phase + 1

    def passes(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def _turn_parity(w: int, rounds: int) -> int:
    """The parity consumer ``w`` waits on for its turn of round ``rounds`` (the kernels' ``_turn_wait``):
    consumer 0 starts each round (a fresh barrier passes parity 1), the others wait for their predecessor."""
    return (rounds & 1) ^ 1 if w == 0 else rounds & 1


def simulate(tiles: list[int], stages: int, num_wg: int, pingpong: bool, seed: int,
             separate_o: bool = False) -> None:
    """One program's tiles (key blocks per tile) under a random schedule; raises on deadlock or hazard.
    ``separate_o``: O goes out through its own buffer, the Q buffer being released after the tile's last
    QK^T (GluonFwdConfig.separate_o); otherwise through the Q buffer, released once its O store read it."""
    rnd = random.Random(seed)
    q_ready, q_empty, turn = ([Barrier(1) for _ in range(num_wg)] for _ in range(3))
    k_ready, v_ready = ([Barrier(1) for _ in range(stages)] for _ in range(2))
    k_empty, v_empty = ([Barrier(num_wg) for _ in range(stages)] for _ in range(2))
    k_slot, v_slot, q_buf = [None] * stages, [None] * stages, [None] * num_wg
    k_readers, v_readers = [set() for _ in range(stages)], [set() for _ in range(stages)]
    in_flight = []  # TMA copies: [steps left, barrier, buffer, index, value]
    o_buf = [None] * num_wg if separate_o else q_buf
    stores = []  # O stores in flight: [steps left, buffer, index, value it must still read, consumer]

    def tma(bar, buf, idx, value):
        in_flight.append([rnd.randint(1, 5), bar, buf, idx, value])

    # A varlen tile past its sequence's end or of a sequence without keys (0 key blocks) is skipped by the
    # producer and every consumer alike, barrier phases included: t counts the tiles that run.
    running = [n for n in tiles if n > 0]

    def producer():
        c = 0
        for t, n in enumerate(running):
            def load(kind, j, count, t=t):
                slot = count % stages
                empty, ready, buf, readers = ((k_empty, k_ready, k_slot, k_readers) if kind == "k" else
                                              (v_empty, v_ready, v_slot, v_readers))
                yield ("wait", empty[slot], ((count // stages) & 1) ^ 1)
                assert not readers[slot], f"{kind} slot {slot} refilled while {readers[slot]} read it"
                tma(ready[slot], buf, slot, (t, j))

            yield from load("k", 0, c)
            for w in range(num_wg):
                yield ("wait", q_empty[w], (t & 1) ^ 1)
                tma(q_ready[w], q_buf, w, t)
            for j in range(1, n):
                yield from load("k", j, c + j)
                yield from load("v", j - 1, c + j - 1)
            yield from load("v", n - 1, c + n - 1)
            c += n

    def consumer(w):
        c, rounds = 0, 0

        def turn_wait():
            if pingpong:
                yield ("wait", turn[w], _turn_parity(w, rounds))

        def turn_pass():
            nonlocal rounds
            if pingpong:
                turn[(w + 1) % num_wg].arrive()
            rounds += 1

        for t, n in enumerate(running):
            yield ("wait", q_ready[w], t & 1)
            assert q_buf[w] == t, f"consumer {w} tile {t} found Q of tile {q_buf[w]}"
            slot = c % stages
            yield ("wait", k_ready[slot], (c // stages) & 1)
            assert k_slot[slot] == (t, 0)
            yield from turn_wait()
            k_readers[slot].add(w)
            turn_pass()
            yield ("step",)
            k_readers[slot].discard(w)
            k_empty[slot].arrive()
            for j in range(1, n):
                kc = c + j
                ks, vs = kc % stages, (kc - 1) % stages
                yield ("wait", k_ready[ks], (kc // stages) & 1)
                assert k_slot[ks] == (t, j), f"consumer {w} wanted K {(t, j)}, found {k_slot[ks]}"
                yield from turn_wait()
                k_readers[ks].add(w)
                yield ("wait", v_ready[vs], ((kc - 1) // stages) & 1)
                assert v_slot[vs] == (t, j - 1), f"consumer {w} wanted V {(t, j - 1)}, found {v_slot[vs]}"
                v_readers[vs].add(w)
                turn_pass()
                yield ("step",)
                k_readers[ks].discard(w)
                k_empty[ks].arrive()
                yield ("step",)
                v_readers[vs].discard(w)
                v_empty[vs].arrive()
            if separate_o:  # every QK^T of the tile is done: Q may be refilled
                q_empty[w].arrive()
            vc = c + n - 1
            vs = vc % stages
            yield ("wait", v_ready[vs], (vc // stages) & 1)
            assert v_slot[vs] == (t, n - 1)
            yield from turn_wait()
            v_readers[vs].add(w)
            turn_pass()
            yield ("step",)
            v_readers[vs].discard(w)
            v_empty[vs].arrive()
            c += n
            if separate_o:
                yield ("stored", w)  # the previous tile's O store has read the buffer
            o_buf[w] = ("O", t)
            stores.append([rnd.randint(1, 5), o_buf, w, ("O", t), w])
            yield ("step",)
            if not separate_o:
                yield ("stored", w)
                q_empty[w].arrive()
        yield ("stored", w)

    agents = {"producer": producer(), **{f"consumer {w}": consumer(w) for w in range(num_wg)}}
    state = dict.fromkeys(agents, ("step",))
    while agents:
        for copy in list(in_flight):
            copy[0] -= 1
            if copy[0] <= 0:
                in_flight.remove(copy)
                copy[2][copy[3]] = copy[4]
                copy[1].arrive()
        for store in list(stores):
            store[0] -= 1
            if store[0] <= 0:
                stores.remove(store)
                assert store[1][store[2]] == store[3], f"O buffer {store[2]} overwritten before its store"

        def ready(s):
            if s[0] == "stored":
                return not any(st[4] == s[1] for st in stores)
            return s[0] == "step" or s[1].passes(s[2])
        runnable = [name for name, s in state.items() if ready(s)]
        if not runnable:
            if in_flight or stores:
                continue
            raise RuntimeError(f"deadlock: tiles {tiles}, stages {stages}, {num_wg} consumers, "
                               f"pingpong {pingpong}, seed {seed}")
        name = rnd.choice(runnable)
        try:
            state[name] = next(agents[name])
        except StopIteration:
            del agents[name], state[name]


def _run(agents: dict, in_flight: list, rnd: random.Random, what: str) -> None:
    """Runs the agents (generators yielding ("wait", barrier, parity) or ("step",)) under a random schedule,
    landing the TMA copies in flight after random delays; raises on deadlock."""
    state = dict.fromkeys(agents, ("step",))
    while agents:
        for copy in list(in_flight):
            copy[0] -= 1
            if copy[0] <= 0:
                in_flight.remove(copy)
                copy[2][copy[3]] = copy[4]
                copy[1].arrive()
        runnable = [n for n, s in state.items() if s[0] == "step" or s[1].passes(s[2])]
        if not runnable:
            if in_flight:
                continue
            raise RuntimeError(f"deadlock: {what}")
        name = rnd.choice(runnable)
        try:
            state[name] = next(agents[name])
        except StopIteration:
            del agents[name], state[name]


# The ready barriers a skipped dK / dV step waits on (_skip_step): both. A test drops one to see the model
# catch it (a later step then passes a parity wait a phase early and finds another step's data).
SKIP_WAITS = ("q_ready", "do_ready")


def simulate_dkdv(steps: int, stages: int, num_wg: int, seed: int, pipelined: bool = False, turns: int = 0,
                  skip: tuple[int, list[int]] | None = None) -> None:
    """The backward's dK / dV kernel (attention_gluon_bwd.attn_bwd_dkdv_gluon_kernel), one CTA: K and V once
    (kv_ready), then ``steps`` query blocks (the group's heads x its query blocks) whose Q (+ m, l) and
    dO (+ delta) land in a ``stages``-deep ring (q_ready / do_ready), released by every consumer (q_empty,
    count num_wg) after both products that read them; ``pipelined`` (GluonBwdConfig.pipeline): those
    products are issued in the next step, so a slot is released a step late (``stages`` >= 2).
    ``turns`` (GluonBwdConfig.turns, unpipelined): the consumers issue their products in turns, one mbarrier
    per consumer, ``turns`` rounds per step. ``skip`` = (query blocks per head, [leading blocks of each head
    consumer w skips]) (GluonBwdConfig.skip_masked, unpipelined): a skipped step waits for its slot's Q and
    dO, takes its turns and releases the slot, without products."""
    rnd = random.Random(seed)
    kv_ready = Barrier(1)
    q_ready, do_ready = ([Barrier(1) for _ in range(stages)] for _ in range(2))
    q_empty = [Barrier(num_wg) for _ in range(stages)]
    turn = [Barrier(1) for _ in range(num_wg)]
    assert not (pipelined and (turns or skip)), "turns and skip_masked are for the unpipelined loop"

    def take_turn(w, rnd_no):
        """_turn_wait then _turn_pass (the products of the turn are issued between them)."""
        yield ("wait", turn[w], _turn_parity(w, rnd_no))
        yield ("step",)
        turn[(w + 1) % num_wg].arrive()
    kv, q_slot, do_slot = [None], [None] * stages, [None] * stages
    readers = [set() for _ in range(stages)]
    in_flight = []

    def tma(bar, buf, idx, value):
        in_flight.append([rnd.randint(1, 5), bar, buf, idx, value])

    def producer():
        tma(kv_ready, kv, 0, "kv")
        for c in range(steps):
            slot = c % stages
            yield ("wait", q_empty[slot], ((c // stages) & 1) ^ 1)
            assert not readers[slot], f"Q / dO slot {slot} refilled while {readers[slot]} read it"
            tma(q_ready[slot], q_slot, slot, c)
            yield ("step",)
            tma(do_ready[slot], do_slot, slot, c)

    def consumer(w):
        yield ("wait", kv_ready, 0)
        assert kv[0] == "kv"
        for c in range(steps):
            slot = c % stages
            if skip is not None and c % skip[0] < skip[1][w]:  # _skip_step
                for name, ready in (("q_ready", q_ready), ("do_ready", do_ready)):
                    if name in SKIP_WAITS:
                        yield ("wait", ready[slot], (c // stages) & 1)
                for r in range(turns):
                    yield from take_turn(w, c * turns + r)
                q_empty[slot].arrive()
                continue
            if turns:  # the first turn brackets the issue of S^T and dP^T (their ready waits inside it)
                yield ("wait", turn[w], _turn_parity(w, c * turns))
            yield ("wait", q_ready[slot], (c // stages) & 1)
            assert q_slot[slot] == c, f"consumer {w} step {c} found Q of step {q_slot[slot]}"
            readers[slot].add(w)
            yield ("wait", do_ready[slot], (c // stages) & 1)
            assert do_slot[slot] == c, f"consumer {w} step {c} found dO of step {do_slot[slot]}"
            if turns:
                turn[(w + 1) % num_wg].arrive()
                for r in range(1, turns):  # the second turn brackets the issue of dV and dK
                    yield from take_turn(w, c * turns + r)
            yield ("step",)
            done = (c - 1) % stages if pipelined else slot
            if pipelined and c == 0:
                continue
            # The slot released now was read until now (pipelined: by the previous step's dV / dK products).
            assert q_slot[done] == c - pipelined and do_slot[done] == c - pipelined, \
                f"consumer {w} step {c}: slot {done} refilled under its products"
            readers[done].discard(w)
            q_empty[done].arrive()
        if pipelined and steps:
            last = (steps - 1) % stages
            yield ("step",)
            assert q_slot[last] == do_slot[last] == steps - 1, f"consumer {w}: last slot refilled"
            readers[last].discard(w)
            q_empty[last].arrive()

    agents = {"producer": producer(), **{f"consumer {w}": consumer(w) for w in range(num_wg)}}
    _run(agents, in_flight, rnd, f"dK/dV{' pipelined' if pipelined else ''}, {steps} steps, {stages} stages, "
         f"{num_wg} consumers, turns {turns}, skip {skip}, seed {seed}")


def random_dkdv_skip(rnd: random.Random, seed: int) -> None:
    """The unpipelined dK / dV loop with turns and skipped leading steps as the kernel takes them: a group of
    heads, each with the same query blocks, consumer w skipping the first min(w, blocks) of each (64-query
    blocks and 64-key warpgroups: warpgroup w's keys start w blocks after the CTA's first query block), or
    random prefixes (other shapes and offsets)."""
    n_mb, group, num_wg = rnd.randint(1, 5), rnd.randint(1, 3), rnd.choice([2, 3])
    prefix = ([min(w, n_mb) for w in range(num_wg)] if rnd.random() < 0.5
              else [rnd.randint(0, n_mb) for _ in range(num_wg)])
    simulate_dkdv(n_mb * group, rnd.randint(1, 4), num_wg, seed, turns=rnd.choice([0, 1, 2]),
                  skip=(n_mb, prefix))


def simulate_dq(n_blocks: int, stages: int, num_wg: int, seed: int) -> None:
    """The backward's dQ kernel (attn_bwd_dq_gluon_kernel), one CTA: each consumer's Q and dO once
    (q_ready[w]), then ``n_blocks`` K / V blocks in a ``stages``-deep ring (k_ready / v_ready), released by
    every consumer (kv_empty, count num_wg) one step late (the pipelined loop), so ``stages`` >= 2."""
    rnd = random.Random(seed)
    q_ready = [Barrier(1) for _ in range(num_wg)]
    k_ready, v_ready = ([Barrier(1) for _ in range(stages)] for _ in range(2))
    kv_empty = [Barrier(num_wg) for _ in range(stages)]
    q_buf, k_slot, v_slot = [None] * num_wg, [None] * stages, [None] * stages
    readers = [set() for _ in range(stages)]
    in_flight = []

    def tma(bar, buf, idx, value):
        in_flight.append([rnd.randint(1, 5), bar, buf, idx, value])

    def producer():
        for w in range(num_wg):
            tma(q_ready[w], q_buf, w, ("q", w))
        for j in range(n_blocks):
            slot = j % stages
            yield ("wait", kv_empty[slot], ((j // stages) & 1) ^ 1)
            assert not readers[slot], f"K / V slot {slot} refilled while {readers[slot]} read it"
            tma(k_ready[slot], k_slot, slot, j)
            yield ("step",)
            tma(v_ready[slot], v_slot, slot, j)

    def consumer(w):
        # Pipelined: step j reads K_j and V_j (S_j, dP_j) while block j - 1's K is still read by its dQ
        # product; block j - 1's slot is released at the end of step j, the last block's after the loop.
        yield ("wait", q_ready[w], 0)
        assert q_buf[w] == ("q", w)
        for j in range(n_blocks):
            slot = j % stages
            yield ("wait", k_ready[slot], (j // stages) & 1)
            assert k_slot[slot] == j, f"consumer {w} wanted K {j}, found {k_slot[slot]}"
            readers[slot].add(w)
            yield ("wait", v_ready[slot], (j // stages) & 1)
            assert v_slot[slot] == j, f"consumer {w} wanted V {j}, found {v_slot[slot]}"
            yield ("step",)
            if j >= 1:
                prev = (j - 1) % stages
                # Block j - 1's K is read until now, by its dQ product.
                assert k_slot[prev] == j - 1, f"consumer {w} step {j}: K slot {prev} refilled under dQ"
                readers[prev].discard(w)
                kv_empty[prev].arrive()
        if n_blocks:
            last = (n_blocks - 1) % stages
            yield ("step",)
            assert k_slot[last] == n_blocks - 1, f"consumer {w}: the last K slot refilled under dQ"
            readers[last].discard(w)
            kv_empty[last].arrive()

    agents = {"producer": producer(), **{f"consumer {w}": consumer(w) for w in range(num_wg)}}
    _run(agents, in_flight, rnd, f"dQ, {n_blocks} blocks, {stages} stages, {num_wg} consumers, seed {seed}")


class Turn:
    """A query block's turn counter in global memory (the fused kernel's ``sem_ptr``): a wait passes once it
    has reached ``target``."""

    def __init__(self, counters: dict, key, target: int):
        self.counters, self.key, self.target = counters, key, target

    def passes(self, parity) -> bool:
        return self.counters.get(self.key, 0) >= self.target


def fused_tile(tile: int, n_n_blocks: int, n_bh: int, head_group: int, causal: bool,
               shift: bool = False, lpt: bool = False) -> tuple[int, int]:
    """(key block, batch x kv head) of CTA ``tile``: attention_gluon_bwd._tile_coords with ORDERED (with
    ``shift``, without: head by head; with ``lpt``, without: key block 0 first)."""
    if shift:
        return tile % n_n_blocks, tile // n_n_blocks
    chunk, r = divmod(tile, head_group * n_n_blocks)
    heads_here = min(head_group, n_bh - chunk * head_group)
    n_block = r // heads_here
    if causal and not lpt:
        n_block = n_n_blocks - 1 - n_block
    return n_block, chunk * head_group + r % heads_here


def simulate_fused(n_m: int, n_n_blocks: int, n_bh: int, group: int, head_group: int, causal: bool,
                   sms: int, dq_bufs: int, num_wg: int, seed: int, block_ratio: int = 2,
                   split_d: bool = False, k_free_wait: bool = True, shift: bool = False,
                   early_turn: bool = False, lpt: bool = False, grids: int = 1) -> dict | list[dict]:
    """The fused backward (attn_bwd_fused_gluon_kernel) over its whole grid: CTAs start in tile order on at
    most ``sms`` slots (a GPU dispatches a grid in order) and leave when done. In each CTA the consumers
    hand each step's dQ partials to the writer through ``dq_bufs`` buffers (dq_full, count num_wg;
    dq_empty, count 1); the writer waits for the query block's turn, adds, and passes the turn on. Key
    blocks are ``block_ratio`` query blocks long. ``split_d`` (GluonFusedConfig.split_d): each consumer's dQ
    products read every consumer's K, so a consumer may store its dK over its K only after the others' last
    dQ products (k_free; ``k_free_wait=False`` drops that wait). ``shift`` (not causal;
    GluonFusedConfig.shift): CTAs head by head, each starting at its first home query block and wrapping
    around, a query block's turns from its home key block down (wrapping). ``early_turn``: the writer waits
    for the turn before the partials. ``lpt`` (causal; GluonFusedConfig.causal_lpt): CTAs longest first,
    a query block's turns ascending from key block 0. ``grids``: that many launches of the same grid at
    once (e.g. from two streams), sharing the ``sms`` slots, each grid's CTAs started in its own order and
    the grids' starts interleaved at random. Raises on deadlock, a buffer read before it
    is written or overwritten before it is read, or additions out of the fixed order; returns {(q head,
    query block): key blocks in the order they added} (one per grid, in a list, for ``grids`` > 1)."""
    rnd = random.Random(seed)
    counters_of, added_of = [{} for _ in range(grids)], [{} for _ in range(grids)]
    n_tiles = n_n_blocks * n_bh

    assert not (shift and causal)

    def steps(n_block, bh):
        lo = min(n_block * block_n // block_m, n_m) if causal else 0  # _tile_coords
        start = -(-n_block * n_m // n_n_blocks) if shift else 0  # _shift_start
        return [(bh * group + g, (mb + start) % n_m) for g in range(group) for mb in range(lo, n_m)]

    block_m, block_n = 64, 64 * block_ratio

    def turn(n_block, mb):  # the writer's formula
        if causal and lpt:  # key blocks 0, 1, ..., n_hi
            return n_block
        if causal:  # key blocks n_hi, n_hi - 1, ..., 0 add into query block mb
            return min(n_n_blocks - 1, (mb * block_m + block_m - 1) // block_n) - n_block
        if shift:  # from the home key block down, wrapping around
            return (mb * n_n_blocks // n_m - n_block) % n_n_blocks
        return n_block

    def cta(grid, tile):
        counters, added = counters_of[grid], added_of[grid]
        n_block, bh = fused_tile(tile, n_n_blocks, n_bh, head_group, causal, shift, lpt)
        work = steps(n_block, bh)
        full, empty = [Barrier(num_wg) for _ in range(dq_bufs)], [Barrier(1) for _ in range(dq_bufs)]
        buf = [dict() for _ in range(dq_bufs)]
        k_readers = [set() for _ in range(num_wg)]
        k_free = Barrier(num_wg)

        def consumer(w):
            for c, key in enumerate(work):
                b = c % dq_bufs
                reads = range(num_wg) if split_d else [w]  # whose K the step's dQ products read
                for u in reads:
                    k_readers[u].add(w)
                yield ("step",)  # the step's products
                for u in reads:
                    k_readers[u].discard(w)
                yield ("wait", empty[b], ((c // dq_bufs) & 1) ^ 1)
                assert w not in buf[b], f"tile {tile}: consumer {w} overwrote an unread dQ partial (step {c})"
                buf[b][w] = (c, key)
                full[b].arrive()
            if split_d:
                k_free.arrive()
                if k_free_wait:
                    yield ("wait", k_free, 0)
            assert not k_readers[w], \
                f"tile {tile}: consumer {w} stored dK over its K while {k_readers[w]} read it"

        def writer():
            for c, key in enumerate(work):
                b = c % dq_bufs
                if early_turn:
                    yield ("wait", Turn(counters, key, turn(n_block, key[1])), None)
                yield ("wait", full[b], (c // dq_bufs) & 1)
                assert all(buf[b].get(w) == (c, key) for w in range(num_wg)), \
                    f"tile {tile}: step {c} read {buf[b]}"
                yield ("wait", Turn(counters, key, turn(n_block, key[1])), None)
                assert counters.get(key, 0) == turn(n_block, key[1]), f"tile {tile}: {key} past its turn"
                buf[b].clear()
                empty[b].arrive()
                added.setdefault(key, []).append(n_block)
                yield ("step",)  # the atomic adds, then the release of the turn
                counters[key] = counters.get(key, 0) + 1

        name = f"{grid}.{tile}"
        return {f"{name} consumer {w}": consumer(w) for w in range(num_wg)} | {f"{name} writer": writer()}

    agents, state, resident, next_tile = {}, {}, {}, [0] * grids
    while True:
        while len(resident) < sms and any(t < n_tiles for t in next_tile):
            grid = rnd.choice([g for g in range(grids) if next_tile[g] < n_tiles])
            new = cta(grid, next_tile[grid])
            agents.update(new)
            state.update(dict.fromkeys(new, ("step",)))
            resident[f"{grid}.{next_tile[grid]}"] = set(new)
            next_tile[grid] += 1
        if not agents:
            break
        runnable = [n for n, st in state.items() if st[0] == "step" or st[1].passes(st[2])]
        if not runnable:
            raise RuntimeError(f"deadlock: fused, {n_m} query blocks, {n_n_blocks} key blocks, {n_bh} heads "
                               f"(group {group}, chunk {head_group}), causal {causal}, {sms} SMs, "
                               f"{grids} grid(s), seed {seed}")
        name = rnd.choice(runnable)
        try:
            state[name] = next(agents[name])
        except StopIteration:
            del agents[name], state[name]
            tile = name.split()[0]
            resident[tile].discard(name)
            if not resident[tile]:
                del resident[tile]
    for added in added_of:
        _check_fused_order(added, n_m, n_n_blocks, n_bh, group, causal, shift, lpt, block_ratio)
    return added_of[0] if grids == 1 else added_of


def _check_fused_order(added: dict, n_m: int, n_n_blocks: int, n_bh: int, group: int, causal: bool,
                       shift: bool, lpt: bool, block_ratio: int) -> None:
    for (h, mb), order in added.items():
        if causal:
            n_hi = min(n_n_blocks - 1, mb // block_ratio)
            expected = list(range(n_hi + 1)) if lpt else list(range(n_hi, -1, -1))
            assert order == expected, f"query block {(h, mb)}: added in order {order}"
        elif shift:
            home = mb * n_n_blocks // n_m
            assert order == [(home - i) % n_n_blocks for i in range(n_n_blocks)], \
                f"query block {(h, mb)}: added in order {order}"
        else:
            assert order == list(range(n_n_blocks)), f"query block {(h, mb)}: added in order {order}"
    assert len(added) == n_bh * group * n_m * (n_n_blocks > 0), "a query block got no dQ"


def _random_fused(rnd: random.Random, seed: int) -> None:
    n_bh = rnd.randint(1, 4)
    causal = rnd.random() < 0.5
    n_n_blocks, sms = rnd.randint(1, 4), rnd.randint(1, 6)
    shift = not causal and 2 * n_n_blocks <= sms and rnd.random() < 0.5  # attention_gluon_bwd.fused_shift
    simulate_fused(rnd.randint(1, 7), n_n_blocks, n_bh, rnd.randint(1, 3), rnd.randint(1, n_bh), causal, sms,
                   rnd.randint(1, 2), 2, seed, split_d=rnd.random() < 0.5, shift=shift,
                   early_turn=rnd.random() < 0.5, lpt=causal and rnd.random() < 0.5,
                   grids=rnd.randint(1, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3000)
    runs = ap.parse_args().runs
    for seed in range(runs):
        rnd = random.Random(seed)
        tiles = [rnd.choice([0, 1, 2, 3, 4, 5, 6]) for _ in range(rnd.randint(1, 5))]
        simulate(tiles, rnd.randint(1, 4), rnd.choice([2, 3]), rnd.random() < 0.7, seed, rnd.random() < 0.5)
        simulate_dkdv(rnd.randint(0, 12), rnd.randint(1, 4), 2, seed)
        simulate_dkdv(rnd.randint(0, 12), rnd.randint(2, 4), 2, seed, pipelined=True)
        random_dkdv_skip(rnd, seed)
        simulate_dq(rnd.randint(0, 12), rnd.randint(2, 4), 2, seed)  # the pipelined loop holds 2 slots
        _random_fused(rnd, seed)
    print(f"{runs} random schedules of the forward, the dK / dV (both loops), the dQ and the fused kernels: "
          "no deadlock, no hazard")


if __name__ == "__main__":
    main()
