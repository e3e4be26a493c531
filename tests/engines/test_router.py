"""The router end to end on the shared cluster (real broker, real vLLM CPU engines with kvloop's connector and
sidecars, real NIXL): OpenAI answers streamed and not, a multi-turn chat that takes each path when it should
(read from an in-memory span exporter), answers equal to a recompute's, an edited history, a broker that cannot
be reached, and bad input refused in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvloop.router.config import RouterConfig
from kvloop.router.residuals import PathResiduals
from kvloop.router.server import RunningRouter, start_router
from kvloop.shared import headers as hdr
from kvloop.shared.http import aiter_sse
from kvloop.shared.vocabulary import PlanOutcome
from tests.support.engine_checks import assert_same_tokens

if TYPE_CHECKING:
    from tests.engines.conftest import PDEngines

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SPANS = InMemorySpanExporter()
SYSTEM = " ".join(f"Rule {i}: the agent keeps its notes short, cites block {i * 3 % 17} and never guesses."
                  for i in range(40))  # ~700 tokens: every later turn matches more than the test threshold


@pytest.fixture(scope="module", autouse=True)
def in_memory_spans() -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(SPANS))
    trace.set_tracer_provider(provider)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def router(pd_engines: PDEngines) -> AsyncIterator[RunningRouter]:
    running = await start_router(RouterConfig(listen="127.0.0.1:0", broker=pd_engines.broker, refresh_s=0.5,
                                              log_format="console", tokenizer=str(pd_engines.model_dir)))
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(200):  # health turns 200 once the broker's engine list arrived
                async with http.get(f"{running.url}/health") as reply:
                    if reply.status == 200:
                        break
                await running.runner.refresh()
        yield running
    finally:
        await running.stop()


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(
            url, data=body if isinstance(body, bytes) else json.dumps(body).encode(),
            headers={"content-type": "application/json", **(headers or {})}) as reply:
        return reply.status, await reply.json(content_type=None)


async def stream_chat(url: str, body: dict[str, Any]) -> str:
    text = []
    async with aiohttp.ClientSession() as http, http.post(url, json={**body, "stream": True}) as reply:
        assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
        async for chunk in aiter_sse(reply.content):
            for choice in chunk["choices"]:
                text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(text)


async def lease_ids(broker: str) -> set[str]:
    from kvloop.shared.client import BrokerClient
    from kvloop.v1 import broker_pb2 as pb

    async with BrokerClient(broker) as client:
        reply = await client.call("Inspect", pb.InspectRequest())
    return {lease.lease_id for lease in reply.leases}


async def wait_new_lease(broker: str, before: set[str]) -> None:
    """The decode's sidecar publishes a finished turn's lease a few milliseconds after the answer: a client that
    sends a turn at once that does not extend the answered prompt (an edit) is not waited for by the router."""
    for _ in range(300):
        if await lease_ids(broker) - before:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no new lease was published after the turn")


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def turn_spans() -> list[Any]:
    return [s for s in SPANS.get_finished_spans() if s.name == "kvloop.turn"]


async def test_completions_streamed_and_not(router: RunningRouter, pd_engines: PDEngines) -> None:
    body = {"model": pd_engines.model_name, "prompt": "The broker keeps leases and", "max_tokens": 8,
            "temperature": 0}
    status, reply = await post(f"{router.url}/v1/completions", body)
    assert status == 200 and reply["choices"][0]["text"] and "kv_transfer_params" not in reply
    streamed = await stream_chat(f"{router.url}/v1/completions", body)
    assert streamed == reply["choices"][0]["text"]
    status, models = 0, None
    async with aiohttp.ClientSession() as http, http.get(f"{router.url}/v1/models") as r:
        status, models = r.status, await r.json()
    assert status == 200 and [m["id"] for m in models["data"]] == [pd_engines.model_name]


async def test_the_routers_tokenizer_equals_the_engines(router: RunningRouter, pd_engines: PDEngines) -> None:
    """The router tokenizes with the model's own tokenizer and chat template: the same ids as the engine's
    /tokenize (so the same block keys), and what it does not render is left to the engine."""
    from kvloop.router.turn import CHAT_TEMPLATE_FIELDS

    tokenizer = router.runner.tokenizer
    assert tokenizer is not None
    model = pd_engines.model_name
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plan the next step."},
               {"role": "assistant", "content": "Read the file, then run the tests."},
               {"role": "user", "content": "Ünïcode, emoji 🙂 and\ttabs\n\nand blank lines."}]
    cases: list[tuple[str, dict[str, Any]]] = [
        ("chat", {"model": model, "messages": history}),
        ("chat", {"model": model, "messages": history[:2], "add_generation_prompt": False}),
        ("completion", {"model": model, "prompt": "The broker keeps leases and"}),
    ]
    for kind, body in cases:
        mine = tokenizer.tokens(kind, body, CHAT_TEMPLATE_FIELDS)
        status, reply = await post(f"{pd_engines.prefill.url}/tokenize", body)
        assert status == 200 and mine == reply["tokens"], (kind, body.keys())
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    assert tokenizer.tokens("chat", {"model": model, "messages": history, "tools": tools}, CHAT_TEMPLATE_FIELDS) is None
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tokenizer.tokens("chat", {"model": model, "messages": parts}, CHAT_TEMPLATE_FIELDS) is None


LONG_TOOL_OUTPUT = " ".join(f"row {i}: status ok, bytes {i * 37 % 1000}, owner agent-{i % 5}" for i in range(60))
"""~900 tokens: a tail over the broker's decode_local_max_tokens (512), so the turn goes through a prefill engine."""


