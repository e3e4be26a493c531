"""An engine profile derived from an accelerator's datasheet and a model's shape, where no curve was measured (issue 51:
GPU fleets this project's machines cannot hold), as AIConfigurator-style planners derive theirs:

- a prefill token costs the model's forward FLOPs (``2 x parameters``) at the accelerators' dense rate times a
  compute efficiency; each token it attends to adds ``4 x layers x heads x head_dim`` FLOPs;
- a decode step reads the weights once (``step_base_s``) and each stream's KV (``decode_context_s`` per token of
  context) at the memory bandwidth times a memory efficiency, and computes each stream's token
  (``decode_stream_s``);
- the KV pool is the accelerators' memory, less the weights, times the share vLLM may use
  (``gpu_memory_utilization``), in blocks of ``block_size`` tokens of every layer's K and V;
- a pull is the network's latency plus the bytes at its bandwidth.

The two efficiencies are the figures a measurement fits (:func:`efficiency_for_ttft` solves the compute one from a
published time to first token); every other figure is derived, and the profile's sources say which is which. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvloop.shared.engine_model.profile import EngineProfile
from kvloop.shared.errors import ConfigError


@dataclass(frozen=True)
class Accelerator:
    name: str
    dense_flops: float
    """Dense FLOP/s at the model's compute type (BF16, or FP8 for an FP8 model)."""
    memory_bytes_per_s: float
    memory_bytes: float
    source: str


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    weight_bytes: float = 2.0
    """Bytes per parameter (2: BF16; 1: FP8)."""
    kv_bytes: float = 2.0
    """Bytes per KV element."""
    source: str = ""

    @property
    def parameters(self) -> float:
        attention = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp) + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes


@dataclass(frozen=True)
class Deployment:
    tensor_parallel: int
    compute_efficiency: float
    """Achieved share of the dense FLOP/s in prefill (model FLOPs utilisation): fitted to a measurement."""
    memory_efficiency: float
    """Achieved share of the memory bandwidth in decode: fitted to a measurement."""
    network_bytes_per_s: float
    network_latency_s: float
    network_source: str
    efficiency_source: str = ""
    """Where the two efficiencies came from (``kvloop plan roofline`` writes the fits it made)."""
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    router_turn_s: float = 0.0
    api_request_s: float = 0.0
    overheads_source: str = "derived: not modelled (0)"

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "memory_efficiency", "gpu_memory_utilization"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"deployment.{name}: above 0, at most 1 (got {value})", field=name)
        if self.tensor_parallel < 1:
            raise ConfigError("deployment.tensor_parallel: at least 1", field="tensor_parallel")


