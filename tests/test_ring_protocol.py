"""The CUDA scorer's shared-memory ring (``scorer.cu``: ``slot_of``, ``mbar_wait``, the producer
and consumer loops of ``score_row``) as a CPU model, run under random and adversarial schedules.

The model has the producer warp's issue lanes, bulk copies that land in any order, each consumer
warpgroup's four warps as independent actors, and every slot's full and empty mbarrier with PTX's
parity rule taken literally (``try_wait.parity p`` passes iff the current phase's parity is not p,
so a barrier two phases behind passes). Independent warps admit more interleavings than the
hardware does, so a schedule the kernel can run is one the model can run; a tile the producer
skips (``slot_ok`` 0: a plain arrive, no copy) is a copy that lands at once.

Proves, for the kernel's mapping (4 consumer warpgroups with 1, 2, 3 and 6 slots per consumer,
shipping 3 and 6; ``ISSUE_LANES`` is the consumer count) and up to 80 tiles: each tile is read by
the four warps of its own consumer,
each read sees that tile's landed copy (never another tile's data, never a copy in flight), no
copy goes into a slot under a reader or over a copy in flight, and the run never deadlocks.
Planted bugs show the checks see their bug class: a ring shared by all consumers with 6 or 10
slots (not a multiple of the consumer count) lets a consumer pass a full barrier a phase early or
two phases behind, while a shared ring of 12 slots is safe; a producer that skips its empty wait
overwrites a slot under its reader; an empty barrier that counts one arrival too many deadlocks.
The model's constants and waits are checked against the kernel's source text.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer

CONSUMERS = 4  # consumer warpgroups of the default build; tile it is consumer it % CONSUMERS's
WARPS = 4  # warps of a warpgroup: the arrivals an empty phase counts
ISSUE_LANES = 4  # producer lanes issuing one tile each before a __syncwarp (the source: CONSUMERS)
BUILDS = {CONSUMERS: (1, 2, 3, 6)}
"""slots per consumer the property test covers, the build's consumer count -> counts (the kernel's
12- and 24-slot rings give 3 and 6)"""

# violation kinds
READ_IN_FLIGHT = "read of a slot whose copy is in flight"
READ_WRONG_TILE = "read of another tile's data"
OVERWRITE_UNDER_READER = "copy issued into a slot under its reader"
COPY_OVER_COPY = "copy issued into a slot whose copy is in flight"
DEADLOCK = "deadlock"
DATA_KINDS = {READ_IN_FLIGHT, READ_WRONG_TILE, OVERWRITE_UNDER_READER, COPY_OVER_COPY}


# ---------------------------------------------------------------------------------------------
# rings: the slot mapping (the only thing the planted shared rings change)


@dataclass(frozen=True)
class Ring:
    """A slot mapping: tile ``it`` goes to slot ``slot(it)``, that slot's ``use(it)``-th fill.

    Consumers wait the full barrier with parity ``use & 1``; the producer, for ``use > 0``, waits
    the empty barrier with parity ``(use - 1) & 1``. ``producer_waits_empty`` and ``empty_count``
    exist only to plant bugs."""

    name: str
    slots: int
    slot: Callable[[int], int]
    use: Callable[[int], int]
    producer_waits_empty: bool = True
    empty_count: int = WARPS
    consumers: int = CONSUMERS  # consumer warpgroups, and the producer's issue lanes

    def __repr__(self) -> str:
        return self.name


def consumer_ring(per_consumer: int, consumers: int = CONSUMERS) -> Ring:
    """The kernel's ring (``slot_of``) on a build of ``consumers`` warpgroups: each consumer
    cycles through its own ``per_consumer`` slots."""
    C = consumers
    return Ring(
        f"slot_of(per_consumer={per_consumer}, consumers={C})",
        per_consumer * C,
        slot=lambda it: it % C + C * ((it // C) % per_consumer),
        use=lambda it: (it // C) // per_consumer,
        consumers=C,
    )


def shared_ring(slots: int) -> Ring:
    """A ring all consumers share in tile order (slot it % R); safe only where R % CONSUMERS == 0."""
    return Ring(f"shared(R={slots})", slots, slot=lambda it: it % slots, use=lambda it: it // slots)


# ---------------------------------------------------------------------------------------------
# the model


class Violation(Exception):
    """A broken safety property: ``kind`` is one of the kinds above."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass
class Barrier:
    """An mbarrier: ``phase`` completed phases, ``pending`` arrivals and ``tx`` bytes still owed."""

    expected: int
    phase: int = 0
    pending: int = field(init=False)
    tx: int = 0

    def __post_init__(self) -> None:
        self.pending = self.expected

    def passes(self, parity: int) -> bool:
        """``mbarrier.try_wait.parity``: the phase of that parity has completed."""
        return (self.phase & 1) != parity

    def arrive(self, tx: int = 0) -> None:
        """``mbarrier.arrive`` (``tx`` > 0: ``arrive.expect_tx``)."""
        self.tx += tx
        self.pending -= 1
        assert self.pending >= 0, "over-arrival (the slot checks report its cause first)"
        self._complete()

    def complete_tx(self, tx: int) -> None:
        """The bulk copy's ``complete_tx``: its bytes landed."""
        self.tx -= tx
        self._complete()

    def _complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.expected


@dataclass
class Slot:
    """A ring slot: the tile whose copy landed last, the copy in flight, the metadata (slot_ok)."""

    landed: int | None = None
    in_flight: int | None = None
    meta: int | None = None


Action = tuple  # ("issue", it) | ("land", it) | ("read", c, w) | ("arrive", c, w)


class RingModel:
    """One program's ring: the producer's lanes, the copies in flight, the consumers' warps."""

    def __init__(self, ring: Ring, n_tiles: int):
        self.ring, self.n = ring, n_tiles
        self.full = [Barrier(1) for _ in range(ring.slots)]
        self.empty = [Barrier(ring.empty_count) for _ in range(ring.slots)]
        self.slots = [Slot() for _ in range(ring.slots)]
        self.base = 0  # the producer's current group of ISSUE_LANES tiles
        self.issued: set[int] = set()
        self.copies: list[int] = []  # tiles whose copy is in flight
        self.C = ring.consumers  # consumers, and the producer's issue lanes (ISSUE_LANES = CONSUMERS)
        self.warps = [(c, w) for c in range(self.C) for w in range(WARPS)]
        self.next_tile = {cw: cw[0] for cw in self.warps}  # the tile a warp waits for next
        self.reading: dict[tuple[int, int], int] = {}  # warp -> slot it passed and has not arrived on
        self.reads: list[tuple[int, int, int]] = []  # (consumer, warp, tile whose data it read)

    def actions(self) -> list[Action]:
        """Every action some actor can take now (a wait that would pass is an action)."""
        ring, acts = self.ring, []
        for it in range(self.base, min(self.base + self.C, self.n)):
            if it not in self.issued:
                use = ring.use(it)
                waits = use > 0 and ring.producer_waits_empty
                if not waits or self.empty[ring.slot(it)].passes((use - 1) & 1):
                    acts.append(("issue", it))
        acts.extend(("land", it) for it in self.copies)
        for c, w in self.warps:
            it = self.next_tile[c, w]
            if (c, w) in self.reading:
                acts.append(("arrive", c, w))
            elif it < self.n and self.full[ring.slot(it)].passes(ring.use(it) & 1):
                acts.append(("read", c, w))
        return acts

    def step(self, action: Action) -> None:
        """Take one action; raises Violation where it breaks a safety property."""
        kind = action[0]
        if kind == "issue":
            self._issue(action[1])
        elif kind == "land":
            it = action[1]
            s = self.ring.slot(it)
            self.copies.remove(it)
            self.slots[s].landed, self.slots[s].in_flight = it, None
            self.full[s].complete_tx(1)
        elif kind == "read":
            self._read(action[1], action[2])
        else:
            c, w = action[1], action[2]
            self.empty[self.reading.pop((c, w))].arrive()
            self.next_tile[c, w] += self.C

    def _issue(self, it: int) -> None:
        s = self.ring.slot(it)
        slot = self.slots[s]
        if slot.in_flight is not None:
            raise Violation(COPY_OVER_COPY, f"tile {it} into slot {s}: tile {slot.in_flight}'s in flight")
        readers = [cw for cw, rs in self.reading.items() if rs == s]
        if readers:
            raise Violation(OVERWRITE_UNDER_READER, f"tile {it} into slot {s} while warps {readers} read it")
        slot.meta, slot.in_flight = it, it
        self.full[s].arrive(tx=1)
        self.issued.add(it)
        self.copies.append(it)
        group = range(self.base, min(self.base + self.C, self.n))
        if all(t in self.issued for t in group):  # __syncwarp: the next group
            self.base = min(self.base + self.C, self.n)

    def _read(self, c: int, w: int) -> None:
        it = self.next_tile[c, w]
        s = self.ring.slot(it)
        slot, bar = self.slots[s], self.full[s]
        use = self.ring.use(it)
        where = f"consumer {c} warp {w} wants tile {it} (slot {s} use {use}, full phase {bar.phase})"
        if slot.in_flight is not None:
            raise Violation(READ_IN_FLIGHT, f"{where}: tile {slot.in_flight}'s copy in flight")
        if slot.landed != it or slot.meta != it:
            raise Violation(READ_WRONG_TILE, f"{where}: slot holds tile {slot.landed} (metadata {slot.meta})")
        self.reads.append((c, w, slot.landed))
        self.reading[c, w] = s

    def done(self) -> bool:
        return all(self.next_tile[cw] >= self.n for cw in self.warps) and not self.copies

    def check_reads(self) -> None:
        """Each tile was read once by each warp of its own consumer, and nothing else was read."""
        want = sorted((it % self.C, w, it) for it in range(self.n) for w in range(WARPS))
        assert sorted(self.reads) == want
        assert len(self.issued) == self.n and self.base >= self.n