async def test_each_path_is_taken_when_it_should_be_and_answers_match_recompute(router: RunningRouter,
                                                                               pd_engines: PDEngines) -> None:
    """Turn 1 recomputes; a short question runs on the decode engine that holds the history (DECODE_LOCAL); a long
    tool output goes through the prefill engine, which pulls the history it lacks (TRANSFER); a short one again
    (DECODE_LOCAL, streamed); then the agent compacts its history to the system prompt and a long summary: the
    prefill engine's own cache holds the system prompt (the broker's soft index says so) and nothing is left to
    pull (PREFILL_LOCAL). Every answer equals a recompute's on the prefill engine alone (greedy, float32, up to
    near-ties), and what each turn reports comes from the engines' own measurements."""
    model = pd_engines.model_name
    messages = [{"role": "system", "content": SYSTEM}]
    # Turn 2's question is ~300 tokens, so the decode engine's history then runs a few blocks (of 128 tokens)
    # beyond what the prefill engine computed on turn 1: turn 3 has something to pull.
    medium = "\n".join(LONG_TOOL_OUTPUT.split(" row ")[:20])
    questions = ["Question 0: which block holds note 0?", f"Question 1: and note 7? Notes:\n{medium}",
                 f"The tool returned:\n{LONG_TOOL_OUTPUT}\nWhich rows matter?", "Question 3: and note 21?",
                 f"Summary of the work so far:\n{LONG_TOOL_OUTPUT}\nGo on from the summary."]
    expected = ["RECOMPUTE", "DECODE_LOCAL", "TRANSFER", "DECODE_LOCAL", "PREFILL_LOCAL"]
    SPANS.clear()
    router.runner.books.residuals = PathResiduals()  # this test's turns alone (the router serves the module's)
    headers: list[Any] = []
    for turn, question in enumerate(questions):
        if turn == 4:
            messages = messages[:1]  # the compaction: system prompt and the summary only
        messages.append({"role": "user", "content": question})
        body = chat_body(model, messages, logprobs=True, top_logprobs=2)
        # No wait between turns: the router itself waits for the previous answer's lease (router/recent.py).
        if turn == 3:
            text = await stream_chat(f"{router.url}/v1/chat/completions", {**body, "user": "agent-1"})
        else:
            async with aiohttp.ClientSession() as http, http.post(f"{router.url}/v1/chat/completions", json=body,
                                                                  headers={"x-session-id": "agent-1"}) as r:
                assert r.status == 200, await r.text()
                reply = await r.json()
                headers.append(r.headers)
            text = reply["choices"][0]["message"]["content"]
            # The same chat recomputed on the prefill engine alone, no cache: the same greedy tokens.
            status, reference = await post(f"{pd_engines.prefill.url}/v1/chat/completions",
                                           {**body, "cache_salt": f"recompute-{turn}", "kv_transfer_params": None})
            assert status == 200
            assert_same_tokens(reply, reference)
        messages.append({"role": "assistant", "content": text})
    spans = turn_spans()
    assert len(spans) == 5
    assert [s.attributes["kvloop.path"] for s in spans] == expected, [dict(s.attributes) for s in spans]
    assert [h[hdr.DECISION] for h in headers] == expected[:3] + expected[4:]
    for span in spans:
        attrs = span.attributes
        assert attrs["kvloop.session"] == "agent-1" and attrs["kvloop.planned"] == attrs["kvloop.path"]
        assert attrs["kvloop.plan_vs_actual"] == PlanOutcome.AS_PLANNED and attrs["kvloop.measured"], dict(attrs)
        assert (attrs["kvloop.local_tokens"] + attrs["kvloop.pulled_tokens"] + attrs["kvloop.recomputed_tokens"]
                == attrs["gen_ai.usage.input_tokens"])
        assert attrs["gen_ai.request.model"] == model and attrs["kvloop.ttft_ms"] > 0
        children = {s.name for s in SPANS.get_finished_spans() if s.parent and s.parent.span_id ==
                    span.context.span_id}
        assert {"kvloop.tokenize", "kvloop.place", "kvloop.decode"} <= children
        if attrs["kvloop.path"] == "DECODE_LOCAL":
            # Served whole by the decode engine: no prefill request, its cache held the history (usage says so).
            assert attrs["kvloop.reason"] == "short_tail_on_decode" and "kvloop.prefill" not in children
            assert attrs["kvloop.prefill_engine"] == attrs["kvloop.decode_engine"] == pd_engines.decode.engine_id
            assert attrs["kvloop.pulled_tokens"] == 0
            assert attrs["kvloop.local_tokens"] >= attrs["kvloop.plan.local_tokens"] > 300
        if attrs["kvloop.path"] == "TRANSFER":
            assert attrs["kvloop.reason"] == "transfer_cheaper" and "kvloop.prefill" in children
            assert attrs["kvloop.plan.decode_local_veto"] == "tail_tokens"
            assert attrs["kvloop.pulled_tokens"] > 0 and attrs["kvloop.pulled_blocks"] > 0
            assert attrs["kvloop.prefill_engine"] == pd_engines.prefill.engine_id
        if attrs["kvloop.path"] == "PREFILL_LOCAL":
            assert attrs["kvloop.reason"] == "local_prefix" and attrs["kvloop.pulled_tokens"] == 0
            assert attrs["kvloop.local_tokens"] >= attrs["kvloop.plan.local_tokens"] > 300
            assert attrs["kvloop.prefill_engine"] == pd_engines.prefill.engine_id
    # Each turn is retained on the decode engine, DECODE_LOCAL ones too: the last turn's lease covers its prompt.
    assert spans[3].attributes["kvloop.local_tokens"] > spans[2].attributes["gen_ai.usage.input_tokens"] - 128
    # The streamed DECODE_LOCAL turn measured the broker's estimate (router/residuals.py), and the next placement
    # carried it to the broker, which priced with it: one turn of the four the median needs in full.
    assert "kvloop.residual_s" not in spans[2].attributes  # not streamed: no first token timed
    residual = spans[3].attributes["kvloop.residual_s"]
    assert spans[4].attributes["kvloop.cost.decode_local_residual_s"] == pytest.approx(residual / 4, abs=1e-5)
    assert spans[4].attributes["kvloop.cost.pd_residual_s"] == 0.0


