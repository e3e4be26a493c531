"""The pure pieces behind the engines: the engine protocol's arithmetic, the connector's books (with fakes for
what vLLM hands it), an idle queue reader's park, the sidecar's lease books and load report, and flags whose
values start with a dash."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvloop.engines.config import EngineConfig
from kvloop.engines.connector.books import (
    PrefillBooks,
    bytes_per_block,
    demotion_copies,
    peers_to_rehandshake,
    retain,
    split_lease_reads,
    split_tier,
)
from kvloop.engines.connector.patches import RECHECK_MAX_MS, RECHECK_MIN_MS, capped_wait, recheck_ms
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
