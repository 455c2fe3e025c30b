"""Slow-step triggers on real tokenizer output (SmolLM2 and Qwen2.5)."""

from __future__ import annotations

import itertools

import pytest

from sfi import SFIConfig
from sfi.core.triggers import (
    BootstrapOnlyTrigger,
    FixedPeriodTrigger,
    RandomPeriodTrigger,
    SentenceTrigger,
    classify_text,
    make_trigger,
    observe,
    token_classes,
)

TEXT = ("The model reads the text. Then it writes more!  Does it stop?\n\nNo, it goes on: "
        "commas, colons; semicolons\nand newlines do not end a sentence. 最后一句。结束！")


@pytest.mark.parametrize("text, ender, space", [
    (".", True, False), (".\n\n", True, False), (" ?", True, False), ("！", True, False),
    ("。", True, False), (",", False, False), (":", False, False), (";", False, False),
    ("\n", False, True), ("  ", False, True), ("word", False, False), ("", False, False),
])
def test_classify_text(text, ender, space):
    assert classify_text(text) == (ender, space)


def _fires(trigger, ids):
    """Indices of ``ids`` (fed one per step after a refresh) at which the trigger fires."""
    since, fired = 0, []
    for i, token in enumerate(ids):
        since += 1
        reason = observe(trigger, token, since)
        if reason:
            fired.append((i, reason))
            since = 0
    return fired


def _expected_sentence_starts(tok, ids):
    """Where the rule says a slow step runs: the first token after an ender that is neither an
    ender nor whitespace-only, computed from the decoded text of each token."""
    starts, pending = [], False
    for i, token in enumerate(ids):
        text = tok.decode([token])
        stripped = "".join(text.split())
        if stripped.endswith((".", "?", "!", "。", "？", "！")):
            pending = True
        elif pending and stripped:
            starts.append(i)
            pending = False
    return starts


@pytest.mark.parametrize("tokenizer_name", ["smol_tokenizer", "qwen_tokenizer"])
def test_sentence_trigger_fires_on_the_first_token_of_each_new_sentence(tokenizer_name, request):
    tok = request.getfixturevalue(tokenizer_name)
    classes = token_classes(tok)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    fired = _fires(SentenceTrigger(classes, refresh_interval=10_000, min_refresh_gap=0), ids)
    positions = [i for i, _ in fired]
    assert positions == _expected_sentence_starts(tok, ids)
    assert len(positions) == 5  # after "text.", "more!", "stop?", "sentence.", "。"
    first_words = [tok.decode(ids[i]).strip() for i in positions]
    assert first_words[:3] == ["Then", "Does", "No"]
    # commas, colons, semicolons and newlines alone never end a sentence
    for i in positions:
        before = tok.decode(ids[:i]).rstrip()
        assert before[-1] in ".?!。？！"


@pytest.mark.parametrize("tokenizer_name", ["smol_tokenizer", "qwen_tokenizer"])
def test_sentence_step_end_fires_on_the_first_ender_of_each_boundary(tokenizer_name, request):
    tok = request.getfixturevalue(tokenizer_name)
    classes = token_classes(tok)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    fired = _fires(SentenceTrigger(classes, refresh_interval=10_000, min_refresh_gap=0,
                                   at_end=True), ids)
    positions = [i for i, _ in fired]
    starts = _expected_sentence_starts(tok, ids)
    # every boundary that starts a sentence, and the text's last one when its last token is an
    # ender (Qwen's "！"; SmolLM2 splits it into bytes)
    last = 1 if ids[-1] in classes.enders else 0
    assert len(positions) == len(starts) + last == 5 + last
    for end, start in zip(positions, starts):  # each boundary's first ender, before its start
        assert "".join(tok.decode([ids[end]]).split()).endswith((".", "?", "!", "。", "！"))
        assert end < start
        assert tok.decode(ids[end + 1:start]).strip(" \n.?!。？！") == ""
        assert end == 0 or ids[end - 1] not in classes.enders


def test_sentence_step_is_checked_and_the_paper_keeps_start():
    from sfi import SFIConfig
    from sfi.core.triggers import make_trigger
    from sfi.errors import SFIConfigError

    assert SFIConfig.paper().sentence_step == "start"
    assert make_trigger(SFIConfig(sentence_step="end"), token_classes_stub(), 0).at_end
    with pytest.raises(SFIConfigError, match="sentence_step must be one of start, end"):
        SFIConfig(sentence_step="middle")


def token_classes_stub():
    from sfi.core.triggers import TokenClasses

    return TokenClasses(frozenset({1}), frozenset({2}))


@pytest.mark.parametrize("tokenizer_name", ["smol_tokenizer", "qwen_tokenizer"])
def test_enders_come_from_the_vocabulary(tokenizer_name, request):
    tok = request.getfixturevalue(tokenizer_name)
    classes = token_classes(tok)
    for text in (".", "?", "!"):
        (token,) = tok(text, add_special_tokens=False)["input_ids"]
        assert token in classes.enders
    (comma,) = tok(",", add_special_tokens=False)["input_ids"]
    assert comma not in classes.enders
    assert tok("\n", add_special_tokens=False)["input_ids"][0] in classes.whitespace
    assert not (classes.enders & classes.whitespace)
    assert not (classes.enders & set(tok.all_special_ids))


def test_sentence_trigger_never_fires_within_the_gap(smol_tokenizer):
    from sfi.texts import essays

    text = essays()[:6000] + " Yes. No. Maybe!" * 100  # real prose, then very short sentences
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    trigger = SentenceTrigger(token_classes(smol_tokenizer), refresh_interval=96,
                              min_refresh_gap=16)
    fired = _fires(trigger, ids)
    assert "sentence" in {r for _, r in fired}
    assert len(fired) > 30
    previous = -1
    for i, reason in fired:
        gap = i - previous
        assert gap >= 16
        assert gap <= 96
        if reason == "interval":
            assert gap == 96
        previous = i


def test_interval_alone_without_enders(smol_tokenizer):
    ids = smol_tokenizer("word " * 300, add_special_tokens=False)["input_ids"]
    fired = _fires(SentenceTrigger(token_classes(smol_tokenizer), 50, 16), ids)
    assert [i for i, _ in fired] == list(range(49, len(ids), 50))
    assert {r for _, r in fired} == {"interval"}


def test_ablation_policies():
    ids = list(range(100))
    assert [i for i, _ in _fires(FixedPeriodTrigger(10), ids)] == list(range(9, 100, 10))
    random_a = _fires(RandomPeriodTrigger(5, 15, seed=3), ids)
    random_b = _fires(RandomPeriodTrigger(5, 15, seed=3), ids)
    assert random_a == random_b
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(random_a)]
    assert all(5 <= g <= 15 for g in gaps) and len(set(gaps)) > 1
    assert _fires(BootstrapOnlyTrigger(), ids) == []
    assert isinstance(make_trigger(SFIConfig(trigger="fixed"), None, 0), FixedPeriodTrigger)
