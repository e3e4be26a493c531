"""``python -m kvloop.app.benchmarks.nixl_probe``: what NIXL's progress-thread delay costs a pull.

Two processes on loopback, each with a NIXL agent created as kvloop's connector creates it
(:func:`kvloop.engines.connector.patches.nixl_progress_delay`, UCX over ``tcp,self,sm`` as the launcher sets it for
loopback): the initiator READs the target's buffer, polling the transfer's state either without pause or once per
``--poll-ms`` (an engine checks its pulls once per step). Prints the median and worst READ per delay. The figures
behind ``kvloop_nixl_progress_delay_us`` are in docs/engine-patches.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

from kvloop.engines.launcher import LOOPBACK_UCX


def agent(name: str, delay_us: int) -> Any:
    from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

    from kvloop.engines.connector.patches import nixl_progress_delay

    with nixl_progress_delay(delay_us):
        return NixlWrapper(name, nixl_agent_config(num_threads=4))


def target(meta: Any, done: Any, delay_us: int, size: int) -> None:
    import torch

    nixl = agent("target", delay_us)
    buf = torch.ones(size // 4, dtype=torch.float32)
    nixl.register_memory(nixl.get_reg_descs([(buf.data_ptr(), size, 0, "")], "DRAM"))
    meta.put((nixl.get_agent_metadata(), buf.data_ptr()))
    done.get()


def read_times(delay_us: int, size: int, repeats: int, poll_s: float) -> list[float]:
    """Milliseconds of each READ of ``size`` bytes from a target process (after one unmeasured READ)."""
    import torch

    spawn = mp.get_context("spawn")  # forked after an agent's threads exist, the target never came up
    meta, done = spawn.Queue(), spawn.Queue()
    peer = spawn.Process(target=target, args=(meta, done, delay_us, size))
    peer.start()
    try:
        remote_meta, remote_ptr = meta.get(timeout=120)
        nixl = agent("initiator", delay_us)
        buf = torch.zeros(size // 4, dtype=torch.float32)
        nixl.register_memory(nixl.get_reg_descs([(buf.data_ptr(), size, 0, "")], "DRAM"))
        name = nixl.add_remote_agent(remote_meta)
        local = nixl.get_xfer_descs([(buf.data_ptr(), size, 0)], "DRAM")
        remote = nixl.get_xfer_descs([(remote_ptr, size, 0)], "DRAM")
        times = []
        for i in range(repeats + 1):
            handle = nixl.initialize_xfer("READ", local, remote, name, b"probe")
            t0 = time.perf_counter()
            if nixl.transfer(handle) == "ERR":
                raise RuntimeError("the READ failed to start")
            while (state := nixl.check_xfer_state(handle)) != "DONE":
                if state == "ERR":
                    raise RuntimeError("the READ failed")
                time.sleep(poll_s)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
            nixl.release_xfer_handle(handle)
        return times
    finally:
        done.put(1)
        peer.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays-us", default="1000,20000", help="comma-separated progress-thread delays")
    parser.add_argument("--mib", type=int, default=16, help="bytes per READ, MiB")
    parser.add_argument("--poll-ms", default="0,20", help="comma-separated pauses between state checks")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    for name, value in LOOPBACK_UCX.items():  # as the launcher sets them for engines on loopback
        os.environ.setdefault(name, value)
    for delay in (int(d) for d in args.delays_us.split(",")):
        for poll_ms in (float(p) for p in args.poll_ms.split(",")):
            times = read_times(delay, args.mib << 20, args.repeats, poll_ms / 1e3)
            print(f"delay {delay} us, {args.mib} MiB READ, state checked every {poll_ms:g} ms: "
                  f"median {statistics.median(times):.1f} ms, worst {max(times):.1f} ms, n = {len(times)}")


if __name__ == "__main__":
    main()
