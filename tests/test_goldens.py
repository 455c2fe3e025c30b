"""Golden outputs: sfi.generate, sfi eval rows, the server engine and the paper Selector give
what they gave when the goldens were recorded (``tests/goldens/record.py``).

Tokens, texts, finish reasons and step counts must match exactly; floats (retention, KL,
perplexity) to 1e-3 (relative, or absolute for the per-step KL values near 0): a different
thread count or BLAS build moves a mean KL in its
fourth digit (seen: 0.032955 with two threads, 0.032944 with one), while a behavioural change
moves tokens.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "goldens"))
import record

GOLDENS = Path(__file__).parent / "goldens"


def assert_same(actual, expected, where: str = "") -> None:
    if isinstance(expected, float) or isinstance(actual, float):
        assert isinstance(actual, int | float) and math.isclose(actual, expected, rel_tol=1e-3,
                                                                abs_tol=1e-3), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), \
            f"{where}: keys {sorted(set(actual) ^ set(expected))}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), \
            f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.mark.parametrize("part", record.PARTS)
def test_golden_outputs_unchanged(part, default_model):
    model, tokenizer = default_model
    expected = json.loads((GOLDENS / f"{part}.json").read_text(encoding="utf-8"))
    actual = json.loads(json.dumps(record.compute(part, model, tokenizer)))
    assert_same(actual, expected, part)