async def test_edited_history_reuses_only_the_unchanged_prefix(router: RunningRouter, pd_engines: PDEngines) -> None:
    model = pd_engines.model_name
    first = [{"role": "system", "content": SYSTEM.replace("Rule", "Law")},
             {"role": "user", "content": "Plan the next step."}]
    before = await lease_ids(pd_engines.broker)
    status, reply = await post(f"{router.url}/v1/chat/completions", chat_body(model, first, max_tokens=24))
    assert status == 200
    answer = reply["choices"][0]["message"]["content"]
    await wait_new_lease(pd_engines.broker, before)
    # The client strips part of the assistant's answer (as agents drop reasoning text) and edits the user turn.
    edited = [first[0], {"role": "user", "content": "Plan the NEXT step, carefully."},
              {"role": "assistant", "content": answer[: len(answer) // 2]}, {"role": "user", "content": "Go on."}]
    SPANS.clear()
    body = chat_body(model, edited, logprobs=True, top_logprobs=2)
    status, reply = await post(f"{router.url}/v1/chat/completions", body)
    assert status == 200
    (span,) = turn_spans()
    # Reuse stops at the first changed block: the full blocks of the two prompts' common token prefix.
    async def tokens(messages: list[dict[str, str]]) -> list[int]:
        status, reply = await post(f"{pd_engines.prefill.url}/tokenize", {"model": model, "messages": messages})
        assert status == 200
        return list(reply["tokens"])

    a, b = await tokens(first), await tokens(edited)
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert common < len(a) and span.attributes["kvloop.matched_tokens"] == (common // 128) * 128 > 0, (
        common, span.attributes)
    status, reference = await post(f"{pd_engines.prefill.url}/v1/chat/completions", {**body, "cache_salt": "edited"})
    assert_same_tokens(reply, reference)


async def test_unreachable_broker_still_answers_by_recomputing(pd_engines: PDEngines) -> None:
    config = RouterConfig(listen="127.0.0.1:0", broker="127.0.0.1:1", prefill_urls=pd_engines.prefill.url,
                          decode_urls=pd_engines.decode.url, broker_timeout_s=0.5, log_format="console")
    running = await start_router(config)
    try:
        SPANS.clear()
        status, reply = await post(f"{running.url}/v1/chat/completions", chat_body(
            pd_engines.model_name, [{"role": "user", "content": "Is the broker there?"}], max_tokens=6))
        assert status == 200 and reply["choices"][0]["message"]["content"] is not None
        (span,) = turn_spans()
        assert span.attributes["kvloop.decision"] == "RECOMPUTE"
        assert span.attributes["kvloop.reason"] == "broker_unavailable"
        async with aiohttp.ClientSession() as http, http.get(f"{running.url}/metrics") as r:
            text = await r.text()
        assert 'kvloop_router_fallbacks_total{kind="broker_unavailable"}' in text
    finally:
        await running.stop()


async def test_a_bogus_registration_neither_passes_nor_steers_real_turns(router: RunningRouter,
                                                                          pd_engines: PDEngines) -> None:
    """Issue 13's find: a registration with block size 2^32-1, a budget of 2^63 and a made-up fingerprint was
    accepted, and the router then placed every turn with that engine's layout (recompute, labelled
    broker_unavailable). Now the broker refuses it naming the field; a well-formed engine of another model is
    accepted but lends its layout to no request of this model."""
    import grpc

    from kvloop.shared.client import BrokerClient
    from kvloop.v1 import broker_pb2 as pb

    def engine(**fields: Any) -> pb.RegisterEngineRequest:
        base = {"engine_id": "bogus", "role": pb.ENGINE_ROLE_DECODE, "block_size": 16, "layout_fingerprint": "made-up",
                "retention_budget_blocks": 10, "incarnation": "i1", "model": "other-model",
                "addresses": pb.EngineAddresses(http="http://127.0.0.1:9", nixl="127.0.0.1:9")}
        return pb.RegisterEngineRequest(engine=pb.Engine(**{**base, **fields}))

    async with BrokerClient(pd_engines.broker) as client:
        for fields, field in (({"block_size": 4294967295}, "engine.block_size"),
                              ({"retention_budget_blocks": 2**63}, "engine.retention_budget_blocks"),
                              ({"layout_fingerprint": "made up!"}, "engine.layout_fingerprint"),
                              ({"addresses": pb.EngineAddresses(http="gopher://x")}, "engine.addresses.http")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.call("RegisterEngine", engine(**fields))
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and field in str(refused.value.details())
        await client.call("RegisterEngine", engine(block_size=4096))
        try:
            await router.runner.refresh()
            assert "bogus" in router.runner.directory.engines
            assert router.runner.directory.layout(pd_engines.model_name) != ("made-up", 4096)
            SPANS.clear()
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which block, bogus?"}]
            status, reply = await post(f"{router.url}/v1/chat/completions", chat_body(pd_engines.model_name, messages))
            assert status == 200, reply
            (span,) = turn_spans()
            assert "kvloop.planned" in span.attributes, span.attributes  # the broker placed it: no fallback
            assert span.attributes["kvloop.reason"] not in ("no_layout", "place_refused", "broker_unavailable")
            status, reply = await post(f"{router.url}/v1/chat/completions", chat_body("no-such-model", messages))
            assert status == 404 and reply["error"]["param"] == "model", reply
        finally:
            await client.call("DeregisterEngine", pb.DeregisterEngineRequest(engine_id="bogus"))
            await router.runner.refresh()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def strict_router(pd_engines: PDEngines) -> AsyncIterator[RunningRouter]:
    """A router that names its model and takes bodies of at most 4 KiB."""
    running = await start_router(RouterConfig(listen="127.0.0.1:0", broker=pd_engines.broker, refresh_s=0.5,
                                              model=pd_engines.model_name, max_request_bytes=4096,
                                              log_format="console"))
    try:
        yield running
    finally:
        await running.stop()


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"{" + b" " * 5000 + b"}", 413, "larger than"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
    ({"model": "MODEL", "messages": []}, 400, "messages"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n:"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
])
async def test_bad_input_gets_an_openai_error(strict_router: RunningRouter, pd_engines: PDEngines, body: Any,
                                              status: int, needle: str) -> None:
    if isinstance(body, dict) and body.get("model") == "MODEL":
        body = {**body, "model": pd_engines.model_name}
    got, reply = await post(f"{strict_router.url}/v1/chat/completions", body)
    assert got == status, reply
    assert set(reply["error"]) >= {"message", "type", "code"} and needle in reply["error"]["message"], reply


async def test_a_prompt_too_long_for_the_engines_gets_their_400(router: RunningRouter, pd_engines: PDEngines) -> None:
    words = " ".join(f"w{i}" for i in range(3000))  # well past the engines' 4096-token context
    got, reply = await post(f"{router.url}/v1/chat/completions", chat_body(
        pd_engines.model_name, [{"role": "user", "content": words}]))
    assert got == 400 and reply["error"]["message"], reply


async def test_unknown_endpoint(strict_router: RunningRouter) -> None:
    got, reply = await post(f"{strict_router.url}/v1/embeddings", {"model": "x"})
    assert got == 404 and reply["error"]["type"] == "invalid_request_error"


async def sse_events(url: str, body: dict[str, Any]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as http, http.post(url, json=streamed) as reply:
        assert reply.status == 200, await reply.text()
        return dict(reply.headers), [chunk async for chunk in aiter_sse(reply.content)]


async def test_chat_turns_sent_as_tokens_answer_as_the_engines_own_chat(router: RunningRouter,
                                                                        pd_engines: PDEngines) -> None:
    """One rendering per turn (router/chat_tokens.py): the router sends a plain chat to the engine as its token
    ids and answers in the chat shape. The answers equal the engine's own chat endpoint's, streamed and not; a
    chat the chat layer must shape (logprobs) still goes as a chat."""
    body = chat_body(pd_engines.model_name, [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": "Which block does rule 7 cite?"}],
                     max_tokens=24)
    engine_chat = f"{pd_engines.decode.url}/v1/chat/completions"
    status, direct = await post(engine_chat, body)
    assert status == 200, direct
    async with aiohttp.ClientSession() as http, http.post(f"{router.url}/v1/chat/completions", json=body) as reply:
        via, headers = await reply.json(), reply.headers
    assert reply.status == 200 and headers[hdr.ENGINE_REQUEST] == "tokens", (via, dict(headers))
    assert via["object"] == "chat.completion" and via["id"].startswith("chatcmpl-")
    for key in ("content", "role"):
        assert via["choices"][0]["message"][key] == direct["choices"][0]["message"][key]
    assert via["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    assert [via["usage"][k] for k in ("prompt_tokens", "completion_tokens")] == [
        direct["usage"][k] for k in ("prompt_tokens", "completion_tokens")]

    _, direct_chunks = await sse_events(engine_chat, body)
    headers, via_chunks = await sse_events(f"{router.url}/v1/chat/completions", body)
    assert headers[hdr.ENGINE_REQUEST] == "tokens"
    assert {c["object"] for c in via_chunks} == {"chat.completion.chunk"}
    assert via_chunks[0]["choices"][0]["delta"] == direct_chunks[0]["choices"][0]["delta"]  # the role first

    def text(chunks: list[dict[str, Any]]) -> str:
        return "".join((c["delta"].get("content") or "") for chunk in chunks for c in chunk["choices"])

    def ends(chunks: list[dict[str, Any]]) -> list[Any]:
        return [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")]

    assert text(via_chunks) == text(direct_chunks) == direct["choices"][0]["message"]["content"]
    assert ends(via_chunks) == ends(direct_chunks)
    assert via_chunks[-1]["usage"]["completion_tokens"] == direct_chunks[-1]["usage"]["completion_tokens"]

    async with aiohttp.ClientSession() as http, http.post(f"{router.url}/v1/chat/completions",
                                                          json={**body, "logprobs": True}) as reply:
        shaped = await reply.json()
        assert reply.status == 200 and reply.headers[hdr.ENGINE_REQUEST] == "chat", shaped
        assert shaped["choices"][0]["logprobs"]["content"], shaped
