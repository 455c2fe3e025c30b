"""The docs that are generated from the code stay what the code says."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from sfi.core.config import SFIConfig
from sfi.core.config_doc import field_docs, reference

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_field_has_a_doc():
    docs = field_docs()
    assert [f.name for f in fields(SFIConfig)] == list(docs)
    assert all(len(doc.split()) >= 3 for doc in docs.values())


def test_configuration_page_is_generated_from_the_field_docs():
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == reference(), (
        "docs/configuration.md is stale: run python -m sfi.core.config_doc docs/configuration.md")


def test_reference_marks_where_the_presets_differ():
    rows = {line.split("|")[1].strip(" `"): line for line in reference().splitlines()
            if line.startswith("| `")}
    assert "**`9`**" in rows["pool_kernel"] and "**`1`**" in rows["pool_kernel"]
    assert "**" not in rows["sink"]


def test_an_undocumented_field_is_refused(monkeypatch):
    import sfi.core.config_doc as config_doc

    monkeypatch.setattr(config_doc, "field_docs", lambda cls=SFIConfig: {"sink": "S sinks."})
    with pytest.raises(ValueError, match="has no docstring"):
        config_doc.reference()


def _build_docs(tmp_path: Path, extra_page: str | None = None) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` (as ``make docs`` runs it) of a copy of the docs, with
    ``extra_page`` added to docs/ and left out of the nav."""
    pytest.importorskip("mkdocs")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "src").symlink_to(ROOT / "src")  # the API reference reads the docstrings
    if extra_page is not None:
        (tmp_path / "docs" / extra_page).write_text("# A page\n\nNot in the nav.\n")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(tmp_path / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, env={**os.environ,
                                                               "NO_MKDOCS_2_WARNING": "1"})


def test_the_docs_build_fails_on_a_page_left_out_of_the_nav(tmp_path):
    clean = _build_docs(tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr
    orphan = _build_docs(tmp_path / "orphan", extra_page="orphan.md")
    assert orphan.returncode != 0
    assert "orphan.md" in orphan.stderr and "nav" in orphan.stderr


def test_make_docs_does_not_hide_warnings():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = makefile.split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "mkdocs build --strict" in recipe and "--quiet" not in recipe and " -q" not in recipe


def test_docs_point_at_nothing_a_user_does_not_have():
    texts = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "src").rglob("*.py")]
    for path in texts:
        text = path.read_text(encoding="utf-8")
        assert "../shared" not in text, path
        assert "METHOD.md" not in text and "BASELINES.md" not in text, path


def test_docs_carry_no_dates_or_commit_ids():
    """Docs say what is true of this release; dates and commits belong to git and the
    CHANGELOG."""
    date = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
    commit = re.compile(r"\bcommit [0-9a-f]{7,40}\b|\(\b[0-9a-f]{7}\b\)")
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        text = path.read_text(encoding="utf-8")
        assert not date.search(text), (path, date.search(text))
        assert not commit.search(text), (path, commit.search(text))


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_table_marked_as_data_is_what_its_data_renders():
    from sfi.bench.doc_tables import BLOCK, render

    marked = [page for page in _pages() if BLOCK.search(page.read_text(encoding="utf-8"))]
    assert ROOT / "docs" / "eval" / "weight-formats.md" in marked
    for page in marked:
        assert page.read_text(encoding="utf-8") == render(page), (
            f"{page.relative_to(ROOT)}: a table differs from its data; run "
            f"python -m sfi.bench.doc_tables {page.relative_to(ROOT)}")


def test_a_figure_changed_by_hand_is_caught(tmp_path):
    from sfi.bench.doc_tables import render

    data = {"cpu": "AVX2", "products": [
        {"shape": "4x8", "path": "a", "ms": 1.0, "gb_s": 2.0, "of_bandwidth": 0.5}]}
    (tmp_path / "d.json").write_text(json.dumps(data))
    page = tmp_path / "p.md"
    page.write_text("x\n<!-- table: weight-products d.json -->\nold\n<!-- /table -->\n")
    rendered = render(page)
    assert "| 4 x 8 | 1.00 ms, 2.0 GB/s (50%) |" in rendered and "old" not in rendered
    page.write_text(rendered.replace("2.0 GB/s", "2.5 GB/s"))
    assert render(page) != page.read_text()


def test_a_table_from_several_runs_keeps_the_methods_it_names(tmp_path):
    """Two ``sfi eval`` results merged as ``sfi report`` merges them, ``only=`` keeping some
    methods; a label the data lacks is an error, not an empty table."""
    from sfi.bench.doc_tables import render

    def run(method: str, score: float) -> dict:
        rows = [{"task": "passkey", "context": 100, "prompt_tokens": 100, "method": m,
                 "budget": b, "capacity": 10, "retention": r, "score": s, "sample": i}
                for m, b, r, s in (("full", 1.0, 1.0, 100.0), (method, 0.1, 0.2, score))
                for i in range(2)]
        return {"model": "m", "tasks": ["passkey"], "contexts": [100], "samples": 2,
                "seed": 0, "rows": rows, "summary": []}

    (tmp_path / "a.json").write_text(json.dumps(run("sfi", 50.0)))
    (tmp_path / "b.json").write_text(json.dumps(run("quest", 0.0)))
    page = tmp_path / "p.md"
    page.write_text("<!-- table: eval-averages a.json,b.json only=full|quest@0.1 -->\n"
                    "<!-- /table -->\n")
    rendered = render(page)
    assert "| 100 | quest@0.1 | 20.0% | 0.0 |" in rendered and "| 100 | full |" in rendered
    assert "sfi@0.1" not in rendered
    page.write_text(rendered.replace("only=full|quest@0.1", "only=snapkv@0.1"))
    with pytest.raises(ValueError, match=r"no method labelled snapkv@0\.1"):
        render(page)


