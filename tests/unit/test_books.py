"""The pure pieces behind the engines: the engine protocol's arithmetic, the connector's books (with fakes for
what vLLM hands it), an idle queue reader's park, the sidecar's lease books and load report, and flags whose
values start with a dash."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvloop.engines.config import EngineConfig
from kvloop.engines.connector.books import (
    PrefillBooks,
    bytes_per_block,
    demotion_copies,
    peers_to_rehandshake,
    promotion_copies,
    promotion_load,
    retain,
    split_lease_reads,
    split_tier,
    tail_to_free,
)
from kvloop.engines.connector.patches import (
    RECHECK_MAX_MS,
    RECHECK_MIN_MS,
    capped_wait,
    free_answer_blocks,
    recheck_ms,
)
from kvloop.engines.sidecar.books import LeaseBooks, Throughput, engine_load
from kvloop.shared.config import join_dashed_values
from kvloop.shared.protocol import (
    BANDWIDTH_SAMPLE_MIN_BYTES,
    LEASE_READ_PREFIX,
    REPORT_KEY,
    ConnectorSettings,
    PrefillReport,
    pull_params,
)


def test_a_finished_pull_counts_a_failed_or_unfinished_one_does_not() -> None:
    books = PrefillBooks(started=10.0, local_tokens=256)
    books.pull_began(external_tokens=512, now=10.5)
    books.pull_finished(failed=False, now=10.75)
    books.pull_finished(failed=True, now=11.0)  # reported again after a reset: the first word stands
    report = books.report(prompt_tokens=1000, block_size=128, bytes_per_block=1000, now=12.0)
    assert report == PrefillReport(local_tokens=256, pulled_tokens=512, pulled_blocks=4, pulled_bytes=4000,
                                   pull_ms=250.0, pull_failed=False, computed_tokens=232, compute_ms=1750.0)
    assert books.compute_s(now=12.0) == pytest.approx(1.75)
    failed = PrefillBooks(started=0.0, local_tokens=0)
    failed.pull_began(384, now=0.1)
    failed.pull_finished(failed=True, now=0.2)
    assert failed.report(1000, 128, 1000, 1.0).pulled_tokens == 0
    assert failed.report(1000, 128, 1000, 1.0).computed_tokens == 1000
    never = PrefillBooks(started=0.0, local_tokens=0)
    never.pull_began(384, now=0.1)  # a pull that never finished counts as failed
    assert never.report(1000, 128, 1000, 1.0).pull_failed
    assert PrefillBooks(started=0.0, local_tokens=128).report(100, 128, 1, 1.0).computed_tokens == 0  # never negative


def test_a_decode_request_retains_only_its_full_blocks() -> None:
    kept = retain(list(range(300)), [7, 8, 9], num_computed_tokens=299, block_size=128, session_id="s")
    assert kept is not None and kept.block_ids == [7, 8] and kept.token_ids == list(range(256))
    assert retain(list(range(100)), [7], num_computed_tokens=99, block_size=128, session_id="") is None
    assert bytes_per_block([1000, 3000], 4) == 1000 and bytes_per_block([], 4) == 0


def test_a_request_whose_answer_will_not_be_repeated_retains_its_prompts_full_blocks_only() -> None:
    # 200 prompt tokens and 99 generated: the second block holds the prompt's last 72 tokens and the answer's first.
    kept = retain(list(range(300)), [7, 8, 9], num_computed_tokens=299, block_size=128, session_id="s",
                  prompt_only_tokens=200)
    assert kept is not None and kept.block_ids == [7] and kept.token_ids == list(range(128))
    assert retain(list(range(300)), [7, 8, 9], 299, 128, "s", prompt_only_tokens=100) is None
    # A prompt longer than what was computed (a length-capped request) keeps what was computed.
    kept = retain(list(range(300)), [7, 8, 9], 299, 128, "s", prompt_only_tokens=1000)
    assert kept is not None and kept.block_ids == [7, 8]


def test_the_tail_past_the_kept_blocks_is_cut_in_place() -> None:
    blocks = [1, 2, 3, 4]
    assert tail_to_free(blocks, 1) == [2, 3, 4] and blocks == [1]
    assert tail_to_free(blocks, 5) == [] and blocks == [1]
    with pytest.raises(ValueError, match="keep"):
        tail_to_free(blocks, -1)


class FakeScheduler:
    """A fake of what ``free_answer_blocks`` reads of vLLM's Scheduler: its connector, its block lists, its pool."""

    def __init__(self, keep: int | None, blocks: list[int], can_free: bool = True) -> None:
        self.keeps = {"r": keep} if keep is not None else {}
        self.freed: list[int] = []
        manager = SimpleNamespace(req_to_blocks={"r": blocks}, num_cached_block={"r": len(blocks)})
        self.connector = SimpleNamespace(kvloop_kept_blocks=lambda rid: self.keeps.pop(rid, None))
        self.kv_cache_manager = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=[manager]),
                                                block_pool=SimpleNamespace(free_blocks=self.freed.extend))
        self.manager, self.can_free = manager, can_free
        self.deferred_frees: list[tuple[int, list[int]]] = []
        self.sched_step_seq = 7

    def _request_blocks_can_be_freed(self, request: Any) -> bool:
        return self.can_free


