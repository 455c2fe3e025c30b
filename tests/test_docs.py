"""The docs that are generated from the code stay what the code says."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from sfi.config import SFIConfig
from sfi.config_doc import field_docs, reference

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_field_has_a_doc():
    docs = field_docs()
    assert [f.name for f in fields(SFIConfig)] == list(docs)
    assert all(len(doc.split()) >= 3 for doc in docs.values())


def test_configuration_page_is_generated_from_the_field_docs():
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == reference(), (
        "docs/configuration.md is stale: run python -m sfi.config_doc docs/configuration.md")


def test_reference_marks_where_the_presets_differ():
    rows = {line.split("|")[1].strip(" `"): line for line in reference().splitlines()
            if line.startswith("| `")}
    assert "**`9`**" in rows["pool_kernel"] and "**`1`**" in rows["pool_kernel"]
    assert "**" not in rows["sink"]


def test_an_undocumented_field_is_refused(monkeypatch):
    import sfi.config_doc as config_doc

    monkeypatch.setattr(config_doc, "field_docs", lambda cls=SFIConfig: {"sink": "S sinks."})
    with pytest.raises(ValueError, match="has no docstring"):
        config_doc.reference()