@dataclass
class Outcome:
    """A finished run: the violation it hit (None: safe), its actions in order."""

    violation: Violation | None
    trace: list[Action]


def run(ring: Ring, n_tiles: int, choose: Callable[[list[Action]], Action]) -> Outcome:
    """Run one program's ring to completion under the scheduler ``choose``."""
    model, trace = RingModel(ring, n_tiles), []
    try:
        while not model.done():
            acts = model.actions()
            if not acts:
                raise Violation(DEADLOCK, f"no actor can move after {len(trace)} actions: "
                                f"producer at tile {model.base}, warps at {sorted(model.next_tile.items())}")
            action = choose(acts)
            trace.append(action)
            model.step(action)
            assert len(trace) <= 10 * n_tiles, "an action that makes no progress"
    except Violation as v:
        return Outcome(v, trace)
    model.check_reads()
    return Outcome(None, trace)


# ---------------------------------------------------------------------------------------------
# schedulers

SPEEDS = (0.01, 1.0, 1.0, 1.0, 30.0)  # an actor's relative speed: some starve, some race ahead


def actor(action: Action) -> tuple:
    """Who takes an action: a producer lane, a copy (its landing), or a consumer warp."""
    if action[0] == "issue":
        return ("lane", action[1] % ISSUE_LANES)
    if action[0] == "land":
        return ("copy", action[1])
    return ("warp", action[1], action[2])


def scheduler(rnd: random.Random, rank: Callable[[Action], int] = lambda a: 0) -> Callable:
    """Picks among the enabled actions of lowest ``rank`` (a higher rank moves only when nothing
    ranked lower can), weighted by a random speed each actor gets on its first move."""
    speed: dict[tuple, float] = {}

    def choose(acts: list[Action]) -> Action:
        low = min(rank(a) for a in acts)
        acts = [a for a in acts if rank(a) == low]
        weights = [speed.setdefault(actor(a), rnd.choice(SPEEDS)) for a in acts]
        return rnd.choices(acts, weights)[0]

    return choose


def starving(rnd: random.Random, starved: set[tuple]) -> Callable:
    """A scheduler under which the ``starved`` actors move only when no other actor can."""
    return scheduler(rnd, rank=lambda a: int(actor(a) in starved))


# ---------------------------------------------------------------------------------------------
# tests

ACTORS = st.one_of(
    st.tuples(st.just("copy"), st.integers(0, 79)),
    st.tuples(st.just("warp"), st.integers(0, CONSUMERS - 1), st.integers(0, WARPS - 1)),
    st.tuples(st.just("lane"), st.integers(0, ISSUE_LANES - 1)),
)


@settings(max_examples=500, deadline=None)
@given(n_tiles=st.integers(0, 80), build=st.sampled_from([(c, p) for c, ps in BUILDS.items() for p in ps]),
       seed=st.integers(0, 2**32 - 1), starved=st.sets(ACTORS, max_size=3))
def test_kernel_ring_is_safe_under_any_schedule(n_tiles, build, seed, starved):
    """The kernel's mapping: every tile reaches its consumer's four warps intact,
    no copy goes into a slot under a reader or over a copy in flight, no deadlock; under random
    schedules in which up to three actors (a copy, a warp, a lane) move only when nothing else can."""
    consumers, per_consumer = build
    out = run(consumer_ring(per_consumer, consumers), n_tiles, starving(random.Random(seed), set(starved)))
    assert out.violation is None, (out.violation, out.trace[-12:])