def test_the_scheduler_frees_the_answers_blocks_last_written_first_and_only_once() -> None:
    request = SimpleNamespace(request_id="r")
    fake = FakeScheduler(keep=2, blocks=[10, 11, 12, 13])
    assert free_answer_blocks(fake, request) == 2
    assert fake.freed == [13, 12] and fake.manager.req_to_blocks["r"] == [10, 11]
    assert fake.manager.num_cached_block["r"] == 2
    assert free_answer_blocks(fake, request) == 0 and fake.freed == [13, 12]  # asked once
    whole = FakeScheduler(keep=None, blocks=[10, 11])  # a request kept whole
    assert free_answer_blocks(whole, request) == 0 and whole.manager.req_to_blocks["r"] == [10, 11]
    busy = FakeScheduler(keep=1, blocks=[10, 11, 12], can_free=False)  # a step in flight may still write them
    assert free_answer_blocks(busy, request) == 2 and busy.manager.req_to_blocks["r"] == [10]
    assert busy.freed == [] and busy.deferred_frees == [(7, [11, 12])]  # vLLM frees them when that step is done


def test_vllms_scheduler_still_has_what_the_answer_free_uses() -> None:
    """``free_answer_blocks`` leans on the scheduler's private block books: an upgrade that renames them must fail
    here."""
    import inspect

    from vllm.v1.core import single_type_kv_cache_manager
    from vllm.v1.core.sched.scheduler import Scheduler

    assert {"_connector_finished", "_request_blocks_can_be_freed", "_drain_deferred_frees"} <= set(vars(Scheduler))
    assert "self.deferred_frees.append((self.sched_step_seq, blocks))" in inspect.getsource(Scheduler)
    source = inspect.getsource(single_type_kv_cache_manager.SingleTypeKVCacheManager.__init__)
    assert "self.req_to_blocks" in source and "self.num_cached_block" in source


def test_reads_of_retained_blocks_are_counted_and_dropped() -> None:
    prefix = LEASE_READ_PREFIX.encode()
    kept, reads = split_lease_reads({"a": [prefix + b"L1", b"req-1"], "b": [prefix + b"L2"]}, prefix)
    assert kept == {"a": [b"req-1"]} and reads == 2


def test_the_report_travels_in_params_and_teaches_bandwidth_only_from_big_pulls() -> None:
    report = PrefillReport(local_tokens=1, pulled_tokens=2, pulled_bytes=BANDWIDTH_SAMPLE_MIN_BYTES, pull_ms=8.0)
    params = {"do_remote_decode": False, REPORT_KEY: report.to_params()}
    assert PrefillReport.pop_from(params) == report and REPORT_KEY not in params
    assert PrefillReport.pop_from({}) is None
    assert report.bandwidth_sample() == (BANDWIDTH_SAMPLE_MIN_BYTES, pytest.approx(0.008))
    assert PrefillReport(pulled_bytes=10, pull_ms=5.0).bandwidth_sample() == (10, 0.0)
    assert report.reused_tokens == 3


