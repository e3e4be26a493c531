"""A small synchronous P/D turn driver over token ids: place, pin, prefill (with the pull), decode.

It is the protocol in its plainest form, used by the engine tests and ``kvloop bench engines``; the
router (``router/``) is the production path with the same steps. Per turn:

1. block keys of the prompt with the shared hash (:mod:`kvloop.shared.hashing`) and ``Place`` at the broker;
2. on ``TRANSFER``: ``PinBlocks`` on the source lease (the broker then defers any eviction of it), and
   the prefill request's ``kv_transfer_params`` name the source: its NIXL side channel, the pinned block
   ids cut to the matched prefix, ``remote_num_tokens`` = the matched tokens, and a ``remote_request_id``
   of ``kvloop-lease-<lease id>`` so the decode engine counts the read without freeing;
3. the prefill engine (``max_tokens=1``) pulls what its local prefix cache lacks, computes the tail and
   returns the P->D params with its ``kvloop`` report; ``CompleteTransfer`` tells the broker how the pull
   went (a failed pull was recomputed by the engine; the answer is still right);
4. the decode engine answers with those params and retains the turn's KV for the next one.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvloop.shared.client import complete_request, transfer_params
from kvloop.shared.hashing import ExtraKeys, block_keys
from kvloop.shared.http import iter_sse
from kvloop.shared.protocol import SESSION_KEY, PrefillReport, prefill_only_params
from kvloop.shared.vocabulary import Path, Reason
from kvloop.v1 import broker_pb2 as pb
from kvloop.v1 import broker_pb2_grpc


def post_json(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        result: dict[str, Any] = json.loads(reply.read())
        return result


@dataclass
class Turn:
    prompt_ids: list[int]
    output_ids: list[int]
    decision: str
    reason: str
    matched_tokens: int
    prefill_engine: str
    decode_engine: str
    report: dict[str, Any]                  # the prefill's kvloop report (local/pulled/computed tokens, pull ms)
    ttft_s: float                           # client-side: placement to the prefill's answer (its first token)
    first_logprobs: dict[str, float] = field(default_factory=dict)  # decode's top logprobs at its first token
    decode_params: dict[str, Any] | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class PDDriver:
    def __init__(self, broker: str, *, fingerprint: str, block_size: int, model: str,
                 engines: dict[str, str], timeout_s: float = 300.0) -> None:
        """``engines``: engine id -> base URL, for overriding the broker's prefill choice."""
        self.channel = grpc.insecure_channel(broker)
        self.stub = broker_pb2_grpc.KVBrokerStub(self.channel)
        self.extra = ExtraKeys(fingerprint)
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.model = model
        self.engines = engines
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.channel.close()

    def place(self, prompt_ids: list[int], session: str = "") -> pb.Plan:
        keys = block_keys(prompt_ids, self.block_size, self.extra)
        # This driver exercises the P/D path itself: it asks for plans without DECODE_LOCAL.
        plan: pb.Plan = self.stub.Place(pb.PlaceRequest(session_id=session, block_keys=keys, num_tokens=len(prompt_ids),
                                                        layout_fingerprint=self.fingerprint,
                                                        block_size=self.block_size, no_decode_local=True), timeout=10)
        return plan

    def turn(self, prompt_ids: list[int], *, max_tokens: int = 16, session: str = "", prefill: str = "",
             transfer: bool = True, logprobs: int = 0, prefill_salt: str = "",
             prefill_params: dict[str, Any] | None = None, stream: bool = False) -> Turn:
        """One turn. ``prefill``: engine id to prefill on (default: the broker's choice); ``transfer=False``
        ignores the plan's source (the one-way baseline); ``prefill_salt`` keeps the prefill engine's local
        prefix cache out (vLLM's ``cache_salt``; block keys do not include it); ``prefill_params`` are
        merged into the prefill's ``kv_transfer_params`` when it pulls (tests use it to make a read fail);
        ``stream`` streams the decode and takes TTFT at its first token (else TTFT is the prefill's answer)."""
        t0 = time.perf_counter()
        plan = self.place(prompt_ids, session)
        decision = pb.Decision.Name(plan.decision).removeprefix("DECISION_")
        reason = plan.reason
        prefill_id = prefill or plan.prefill_engine_id
        params: dict[str, Any] = prefill_only_params()
        pin: pb.PinBlocksResponse | None = None
        if plan.decision == pb.DECISION_TRANSFER:
            if transfer and plan.source_engine_id != prefill_id:
                try:
                    pin = self.stub.PinBlocks(pb.PinBlocksRequest(
                        reader_engine_id=prefill_id, lease_id=plan.source_lease_id, num_blocks=plan.matched_blocks),
                        timeout=10)
                except grpc.RpcError:
                    pin = None  # the lease went away since the plan: recompute
            if pin is None:
                decision = Path.RECOMPUTE
                reason = "return_path_off" if not transfer else (
                    Reason.SOURCE_IS_PREFILL if plan.source_engine_id == prefill_id else Reason.PIN_REFUSED)
            else:
                params = {**transfer_params(plan, pin), **(prefill_params or {})}
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": params}
        if prefill_salt:
            body["cache_salt"] = prefill_salt
        prefilled = post_json(f"{self.engines[prefill_id]}/v1/completions", body, self.timeout_s)
        ttft = time.perf_counter() - t0
        p_params = dict(prefilled.get("kv_transfer_params") or {})
        prefill_report = PrefillReport.pop_from(p_params)
        report = prefill_report.to_params() if prefill_report else {}
        if pin is not None:
            self.stub.CompleteTransfer(complete_request(pin, prefill_report), timeout=10)
        decode_id = plan.decode_engine_id
        p_params[SESSION_KEY] = session
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                "kv_transfer_params": p_params, "return_token_ids": True}
        if logprobs:
            body["logprobs"] = logprobs
        decode_url = f"{plan.decode_addresses.http or self.engines[decode_id]}/v1/completions"
        if stream:
            body["stream"] = True
            output_ids, first, ttft_stream = self._stream(decode_url, body, t0)
            ttft, decoded_params = ttft_stream, None
        else:
            decoded = post_json(decode_url, body, self.timeout_s)
            choice = decoded["choices"][0]
            output_ids, decoded_params = list(choice.get("token_ids") or []), decoded.get("kv_transfer_params")
            first = {}
            if logprobs and choice.get("logprobs") and choice["logprobs"].get("top_logprobs"):
                first = dict(choice["logprobs"]["top_logprobs"][0])
        return Turn(prompt_ids=list(prompt_ids), output_ids=output_ids, decision=decision, reason=reason,
                    matched_tokens=int(plan.matched_tokens), prefill_engine=prefill_id, decode_engine=decode_id,
                    report=report, ttft_s=ttft, first_logprobs=first, decode_params=decoded_params)

    def _stream(self, url: str, body: dict[str, Any], t0: float) -> tuple[list[int], dict[str, float], float]:
        """Server-sent events of a streamed completion: token ids, the first top logprobs, TTFT."""
        request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        ids: list[int] = []
        first: dict[str, float] = {}
        ttft = 0.0
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            for chunk in iter_sse(reply):
                for choice in chunk.get("choices", []):
                    new = list(choice.get("token_ids") or [])
                    if new and not ttft:
                        ttft = time.perf_counter() - t0
                        top = (choice.get("logprobs") or {}).get("top_logprobs") or [{}]
                        first = dict(top[0] or {})
                    ids += new
        return ids, first, ttft or time.perf_counter() - t0
