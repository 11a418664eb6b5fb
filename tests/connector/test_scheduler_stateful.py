"""A stateful test of the connector's scheduler half driven through vLLM's own ``Scheduler``.

What is modelled: one engine (vLLM 0.32's real ``Scheduler`` plus the real worker half, over CPU KV
tensors in shared memory, :mod:`tests.connector.scheduler_rig`) beside a real ``kvgrid agent``
process, with ``async_store`` on (CUDA's default: a finished request keeps its blocks until the
worker reports its stores in ``finished_sending``) and ``kv_load_failure_policy: recompute``. A
Hypothesis ``RuleBasedStateMachine`` sends it requests whose prompts share chunk-aligned prefixes
with earlier ones (so Lookups hit what earlier requests stored and loads happen), steps it, aborts
requests in any state, holds the worker's loads or stores in flight for a few steps, breaks the
next load (the agent forgets the engine between Lookup and load; the agent restarts between them,
empty or with only the first chunks stored again -- a load that partly fails), and restarts the
agent between steps. The KV cache is small (32 blocks of 16 tokens), so running requests preempt
each other.

Why: each rule is something an engine meets in production, and the bugs this half can have --
pins or leases left at the agent, blocks vLLM never gets back, a request that never ends, a failed
load offered again and again, state kept for requests long gone -- show only in interleavings
nobody writes by hand.

What holds, checked after every rule:

- vLLM's view and the model agree on which requests are unfinished; none is older than
  :data:`AGE_BOUND` steps;
- the scheduler half's maps (``_requests``, ``_lookups``, ``_keys``, ``_load_failed``) hold only
  unfinished requests; ``_sending`` and ``_freed_with_stores`` only ended or preempted ones;
  nothing waits in ``_pending_loads`` between steps;
- the agent holds no pin or lease for a request that ended (asked per request, once its load,
  if any, was reported);
- with ``recompute``, no request ends with an error;
- a request whose load failed, wholly or partly, is never ordered a load again;

and whenever the machine drains (a rule, and at the end of every run): every request ends within a
bound of steps computed from the work left; then vLLM's block pool has every block back (free =
total - the null block), the scheduler half holds nothing for anyone, the worker has no load or
send outstanding and the agent holds no pin or lease at all.

Time: the connector's modules read ``time.monotonic()`` for the scheduler's back-off from an agent
that failed and the worker's re-registration interval; the tests put a clock there that moves one
second per step, so those count steps and a run does not depend on the machine's speed.

Budget: fixed and derandomized for CI (about 40 s on 2 cores with the tour): a real agent restart
costs seconds of CPU (the next agent starting), so the CI run makes the agent forget the engine
instead, and ``test_a_tour_of_every_rule`` -- the rules in a fixed order -- restarts it twice and
asserts that the two runs reached preemption, loads that succeeded, partly failed and failed,
aborts (of a request whose load was in flight too) and agent restarts.
``KVGRID_FUZZ_EXAMPLES=N`` runs N/10 randomized examples (one real restart allowed in each) with
``KVGRID_FUZZ_STEPS`` steps each (default 80), shrunk on failure; pytest's timeout must be off::

    KVGRID_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=0 \\
        tests/connector/test_scheduler_stateful.py
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from vllm.config import ModelConfig
from vllm.v1.engine import FinishReason

from kvgrid.connector import scheduler as connector_scheduler
from kvgrid.connector import worker_registration as connector_worker_registration
from kvgrid.connector.metadata import KVGridConnectorMetadata, LoadOrder
from tests.connector.scheduler_rig import (
    BLOCK,
    CHUNK,
    AgentSwitch,
    Rig,
    StepClock,
    StepResult,
    shm_kv_caches,
    tiny_model_config,
)

FUZZ = int(os.environ.get("KVGRID_FUZZ_EXAMPLES", "0") or 0)
FUZZ_STEPS = int(os.environ.get("KVGRID_FUZZ_STEPS", "80") or 80)
NUM_BLOCKS = 32
TOKEN_BUDGET = 128
MAX_LIVE = 8
AGE_BOUND = 400
"""Steps a request may stay unfinished while new ones keep coming (a livelock shows as a breach)."""
FAMILIES = [[(f * 7919 + i * 31) % 997 for i in range(4 * CHUNK)] for f in range(3)]
"""Chunk-aligned prompt prefixes that requests share (3 families of 4 chunks)."""


@dataclass
class Coverage:
    """What the runs reached, summed over examples (the CI run asserts the interesting parts)."""

    examples: int = 0
    steps: int = 0
    requests: int = 0
    loads: int = 0
    loads_failed: int = 0
    loads_partly_failed: int = 0
    preemptions: int = 0
    aborts: int = 0
    aborts_while_loading: int = 0
    held_for_stores: int = 0
    """Steps that ended with finished requests whose blocks vLLM held for their stores."""
    restarts: int = 0
    forgotten: int = 0
    drains: int = 0


@dataclass
class Live:
    arrival: int
    prompt_len: int
    max_tokens: int


_RUNS = itertools.count()
"""Each engine's keys are its own (``kv_identity``): nothing stored by an earlier run hits."""


