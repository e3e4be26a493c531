"""The soft index end to end on a real vLLM CPU engine: its KV cache events reach its sidecar, which reports them to
the broker in kvloop block keys.

The reference is built here, independently of the sidecar: this test asks the engine's own replay endpoint for
every event since the engine started and translates them with the same :class:`CacheMirror`; the prompt's leading
``block_keys`` must be among them, and the broker must count exactly as many blocks as they name.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

import grpc
import pytest
import zmq

from kvloop.app.benchmarks.pd_driver import post_json
from kvloop.engines.layout import engine_fingerprint
from kvloop.engines.sidecar.cache_events import CacheMirror, decode_batch
from kvloop.shared.hashing import ExtraKeys, block_keys
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc
from tests.support.engine_checks import wait_for

if TYPE_CHECKING:
    from kvloop.engines.launcher import EngineProcess
    from tests.engines.conftest import PDEngines

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
BS = 128
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replayed_mirror(engine: EngineProcess, fingerprint: str) -> CacheMirror:
    """Every batch the engine's publisher still holds, from seq 0, through a fresh mirror."""
    assert engine.plan.kv_events is not None and engine.plan.kv_events[1]
    mirror = CacheMirror(BS, fingerprint, 1 << 20)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(engine.plan.kv_events[1])
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        expected = 0
        while True:
            assert sock.poll(10_000), "the replay endpoint did not answer in 10 s"
            _, _, seq_bytes, payload = sock.recv_multipart()
            if seq_bytes == END_SEQ:
                return mirror
            seq = int.from_bytes(seq_bytes, "big")
            assert seq == expected, f"the replay buffer no longer starts at 0 (got {seq}): the reference is incomplete"
            assert mirror.apply(decode_batch(payload)) == []
            expected += 1
    finally:
        sock.close()
        ctx.term()


def soft_status(stub: broker_pb2_grpc.KVBrokerStub, engine_id: str) -> tuple[int, int]:
    """(cached_blocks, cache_resets) of the engine at the broker."""
    reply = stub.Inspect(pb.InspectRequest(), timeout=5)
    status = next(e for e in reply.engines if e.engine.engine_id == engine_id)
    return status.cached_blocks, status.cache_resets


def test_prefix_cache_reaches_the_broker_as_block_keys(pd_engines: PDEngines) -> None:
    prefill = pd_engines.prefill
    fp = engine_fingerprint(pd_engines.model_dir, dtype="float32", block_size=BS)
    rng = random.Random(4242)
    prompt = [rng.randrange(300, 4000) for _ in range(3 * BS + 10)]  # three full blocks and a partial one
    channel = grpc.insecure_channel(pd_engines.broker)
    stub = broker_pb2_grpc.KVBrokerStub(channel)
    try:
        wait_for(lambda: {e.engine.engine_id: e.engine.layout_fingerprint
                          for e in stub.Inspect(pb.InspectRequest(), timeout=5).engines}.get(prefill.engine_id),
                 lambda registered: registered == fp, timeout_s=60, what="the prefill engine registered")
        post_json(f"{prefill.url}/v1/completions", {"model": pd_engines.model_name, "prompt": prompt, "max_tokens": 1,
                                                    "temperature": 0})
        keys = block_keys(prompt, BS, ExtraKeys(fp))
        assert len(keys) == 3
        mirror = wait_for(lambda: replayed_mirror(prefill, fp), lambda m: set(keys) <= set(m.keys()), timeout_s=30,
                          what="the prompt's blocks among the engine's own events")
        # The sidecar reports what the engine's events say: the broker names as many blocks as the reference does.
        deadline = time.monotonic() + 30
        while (broker := soft_status(stub, prefill.engine_id))[0] != len(mirror) and time.monotonic() < deadline:
            time.sleep(0.2)
            mirror = replayed_mirror(prefill, fp)  # other steps may have stored or removed blocks meanwhile
        assert broker[0] == len(mirror) >= 3, (broker, len(mirror))
    finally:
        channel.close()
