"""Parsing what another tool or a user handed us, its nesting bounded before anything recurses over it.

A file shardavg did not write is hostile until checked, and both formats other tools write
nest without limit: JSON (records, indexes, configs, Megatron's and DeepSpeed's metadata) and
DCP's pickled ``.metadata``. Deep nesting breaks Python in two ways: ``json.loads`` raises a
bare ``RecursionError`` (and what parsed just under it can overflow a later walk), and C code
with no recursion check at all (hashing a tuple nested 200,000 deep as a dict key) kills the
process with SIGSEGV, while ``pickle`` builds such a tuple without recursing. So JSON goes
through ``parse_json``, which bounds the depth of what it returns, and a pickle through
``check_pickle``, which counts its nesting, the objects it would build (and a walk over them
visit) and the memo slots it would store from its opcodes, building nothing, before any
unpickler sees it.
"""

from __future__ import annotations

import json
import os
import pickletools
import struct
from array import array
from typing import Any

from .errors import CheckpointError
from .validate import nesting

JSON_DEPTH = 100  # arrays and objects nested in JSON another tool wrote (a model config: a handful)
PICKLE_DEPTH = 100  # containers and objects nested in a pickled DCP metadata (torch's own: 11)
PICKLE_OBJECTS = 2**26  # objects and entries a pickle may build or a walk visit: DCP's own, one per ~5 bytes


def parse_json(text: str | bytes, where: str | os.PathLike, depth: int = JSON_DEPTH) -> Any:
    """``json.loads(text)``, refused with a ``CheckpointError`` naming ``where`` (the file it came from)
    when it nests more than ``depth`` arrays and objects: never a ``RecursionError``, and nothing returned
    that a later recursive walk (comparing, showing, writing it again) could overflow on.

    Text that is not JSON raises json's own ``ValueError``, as ``json.loads`` does, for the caller
    to word with the rest of what it refuses.
    """
    try:
        value = json.loads(text)
    except RecursionError:  # (json's C scanner checks the recursion limit, ~1,000 levels)
        raise CheckpointError(_too_deep(where, depth, "JSON", "JSON_DEPTH")) from None
    if nesting(value, depth) > depth:
        raise CheckpointError(_too_deep(where, depth, "JSON", "JSON_DEPTH"))
    return value


def _too_deep(where: str | os.PathLike, depth: int, what: str, limit: str) -> str:
    return (
        f"{where}: {what} nested more than {depth} levels deep ({limit}), deeper than any checkpoint's files go "
        "(damaged or crafted): refused"
    )


# ---------------------------------------------------------------------------------- pickles

# What each opcode does to the pickle machine's stack, as far as nesting goes: push a scalar
# (depth 0) or an empty container (1), push a mark, build an object of the top n items (or those
# above the mark) one level deeper than the deepest of them, add items into the object under
# them, memo store and fetch, pop, or nothing. The commonest in DCP's metadata (MEMOIZE, BINGET,
# LONG_BINGET, BININT1, MARK, TUPLE1) are handled inline, before the table is looked at.
_SCALAR, _EMPTY, _MARK, _NOTHING, _GET, _PUT, _INLINE, _POP, _DUP, _POP_MARK = range(10)
_BUILD, _BUILD_MARKED, _ADD, _ADD_MARKED, _GLOBAL, _STOP = range(10, 16)
_EFFECTS = {
    "EMPTY_LIST": (_EMPTY, 0),
    "EMPTY_TUPLE": (_EMPTY, 0),
    "EMPTY_DICT": (_EMPTY, 0),
    "EMPTY_SET": (_EMPTY, 0),
    "MARK": (_MARK, 0),
    "PROTO": (_NOTHING, 0),
    "FRAME": (_NOTHING, 0),
    "READONLY_BUFFER": (_NOTHING, 0),
    "GET": (_GET, 0),
    "BINGET": (_INLINE, 0),
    "LONG_BINGET": (_INLINE, 0),
    "PUT": (_PUT, 0),
    "BINPUT": (_PUT, 0),
    "LONG_BINPUT": (_PUT, 0),
    "MEMOIZE": (_INLINE, 0),
    "POP": (_POP, 0),
    "DUP": (_DUP, 0),
    "POP_MARK": (_POP_MARK, 0),
    "TUPLE1": (_BUILD, 1),
    "TUPLE2": (_BUILD, 2),
    "TUPLE3": (_BUILD, 3),
    "REDUCE": (_BUILD, 2),
    "NEWOBJ": (_BUILD, 2),
    "NEWOBJ_EX": (_BUILD, 3),
    "TUPLE": (_BUILD_MARKED, 0),
    "LIST": (_BUILD_MARKED, 0),
    "DICT": (_BUILD_MARKED, 0),
    "FROZENSET": (_BUILD_MARKED, 0),
    "OBJ": (_BUILD_MARKED, 0),
    "INST": (_BUILD_MARKED, 0),
    "APPEND": (_ADD, 1),
    "SETITEM": (_ADD, 2),
    "BUILD": (_ADD, 1),
    "APPENDS": (_ADD_MARKED, 0),
    "SETITEMS": (_ADD_MARKED, 0),
    "ADDITEMS": (_ADD_MARKED, 0),
    "STACK_GLOBAL": (_GLOBAL, 2),
    "BINPERSID": (_GLOBAL, 1),
    "STOP": (_STOP, 0),
}  # fmt: skip; every other opcode pushes a scalar (a number, a string, a global)
_LENGTHS = {-2: (1, "<B"), -3: (4, "<i"), -4: (4, "<I"), -5: (8, "<Q")}  # pickletools' argument length codes


