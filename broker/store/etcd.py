"""The etcd store and leader election (etcd v3 through the asyncio client ``aetcd``).

Layout under ``prefix`` (default ``/kvloop/``): ``leader`` (the leader's id and address, on a short
etcd lease), ``engines/<id>``, ``leases/<id>``, ``pins/<id>`` (JSON).

TTLs ride on etcd leases: each record is attached to an etcd lease that ends a grace period after the
record's own deadline (a kvloop lease's expiry, or its last pin's; an engine's keep-alive deadline), so
etcd drops what no broker is left to expire, and a broker that restarts finds everything still due.
Records are bucketed by deadline (``bucket_s``) so a few etcd leases serve many records.

Every write is a transaction guarded by ``leader == <this replica>``: a replica that lost leadership
without noticing cannot overwrite its successor's state (fencing).

A replica that becomes leader reads the records in pages (``LOAD_PAGE_KEYS``) at one revision: one read of every
lease failed once the leases passed gRPC's 4 MiB message limit (about 58k retained blocks), so no replica could
take over (``tests/integration/test_broker_etcd.py::test_a_new_leader_loads_more_state_than_one_message_holds``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd
import aetcd.rpc
import aetcd.utils
import grpc
import structlog

from kvloop.broker.core import Changes, Lease, Limits
from kvloop.broker.store import codec
from kvloop.broker.store.base import Snapshot
from kvloop.shared.config import field_default
from kvloop.shared.errors import Unavailable

log = structlog.get_logger("kvloop.broker.etcd")


LOAD_PAGE_KEYS = 128
"""Records per range read of a load. etcd refuses a put over its ``--max-request-bytes`` (1.5 MiB by default), so a
page holds at most 192 MiB, within ``MAX_RECEIVE_BYTES``; typical pages (128-block leases, 9 KiB each) about 1 MiB."""
MAX_RECEIVE_BYTES = 256 * 2**20


def connect(endpoint: str, timeout_s: float = 5.0) -> aetcd.Client:
    host, _, port = endpoint.rpartition(":")
    return aetcd.Client(host=host or "127.0.0.1", port=int(port), timeout=timeout_s,
                        options={"grpc.max_receive_message_length": MAX_RECEIVE_BYTES})


class EtcdStore:
    kind = "etcd"
    durable = True

    def __init__(
        self, client: aetcd.Client, prefix: str, replica_id: str, *, grace_s: float = 30.0, bucket_s: float = 5.0,
        engine_ttl_s: float = field_default(Limits, "engine_ttl_s"),
    ) -> None:
        self._client = client
        self._prefix = prefix.encode()
        self._leader_key = self._prefix + b"leader"
        self._replica_id = replica_id
        self._grace_s = grace_s
        self._bucket_s = bucket_s
        self._engine_ttl_s = engine_ttl_s
        self._buckets: dict[int, int] = {}
        self._leader_value = b""  # set by the election; every write is fenced on it

    def _key(self, kind: str, ident: str) -> bytes:
        return self._prefix + kind.encode() + b"/" + ident.encode()

    async def load(self) -> Snapshot:
        raw: dict[bytes, list[bytes]] = {}
        try:
            await self._client.connect()
            revision = 0
            for kind in (b"engines", b"leases", b"pins"):
                raw[kind], revision = await self._read_prefix(self._prefix + kind + b"/", revision)
        except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError) as exc:
            raise Unavailable(f"etcd: cannot load broker state: {exc}") from exc
        return Snapshot(engines=[codec.decode_engine(v) for v in raw[b"engines"]],
                        leases=[codec.decode_lease(v) for v in raw[b"leases"]],
                        pins=[codec.decode_pin(v) for v in raw[b"pins"]])

    async def _read_prefix(self, prefix: bytes, revision: int) -> tuple[list[bytes], int]:
        """Every value under ``prefix``, ``LOAD_PAGE_KEYS`` a read, all at ``revision`` (0: the current one, which
        is returned for the next reads): the pages add up to one consistent snapshot."""
        values: list[bytes] = []
        start, end = prefix, aetcd.utils.prefix_range_end(prefix)
        while True:
            request = aetcd.rpc.RangeRequest(key=start, range_end=end, limit=LOAD_PAGE_KEYS, revision=revision)
            reply = await self._client.kvstub.Range(request, timeout=self._client._timeout,
                                                    metadata=self._client.metadata)
            revision = revision or reply.header.revision
            values += [kv.value for kv in reply.kvs]
            if not reply.more or not reply.kvs:
                return values, revision
            start = reply.kvs[-1].key + b"\0"  # etcd returns keys in order: the next page starts after the last

    async def _etcd_lease(self, deadline: float, now: float) -> int:
        bucket = math.ceil(deadline / self._bucket_s)
        lease_id = self._buckets.get(bucket)
        if lease_id is None:
            ttl = max(1, math.ceil(bucket * self._bucket_s + self._grace_s - now))
            lease_id = (await self._client.lease(ttl)).id
            self._buckets = {b: i for b, i in self._buckets.items() if b * self._bucket_s + self._grace_s > now}
            self._buckets[bucket] = lease_id
        return lease_id

    async def apply(self, changes: Changes, hold_until: Callable[[Lease], float], now: float) -> None:
        tx = self._client.transactions
        ops: list[Any] = []
        try:
            # (kind, changed records, encoder, the record's deadline: etcd may drop it a grace later)
            kinds: list[tuple[str, dict[str, Any], Callable[[Any], bytes], Callable[[Any], float]]] = [
                ("engines", changes.engines, codec.encode_engine, lambda r: r.last_seen + self._engine_ttl_s),
                ("leases", changes.leases, codec.encode_lease, hold_until),
                ("pins", changes.pins, codec.encode_pin, lambda p: p.expires_at),
            ]
            for kind, records, encode, deadline in kinds:
                for ident, record in records.items():
                    key = self._key(kind, ident)
                    if record is None:
                        ops.append(tx.delete(key))
                    else:
                        lease = await self._etcd_lease(deadline(record), now)
                        ops.append(tx.put(key, encode(record), lease=lease))
            if not ops:
                return
            guard = [tx.value(self._leader_key) == self._leader_value]
            # etcd caps operations per transaction (128 by default): split big batches, each guarded.
            for start in range(0, len(ops), 100):
                ok, _ = await self._client.transaction(compare=guard, success=ops[start : start + 100], failure=[])
                if not ok:
                    raise Unavailable("etcd: this broker replica is no longer the leader")
        except aetcd.exceptions.ClientError as exc:
            raise Unavailable(f"etcd: write failed: {exc}") from exc

    def set_leader_value(self, value: bytes) -> None:
        """The value of the leader key while this replica leads (fencing token)."""
        self._leader_value = value

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.close()


class EtcdElection:
    """Campaign for ``<prefix>leader`` with create-if-absent on a short etcd lease; keep it alive while
    leading; on losing it (lease lapsed, etcd unreachable too long) call ``on_deposed`` and campaign again."""

    def __init__(
        self, client: aetcd.Client, store: EtcdStore, prefix: str, replica_id: str, address: str,
        *, ttl_s: int = 5,
    ) -> None:
        self._client = client
        self._store = store
        self._key = prefix.encode() + b"leader"
        self._value = json.dumps({"replica_id": replica_id, "address": address}).encode()
        self._ttl_s = ttl_s
        self._lease: Any = None
        self._leader_address = ""
        self._stop = asyncio.Event()
        store.set_leader_value(self._value)

    def leader(self) -> str:
        return self._leader_address

    async def _campaign(self) -> bool:
        tx = self._client.transactions
        lease = await self._client.lease(self._ttl_s)
        ok, responses = await self._client.transaction(
            compare=[tx.create(self._key) == 0],
            success=[tx.put(self._key, self._value, lease=lease)],
            failure=[tx.get(self._key)],
        )
        if ok:
            self._lease = lease
            return True
        with contextlib.suppress(Exception):
            await lease.revoke()
        current = responses[0][0][0] if responses and responses[0] else b""
        with contextlib.suppress(ValueError):
            self._leader_address = json.loads(current).get("address", "")
        return False

    async def _wait(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def run(
        self, on_elected: Callable[[], Awaitable[None]], on_deposed: Callable[[], Awaitable[None]]
    ) -> None:
        interval = self._ttl_s / 3
        while not self._stop.is_set():
            try:
                elected = await self._campaign()
            except aetcd.exceptions.ClientError as exc:
                log.warning("election.campaign_failed", error=str(exc))
                await self._wait(interval)
                continue
            if not elected:
                await self._wait(interval)
                continue
            self._leader_address = json.loads(self._value)["address"]
            log.info("election.elected")
            try:
                await on_elected()
            except Exception:
                # e.g. the state could not be loaded: give the leadership up and campaign again,
                # rather than end the loop and hold the key without ever serving.
                log.exception("election.takeover_failed")
                await self._give_up()
                await self._wait(interval)
                continue
            await self._hold(interval)
            await on_deposed()
            log.warning("election.deposed")

    async def _hold(self, interval: float) -> None:
        """Refresh the leader lease until it lapses or we resign."""
        last_ok = asyncio.get_running_loop().time()
        while not self._stop.is_set():
            await self._wait(interval)
            if self._stop.is_set():
                return
            try:
                reply = await self._client.refresh_lease(self._lease.id)
                if reply is None or reply.TTL <= 0:
                    return  # the lease is gone: someone else may lead now
                last_ok = asyncio.get_running_loop().time()
            except aetcd.exceptions.ClientError as exc:
                log.warning("election.refresh_failed", error=str(exc))
                if asyncio.get_running_loop().time() - last_ok >= self._ttl_s:
                    return

    async def still_leader(self) -> bool:
        if self._lease is None:
            return False
        current = await self._client.get(self._key)
        return current is not None and current.value == self._value

    async def _give_up(self) -> None:
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await self._lease.revoke()
            self._lease = None

    async def resign(self) -> None:
        self._stop.set()
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await self._lease.revoke()
            self._lease = None
