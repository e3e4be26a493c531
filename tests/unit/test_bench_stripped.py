"""``kvloop bench stripped``'s pure parts: the history a stripping client sends, and the blocks counted as retained and
never reused."""

from __future__ import annotations

from kvloop.app.benchmarks.stripped_bench import FINAL_WORD, ConfigFigures, TurnFigures, history


def test_each_earlier_answer_is_one_word_in_the_next_turns_history() -> None:
    messages = history("sys", ["one", "two"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == FINAL_WORD


def test_retained_blocks_the_next_turn_did_not_find_are_never_reused_and_the_last_turn_is_left_out() -> None:
    # 10 blocks retained and 8 found by the next turn: 2 never reused. 4 retained and 7 found (the rest in another
    # cache): none. The last turn's lease has no next turn and is left out.
    figures = ConfigFigures([TurnFigures(10, 8 * 128 + 5), TurnFigures(4, 7 * 128), TurnFigures(12)], 1, 1)
    summary = figures.summary(block_size=128)
    assert summary["turns_followed"] == 2 and summary["retained_blocks"] == 14
    assert summary["retained_never_reused_blocks"] == 2 and summary["reused_blocks"] == 12
    assert summary["answers_equal_to_recompute"] == "1 of 1"
