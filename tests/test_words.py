"""One word per idea (issue 39): the package's identifiers name a set of a tensor's elements only
with a word the glossary defines, "chunk" only where it means what lies on disk, and "run" (the
training run) never where indices live.

Identifiers are read with ``ast`` (names, attributes, arguments, function and class names), split
into words at underscores and capitals; strings (JSON keys, messages) and comments are not: what
lies on disk keeps its spelling.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardavg"
GLOSSARY = ROOT / "docs" / "glossary.md"

# Words English (and the code's history) uses for a set of a tensor's elements. Each one the code
# uses must be a term of the glossary. ("segment" is left out: ``WRAPPER_SEGMENTS`` are a name's
# dotted segments, not elements; "interval" is a time.)
ELEMENT_WORDS = {
    "part", "run", "block", "box", "chunk", "row", "piece", "range", "slab", "span", "slice", "tile",
    "fragment", "extent", "stripe", "region", "window", "stretch", "section", "strip", "shard",
}  # fmt: skip
# Names of other libraries' objects, read as they spell them (DeepSpeed's ``param._hp_mapping``).
FOREIGN = {"hp_fragment", "lp_fragment_address", "strip", "rstrip", "lstrip"}
# "chunk" means what lies on disk: a box a file holds (the manifest's chunk table, a DCP chunk).
# Only the parts that read and write files say it; ``torch.chunk`` is torch's.
ON_DISK = ("checkpoints", "offline", "output")
# Where indices live, "run" would read as consecutive indices: they are a range there.
NO_RUN = ("layouts", "strategies", "update")


def words(identifier: str) -> list[str]:
    """``FlatLayout.range_numel`` -> flat, layout, range, numel; plurals singular."""
    found = []
    for token in identifier.split("_"):
        for word in re.findall(r"[A-Z]+(?=[A-Z][a-z]|\d|$)|[A-Z]?[a-z]+|[A-Z]+", token):
            word = word.lower()
            found.append(word[:-1] if word.endswith("s") and word[:-1] in ELEMENT_WORDS else word)
    return found


def identifiers(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            if not (node.attr == "chunk" and isinstance(node.value, ast.Name) and node.value.id == "torch"):
                yield node.lineno, node.attr
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name


def used() -> Iterator[tuple[str, int, str, str]]:
    """``(module, line, identifier, element word)`` for every element word in an identifier."""
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        for line, name in identifiers(ast.parse(path.read_text(), str(path))):
            if name in FOREIGN:
                continue
            for word in words(name):
                if word in ELEMENT_WORDS:
                    yield module, line, name, word


def glossary_terms() -> set[str]:
    """Every word of the glossary's bold terms (``**flat range**`` gives flat and range)."""
    terms = re.findall(r"^- \*\*([^*]+)\*\*", GLOSSARY.read_text(), flags=re.MULTILINE)
    found = {word for term in terms for word in re.findall(r"[a-z]+", term.lower())}
    return {word[:-1] if word.endswith("s") and word[:-1] in ELEMENT_WORDS else word for word in found}


def test_every_word_for_elements_is_in_the_glossary() -> None:
    terms = glossary_terms()
    missing = sorted({f"{word} ({module}:{line} {name})" for module, line, name, word in used() if word not in terms})
    assert not missing, f"words for elements of a tensor the glossary does not define: {missing[:20]}"


def test_chunk_means_what_lies_on_disk() -> None:
    elsewhere = [
        f"{module}:{line} {name}"
        for module, line, name, word in used()
        if word == "chunk" and module.split("/")[0] not in ON_DISK
    ]
    assert not elsewhere, f"'chunk' outside the parts that read and write files: {elsewhere}"


def test_run_is_the_training_run_only() -> None:
    indices = [
        f"{module}:{line} {name}"
        for module, line, name, word in used()
        if word == "run" and module.split("/")[0] in NO_RUN
    ]
    assert not indices, f"'run' where indices live (consecutive indices are a range): {indices}"


def test_the_glossary_defines_none_of_the_words_taken_out() -> None:
    """The words taken out stay out: none of them becomes a glossary term again."""
    assert not glossary_terms() & {"slab", "span", "fragment", "extent", "stripe", "region", "window", "stretch"}


def test_words_split_as_the_checks_read_them() -> None:
    assert words("FlatLayout") == ["flat", "layout"]
    assert words("slab_size") == ["slab", "size"]
    assert words("FUSED_PIECE") == ["fused", "piece"]
    assert words("from_ranges") == ["from", "range"]
    assert words("StoredChunk") == ["stored", "chunk"]
    assert words("piece_of_program") == ["piece", "of", "program"]


# One word per idea (issue 49): the glossary's "Words not used" table names each word the code and
# the pages do not use, and the one they use instead. It is read from there, so choosing a word is
# editing the glossary. Identifiers, comments, docstrings and messages of the package, the tools and
# the main job are read, and the pages; what lies in code spans (``name``, `name`), f-string
# fields, ``keyword=`` and a docstring's ``name:`` entry for a parameter are code, checked as
# identifiers where they are the package's own.
SCANNED = ("shardavg", "tools", "launch")
PAGES = ROOT / "docs"
# The glossary names the words it turns down; the changelog records what past releases said.
UNSCANNED_PAGES = {"glossary.md", "changelog.md"}
# ``directory`` is the public keyword of ``save``, ``load``, ``PostHocEMA`` and ``accelerate.attach``
# (and the attribute that keeps it): code that passes it on keeps its name. Other names say folder.
# The others are other libraries' names, as they spell them.
KEPT_IDENTIFIERS = {"directory", "TemporaryDirectory", "O_DIRECTORY"}
# Where a turned-down word quotes another tool's own: (word, file) -> (uses, why). Exact counts, so
# that a new use is a decision here, not a slip.
QUOTED = {
    ("adapter", "shardavg/output/model_folder.py"): (10, "a PEFT adapter (adapter_model*), refused as an input"),
    ("adapter", "docs/merge.md"): (4, "a PEFT adapter, refused as a merge input or left beside a model"),
    ("adapter", "docs/testing.md"): (1, "a PEFT adapter among the files a merge does not carry"),
    ("worker", "shardavg/cli.py"): (6, "torchrun's word for the processes it starts (TORCHELASTIC_RUN_ID)"),
    ("worker", "docs/testing.md"): (2, "torchrun's and pytest-xdist's processes"),
    ("directory", "shardavg/integrations/accelerate.py"): (1, "names the directory= keyword in its refusal"),
}  # fmt: skip
CODE = re.compile(r"``[^`]*``|`[^`\n]*`|\{[^{}]*\}|\b\w+=|^ +\w+:", re.MULTILINE)


