"""OutputText: pieces joined only when handed out; stop strings found across pieces and cut
where vLLM cuts; streams hold back what could still begin a stop string."""

from __future__ import annotations

import pytest

from vllm_lite.engine.output_text import OutputText


def test_pieces_join_and_deltas_cover_the_text() -> None:
    text = OutputText(None, include_stop=False, delta=True)
    deltas = []
    for piece in ["Hel", "", "lo", " wor", "ld"]:
        assert text.append(piece, check_stop=True) is None
        deltas.append(text.take_delta(finished=False))
    assert "".join(deltas) == "Hello world" and text.length == 11
    assert text.take_delta(finished=True) == ""


@pytest.mark.parametrize("include", [False, True])
def test_stop_across_pieces_and_hold_back(include: bool) -> None:
    text = OutputText(["STOP", "xyz"], include_stop=include, delta=True)
    shown = []
    for piece in ["ab", "cS", "T", "O", "Pdef"]:
        stop = text.append(piece, check_stop=True)
        shown.append(text.take_delta(finished=stop is not None))
        if stop is not None:
            break
    assert stop == "STOP"
    assert "".join(shown) == ("abcSTOP" if include else "abc")
    # Without include_stop_str_in_output the last 3 characters wait: "S", "ST", "STO" never show.
    assert shown == (["ab", "cS", "T", "O", "P"] if include else ["", "a", "b", "c", ""])


def test_earliest_stop_wins_and_cumulative_text_is_cut() -> None:
    text = OutputText(["bb", "abb"], include_stop=False, delta=False)
    assert text.append("xa", check_stop=True) is None
    assert text.append("bbq", check_stop=True) == "abb"  # starts before "bb"
    assert text.text(finished=True) == "x"


def test_min_tokens_text_is_searched_with_the_next_piece() -> None:
    """Pieces added without the check (within min_tokens) stay in the window of the next one."""
    text = OutputText(["end"], include_stop=False, delta=False)
    assert text.append("the en", check_stop=False) is None
    assert text.append("d!", check_stop=True) == "end"
    assert text.text(finished=True) == "the "
