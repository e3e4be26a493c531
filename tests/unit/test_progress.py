"""router.progress: what tells a busy engine from a frozen one while a non-streamed answer is outstanding."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvloop.router.progress import ProgressWatch, progress_count

VLLM_METRICS = """# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 3.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 41.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 9000.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0
vllm:generation_tokens_total{engine="0",model_name="m"} 300.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_the_count_sums_the_step_counters_only() -> None:
    assert progress_count(VLLM_METRICS) == 41 + 1200 + 300
    assert progress_count("process_cpu_seconds_total 3.0\n") is None
    assert progress_count("vllm:generation_tokens_total{engine=\"0\"} not-a-number\n") is None


def test_a_busy_engine_is_never_frozen_and_a_silent_one_is() -> None:
    watch = ProgressWatch(stall_s=60, last_progress=0)
    for t in range(15, 600, 15):  # ten minutes of a long answer, counters moving
        watch.observe(True, float(t), float(t))
        assert not watch.frozen(float(t))
    stopped = ProgressWatch(stall_s=60, last_progress=0)
    stopped.observe(True, 5.0, 15)
    for t in (30, 45, 60):
        stopped.observe(False, None, t)  # SIGSTOP: scrapes time out
        assert not stopped.frozen(t)
    stopped.observe(True, 5.0, 75)  # a hung EngineCore: the API server answers, the counts stand still
    assert stopped.frozen(75)


@given(st.lists(st.tuples(st.booleans(), st.one_of(st.none(), st.integers(0, 3).map(float)),
                          st.floats(0.01, 30)), max_size=30), st.floats(1, 120))
def test_frozen_means_no_progress_for_stall_s(scrapes: list[tuple[bool, float | None, float]],
                                             stall_s: float) -> None:
    """Frozen exactly when stall_s has passed since the watch began or since the last scrape that was answered
    and showed a new count (or no counters)."""
    watch, now, last, count = ProgressWatch(stall_s, 0.0), 0.0, 0.0, None
    for answered, value, step in scrapes:
        now += step
        watch.observe(answered, value, now)
        if answered and (value is None or value != count):
            last, count = now, value
        assert watch.frozen(now) == (now - last >= stall_s)