def _opcode_table() -> list[tuple[int, int, int, int] | None]:
    """For each opcode byte: (effect, items it takes, argument bytes or pickletools' length code,
    lines of a text argument); None for a byte that is no opcode."""
    table: list[tuple[int, int, int, int] | None] = [None] * 256
    for op in pickletools.opcodes:
        effect, items = _EFFECTS.get(op.name, (_SCALAR, 0))
        argument = 0 if op.arg is None else op.arg.n
        table[ord(op.code)] = (effect, items, argument, 2 if op.name in ("GLOBAL", "INST") else 1)
    return table


_OPCODES = _opcode_table()


def check_pickle(
    raw: bytes, where: str | os.PathLike, depth: int = PICKLE_DEPTH, objects: int = PICKLE_OBJECTS
) -> None:
    """Refuse the pickle ``raw`` (from the file ``where``) with a ``CheckpointError`` naming it when
    what it builds nests more than ``depth`` containers and objects deep (``depth`` below 255), or
    takes more than ``objects`` objects and container entries to build or to walk, or does what
    pickle never writes and the unpickler would pay for, before anything is unpickled.

    Its opcodes are walked as the unpickler would run them, keeping for each object it would build
    only how deep it nests and how many objects walking it visits: nothing is built, nothing
    recurses, and a stack that underflows, a memo slot fetched that was never stored or a byte that
    is no opcode is refused as not a pickle. Linear in the pickle's length, a few bytes an object:
    about three times as long as unpickling DCP's metadata takes. Refused too, each costing the
    unpickler far more than the bytes that ask for it:

    - a memo slot stored past those stored so far: pickle numbers them 0, 1, 2... as it stores
      them, but the unpickler sizes its memo table by the highest slot named (slot 2**30: 16 GB);
    - anything added to a container after it was put inside another (appending to a list fetched
      from the memo, a cycle): a million lists each appended to the last are a million levels deep,
      at a few bytes a level, however deep each looked when it was put in the next;
    - shared objects that a walk visits too often: a tuple holding another twice, 40 times over, is
      200 bytes, and hashing it (as a dict key) visits 2**40 tuples.
    """
    if not 0 < depth < 255:
        raise ValueError(f"check_pickle's depth is {depth}: it keeps depths in bytes, so 1 to 254")
    try:
        _walk(raw, where, depth, objects)
    except CheckpointError:
        raise
    except (IndexError, KeyError, ValueError, struct.error):
        raise CheckpointError(f"cannot read {where}: not a pickle (truncated or damaged)") from None


