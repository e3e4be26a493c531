"""The return path end to end: real vLLM CPU engines with kvloop's connector, their sidecars, a real broker,
real NIXL over loopback. Turns are driven by :class:`kvloop.app.benchmarks.pd_driver.PDDriver` over token ids.

Proofs come from the engines themselves: the prefill engine's
``vllm:prompt_tokens_by_source_total{source=...}`` (tokens computed, hit in its local prefix cache, or
loaded by the connector), its NIXL byte counter, and the decode engine's KV usage; the broker's
``Inspect`` for leases.
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import pytest

from kvloop.app.benchmarks.pd_driver import PDDriver, Turn, post_json
from kvloop.app.engine_set import start_engines
from kvloop.engines.config import EngineConfig, role_cores
from kvloop.engines.layout import engine_fingerprint
from kvloop.shared.protocol import DROPPED_KEY, KEEP_GENERATED_KEY, decode_local_params
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc
from tests.engines.conftest import ENGINE_START_TIMEOUT_S, EXTRA_CONFIG
from tests.support.engine_checks import NEAR_TIE, metric, scrape, wait_for

if TYPE_CHECKING:
    from tests.engines.conftest import PDEngines

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BS = 128
T = TypeVar("T")
# Float32 on both engines: a correct path differs from another by float rounding only.
LOGPROB_TOLERANCE = 2e-3
def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def broker_stub(pd_engines: PDEngines) -> Iterator[broker_pb2_grpc.KVBrokerStub]:
    channel = grpc.insecure_channel(pd_engines.broker)
    yield broker_pb2_grpc.KVBrokerStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def driver(pd_engines: PDEngines) -> Iterator[PDDriver]:
    fp = engine_fingerprint(pd_engines.model_dir, dtype="float32", block_size=BS)
    d = PDDriver(pd_engines.broker, fingerprint=fp, block_size=BS, model=pd_engines.model_name,
                 engines={e.engine_id: e.url for e in (pd_engines.prefill, pd_engines.decode)})
    yield d
    d.close()


def leases_of(stub: broker_pb2_grpc.KVBrokerStub, engine_id: str) -> list[pb.Lease]:
    reply = stub.Inspect(pb.InspectRequest(), timeout=5)
    return [lease for lease in reply.leases if lease.engine_id == engine_id]

def expire_all_leases(stub: broker_pb2_grpc.KVBrokerStub, engine_id: str) -> None:
    """A clean baseline: every lease of ``engine_id`` made to expire, and none left. A lease the previous test's
    last turn publishes while this runs is shortened too, once (renewing a lease at every poll would keep it)."""
    shortened: set[str] = set()

    def leases() -> list[pb.Lease]:
        held = leases_of(stub, engine_id)
        for lease in held:
            if lease.lease_id not in shortened:
                stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=1.0), timeout=5)
                shortened.add(lease.lease_id)
        return held

    wait_for(leases, lambda held: not held, timeout_s=30, what="no leases")


def engines_registered(stub: broker_pb2_grpc.KVBrokerStub) -> set[str]:
    return {e.engine.engine_id for e in stub.Inspect(pb.InspectRequest(), timeout=5).engines}


def wait_lease(stub: broker_pb2_grpc.KVBrokerStub, engine_id: str, session: str, blocks: int) -> pb.Lease:
    found = wait_for(lambda: [lease for lease in leases_of(stub, engine_id)
                              if lease.session_id == session and len(lease.block_keys) >= blocks],
                     bool, timeout_s=30, what=f"a {blocks}-block lease of session {session} on {engine_id}")
    return found[0]


def first_turn(driver: PDDriver, stub: broker_pb2_grpc.KVBrokerStub, pd: PDEngines, session: str, seed: int,
               n: int = 600, max_tokens: int = 60, prefill_salt: str = "") -> Turn:
    """Turn 1 of a session. ``prefill_salt`` keeps its prompt out of the prefill engine's cache as the broker's
    soft index sees it (salted blocks get no block key), for tests whose turn 2 must pull."""
    wait_for(lambda: engines_registered(stub), lambda ids: {pd.prefill.engine_id, pd.decode.engine_id} <= ids,
             timeout_s=60, what="both engines registered with the broker")
    turn = driver.turn(tokens(random.Random(seed), n), max_tokens=max_tokens, session=session,
                       prefill_salt=prefill_salt)
    assert turn.decision == "RECOMPUTE" and turn.reason == "no_match"
    assert len(turn.output_ids) == max_tokens
    wait_lease(stub, pd.decode.engine_id, session, (len(turn.all_ids) - 1) // BS)
    return turn


def source_counts(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {source: metric(samples, "vllm:prompt_tokens_by_source_total", source=source)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def aggregated(pd: PDEngines, prompt: list[int], *, max_tokens: int, salt: str = "", logprobs: int = 5
               ) -> dict[str, Any]:
    """The prompt on the prefill engine alone, no transfer: local prefix cache (or, with a salt, none)."""
    body: dict[str, Any] = {"model": pd.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "logprobs": logprobs, "return_token_ids": True}
    if salt:
        body["cache_salt"] = salt
    choice = post_json(f"{pd.prefill.url}/v1/completions", body)["choices"][0]
    return {"ids": list(choice["token_ids"]), "top": [dict(t) for t in choice["logprobs"]["top_logprobs"]]}


def assert_same_greedy(got: list[int], want: list[int], want_top: list[dict[str, float]]) -> None:
    """Equal up to the first differing token, and that token a near-tie in the reference's logprobs."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            top = sorted(want_top[i].values(), reverse=True)
            assert len(top) >= 2 and top[0] - top[1] < NEAR_TIE, (
                f"greedy tokens part at {i} without a near-tie (top logprobs {top[:3]}): {got} vs {want}")
            return
    assert len(got) == len(want)