def test_pull_params_name_the_lease_and_cut_the_blocks() -> None:
    params = pull_params(source_engine_id="dec", lease_id="L", nixl_address="[::1]:5600", block_ids=[1, 2, 3],
                         matched_blocks=2, matched_tokens=256)
    assert params["remote_block_ids"] == [[1, 2]] and params["remote_host"] == "[::1]"
    assert params["remote_port"] == 5600 and params["remote_request_id"] == LEASE_READ_PREFIX + "L"


def test_connector_settings_have_one_set_of_defaults() -> None:
    assert ConnectorSettings.from_extra(None) == ConnectorSettings()
    assert ConnectorSettings.from_extra({"kvloop_hold_s": "30", "other": 1}).kvloop_hold_s == 30.0
    assert ConnectorSettings(kvloop_hold_s=30.0).to_extra() == {"kvloop_hold_s": 30.0}
    config = EngineConfig(model="m", connector="kvloop").kv_transfer_config("e", None)  # type: ignore[arg-type]
    extra = config["kv_connector_extra_config"]
    assert ConnectorSettings.from_extra(extra).kvloop_hold_s == EngineConfig().hold_s
    assert EngineConfig().hold_s == ConnectorSettings().kvloop_hold_s


def test_lease_books_resync_evict_and_engine_frees() -> None:
    books = LeaseBooks()
    books.published("r1", "L1")
    books.published("r2", "L2")
    assert books.not_live(["L2"]) == ["r1"]
    assert books.is_new(5) and not books.is_new(5) and not books.is_new(3) and books.is_new(0)
    assert books.holder_of("L2") == "r2"
    assert books.freed_by_engine("r2") == "L2" and books.holder_of("L2") is None
    assert books.freed_by_engine("r2") is None  # the sidecar had asked for it
    books.forget(["r1"])
    assert books.held == {} and books.by_lease == {}


def test_lease_books_follow_a_lease_to_the_host_tier_and_out() -> None:
    books = LeaseBooks()
    books.published("r1", "L1")
    books.published("r2", "L2")
    assert books.demoting("L9") is None  # not held here: the demotion fails
    assert books.demoting("L1") == "r1" and "r1" not in books.held and books.holder_of("L1") is None
    assert books.known() == {"L1", "L2"}  # mid-copy, still this engine's
    assert books.freed_by_engine("r1") is None  # the connector frees a demoted request: no release at the broker
    assert books.demoted("r1", True) == "L1" and books.hosted == {"L1"} and books.demoted("r1", True) is None
    assert books.not_live(["L1", "L2"]) == [] and books.known() == {"L1", "L2"}
    assert books.demoting("L2") == "r2" and books.demoted("r2", False) == "L2" and books.hosted == {"L1"}
    assert books.not_live([]) == [] and books.hosted == set()  # a resync forgets tier leases the broker dropped
    books.published("r3", "L3")
    books.demoting("L3")
    assert books.drop_hosted("L3") and books.demoted("r3", True) is None  # timed out at the broker mid-copy
    assert not books.drop_hosted("L3")


def test_the_tier_is_the_top_of_the_allocation_and_copies_must_fit_it() -> None:
    assert split_tier(100, 0) == (100, 100) and split_tier(100, 40) == (60, 60)
    with pytest.raises(ValueError, match="kvloop_host_tier_blocks"):
        split_tier(100, 100)
    assert demotion_copies([3, 7], [60, 61], 60, 40) == [(3, 60), (7, 61)]
    assert demotion_copies([3, 7], [60], 60, 40) is None  # one slot per block
    assert demotion_copies([3, 7], [60, 60], 60, 40) is None  # none twice
    assert demotion_copies([3, 7], [59, 60], 60, 40) is None  # a pool block is not a slot
    assert demotion_copies([3, 7], [99, 100], 60, 40) is None  # past the tier