def roofline_profile(gpu: Accelerator, model: ModelShape, d: Deployment) -> EngineProfile:
    """The profile of one engine of ``d.tensor_parallel`` accelerators serving ``model``."""
    flops = gpu.dense_flops * d.tensor_parallel * d.compute_efficiency
    bandwidth = gpu.memory_bytes_per_s * d.tensor_parallel * d.memory_efficiency
    weights = model.parameters * model.weight_bytes
    block_bytes = model.kv_bytes_per_token * d.block_size
    room = gpu.memory_bytes * d.tensor_parallel * d.gpu_memory_utilization - weights
    if room < block_bytes * d.max_num_seqs:
        raise ConfigError(f"{model.name} on {d.tensor_parallel} x {gpu.name}: the weights leave too little memory "
                          f"for {d.max_num_seqs} sequences' KV", field="tensor_parallel")
    shape = f"{model.name} ({model.source}) on {d.tensor_parallel} x {gpu.name} ({gpu.source})"
    derived = f"derived: roofline of {shape}"
    return EngineProfile(
        name=f"roofline {model.name} tp{d.tensor_parallel} {gpu.name}",
        step_base_s=weights / bandwidth,
        prefill_token_s=2 * model.parameters / flops,
        attention_token_s=1000 * 4 * model.layers * model.heads * model.head_dim / flops,
        decode_stream_s=2 * model.parameters / flops,
        decode_context_s=model.kv_bytes_per_token / bandwidth,
        max_num_batched_tokens=d.max_num_batched_tokens, max_num_seqs=d.max_num_seqs, block_size=d.block_size,
        kv_pool_blocks=int(room // block_bytes), bytes_per_block=int(block_bytes),
        pull_latency_s=d.network_latency_s, pull_bytes_per_s=d.network_bytes_per_s,
        router_turn_s=d.router_turn_s, api_request_s=d.api_request_s,
        source={
            "prefill": f"{derived}; compute efficiency {d.compute_efficiency:g} ({d.efficiency_source})",
            "decode": f"{derived}; memory efficiency {d.memory_efficiency:g} ({d.efficiency_source})",
            "scheduler": f"derived: vLLM settings of the deployment (--max-num-batched-tokens "
                         f"{d.max_num_batched_tokens}, --max-num-seqs {d.max_num_seqs})",
            "pool": f"{derived}; --gpu-memory-utilization {d.gpu_memory_utilization:g}, block {d.block_size}",
            "pull": d.network_source,
            "router": d.overheads_source,
            "api": d.overheads_source,
        })


def lone_prefill_s(profile: EngineProfile, prompt_tokens: int) -> float:
    """A lone prompt's time to first token on an idle engine, chunked as the engine model cuts it."""
    total, done = profile.api_request_s, 0
    while done < prompt_tokens:
        n = min(profile.max_num_batched_tokens, prompt_tokens - done)
        total += profile.step_seconds(n, n * (done + n / 2), 0, 0)
        done += n
    return total


def fit_prefill(gpu: Accelerator, model: ModelShape, d: Deployment,
                points: list[tuple[int, float]]) -> tuple[float, float]:
    """(compute efficiency, per-request fixed cost in seconds) through two or more published lone prefills
    ``(prompt_tokens, seconds)``, least squares: each time is the fixed cost, the steps' weight reads, and the
    compute, which scales as 1 / efficiency. The fixed cost is the API server, scheduling and hand-off work the
    roofline does not see (``api_request_s``)."""
    if len(points) < 2:
        raise ConfigError("fit: two prompt lengths at least, to tell the fixed cost from the compute", field="fit")
    at_one = roofline_profile(gpu, model, replace(d, compute_efficiency=1.0, api_request_s=0.0))
    rows = []
    for tokens, seconds in points:
        reads = -(-tokens // d.max_num_batched_tokens) * at_one.step_base_s
        rows.append((lone_prefill_s(at_one, tokens) - reads, seconds - reads))
    n = len(rows)
    mean_c = sum(c for c, _ in rows) / n
    mean_t = sum(t for _, t in rows) / n
    spread = sum((c - mean_c) ** 2 for c, _ in rows)
    if spread <= 0:
        raise ConfigError("fit: the prompt lengths must differ", field="fit")
    slope = sum((c - mean_c) * (t - mean_t) for c, t in rows) / spread  # seconds per second of ideal compute
    fixed = mean_t - slope * mean_c
    if slope < 1 - 1e-9 or fixed < -1e-9:
        raise ConfigError(f"fit: the points need {'more than the datasheet' if slope < 1 else 'a negative fixed cost'} "
                          f"(efficiency {1 / slope if slope > 0 else float('inf'):.2f}, fixed {fixed:.4f} s)",
                          field="fit")
    return min(1.0, 1.0 / slope), max(0.0, fixed)


def efficiency_for_ttft(gpu: Accelerator, model: ModelShape, d: Deployment, prompt_tokens: int,
                        ttft_s: float) -> float:
    """The compute efficiency at which a lone ``prompt_tokens`` prompt's modelled TTFT is ``ttft_s``: a measured
    TTFT's fit (the time is its fixed part plus the compute part, which scales as 1 / efficiency)."""
    at_one = roofline_profile(gpu, model, replace(d, compute_efficiency=1.0))
    fixed = at_one.api_request_s + -(-prompt_tokens // d.max_num_batched_tokens) * at_one.step_base_s
    compute = lone_prefill_s(at_one, prompt_tokens) - fixed
    return _solved("ttft_s", ttft_s, fixed, compute, "the model's fixed cost", "FLOP/s")


def memory_efficiency_for_step(gpu: Accelerator, model: ModelShape, d: Deployment, streams: int,
                               context_tokens: int, step_s: float) -> float:
    """The memory efficiency at which a decode step of ``streams`` streams of ``context_tokens`` each lasts
    ``step_s`` (its compute part at ``d``'s compute efficiency; the bytes it reads scale as 1 / efficiency)."""
    at_one = roofline_profile(gpu, model, replace(d, memory_efficiency=1.0))
    memory = at_one.step_base_s + at_one.decode_context_s * streams * context_tokens
    compute = at_one.decode_stream_s * streams
    return _solved("step_s", step_s, compute, memory, "the step's compute", "bandwidth")


def _solved(name: str, measured: float, fixed: float, ideal: float, fixed_is: str, limit: str) -> float:
    """The efficiency at which ``fixed + ideal / efficiency`` is ``measured``, or why none is."""
    if measured <= fixed:
        raise ConfigError(f"{name}: {measured} s is not more than {fixed_is} {fixed:.5f} s", field=name)
    efficiency = ideal / (measured - fixed)
    if efficiency > 1 + 1e-9:
        raise ConfigError(f"{name}: {measured} s would need more than the datasheet's {limit} ({efficiency:.2f}x)",
                          field=name)
    return min(1.0, efficiency)
