"""Task generators: needles present once, at the requested depth, answers recoverable; the
string-match scores."""

from __future__ import annotations

import pytest

from sfi.errors import SFIError
from sfi.eval.tasks import (
    LIST_TASKS,
    NEEDLE_COUNT,
    RETRIEVAL_TASKS,
    essay_ids,
    found_in_order,
    make_sample,
    score,
    score_all,
    score_in_order,
)

RETRIEVAL = list(RETRIEVAL_TASKS)


@pytest.mark.parametrize("task", RETRIEVAL)
def test_needles_once_answers_recoverable_length_on_target(task, smol_tokenizer):
    sample = make_sample(task, smol_tokenizer, 1500, seed=3)
    text = sample.text
    assert sample.target == 1500 and abs(sample.context - 1500) <= 30
    assert sample.prompt_ids == smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = 1 if task in ("passkey", "niah") else LIST_TASKS.get(task, NEEDLE_COUNT)
    assert len(sample.needles) == len(sample.depths) == expected
    for needle in sample.needles:
        assert text.count(needle) == 1, needle
    for answer in sample.answers:  # every answer is stated in a needle, inside the prompt
        assert any(answer in needle for needle in sample.needles)
        assert answer in text
    for needle, depth in zip(sample.needles, sample.depths):
        assert abs(_depth_of(text, needle, sample.needles) - depth) < 0.05, (needle, depth)


def _depth_of(text: str, needle: str, needles: list[str]) -> float:
    """Where ``needle`` sits in the haystack, as a fraction of the haystack without needles."""
    start = text.index("\n\n") + 2
    hay = text[start:text.rindex("\n\n", 0, text.index("<|im_end|>", start))]
    before = hay[:hay.index(needle)]
    for other in needles:
        hay, before = hay.replace(other, ""), before.replace(other, "")
    return len(before) / len(hay)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_niah_depth_is_the_requested_one(depth, smol_tokenizer):
    sample = make_sample("niah", smol_tokenizer, 1200, seed=0, depth=depth)
    assert sample.depths == [depth]
    assert abs(_depth_of(sample.text, sample.needles[0], sample.needles) - depth) < 0.03


def test_samples_are_seeded(smol_tokenizer):
    a = make_sample("niah_multikey", smol_tokenizer, 800, seed=1)
    b = make_sample("niah_multikey", smol_tokenizer, 800, seed=1)
    c = make_sample("niah_multikey", smol_tokenizer, 800, seed=2)
    assert a.prompt_ids == b.prompt_ids and a.answers == b.answers
    assert a.prompt_ids != c.prompt_ids


def test_sequential_asks_in_an_order_other_than_the_text(smol_tokenizer):
    sample = make_sample("sequential", smol_tokenizer, 1000, seed=5)
    text = sample.text
    question = text[text.rindex("Give the secret codes"):]
    asked_keys = [n.split(" the ")[1].split(" is ")[0] for n in sample.needles]
    by_question = sorted(asked_keys, key=question.index)
    values = {n.split(" the ")[1].split(" is ")[0]: n.rsplit(" ", 1)[1].rstrip(".")
              for n in sample.needles}
    assert sample.answers == [values[k] for k in by_question]


@pytest.mark.parametrize("task", list(LIST_TASKS))
def test_a_long_answer_task_asks_for_its_codes_in_its_own_order(task, smol_tokenizer):
    count = LIST_TASKS[task]
    sample = make_sample(task, smol_tokenizer, 1500, seed=3)
    assert len(sample.needles) == count == len(sample.answers) == len(set(sample.answers))
    assert sample.max_new_tokens == 16 * count and abs(sample.context - 1500) < 40
    question = sample.text[sample.text.rindex("Give the secret codes"):]
    values = {n.split(" the ")[1].split(" is ")[0]: n.rsplit(" ", 1)[1].rstrip(".")
              for n in sample.needles}
    assert sample.answers == [values[k] for k in sorted(values, key=question.index)]
    for needle in sample.needles:
        assert needle in sample.text
    answer = " ".join(f"The code is {v}." for v in sample.answers[1:])  # the first one lost
    assert score(task, answer, sample.answers) == pytest.approx(100 * (count - 1) / count)


def test_generation_samples_are_essay_or_code_prompts(smol_tokenizer):
    essay = make_sample("generation", smol_tokenizer, 600, seed=1)
    code = make_sample("generation_code", smol_tokenizer, 600, seed=1)
    assert len(essay.prompt_ids) == len(code.prompt_ids) == 600 and essay.answers == []
    text = smol_tokenizer.decode(code.prompt_ids)
    assert "def " in text or "class " in text or "import " in text
    assert code.prompt_ids != make_sample("generation_code", smol_tokenizer, 600, 2).prompt_ids


def test_found_in_order_says_which_items_came():
    assert found_in_order("a 12, then 56, then 34", ["12", "34", "56"]) == [True, True, False]
    assert found_in_order("", ["1"]) == [False]


def test_fidelity_sample_is_a_contiguous_essay_slice(smol_tokenizer):
    sample = make_sample("fidelity", smol_tokenizer, 700, seed=0, continuation=50)
    assert len(sample.prompt_ids) == 750 and sample.context == 700
    ids = essay_ids(smol_tokenizer)
    start = next(i for i in range(len(ids)) if list(ids[i:i + 750]) == sample.prompt_ids)
    assert start >= 0


def test_bad_requests_fail_clearly(smol_tokenizer):
    with pytest.raises(SFIError, match="unknown task"):
        make_sample("needle", smol_tokenizer, 1000, 0)
    with pytest.raises(SFIError, match="needs more than"):
        make_sample("niah_multiquery", smol_tokenizer, 100, 0)
    with pytest.raises(SFIError, match="depth"):
        make_sample("niah", smol_tokenizer, 1000, 0, depth=1.5)


def test_scores():
    assert score_all("The number is 1234567.", ["1234567"]) == 100.0
    assert score_all("numbers: 111, 333", ["111", "222", "333", "444"]) == 50.0
    assert score_all("ABCDE and fghij", ["abcde", "FGHIJ"]) == 100.0
    assert score_in_order("first 12 then 34 then 56", ["12", "34", "56"]) == 100.0
    assert score_in_order("first 34 then 12 then 56", ["12", "34", "56"]) == pytest.approx(
        200 / 3)  # 12 then 56 are in order; 34 came before 12
    assert score_in_order("nothing", ["1", "2"]) == 0.0
    assert score("sequential", "2 1", ["1", "2"]) == 50.0
    assert score("niah_multivalue", "2 1", ["1", "2"]) == 100.0