def test_a_promotion_loads_the_slots_past_the_local_hit_and_short_of_the_last_token() -> None:
    slots = [60, 61, 62]  # a lease of 3 blocks of 4 tokens; the promotion's prompt is its 12 tokens and one more
    assert promotion_load(slots, 13, 0, 4, 60, 40) == 12
    assert promotion_load(slots, 13, 8, 4, 60, 40) == 4  # vLLM's prefix cache had the first two blocks
    assert promotion_load(slots, 13, 12, 4, 60, 40) == 0  # ... or all three
    assert promotion_load(slots, 12, 0, 4, 60, 40) == 8  # a prompt of the lease's tokens alone: its last is computed
    assert promotion_load([60, 60, 61], 13, 0, 4, 60, 40) == 0  # a slot twice
    assert promotion_load([59, 60, 61], 13, 0, 4, 60, 40) == 0  # a pool block is not a slot
    assert promotion_copies(slots, [7, 8, 9, 10], 0, 12, 4) == [(60, 7), (61, 8), (62, 9)]
    assert promotion_copies(slots, [7, 8, 9, 10], 8, 4, 4) == [(62, 9)]  # after the locally cached blocks


def test_lease_books_keep_a_leases_tokens_through_the_tier_for_its_promotion() -> None:
    books = LeaseBooks()
    books.published("r1", "L1", "s1", [1, 2, 3, 4])
    books.published("r2", "L2", "s2", [5, 6, 7, 8])
    assert books.promotion("L1") is None  # in the pool: nothing to promote
    books.demoting("L1")
    assert books.promotion("L1") is None  # mid-copy
    books.demoted("r1", True)
    assert books.promotion("L1") == ("s1", [1, 2, 3, 4])
    assert books.drop_hosted("L1") and books.promotion("L1") is None and "L1" not in books.contents
    books.forget(["r2"])
    assert books.contents == {}  # released: nothing kept
    books.published("r3", "L3", "s3", [9])
    books.demoting("L3")
    books.demoted("r3", False)
    assert books.contents == {}  # a failed copy: the lease is gone


def test_a_retained_request_sent_twice_is_published_once() -> None:
    books = LeaseBooks()
    assert books.claim("r1") and not books.claim("r1")  # the second copy while the first publication is in flight
    books.published("r1", "L1")
    assert not books.claim("r1")  # and after it
    books.forget(["r1"])
    assert books.claim("r1")  # freed and retained again later (a new request id in practice): published anew
    books.forget(["r1"])  # a failed publication releases it
    assert books.publishing == set() and books.claim("r2")
    books.clear()
    assert books.publishing == set()


def test_load_report_and_throughput() -> None:
    calm = engine_load({"running": 2, "waiting": 0, "kv_usage": 0.95}, num_blocks=100, pressure_kv_usage=0.9)
    assert not calm.memory_pressure and calm.pressure_free_blocks == 0
    tight = engine_load({"running": 2, "waiting": 1, "kv_usage": 0.875}, num_blocks=100, pressure_kv_usage=0.75)
    assert tight.memory_pressure and tight.pressure_free_blocks == 17  # the excess and 5% more
    rates = Throughput()
    rates.prefill_done(100, 1.0, 0, 0.0, False)  # too short to teach anything
    assert rates.prefill_tokens_per_s == 0.0
    rates.prefill_done(1000, 0.5, BANDWIDTH_SAMPLE_MIN_BYTES, 0.01, False)
    assert rates.prefill_tokens_per_s == 2000.0 and rates.transfer_bytes_per_s == BANDWIDTH_SAMPLE_MIN_BYTES / 0.01


def test_dashed_values_pass_through_in_the_form_users_type_them() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    argv = ["--role", "prefill", "--extra-vllm-args", "--no-enable-prefix-caching", "--model", "m"]
    with pytest.raises(SystemExit):
        parser.parse_args(argv)  # what argparse alone does
    args = parser.parse_args(join_dashed_values(argv, EngineConfig.dashed_value_flags()))
    assert args.extra_vllm_args == "--no-enable-prefix-caching" and args.model == "m"
    assert EngineConfig(extra_vllm_args=args.extra_vllm_args).extra_args() == ["--no-enable-prefix-caching"]


