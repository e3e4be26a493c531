"""Tail rate on a cached prefix: prefix P (cached) + a fresh tail T, max_tokens=1, on one prefill and the decode
engine of the benchmark's P/D layout, idle. From the repository root: ``python docs/bench/diagnostics/tail_rate.py``.
"""

import json
import random
import time
import urllib.request
from pathlib import Path

from kvloop.app.cluster import pd_configs
from kvloop.app.engine_set import start_engines
from kvloop.shared.procs import start_broker

model = Path(".kvloop/models/tiny").absolute()
work = Path("/tmp/kvloop-tail-rate")
broker = start_broker("broker", ["--engine-ttl-s=10"], work / "broker")
engines = start_engines(pd_configs(model, work, broker.extra["address"], prefill=2, decode=1, max_model_len=16384,
                                   log_level="warning"))


def request(url: str, prompt: list[int]) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(r, timeout=300) as reply:
        reply.read()
    return time.perf_counter() - t0


rng = random.Random(7)


def tokens(n: int) -> list[int]:
    return [rng.randrange(100, 3000) for _ in range(n)]


try:
    for e in engines:
        request(e.url, tokens(64))
    for e in (engines.by_id("prefill-0"), engines.by_id("decode-2")):
        for p in (0, 4000, 10000):
            prefix = tokens(p)
            if p:
                request(e.url, prefix)
            for t in (256, 512, 768, 1024, 1536):
                times = [request(e.url, prefix + tokens(t)) for _ in range(2)]
                print(f"{e.engine_id:10} P={p:5} T={t:5}: {t / min(times):.0f} tok/s", flush=True)
finally:
    engines.stop()
    broker.stop()