def test_a_malformed_table_marker_is_an_error_not_a_table_left_unchecked(tmp_path):
    from sfi.bench.doc_tables import BLOCK, render

    (tmp_path / "d.json").write_text(json.dumps({"products": []}))
    page = tmp_path / "p.md"
    for marker, message in (("weight-products d.json olny=a", "is not only="),
                            ("weight-product d.json", "no table renderer"),
                            ("weight-products missing.json", "missing.json")):
        page.write_text(f"<!-- table: {marker} -->\n<!-- /table -->\n")
        with pytest.raises(ValueError, match=message):
            render(page)
    for path in _pages():  # every marker in the docs is one the renderer reads
        text = path.read_text(encoding="utf-8")
        openers = re.findall(r"^<!-- table:", text, flags=re.M)  # (not those quoted in code)
        assert len(openers) == len(BLOCK.findall(text)), path


def test_a_vllm_cell_measured_in_two_runs_is_refused():
    """Ratios compare rows of one run: a (context, batch, engine, mode) twice is an error."""
    from sfi.bench.doc_tables import vllm_engines

    row = {"context": 4096, "batch": 1, "engine": "vllm", "mode": "vllm", "decode_tok_s": 8.0}
    assert "| 4,096 | 1 | 8.0 |" in vllm_engines({"rows": [row]})
    with pytest.raises(ValueError, match="measured twice"):
        vllm_engines({"rows": [row, dict(row, decode_tok_s=9.0)]})


# a cell that reads as a measurement: a share, a ratio, a time, a rate, a fraction of 3 digits
MEASURED = re.compile(r"\d%|\b\d+(?:\.\d+)?x\b|\d ?ms\b|\d s\b|tok/s|GB/s|\d\.\d{3}")


def _manual_pages() -> list[Path]:
    """README and the docs pages a user reads; the generated configuration page and the
    eval reports (each `sfi eval` writes its own from its results) aside."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "docs" / "eval" / "weight-formats.md"]
    return [p for p in pages if p.name != "configuration.md"]


def _unmarked_tables(text: str) -> list[tuple[int, str]]:
    """(line, row) of each table row outside a ``<!-- table: ... -->`` block."""
    rows, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("<!-- table:"):
            inside = True
        elif line.startswith("<!-- /table"):
            inside = False
        elif line.startswith("|") and not inside:
            rows.append((number, line))
    return rows


def test_every_measured_table_is_rendered_from_its_data():
    """A table of measurements typed by hand cannot be checked against its data: every such
    table in README and the manual's pages is a marked block that
    ``test_every_table_marked_as_data_is_what_its_data_renders`` compares."""
    for page in _manual_pages():
        for number, row in _unmarked_tables(page.read_text(encoding="utf-8")):
            assert not MEASURED.search(row), (
                f"{page.relative_to(ROOT)}:{number}: a table of measurements typed by hand; "
                f"render it from its JSON with <!-- table: RENDERER FILE --> ({row[:80]})")


def test_the_measured_table_check_can_fail():
    text = "| context | tok/s |\n|---|---|\n| 4,096 | 12.3 tok/s |\n"
    assert any(MEASURED.search(row) for _, row in _unmarked_tables(text))
    marked = "<!-- table: bench-modes d.json -->\n" + text + "<!-- /table -->\n"
    assert _unmarked_tables(marked) == []


def test_no_page_reads_as_a_run_history():
    """The docs say what is true now; run histories belong to commit messages and notes."""
    history = re.compile(r"earlier series|not kept|not rerun|the issue's|which it was then|"
                         r"at the time|this release's", re.I)
    for page in _manual_pages():
        found = history.search(page.read_text(encoding="utf-8"))
        assert not found, (page.relative_to(ROOT), found.group(0))


def test_llama_cpp_with_flash_attention_on_and_off_shows_the_faster():
    from sfi.bench.doc_tables import sfi_against_peers

    rows = [{"context": 8192, "batch": 1, "weights": "int8", "mode": "sfi", "decode_tok_s": 20.0},
            {"context": 8192, "batch": 1, "weights": "Q8_0", "mode": "llama.cpp Q8_0",
             "decode_tok_s": 10.0},
            {"context": 8192, "batch": 1, "weights": "Q8_0", "mode": "llama.cpp Q8_0 no-fa",
             "decode_tok_s": 16.0}]
    table = sfi_against_peers({"rows": rows})
    assert "llama.cpp Q8_0 (faster of flash attn on/off, where both ran)" in table
    assert "| 16.0 | 1.25x |" in table
    one = sfi_against_peers({"rows": rows[:2]})  # one setting: its own name, its own figure
    assert "| llama.cpp Q8_0 |" in one and "| 10.0 | 2.00x |" in one


def test_the_readme_fits_one_screen_of_reading():
    """What SFI is, the two commands, install, quick starts, one table each of quality and
    speed, where it pays, limits: about 150 lines; the rest belongs to docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 160, f"README.md has {lines} lines; move detail to docs/"