PRODUCER_AHEAD = {"land": 0, "issue": 1, "read": 2, "arrive": 3}  # copies land at once, consumers trail


def late_copy(tile: int) -> Callable:
    """A deterministic adversary: every copy lands as soon as it is issued, the producer runs as far
    ahead as it may, warps read before they arrive, and the copy of ``tile`` lands only when nothing
    else can move (ties: the first action listed)."""

    def rank(action: Action) -> int:
        return len(PRODUCER_AHEAD) if action == ("land", tile) else PRODUCER_AHEAD[action[0]]

    def choose(acts: list[Action]) -> Action:
        return min(acts, key=rank)

    return choose


@pytest.mark.parametrize("slots", [6, 10])
@pytest.mark.parametrize("late", ["first fill", "second fill"])
def test_shared_ring_not_a_multiple_of_consumers_breaks(slots, late):
    """A ring of R = 6 or 10 slots shared in tile order: slot 0's second fill is tile R, consumer
    R % 4's. With slot 0's first fill (tile 0) late, that consumer waits parity 1 on slot 0's fresh
    full barrier, passes at once and reads tile 0's copy in flight; with the second fill (tile R)
    late, consumer 0 waits parity 0 for tile 2R, passes the barrier two phases behind (one phase
    done, tile 0's) and reads tile R's copy in flight."""
    late_tile, reader, want, use, phase = {
        "first fill": (0, slots % CONSUMERS, slots, 1, 0),
        "second fill": (slots, 0, 2 * slots, 2, 1),
    }[late]
    out = run(shared_ring(slots), 6 * slots, late_copy(late_tile))
    assert out.violation is not None and out.violation.kind == READ_IN_FLIGHT, out.violation
    pattern = (rf"consumer {reader} warp \d wants tile {want} \(slot 0 use {use}, full phase {phase}\): "
               rf"tile {late_tile}'s copy in flight")
    assert re.fullmatch(pattern, out.violation.detail), out.violation.detail


@pytest.mark.parametrize(("slots", "kinds"), [(6, {READ_IN_FLIGHT, READ_WRONG_TILE}), (10, {READ_IN_FLIGHT})])
def test_random_schedules_find_the_shared_ring_bug(slots, kinds):
    """The property test's own schedules, told nothing of the bug, find the shared rings' bug in
    100 seeded runs: copies in flight read, and (R = 6) a stale tile read through a full barrier
    two phases behind whose next fill was not yet issued."""
    found = set()
    for seed in range(100):
        out = run(shared_ring(slots), 48, starving(random.Random(seed), set()))
        if out.violation is not None:
            found.add(out.violation.kind)
    assert kinds <= found <= DATA_KINDS, found


def test_shared_ring_of_12_is_safe():
    """A shared ring of 12 slots gives each slot one consumer: safe under the late-copy adversary
    (each of slot 0's first three fills late) and under random schedules, so the model does not
    fail every shared ring."""
    for late_tile in (0, 12, 24):
        out = run(shared_ring(12), 72, late_copy(late_tile))
        assert out.violation is None, (late_tile, out.violation)
    for seed in range(100):
        out = run(shared_ring(12), 1 + seed % 80, starving(random.Random(seed), set()))
        assert out.violation is None, (seed, out.violation)


def test_skipped_empty_wait_overwrites_under_a_reader():
    """A producer that does not wait a slot's empty barrier refills it while its consumer's warps
    read it (copies land at once, warps read as soon as they may and arrive last), or issues a copy
    over one still in flight."""
    ring = replace(consumer_ring(1), producer_waits_empty=False)
    order = {"land": 0, "read": 1, "issue": 2, "arrive": 3}
    for seed in range(5):
        out = run(ring, 16, scheduler(random.Random(seed), rank=lambda a: order[a[0]]))
        assert out.violation is not None, seed
        assert out.violation.kind == OVERWRITE_UNDER_READER, (seed, out.violation)
    out = run(ring, 16, late_copy(0))  # the producer ahead of a late copy: a copy issued over it
    assert out.violation is not None and out.violation.kind == COPY_OVER_COPY, out.violation