def not_used() -> dict[str, str]:
    """The glossary's table: each word turned down and the word used instead."""
    table = GLOSSARY.read_text().split("## Words not used", 1)[1]
    rows = re.findall(r"^\| ([a-z ]+) \| ([a-z ]+) \|$", table, flags=re.MULTILINE)
    return {word: instead for word, instead in rows if word != "not used"}


def pattern(phrase: str) -> re.Pattern[str]:
    """``local view`` -> local view(s), local_view(s), LocalView(s); ``directory`` -> directories too."""
    *first, last = phrase.split()
    plural = f"{last[:-1]}(?:y|ies)" if last.endswith("y") else f"{last}s?"
    return re.compile(r"\b" + r"[ _-]?".join([*first, plural]) + r"\b", re.IGNORECASE)


def identifier_text(name: str) -> str:
    """``FlatLayout.local_views`` reads as "flat layout local views" (words at underscores and capitals)."""
    return " ".join(re.findall(r"[A-Z]+(?=[A-Z][a-z]|\d|\b)|[A-Z]?[a-z]+|[A-Z]+|\d+", name)).lower()


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """The lines of a page, or a module's comments and strings, with code spans taken out."""
    if path.suffix == ".md":
        texts = enumerate(path.read_text().splitlines(), 1)
    else:
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        texts = ((t.start[0], t.string) for t in tokens if t.type in (tokenize.COMMENT, tokenize.STRING))
    for line, text in texts:
        yield line, CODE.sub(" ", text)


def turned_down() -> dict[tuple[str, str], list[str]]:
    """``(word, file) -> places`` for every use of a word the glossary turns down."""
    words = {word: pattern(word) for word in not_used()}
    found: dict[tuple[str, str], list[str]] = {}
    files = [p for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))]
    files += [p for p in sorted(PAGES.rglob("*.md")) if p.name not in UNSCANNED_PAGES] + [ROOT / "README.md"]
    for path in files:
        where = path.relative_to(ROOT).as_posix()
        texts = list(prose(path))
        if path.suffix == ".py":
            tree = ast.parse(path.read_text(), str(path))
            texts += [(line, identifier_text(name)) for line, name in identifiers(tree) if name not in KEPT_IDENTIFIERS]
        for line, text in texts:
            for word, regex in words.items():
                found.setdefault((word, where), []).extend(f"{where}:{line} {m}" for m in regex.findall(text))
    return {key: places for key, places in found.items() if places}


def test_one_word_per_idea() -> None:
    unexpected = [
        f"{places} (say '{not_used()[word]}')"
        for (word, where), places in turned_down().items()
        if len(places) != QUOTED.get((word, where), (0, ""))[0]
    ]
    assert not unexpected, f"words the glossary turns down (its 'Words not used'), or quotes miscounted: {unexpected}"


def test_every_quote_is_still_there() -> None:
    found = turned_down()
    stale = [f"{key}: {uses} expected, {len(found.get(key, []))} found" for key, (uses, _) in QUOTED.items()]
    assert all(len(found.get(key, [])) == uses for key, (uses, _) in QUOTED.items()), stale


def test_the_table_turns_down_what_the_issue_found() -> None:
    """The doubles found (issue 49) are each settled in the table, each for a word the glossary defines."""
    table = not_used()
    assert {"local view", "live shard", "adapter", "worker", "directory", "model part"} <= set(table)
    terms = set(re.findall(r"^- \*\*([^*]+)\*\*", GLOSSARY.read_text(), flags=re.MULTILINE))
    assert set(table.values()) <= terms, sorted(set(table.values()) - terms)
    assert not set(table) & terms, "a word both turned down and defined"


def test_snapshot_is_the_post_hoc_ema_s_only() -> None:
    """What a background update copies of the buffers is a buffer copy, never a snapshot."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for part in ("update", "state")
        for path in sorted((PACKAGE / part).rglob("*.py"))
        for line, text in [
            *prose(path),
            *((n, identifier_text(i)) for n, i in identifiers(ast.parse(path.read_text()))),
        ]
        if re.search(r"\bsnapshots?\b", text, re.IGNORECASE)
    ]
    assert not found, found


def test_a_turned_down_word_is_found_in_every_spelling() -> None:
    assert pattern("local view").findall("local views, local_view, LocalView") == [
        "local views",
        "local_view",
        "LocalView",
    ]
    assert pattern("directory").findall("directories, a directory") == ["directories", "directory"]
    assert identifier_text("buffer_copies") == "buffer copies" and identifier_text("ADAPTERS") == "adapters"
    assert [text for _, text in prose(GLOSSARY)][0] == "# Glossary"