def _tail(n: int, length: int) -> list[int]:
    """Tokens no other request's prompt has at that position."""
    return [(n * 104729 + i * 613 + 1) % 997 for i in range(length)]


class SchedulerMachine(RuleBasedStateMachine):
    """One engine per example; the agents outlive examples (the keys of each are its own)."""

    def __init__(self, env: Env) -> None:
        super().__init__()
        self.env = env
        cov = env.coverage
        cov.examples += 1
        self.cov = cov
        self.rig = Rig(
            env.model_config, env.agents, env.kv, kv_identity=f"run-{next(_RUNS)}", clock=env.clock
        )
        self.step_no = 0
        self.n_requests = 0
        self.live: dict[str, Live] = {}
        self.ended: set[str] = set()
        self.preempted: set[str] = set()
        self.loading: dict[str, LoadOrder] = {}
        """Load orders emitted and not yet reported, by request."""
        self.load_failed: set[str] = set()
        self.unchecked: set[str] = set()
        """Ended requests whose agent-side pins are still to be checked (after their load ended)."""
        self.prompts: list[list[int]] = []
        self.fault_armed = False
        # A real restart waits for the next agent to start (seconds of CPU): once per example when
        # fuzzing; the fixed CI run leaves them to the tour (the agent forgets the engine instead).
        self.restarts_left = 1 if FUZZ else 0

    # ---- stepping ---------------------------------------------------------------------------------

    def _step(self) -> StepResult:
        res = self.rig.step()
        self.step_no += 1
        self.cov.steps += 1
        for load in res.meta.loads:
            rid = load.request_id
            assert rid not in self.load_failed, f"request {rid}: a load ordered again after its load failed"
            assert rid not in self.loading, f"request {rid}: a second load ordered before the first ended"
            self.loading[rid] = load
            self.cov.loads += 1
        for rid in res.out.preempted_req_ids or ():
            self.preempted.add(rid)
            self.cov.preemptions += 1
        for rid in res.finished_recving:
            order = self.loading.pop(rid, None)
            assert order is not None, f"request {rid}: reported loaded, but no load was ordered"
            self._note_load_outcome(order, res)
        for rid, reason in res.finished.items():
            assert reason != FinishReason.ERROR, f"request {rid} ended with an error (policy: recompute)"
            self._ended(rid)
        if any(r.is_finished() for r in self.rig.scheduler.requests.values()):
            self.cov.held_for_stores += 1
        self._check_ended_requests()
        return res

    def _note_load_outcome(self, order: LoadOrder, res: StepResult) -> None:
        rid = order.request_id
        skip_blocks = order.skip_first_n_tokens // BLOCK
        wanted = set(order.block_ids[0][skip_blocks : len(order.keys[0]) * CHUNK // BLOCK])
        missed = res.invalid_block_ids & wanted
        if rid in res.failed_recving or missed:
            self.load_failed.add(rid)
            if missed == wanted or rid in res.failed_recving:
                self.cov.loads_failed += 1
            else:
                self.cov.loads_partly_failed += 1

    def _ended(self, rid: str) -> None:
        self.live.pop(rid, None)
        self.ended.add(rid)
        self.unchecked.add(rid)

    def _check_ended_requests(self) -> None:
        ready = {rid for rid in self.unchecked if rid not in self.loading}
        if not ready:
            return
        self.rig.settle_releases()
        for rid in sorted(ready):
            pins, leased = self.rig.agent_holds_for(rid)
            assert (pins, leased) == (0, 0), (
                f"request {rid} ended; the agent still held {pins} pins, {leased} leased"
            )
        self.unchecked -= ready

    # ---- rules ------------------------------------------------------------------------------------

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        rid = f"r{self.n_requests}"
        self.n_requests += 1
        self.cov.requests += 1
        self.rig.add(rid, prompt, max_tokens)
        self.live[rid] = Live(self.step_no, len(prompt), max_tokens)
        if len(prompt) <= 300:  # a follow-up adds up to 40 tokens: every request fits the cache
            self.prompts.append(prompt)

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(
        requests=st.lists(
            st.tuples(
                st.integers(0, len(FAMILIES) - 1), st.integers(0, 4), st.integers(1, 80), st.integers(1, 40)
            ),
            min_size=1,
            max_size=3,
        )
    )
    def add_requests(self, requests: list[tuple[int, int, int, int]]) -> None:
        """Prompts sharing a prefix of whole chunks with others of their family, then their own
        tokens: (family, shared chunks, own tokens, max_tokens) each."""
        for family, shared_chunks, tail, max_tokens in requests:
            self._add(FAMILIES[family][: shared_chunks * CHUNK] + _tail(self.n_requests, tail), max_tokens)

    @precondition(lambda self: len(self.live) < MAX_LIVE and bool(self.prompts))
    @rule(data=st.data(), extra=st.integers(0, 40), max_tokens=st.integers(1, 16))
    def add_follow_up(self, data: st.DataObject, extra: int, max_tokens: int) -> None:
        """An earlier prompt again, with more tokens (a chat's next turn): hits all its chunks."""
        earlier = data.draw(st.sampled_from(self.prompts))
        self._add(earlier + _tail(self.n_requests, extra), max_tokens)

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            self._step()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), now=st.integers(0, 2))
    def abort(self, data: st.DataObject, now: int) -> None:
        """Now and then (one draw in three): the client of a request goes away."""
        if not now:
            self._abort(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: any(rid in self.live for rid in self.loading))
    @rule(data=st.data())
    def abort_while_loading(self, data: st.DataObject) -> None:
        """The client of a request whose load is in flight goes away (vLLM keeps its blocks until
        the load is reported)."""
        self._abort(data.draw(st.sampled_from(sorted(set(self.loading) & set(self.live)))))

    def _abort(self, rid: str) -> None:
        loading = rid in self.loading
        assert self.rig.abort(rid), f"request {rid} is unfinished, yet vLLM did not abort it"
        self.cov.aborts += 1
        self.cov.aborts_while_loading += loading
        self._ended(rid)
        self._check_ended_requests()

    @precondition(lambda self: not self.fault_armed)
    @rule(steps=st.integers(2, 6))
    def hold_loads(self, steps: int) -> None:
        """Loads ordered in the next steps stay in flight until then (a slow agent)."""
        self.rig.hold_loads(steps)

    @rule(steps=st.integers(1, 4))
    def hold_stores(self, steps: int) -> None:
        """Stores ordered in the next steps stay in flight until then: finished requests wait."""
        self.rig.hold_stores(steps)

    @rule(blocks=st.integers(4, 24), steps=st.integers(1, 6))
    def shrink_kv_cache(self, blocks: int, steps: int) -> None:
        """For the next steps the KV cache has fewer free blocks: growing requests are preempted."""
        self.rig.squeeze(blocks, steps)

    @precondition(lambda self: not self.fault_armed and self.rig._loads_gate is None)
    @rule(
        how=st.sampled_from(["forgotten", "restarted-partly-refilled", "restarted"]),
        keep=st.integers(1, 3),
    )
    def break_next_load(self, how: str, keep: int) -> None:
        """Between the next load's Lookup and the load itself, the agent forgets this engine, or
        restarts (empty, or with the first ``keep`` chunks of the load stored again by then)."""
        if not self.restarts_left:
            how = "forgotten"
        self.fault_armed = True

        def fault(meta: KVGridConnectorMetadata) -> bool:
            if how == "forgotten":
                self.cov.forgotten += 1
                self.rig.forget_registration()
            else:
                # a partial refill needs a load of two chunks or more: wait for one
                order = next((o for o in meta.loads if len(o.keys[0]) > 1 or how == "restarted"), None)
                if order is None:
                    return False
                self._restarted()
                self.rig.restart_agent_keeping(
                    order, min(keep, len(order.keys[0]) - 1) if how != "restarted" else 0
                )
            self.fault_armed = False
            return True

        self.rig.before_load = fault

    @precondition(lambda self: self.restarts_left > 0)
    @rule()
    def restart_agent(self) -> None:
        """The agent restarts between steps: pins, leases, registration and L1 are gone."""
        self._restarted()
        self.env.agents.restart()

    def _restarted(self) -> None:
        self.restarts_left -= 1
        self.cov.restarts += 1

    @rule(now=st.integers(0, 3))
    def drain(self, now: int) -> None:
        """Now and then (one draw in four): no new requests until every one ended."""
        if now == 0:
            self._drain()

    # ---- invariants -------------------------------------------------------------------------------

    @invariant()
    def unfinished_requests_agree(self) -> None:
        vllm_unfinished = {rid for rid, r in self.rig.scheduler.requests.items() if not r.is_finished()}
        assert vllm_unfinished == set(self.live), (
            f"vLLM: {sorted(vllm_unfinished)}, model: {sorted(self.live)}"
        )
        for rid, live in self.live.items():
            age = self.step_no - live.arrival
            assert age <= AGE_BOUND, f"request {rid} unfinished after {age} steps"

    @invariant()
    def scheduler_half_holds_only_live_requests(self) -> None:
        s = self.rig.sched
        live = set(self.live)
        for name, ids in (
            ("_requests", s._requests),
            ("_lookups", s._lookups),
            ("_keys", s._keys),
            ("_load_failed", s._load_failed),
        ):
            stray = set(ids) - live
            assert not stray, f"the scheduler half's {name} holds requests that ended: {sorted(stray)}"
        assert not s._pending_loads, [o.request_id for o in s._pending_loads]
        assert s._sending <= self.ended, sorted(s._sending - self.ended)
        assert s._freed_with_stores <= self.ended | self.preempted, sorted(s._freed_with_stores)

    # ---- draining ---------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Step until vLLM holds no request, then once more (the last names go out), and check
        that nothing is left anywhere."""
        self.rig.release_holds()  # a fault armed for the next load stays armed
        work = sum(math.ceil(v.prompt_len / TOKEN_BUDGET) + v.max_tokens + 2 for v in self.live.values())
        bound = 20 + 3 * work
        for _ in range(bound):
            if not self.rig.scheduler.requests:
                break
            self._step()
        left = {rid: r.status.name for rid, r in self.rig.scheduler.requests.items()}
        assert not left, f"not drained within {bound} steps: {left}"
        self._step()
        self.cov.drains += 1
        rig, s, w = self.rig, self.rig.sched, self.rig.worker
        assert rig.free_blocks() == rig.num_blocks - 1, (
            f"vLLM's block pool: {rig.free_blocks()} free of {rig.num_blocks} (expected all but the null one)"
        )
        rig.settle_releases()
        for name, held in (
            ("_requests", s._requests),
            ("_lookups", s._lookups),
            ("_keys", s._keys),
            ("_load_failed", s._load_failed),
            ("_sending", s._sending),
            ("_freed_with_stores", s._freed_with_stores),
            ("_pending_loads", s._pending_loads),
            ("_releasing", s._releasing),
        ):
            assert not held, f"drained, yet the scheduler half's {name} holds {held!r}"
        assert not w._loading and not w._sending, (sorted(w._loading), sorted(w._sending))
        assert not self.loading and not self.unchecked, (sorted(self.loading), sorted(self.unchecked))
        assert rig.agent_totals() == (0, 0), (
            f"drained, yet the agent holds (pins, leased) {rig.agent_totals()}"
        )

    def teardown(self) -> None:
        try:
            self._drain()
        finally:
            self.rig.close()


@dataclass
class Env:
    model_config: ModelConfig
    agents: AgentSwitch
    kv: tuple
    coverage: Coverage
    """Of the test running now."""
    clock: StepClock


@pytest.fixture(scope="module")
def env(workdir: Path) -> Iterator[Env]:
    agents = AgentSwitch(workdir, workdir)
    clock = StepClock()
    try:
        with pytest.MonkeyPatch.context() as mp:  # time in the connector's modules counts steps
            mp.setattr(connector_scheduler, "time", clock)
            mp.setattr(connector_worker_registration, "time", clock)
            yield Env(
                tiny_model_config(workdir / "model"),
                agents,
                shm_kv_caches(workdir / "kv-cache.bin", NUM_BLOCKS),
                Coverage(),
                clock,
            )
    finally:
        agents.close()


def test_scheduler_half_through_vllm_scheduler(env: Env) -> None:
    if FUZZ:
        # an example costs seconds here (a real agent restart): a tenth of the index tests' count
        opts = settings(max_examples=max(1, FUZZ // 10), stateful_step_count=FUZZ_STEPS, derandomize=False)
    else:
        opts = settings(max_examples=60, stateful_step_count=60, derandomize=True)
    cov = env.coverage = Coverage()
    run_state_machine_as_test(
        lambda: SchedulerMachine(env),
        settings=settings(
            opts,
            deadline=None,
            database=None,
            report_multiple_bugs=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )
    print(cov)
    if not FUZZ:  # the fixed run reaches what it is meant to (a guard against a weakened budget)
        assert cov.loads >= 100 and cov.loads_failed >= 10 and cov.preemptions >= 10, cov
        assert cov.aborts >= 20 and cov.forgotten >= 10, cov
        assert cov.held_for_stores >= 50, cov


def test_a_tour_of_every_rule(env: Env) -> None:
    """The machine's rules in a fixed order that reaches each kind of event at least once (the
    randomized run above reaches them by chance), every invariant checked after each."""
    cov = env.coverage = Coverage()
    m = SchedulerMachine(env)
    m.restarts_left = 2

    def check() -> None:
        m.unfinished_requests_agree()
        m.scheduler_half_holds_only_live_requests()

    def steps(n: int) -> None:
        for _ in range(n):
            m._step()
            check()

    try:
        family = FAMILIES[0]
        m._add(family + _tail(1000, 10), 2)  # stores the family's 4 chunks
        m._drain()
        m.rig.hold_loads(3)
        m._add(family + _tail(1001, 5), 4)  # hits 4 chunks; its load stays in flight
        m._add(family[: 2 * CHUNK] + _tail(1002, 5), 4)  # hits 2
        steps(1)
        assert set(m.loading) == {"r1", "r2"}, m.loading
        m._abort("r1")  # aborted while its load is in flight
        check()
        steps(3)
        m.break_next_load("forgotten", 1)
        m._add(family[: 3 * CHUNK] + _tail(1003, 5), 4)
        steps(2)
        m.break_next_load("restarted-partly-refilled", 1)
        m._add(family[: 3 * CHUNK] + _tail(1004, 5), 4)
        steps(2)
        m.hold_stores(3)
        m._add(FAMILIES[1] + _tail(1005, 20), 30)
        m._add(FAMILIES[2] + _tail(1006, 20), 30)
        steps(4)
        m.rig.squeeze(20, 6)  # the two grow into a cache that shrank: one is preempted
        steps(8)
        m.restart_agent()
        m._drain()
        check()
    finally:
        m.teardown()
    print(cov)
    assert cov.loads_failed >= 1 and cov.loads_partly_failed >= 1, cov
    assert cov.aborts_while_loading >= 1 and cov.preemptions >= 1, cov
    assert cov.restarts >= 2 and cov.forgotten >= 1 and cov.held_for_stores >= 1, cov