def test_wrong_empty_count_deadlocks():
    """An empty barrier that counts five arrivals (a warpgroup has four warps) never completes, so
    the producer never refills a slot: a deadlock, seen as no actor able to move."""
    ring = replace(consumer_ring(3), empty_count=WARPS + 1)
    out = run(ring, 13, starving(random.Random(0), set()))
    assert out.violation is not None and out.violation.kind == DEADLOCK, out.violation
    assert run(ring, 12, starving(random.Random(0), set())).violation is None  # no slot reused


def test_model_matches_the_kernel_source():
    """The model's mapping, waits, barrier counts and lanes are the kernel's: its source holds the
    expressions the model implements, and every mbarrier wait in it is one the model has (a kernel
    change fails here, not on a GPU host)."""
    src = " ".join(cuda_scorer.source().split())
    for text in [
        "#define CONSUMERS 4",
        "#define ISSUE_LANES CONSUMERS",
        "return it % CONSUMERS + CONSUMERS * ((it / CONSUMERS) % per_consumer);",
        "mbar_init(smem_addr(&full[s]), 1);",
        "mbar_init(smem_addr(&empty[s]), 4);",
        "if (lane == 0) mbar_arrive(",  # one empty arrival per warp
        "issue(0); }",  # the first tiles, before the CTA barrier; then the rest in order
        "for (int base = ISSUE_LANES; base < my_tiles; base += ISSUE_LANES) issue(base);",
        "for (int it = wg; it < my_tiles; it += CONSUMERS) {",
        "mbarrier.try_wait.parity.shared::cta.b64",
    ]:
        assert text in src, text
    waits = re.findall(r"mbar_wait\((smem_addr\(&\w+\[s\]\)), ([^;]*)\);", src)
    forms = {
        ("smem_addr(&empty[s])", "((j / {pc}) - 1) & 1"),  # the producer, behind `if (j >= {pc})`
        ("smem_addr(&full[s])", "((it / CONSUMERS) / {pc}) & 1"),  # a consumer
    }
    names = ("per_consumer",)  # score_row's
    allowed = {(bar, parity.format(pc=pc)) for bar, parity in forms for pc in names}
    assert waits and set(waits) <= allowed, set(waits) - allowed
    assert {bar for bar, _ in waits} == {"smem_addr(&empty[s])", "smem_addr(&full[s])"}
    for pc in names:
        if f"mbar_wait(smem_addr(&empty[s]), ((j / {pc}) - 1) & 1)" in src:
            assert f"if (j >= {pc}) mbar_wait(smem_addr(&empty[s])" in src, pc
    assert cuda_scorer.CONSUMERS == CONSUMERS == WARPS == ISSUE_LANES
    assert "#ifndef CONSUMERS" in src  # a tool's variant build may define another count
    for c, covered in BUILDS.items():  # both rings each build runs are in the property test
        assert {cuda_scorer.STAGES_SHORT // c, cuda_scorer.STAGES_DEEP // c} <= set(covered), c
        for per_consumer in covered:  # slot_of: each window of a ring's tiles fills every slot once
            ring = consumer_ring(per_consumer, c)
            for start in range(0, 96, ring.slots):
                window = range(start, start + ring.slots)
                assert sorted(ring.slot(it) for it in window) == list(range(ring.slots))


def test_barrier_parity_rule():
    """The PTX rule as modelled: parity 0 blocks on a fresh barrier, parity 1 passes at once, a
    phase with bytes owed is not complete, and a barrier two phases behind its waiter passes."""
    bar = Barrier(1)
    assert not bar.passes(0) and bar.passes(1)
    bar.arrive(tx=1)
    assert not bar.passes(0) and bar.phase == 0  # the bytes are still owed
    bar.complete_tx(1)
    assert bar.passes(0) and not bar.passes(1) and bar.phase == 1
    bar.arrive()
    assert bar.phase == 2 and bar.passes(1)  # a waiter for use 3 (parity 1, owed 4 phases) passes at 2


def test_the_gpu_plant_still_applies_to_the_kernel_source():
    """scripts/plant_shared_ring.py (the GPU-side plant of the shared ring) still finds the lines it
    replaces, and its planted source has the shared mapping and waits the model plants."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "scripts" / "plant_shared_ring.py"
    spec = importlib.util.spec_from_file_location("plant_shared_ring", path)
    plant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plant)
    src = cuda_scorer.source()
    out = plant.planted(src, 6)
    assert out != src and "return it % 6;" in out and "(it / 6) & 1" in out
    with pytest.raises(ValueError, match="update the plant"):
        plant.planted(out, 6)