def test_turn2_pulls_turn1_prompt_and_generated_blocks(pd_engines: PDEngines, driver: PDDriver,
                                                       broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    t1 = first_turn(driver, broker_stub, pd_engines, "s-pull", seed=1)
    lease = wait_lease(broker_stub, pd_engines.decode.engine_id, "s-pull", (len(t1.all_ids) - 1) // BS)
    # The lease covers generated tokens too: its blocks reach past the prompt's full blocks.
    assert len(lease.block_keys) * BS > len(t1.prompt_ids)
    prompt2 = t1.all_ids + tokens(random.Random(2), 150)
    before_p, bytes_before = source_counts(pd_engines.prefill.url), scrape(pd_engines.prefill.url)
    # A fresh salt keeps the prefill engine's own prefix cache of turn 1 out: every matched block is pulled.
    t2 = driver.turn(prompt2, max_tokens=8, session="s-pull", prefill_salt="turn-2")
    after_p, bytes_after = source_counts(pd_engines.prefill.url), scrape(pd_engines.prefill.url)
    assert t2.decision == "TRANSFER", t2
    assert t2.matched_tokens == len(lease.block_keys) * BS
    report = t2.report
    assert report["pull_failed"] is False and report["local_tokens"] == 0
    assert report["pulled_tokens"] == t2.matched_tokens and report["pulled_blocks"] == t2.matched_tokens // BS
    assert report["computed_tokens"] == len(prompt2) - t2.matched_tokens
    d = delta(after_p, before_p)
    assert d["external_kv_transfer"] == t2.matched_tokens, d
    assert d["local_compute"] == len(prompt2) - t2.matched_tokens, d
    nixl = (metric(bytes_after, "vllm:nixl_bytes_transferred_sum")
            - metric(bytes_before, "vllm:nixl_bytes_transferred_sum"))
    assert nixl >= report["pulled_bytes"] > 0, (nixl, report)
    print(f"\nturn 2: {len(prompt2)} tokens, pulled {report['pulled_blocks']} blocks "
          f"({report['pulled_bytes']} B) in {report['pull_ms']} ms, computed {report['computed_tokens']}")


def test_pull_only_what_the_local_prefix_cache_lacks(pd_engines: PDEngines, driver: PDDriver,
                                                      broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    t1 = first_turn(driver, broker_stub, pd_engines, "s-local", seed=3)
    prompt2 = t1.all_ids + tokens(random.Random(4), 150)
    before = source_counts(pd_engines.prefill.url)
    t2 = driver.turn(prompt2, max_tokens=4, session="s-local")  # no salt: turn 1's prompt is cached there
    d = delta(source_counts(pd_engines.prefill.url), before)
    local = (len(t1.prompt_ids) // BS) * BS
    assert t2.decision == "TRANSFER" and t2.report["local_tokens"] == local, t2.report
    assert t2.report["pulled_tokens"] == t2.matched_tokens - local > 0
    assert d["local_cache_hit"] == local and d["external_kv_transfer"] == t2.matched_tokens - local, d


def test_pulled_kv_matches_local_hit_and_recompute(pd_engines: PDEngines, driver: PDDriver,
                                                   broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    t1 = first_turn(driver, broker_stub, pd_engines, "s-exact", seed=5, n=700, prefill_salt="exact-1")
    prompt2 = t1.all_ids + tokens(random.Random(6), 120)
    t2 = driver.turn(prompt2, max_tokens=12, session="s-exact", prefill_salt="exact-2", logprobs=5)
    assert t2.decision == "TRANSFER" and t2.report["pulled_tokens"] > 0, t2
    local_hit = aggregated(pd_engines, prompt2, max_tokens=12, salt="exact-2")  # turn 2's prefill cached it
    recompute = aggregated(pd_engines, prompt2, max_tokens=12, salt="exact-recompute")
    assert set(t2.first_logprobs) == set(local_hit["top"][0]), (t2.first_logprobs, local_hit["top"][0])
    for token, logprob in t2.first_logprobs.items():
        assert math.isclose(logprob, local_hit["top"][0][token], abs_tol=LOGPROB_TOLERANCE), (token, logprob)
    assert_same_greedy(t2.output_ids, recompute["ids"], recompute["top"])


def test_pull_under_threshold_is_skipped(pd_engines: PDEngines, driver: PDDriver,
                                         broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    # Turn 1 of 200 tokens + 60 generated leaves two full blocks (256 tokens): under the broker's 300.
    t1 = first_turn(driver, broker_stub, pd_engines, "s-small", seed=7, n=200, max_tokens=60)
    before = source_counts(pd_engines.prefill.url)
    t2 = driver.turn(t1.all_ids + tokens(random.Random(8), 100), max_tokens=4, session="s-small",
                     prefill_salt="small-2")
    assert t2.decision == "RECOMPUTE" and t2.reason == "below_threshold", t2
    assert delta(source_counts(pd_engines.prefill.url), before)["external_kv_transfer"] == 0
    assert t2.report["pulled_tokens"] == 0 and len(t2.output_ids) == 4


def test_failed_pull_recomputes_without_hanging(pd_engines: PDEngines, driver: PDDriver,
                                                broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    """The decode's blocks advertised as already expired: the prefill engine declines the read (upstream's
    expiry check), and the request, which upstream 0.32 leaves waiting forever, is recomputed."""
    t1 = first_turn(driver, broker_stub, pd_engines, "s-fail", seed=9)
    prompt2 = t1.all_ids + tokens(random.Random(10), 150)
    before = source_counts(pd_engines.prefill.url)
    t0 = time.monotonic()
    t2 = driver.turn(prompt2, max_tokens=8, session="s-fail", prefill_salt="fail-2",
                     prefill_params={"remote_blocks_expiry_time": 0.0})
    assert time.monotonic() - t0 < 60, "the failed pull took as long as a hang"
    assert t2.decision == "TRANSFER" and t2.report["pull_failed"] is True, t2.report
    d = delta(source_counts(pd_engines.prefill.url), before)
    assert d["external_kv_transfer"] == 0 and d["local_compute"] == len(prompt2), d
    reference = aggregated(pd_engines, prompt2, max_tokens=8, salt="fail-reference")
    assert_same_greedy(t2.output_ids, reference["ids"], reference["top"])


def test_evicted_lease_recomputes_and_frees_its_blocks(pd_engines: PDEngines, driver: PDDriver,
                                                       broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    decode = pd_engines.decode
    usage = lambda: metric(scrape(decode.url), "vllm:kv_cache_usage_perc")  # noqa: E731
    expire_all_leases(broker_stub, decode.engine_id)  # a clean baseline: nothing retained
    baseline = wait_for(usage, lambda u: u == 0.0, timeout_s=30, what="decode KV usage back to zero")
    t1 = first_turn(driver, broker_stub, pd_engines, "s-evict", seed=11, prefill_salt="evict-1")
    assert usage() > baseline
    (lease,) = leases_of(broker_stub, decode.engine_id)
    broker_stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=1.0), timeout=5)  # expires in 1 s
    wait_for(lambda: leases_of(broker_stub, decode.engine_id), lambda ls: not ls, timeout_s=30, what="lease expired")
    wait_for(usage, lambda u: u == baseline, timeout_s=30, what="decode KV usage back to its baseline")
    t2 = driver.turn(t1.all_ids + tokens(random.Random(12), 150), max_tokens=6, session="s-evict",
                     prefill_salt="evict-2")
    # No lease is left to pull from. The decode engine's prefix cache may still list the freed blocks (the soft
    # index): this strict-P/D driver cannot use them, and the plan says so.
    assert t2.decision == "RECOMPUTE" and t2.matched_tokens == 0 and len(t2.output_ids) == 6, t2
    assert t2.reason in ("no_match", "decode_local_vetoed"), t2


def test_an_agents_end_frees_its_sessions_blocks_on_the_engine(pd_engines: PDEngines, driver: PDDriver,
                                                                broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    """A session's end (docs/sessions.md): the broker releases its lease at once, and the decode engine, told over its
    sidecar's eviction stream, frees the blocks, long before the lease's TTL."""
    decode = pd_engines.decode
    usage = lambda: metric(scrape(decode.url), "vllm:kv_cache_usage_perc")  # noqa: E731
    expire_all_leases(broker_stub, decode.engine_id)  # a clean baseline: nothing retained
    baseline = wait_for(usage, lambda u: u == 0.0, timeout_s=30, what="decode KV usage back to zero")
    first_turn(driver, broker_stub, pd_engines, "s-end", seed=41, prefill_salt="end-1")
    assert usage() > baseline
    (lease,) = leases_of(broker_stub, decode.engine_id)
    assert lease.expires_at_unix > time.time() + 60  # the default TTL would hold it for minutes
    state = broker_stub.HintSession(pb.HintSessionRequest(session_id=lease.session_id, end=True), timeout=5)
    assert state.released_leases == 1 and state.ended_at_unix > 0, state
    assert not leases_of(broker_stub, decode.engine_id)
    started = time.monotonic()
    wait_for(usage, lambda u: u == baseline, timeout_s=30, what="the ended session's blocks freed by the engine")
    print(f"\nend: the decode engine freed the session's blocks {time.monotonic() - started:.2f} s after the hint")


def test_a_lease_demoted_under_memory_pressure_is_pulled_from_the_host_tier(
        pd_engines: PDEngines, driver: PDDriver, broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    """Memory pressure makes the broker demote the lease: the decode engine copies its blocks (prompt and generated)
    into its host tier and frees them; the next turn pulls from the tier's slots, and its answer equals a
    recompute's. The tier's slots start zeroed, so a copy that did not happen would change the answer."""
    decode = pd_engines.decode
    usage = lambda: metric(scrape(decode.url), "vllm:kv_cache_usage_perc")  # noqa: E731
    expire_all_leases(broker_stub, decode.engine_id)  # a clean baseline: nothing retained
    baseline = wait_for(usage, lambda u: u == 0.0, timeout_s=30, what="decode KV usage back to zero")
    t1 = first_turn(driver, broker_stub, pd_engines, "s-tier", seed=31, prefill_salt="tier-1")
    (lease,) = leases_of(broker_stub, decode.engine_id)
    status = next(e for e in broker_stub.Inspect(pb.InspectRequest(), timeout=5).engines
                  if e.engine.engine_id == decode.engine_id)
    first = status.engine.host_tier_first_id
    assert status.engine.host_tier_blocks == 64 and first > max(lease.block_ids), status.engine
    # Memory pressure as the decode engine's sidecar reports it (KV usage past its threshold, requests waiting).
    broker_stub.KeepAlive(pb.KeepAliveRequest(engine_id=decode.engine_id, load=pb.EngineLoad(
        memory_pressure=True, pressure_free_blocks=len(lease.block_ids))), timeout=5)
    demoted = wait_for(lambda: leases_of(broker_stub, decode.engine_id),
                       lambda ls: len(ls) == 1 and ls[0].tier == pb.TIER_HOST and not ls[0].demoting,
                       timeout_s=30, what="the lease copied to the host tier")[0]
    assert demoted.lease_id == lease.lease_id and list(demoted.block_keys) == list(lease.block_keys)
    assert all(first <= b < first + 64 for b in demoted.block_ids), demoted.block_ids
    wait_for(usage, lambda u: u == baseline, timeout_s=30, what="the demoted blocks freed from vLLM's pool")
    prompt2 = t1.all_ids + tokens(random.Random(32), 150)
    t2 = driver.turn(prompt2, max_tokens=8, session="s-tier", prefill_salt="tier-2", logprobs=5)
    assert t2.decision == "TRANSFER" and t2.matched_tokens == len(lease.block_keys) * BS, t2
    report = t2.report
    assert report["pull_failed"] is False and report["pulled_blocks"] == len(lease.block_keys), report
    # Against a recompute, to float32's rounding: the tiny model's greedy tokens hardly depend on a far context
    # (they came out equal with the tier's slots left zeroed), its logprobs do.
    reference = aggregated(pd_engines, prompt2, max_tokens=8, salt="tier-reference")
    assert set(t2.first_logprobs) == set(reference["top"][0]), (t2.first_logprobs, reference["top"][0])
    for token, logprob in t2.first_logprobs.items():
        assert math.isclose(logprob, reference["top"][0][token], abs_tol=LOGPROB_TOLERANCE), (token, logprob)
    assert_same_greedy(t2.output_ids, reference["ids"], reference["top"])
    assert lease.lease_id not in {x.lease_id for x in leases_of(broker_stub, decode.engine_id)}  # superseded by t2's


def test_a_decode_local_turn_is_retained_and_its_blocks_freed_with_its_lease(
        pd_engines: PDEngines, broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    """A request the decode engine serves whole (DECODE_LOCAL) is retained like one from a prefill engine, and when
    its lease expires its blocks go back to the pool. Before the fix they never did: the workers ignored the
    release of a request that had not come through a pull."""
    decode = pd_engines.decode
    usage = lambda: metric(scrape(decode.url), "vllm:kv_cache_usage_perc")  # noqa: E731
    wait_for(lambda: engines_registered(broker_stub), lambda ids: decode.engine_id in ids, timeout_s=60,
             what="the decode engine registered")
    expire_all_leases(broker_stub, decode.engine_id)  # a clean baseline: nothing retained
    wait_for(usage, lambda u: u == 0.0, timeout_s=30, what="decode KV usage at zero")
    body = {"model": pd_engines.model_name, "prompt": tokens(random.Random(21), 400), "max_tokens": 8,
            "temperature": 0, "return_token_ids": True, "kv_transfer_params": decode_local_params("s-local")}
    choice = post_json(f"{decode.url}/v1/completions", body)["choices"][0]
    assert len(choice["token_ids"]) == 8
    lease = wait_lease(broker_stub, decode.engine_id, "s-local", 400 // BS)
    assert usage() > 0.0
    broker_stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=1.0), timeout=5)
    wait_for(lambda: leases_of(broker_stub, decode.engine_id), lambda ls: not ls, timeout_s=30, what="lease expired")
    wait_for(usage, lambda u: u == 0.0, timeout_s=30, what="the decode-local turn's blocks freed")


def test_an_answer_the_client_will_not_repeat_is_freed_and_the_prompt_kept(
        pd_engines: PDEngines, broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    """``keep_generated: false`` (a reasoning model's client whose next turn drops the answer): the decode engine
    retains the prompt's full blocks and gives the answer's back to the pool at once; the next turn, which does not
    repeat the answer, finds the prompt in the engine's cache and answers as a recompute does."""
    decode = pd_engines.decode
    usage = lambda: metric(scrape(decode.url), "vllm:kv_cache_usage_perc")  # noqa: E731
    wait_for(lambda: engines_registered(broker_stub), lambda ids: decode.engine_id in ids, timeout_s=60,
             what="the decode engine registered")

    def served_whole(prompt: list[int], session: str, keep_generated: bool, max_tokens: int = 200) -> dict[str, Any]:
        params = {**decode_local_params(session), **({} if keep_generated else {KEEP_GENERATED_KEY: False})}
        return post_json(f"{decode.url}/v1/completions", {
            "model": pd_engines.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 5, "kv_transfer_params": params})

    held = {}
    for session, seed, keep in (("s-keep", 51, True), ("s-drop", 52, False)):
        expire_all_leases(broker_stub, decode.engine_id)
        wait_for(usage, lambda u: u == 0.0, timeout_s=30, what="decode KV usage at zero")
        prompt = tokens(random.Random(seed), 400)
        reply = served_whole(prompt, session, keep)
        # 400 prompt tokens and 200 generated: 599 with KV, 4 full blocks, 3 of them the prompt's alone.
        lease = wait_lease(broker_stub, decode.engine_id, session, 3)
        # vLLM returns a finished request's blocks after the step in flight (async scheduling), and an idle engine
        # takes no step: one more request lets it, and its stats then show what the engine holds.
        post_json(f"{decode.url}/v1/completions", {"model": pd_engines.model_name, "prompt": [7], "max_tokens": 1})
        held[session] = (len(lease.block_ids), usage(), reply.get("kv_transfer_params") or {}, prompt)
    assert held["s-keep"][0] == 4 and held["s-drop"][0] == 3, held
    assert held["s-drop"][2].get(DROPPED_KEY) == 2 and DROPPED_KEY not in held["s-keep"][2], held
    # The keeping session holds every block it wrote (5, the last one partly filled); the dropping one its
    # prompt's 3.
    assert math.isclose(held["s-drop"][1] * 5, held["s-keep"][1] * 3), held
    prompt2 = held["s-drop"][3] + tokens(random.Random(53), 150)  # the next turn: no answer in it
    turn2 = served_whole(prompt2, "s-drop", keep_generated=False, max_tokens=8)
    assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS, turn2["usage"]
    reference = aggregated(pd_engines, prompt2, max_tokens=8, salt="drop-reference")
    assert_same_greedy(list(turn2["choices"][0]["token_ids"]), reference["ids"], reference["top"])
    expire_all_leases(broker_stub, decode.engine_id)
    wait_for(usage, lambda u: u == 0.0, timeout_s=30, what="the kept prompts' blocks freed with their leases")


@pytest.mark.stops_engines(order=0)  # before the test that stops every shared engine; leaves a new decode engine
def test_killed_decode_engine_drops_its_leases_and_the_next_turn_recomputes(
        pd_engines: PDEngines, driver: PDDriver, broker_stub: broker_pb2_grpc.KVBrokerStub,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    t1 = first_turn(driver, broker_stub, pd_engines, "s-kill", seed=13)
    old = pd_engines.decode
    old._signal_group(signal.SIGKILL)  # vLLM dies at once; its sidecar sees the connector go
    wait_for(lambda: leases_of(broker_stub, old.engine_id), lambda ls: not ls, timeout_s=30,
             what="the killed engine's leases dropped")
    old.stop()
    config = EngineConfig(role="decode", model=pd_engines.model_dir, dtype="float32", max_model_len=4096,
                          work_dir=tmp_path_factory.mktemp("decode-again"), kv_connector_extra_config=EXTRA_CONFIG,
                          omp_threads_bind=role_cores("decode"), connector="kvloop",
                          broker=pd_engines.broker, engine_id="decode-test-2")
    fresh = start_engines([config], timeout_s=ENGINE_START_TIMEOUT_S).by_id("decode-test-2")
    pd_engines.replacements.append(fresh)  # stopped at teardown (stop is idempotent)
    pd_engines.decode = fresh  # the shared decode engine from now on
    wait_for(lambda: engines_registered(broker_stub), lambda ids: "decode-test-2" in ids, timeout_s=60,
             what="the new decode engine registered")
    driver.engines["decode-test-2"] = fresh.url
    t2 = driver.turn(t1.all_ids + tokens(random.Random(14), 150), max_tokens=6, session="s-kill")
    assert t2.decision in ("RECOMPUTE", "PREFILL_LOCAL") and t2.decode_engine == "decode-test-2", t2
    assert len(t2.output_ids) == 6


def test_a_paused_sessions_demoted_lease_is_promoted_back_before_it_resumes(
        pd_engines: PDEngines, broker_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    """Prefetch (docs/sessions.md): a session pauses, pressure demotes its lease to the host tier, and before the
    stated resume the broker has the decode engine load it back into its pool; the next turn finds its prefix in
    the engine's own cache and answers as a recompute does. Turn 1 is salted on the decode engine, so vLLM's
    prefix cache cannot stand in for the copy: the promotion's tokens come from the tier (the engine's
    ``external_kv_transfer`` count), and the tier's slots, copied from nothing, would change the answer."""
    decode = pd_engines.decode
    usage = lambda: metric(scrape(decode.url), "vllm:kv_cache_usage_perc")  # noqa: E731
    wait_for(lambda: engines_registered(broker_stub), lambda ids: decode.engine_id in ids, timeout_s=60,
             what="the decode engine registered")
    expire_all_leases(broker_stub, decode.engine_id)
    wait_for(usage, lambda u: u == 0.0, timeout_s=30, what="decode KV usage at zero")
    prompt = tokens(random.Random(71), 400)  # a prompt of its own: no other test's is in the engine's cache
    body = {"model": pd_engines.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True, "cache_salt": "promote-1", "kv_transfer_params": decode_local_params("s-pre")}
    answer = list(post_json(f"{decode.url}/v1/completions", body)["choices"][0]["token_ids"])
    lease = wait_lease(broker_stub, decode.engine_id, "s-pre", 3)
    pause_s = 12.0  # the broker's lead is 5 s: the promotion comes 7 s after the hint
    broker_stub.HintSession(pb.HintSessionRequest(session_id="s-pre", pause_s=pause_s), timeout=5)
    hinted = time.monotonic()
    broker_stub.KeepAlive(pb.KeepAliveRequest(engine_id=decode.engine_id, load=pb.EngineLoad(
        memory_pressure=True, pressure_free_blocks=len(lease.block_ids))), timeout=5)
    wait_for(lambda: leases_of(broker_stub, decode.engine_id),
             lambda ls: [(x.lease_id, x.tier, x.demoting) for x in ls] == [(lease.lease_id, pb.TIER_HOST, False)],
             timeout_s=5, what="the paused session's lease copied to the host tier")
    wait_for(usage, lambda u: u == 0.0, timeout_s=5, what="the demoted blocks freed from vLLM's pool")
    before = source_counts(decode.url)
    promoted = wait_for(lambda: leases_of(broker_stub, decode.engine_id),
                        lambda ls: len(ls) == 1 and ls[0].tier == pb.TIER_POOL, timeout_s=30,
                        what="the lease promoted back into the pool")[0]
    assert time.monotonic() - hinted < pause_s  # before the stated resume
    assert promoted.lease_id != lease.lease_id and list(promoted.block_keys) == list(lease.block_keys)
    loaded = delta(source_counts(decode.url), before)
    assert loaded["external_kv_transfer"] == len(lease.block_keys) * BS and loaded["local_compute"] == 1, loaded
    prompt2 = prompt + answer + tokens(random.Random(72), 100)
    before = source_counts(decode.url)
    body = {"model": pd_engines.model_name, "prompt": prompt2, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True, "logprobs": 5, "kv_transfer_params": decode_local_params("s-pre")}
    choice = post_json(f"{decode.url}/v1/completions", body)["choices"][0]
    assert delta(source_counts(decode.url), before)["local_cache_hit"] == len(lease.block_keys) * BS
    reference = aggregated(pd_engines, prompt2, max_tokens=8, salt="promote-reference")
    top = dict(choice["logprobs"]["top_logprobs"][0])
    assert set(top) == set(reference["top"][0]), (top, reference["top"][0])
    for token, logprob in top.items():
        assert math.isclose(logprob, reference["top"][0][token], abs_tol=LOGPROB_TOLERANCE), (token, logprob)
    assert_same_greedy(list(choice["token_ids"]), reference["ids"], reference["top"])