def test_a_peer_that_failed_a_read_is_handshaken_again_once() -> None:
    # decode-3 failed a read and is known: marked. decode-2 is already marked (its backoff runs); prefill-9 is not
    # known to this agent (its handshake never finished): nothing to release.
    assert peers_to_rehandshake({"decode-3", "decode-2", "prefill-9"}, {"decode-2"},
                                {"decode-3": {}, "decode-2": {}}) == ["decode-3"]
    assert peers_to_rehandshake(set(), set(), {"decode-3": {}}) == []


def test_the_upstream_worker_still_has_what_the_rehandshake_uses() -> None:
    """The override leans on upstream's private peer bookkeeping: an upgrade that renames it must fail here."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    source = inspect.getsource(base_worker.NixlBaseConnectorWorker)
    for name in ("self._failed_remote_engines", "self._invalid_remote_engines", "self._remote_agents",
                 "def _cleanup_remote_engines", "def _mark_remote_engine_invalid"):
        assert name in source, name


@given(idle_s=st.floats(min_value=0, max_value=1e6), timeout_ms=st.one_of(st.none(), st.integers(0, 10_000)))
def test_an_idle_queue_reader_parks_briefly_and_never_past_its_timeout(idle_s: float, timeout_ms: int | None) -> None:
    """engines.connector.patches.recheck_ms: the park grows with the idle time, within [1, 50] ms (vLLM: 5 s,
    the stall of a lost wake-up), and never outlasts the caller's own timeout."""
    park = recheck_ms(idle_s, timeout_ms)
    assert park <= RECHECK_MAX_MS and (timeout_ms is None or park <= timeout_ms)
    assert park >= min(RECHECK_MIN_MS, RECHECK_MAX_MS if timeout_ms is None else timeout_ms)
    assert park >= min(int(idle_s * 1000), RECHECK_MAX_MS, 10**9 if timeout_ms is None else timeout_ms)


class FakeSpinCondition:
    """A fake of vLLM 0.32's ``SpinCondition`` reader: its ``wait`` reads the clock itself, spins while within
    ``busy_loop_s`` of the last read, else parks with the timeout it is given (recorded, not slept)."""

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.last_read, self.busy_loop_s = clock, 0.0, 1.0
        self.parks: list[int | None] = []

    def now(self) -> float:
        return self.clock.pop(0)

    def vllm_wait(self, timeout_ms: int | None = None) -> None:
        if self.now() > self.last_read + self.busy_loop_s:
            self.parks.append(timeout_ms)


@given(spin_s=st.floats(0.0005, 0.01), before=st.floats(0, 1), after=st.floats(1e-6, 30),
       timeout_ms=st.one_of(st.none(), st.integers(0, 10_000)))
def test_a_reader_preempted_as_its_spin_ends_never_parks_for_vllms_5_s(
        spin_s: float, before: float, after: float, timeout_ms: int | None) -> None:
    """engines.connector.patches.capped_wait: the patched wait reads the clock while the reader still spins, vLLM's
    own wait reads it again after the spin has ended (the reader was preempted in between). The park vLLM then
    makes is still bounded by recheck_ms, not the caller's 5 s (issue 49's 5,018-5,043 ms gaps); without the bound
    on spinning calls it parked for the caller's timeout."""
    fake = FakeSpinCondition([before * spin_s, spin_s + after])  # first read inside the spin, second past it
    wait = capped_wait(type(fake).vllm_wait, spin_s, fake.now)
    wait(fake, timeout_ms)
    assert fake.busy_loop_s == spin_s and len(fake.parks) == 1
    park = fake.parks[0]
    assert park is not None and park <= RECHECK_MAX_MS and (timeout_ms is None or park <= timeout_ms)