def _walk(raw: bytes, where: str | os.PathLike, limit: int, most: int) -> None:
    """``check_pickle``'s walk; IndexError, KeyError, ValueError or struct.error where ``raw`` is no pickle.

    Every object is numbered as it is built (0 stands for every scalar), and the stack and the memo
    hold those numbers: an object fetched from the memo is the same object, as deep and as large as
    it is now. Once an object is inside another, nothing may be added to it (pickle adds to a
    container before putting it anywhere, except in a cycle), so what was counted for all that holds
    it stays true, and a cycle, nested without end, is refused with the rest. The commonest
    opcodes of DCP's metadata come first, inline: this loop is the whole cost."""
    stack: list[int] = []  # the objects on the unpickler's stack, by number
    marks: list[int] = []  # the stack's length at each MARK
    memo = array("I")  # the objects the memo holds, slot by slot (stored densely, as pickle does)
    depths = bytearray(1)  # how deep each object nests (a scalar: 0)
    sizes = array("Q", [1])  # how many objects and entries walking each visits, shared ones each time
    inside = bytearray(b"\x01")  # 1 for an object put inside another (a scalar: always)
    deepest, built, position = 0, 0, 0
    push, unpack = stack.append, struct.unpack_from
    while True:
        code = raw[position]
        position += 1
        if code == 0x94:  # MEMOIZE
            memo.append(stack[-1])
            continue
        if code == 0x68:  # BINGET
            push(memo[raw[position]])
            position += 1
            continue
        if code == 0x6A:  # LONG_BINGET
            push(memo[unpack("<I", raw, position)[0]])
            position += 4
            continue
        if code == 0x4B:  # BININT1
            push(0)
            position += 1
            built += 1
            continue
        if code == 0x28:  # MARK
            marks.append(len(stack))
            continue
        if code == 0x85:  # TUPLE1: a new object, one level deeper than its item
            item = stack[-1]
            inside[item] = 1
            stack[-1] = len(depths)
            level = depths[item] + 1
            depths.append(level)
            sizes.append(sizes[item] + 1)
            inside.append(0)
            built += 2
            if level > deepest:
                deepest = level
                if deepest > limit:
                    raise CheckpointError(_too_deep(where, limit, "a pickle", "PICKLE_DEPTH"))
            if sizes[-1] > most:
                raise CheckpointError(_too_large(where, most))
            continue
        entry = _OPCODES[code]
        if entry is None:
            raise ValueError(f"no opcode {code:#x}")
        effect, items, argument, lines = entry
        start = position
        if argument > 0:
            position += argument
        elif argument == -1:  # (protocol 0's text arguments, one line each)
            for _ in range(lines):
                position = raw.index(b"\n", position) + 1
        elif argument:
            size, layout = _LENGTHS[argument]
            (length,) = unpack(layout, raw, position)
            if length < 0:
                raise ValueError("a negative length")
            position += size + length
        if effect == _SCALAR:
            push(0)
            built += 1
            if built > most:
                raise CheckpointError(_too_large(where, most))
        elif effect == _EMPTY:  # a new object, empty
            push(len(depths))
            depths.append(1)
            sizes.append(1)
            inside.append(0)
            built += 1
            if built > most:
                raise CheckpointError(_too_large(where, most))
        elif effect == _MARK:
            marks.append(len(stack))
        elif effect == _BUILD or effect == _BUILD_MARKED or effect == _ADD or effect == _ADD_MARKED:
            below = len(stack) - items if items else marks.pop()
            if below < 0 or (effect >= _ADD and below < 1):  # (adding needs the object it adds to)
                raise IndexError("stack underflow")
            inner = stack[below:]
            del stack[below:]
            level, size = 1, 1
            for item in inner:
                inside[item] = 1
                if depths[item] >= level:
                    level = depths[item] + 1
                size += sizes[item]
            built += len(inner) + 1
            if size > most or built > most:
                raise CheckpointError(_too_large(where, most))
            if effect <= _BUILD_MARKED:  # a new object of the items
                push(len(depths))
                depths.append(level)
                sizes.append(size)
                inside.append(0)
            else:  # the items added to the object under them
                target = stack[-1]
                if inside[target]:
                    raise CheckpointError(
                        f"{where}: a pickle that adds to a container after putting it inside another (a "
                        "cycle, or nesting hidden behind the memo), which no checkpoint's metadata does (damaged "
                        "or crafted): refused"
                    )
                depths[target] = max(depths[target], level)
                sizes[target] += size - 1
                if sizes[target] > most:
                    raise CheckpointError(_too_large(where, most))
            if level > deepest:
                deepest = level
                if deepest > limit:
                    raise CheckpointError(_too_deep(where, limit, "a pickle", "PICKLE_DEPTH"))
        elif effect == _GET or effect == _PUT:
            if argument == -1:  # (a decimal line)
                index = int(raw[start : position - 1])
            else:
                index = raw[start] if argument == 1 else unpack("<I", raw, start)[0]
            if index < 0:
                raise ValueError("a negative memo slot")
            if effect == _GET:
                push(memo[index])
            elif index < len(memo):
                memo[index] = stack[-1]
            elif index == len(memo):
                memo.append(stack[-1])
            else:
                raise CheckpointError(
                    f"{where}: a pickle that stores memo slot {index} after storing {len(memo)} (pickle stores "
                    f"slots 0, 1, 2... in turn; the unpickler would allocate {2 * index:,} slots of 8 bytes for "
                    "it) (damaged or crafted): refused"
                )
        elif effect == _GLOBAL:
            if len(stack) < items:
                raise IndexError("stack underflow")
            del stack[len(stack) - items :]
            push(0)
        elif effect == _POP:
            if len(stack) > (marks[-1] if marks else 0):
                stack.pop()
            else:
                marks.pop()
        elif effect == _DUP:
            push(stack[-1])
        elif effect == _POP_MARK:
            del stack[marks.pop() :]
        elif effect == _STOP:
            return


def _too_large(where: str | os.PathLike, most: int) -> str:
    return (
        f"{where} builds more than {most} objects and entries (PICKLE_OBJECTS), counting a shared one each "
        "time it is held, more than any checkpoint's metadata"
    )
