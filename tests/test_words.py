"""One word per idea (issue 39): the package's identifiers name a set of a tensor's elements only
with a word the glossary defines, "chunk" only where it means what lies on disk, and "run" (the
training run) never where indices live.

Identifiers are read with ``ast`` (names, attributes, arguments, function and class names), split
into words at underscores and capitals; strings (JSON keys, messages) and comments are not: what
lies on disk keeps its spelling.
"""

from __future__ import annotations

import ast
import re
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
