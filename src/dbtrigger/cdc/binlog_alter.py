"""Does an ``ALTER TABLE`` change the column list a reader names a table map's values by?

Without column names in the binary log (``binlog_row_metadata`` not FULL) a table
map's values are named by position from ``information_schema``; a statement
between the table map and that reading that adds, drops, renames, moves or
retypes a column makes the names (or the reading of the values) wrong. Most
``ALTER TABLE`` statements do none of that: indexes, constraints, table options,
a column's default, partitions, a rebuild. Those must not stop delivery. Adding
or dropping the primary key counts as a change too: the reading also gives the
key each change is delivered with.

Each clause (the statement's top-level comma-separated parts) is checked against
the clauses known to leave every column as it was; anything else, a clause this
module does not know included, counts as a change (a stop is an outage, a wrong
name is wrong data). ``MODIFY`` and ``CHANGE`` count even without a new name or
place: they may change the column's type, and the reading of a value whose type
the log does not tell (UUID, INET6, binary strings) comes from the catalog; the
type before is not in the statement.

:func:`column_ops` reads what each clause does (added, dropped, renamed, changed
columns, the key), for the statements whose effect can be undone from their text
(:mod:`dbtrigger.cdc.binlog_replay`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_IDENT = r"(?:`(?:[^`]|``)+`|\"(?:[^\"]|\"\")+\"|[\w$]+)"
#: ``ALTER [ONLINE] [IGNORE] TABLE [IF EXISTS] name <clauses>`` (comments and literals gone).
_ALTER = re.compile(
    rf"^alter\s+(?:online\s+|ignore\s+)*table\s+(?:if\s+exists\s+)?"
    rf"({_IDENT}(?:\s*\.\s*{_IDENT})?)(?=[\s,;]|$)(.*)$",
    re.I | re.S,
)
_OPTION = (
    r"engine|auto_increment|avg_row_length|checksum|page_checksum|comment|compression|"
    r"connection|data\s+directory|index\s+directory|delay_key_write|encrypted|"
    r"encryption_key_id|ietf_quotes|insert_method|key_block_size|max_rows|min_rows|"
    r"pack_keys|page_compressed|page_compression_level|row_format|sequence|"
    r"stats_auto_recalc|stats_persistent|stats_sample_pages|tablespace|transactional|union|"
    r"(?:default\s+)?(?:character\s+set|charset|collate)|algorithm|lock"
)
_PARTITION = (
    r"(?:add|drop|coalesce|reorganize|exchange|truncate|analyze|check|optimize|rebuild|"
    r"repair|discard|import)\s+partition|remove\s+partitioning|partition\s+by"
)
#: A clause that adds or drops the primary key: it changes what names an event's row.
_PRIMARY = re.compile(
    rf"^(?:add\s+(?:constraint\s+(?:{_IDENT}\s+)?)?primary\s+key|drop\s+primary\s+key)\b",
    re.I | re.S,
)
#: Clauses that leave every column's name, place and type, and the primary key, as they were.
_KEEPS = re.compile(
    r"^(?!add\s+(?:constraint\s+(?:\S+\s+)?)?primary\s+key\b)(?:"
    r"add\s+(?:constraint|unique|index|key|fulltext|spatial|foreign\s+key|check)\b"
    r"|drop\s+(?:index|key|foreign\s+key|constraint|check)\b"
    r"|rename\s+(?:index|key)\b"
    r"|alter\s+(?:index|key)\b"
    rf"|alter\s+(?:column\s+)?{_IDENT}\s+(?:set\s+default\b|drop\s+default\b)"
    rf"|(?:{_OPTION})\b"
    rf"|(?:{_PARTITION})\b"
    r"|(?:discard|import)\s+tablespace\b"
    r"|(?:enable|disable)\s+keys\b"
    r"|order\s+by\b"
    r"|force\b"
    r")",
    re.I | re.S,
)
_VERSIONED = re.compile(r"/\*M?!\d*")
_UNSAFE = re.compile(r"[^\w$]")


def cleaned(text: str) -> str:
    """``text`` without comments, its string literals emptied (``''``).

    Quoted identifiers stay: `` `...` `` whole, ``"..."`` (a string, or an identifier
    under ``ANSI_QUOTES``) as one token of its letters and digits. A versioned comment
    (``/*! ... */``, ``/*M! ... */``) is SQL the server ran: its text stays.
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "'\"`":
            j = i + 1
            while j < n:
                if text[j] == "\\" and ch != "`":
                    j += 2
                    continue
                if text[j] == ch:
                    if j + 1 < n and text[j + 1] == ch:  # a doubled quote
                        j += 2
                        continue
                    break
                j += 1
            if ch == "'":
                out.append("''")
            elif ch == '"':  # escapes and inner quotes gone: one safe token
                out.append('"' + _UNSAFE.sub("_", text[i + 1 : j]) + '"')
            else:
                out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("/*", i):
            versioned = _VERSIONED.match(text, i)
            if versioned is not None:
                out.append(" ")
                i = versioned.end()
                continue
            end = text.find("*/", i + 2)
            out.append(" ")
            i = n if end < 0 else end + 2
        elif text.startswith("*/", i):  # the end of a versioned comment
            out.append(" ")
            i += 2
        elif ch == "#" or (text.startswith("--", i) and (i + 2 >= n or text[i + 2].isspace())):
            end = text.find("\n", i)
            out.append(" ")
            i = n if end < 0 else end
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def clauses(text: str) -> list[str]:
    """The top-level comma-separated parts of ``text`` (already :func:`cleaned`)."""
    parts: list[str] = []
    depth, start, quote = 0, 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "`\"'":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def altered(text: str) -> tuple[str, bool] | None:
    """For an ``ALTER TABLE``: the table as written, and whether the statement may change
    its column list (see the module docstring). None for any other statement."""
    sql = cleaned(text).strip().rstrip(";").strip()
    found = _ALTER.match(sql)
    if found is None:
        return None
    name = re.sub(r"\s*\.\s*", ".", found.group(1))
    return name, any(_KEEPS.match(c) is None for c in clauses(found.group(2)))


# --- what a statement does to the column list, clause by clause ---------------------------


@dataclass(frozen=True)
class ColumnOp:
    """One clause of an ``ALTER TABLE``, as far as it changes the column list or the key.

    ``kind``: ``add`` (``name``, placed ``place``: None at the end, ``""`` first, else
    after that column), ``drop`` (``name``), ``rename`` (``name`` to ``new``, type and
    place kept), ``change`` (``CHANGE``/``MODIFY``: ``name`` to ``new``, its type may
    differ, moved when ``place`` is not None), ``key`` (the primary key made ``keys``;
    ``keys`` empty: dropped). ``keyed``: the column's definition makes it (part of) a key.
    """

    kind: str
    name: str = ""
    new: str = ""
    place: str | None = None
    keys: tuple[str, ...] = ()
    keyed: bool = False


_NAME = r"`(?:[^`]|``)+`|[\w$]+"
_PLACE = re.compile(rf"\s(first|after\s+({_NAME}))\s*$", re.I | re.S)
_ADD_MANY = re.compile(r"^add\s+(?:column\s+)?\((.*)\)$", re.I | re.S)
_ADD = re.compile(rf"^add\s+(?:column\s+)?(?!if\s)({_NAME})\s+(.+)$", re.I | re.S)
_DROP_COLUMN = re.compile(
    rf"^drop\s+(?:column\s+)?(?!if\s)({_NAME})(?:\s+(?:restrict|cascade))?$", re.I
)
_RENAME_COLUMN = re.compile(rf"^rename\s+column\s+({_NAME})\s+to\s+({_NAME})$", re.I)
_CHANGE = re.compile(rf"^change\s+(?:column\s+)?(?!if\s)({_NAME})\s+({_NAME})\s+(.+)$", re.I | re.S)
_MODIFY = re.compile(rf"^modify\s+(?:column\s+)?(?!if\s)({_NAME})\s+(.+)$", re.I | re.S)
_KEY_COLUMNS = re.compile(r"\((.*)\)", re.S)
_KEY_PART = re.compile(rf"^({_NAME})\s*(?:\(\s*\d+\s*\))?(?:\s+(?:asc|desc))?$", re.I)
_IF = re.compile(r"^(?:add|drop|change|modify)\s+(?:column\s+)?if\s", re.I)
_IN_DEFINITION = re.compile(r"\bkey\b", re.I)


def _name(written: str) -> str:
    return written[1:-1].replace("``", "`") if written.startswith("`") else written


def _place(definition: str) -> str | None:
    found = _PLACE.search(definition)
    if found is None:
        return None
    return "" if found.group(1).lower() == "first" else _name(found.group(2))


def _clause_ops(clause: str) -> list[ColumnOp] | None:
    """The clause's :class:`ColumnOp` (none for one that keeps every column and the key);
    None for one not understood (``IF [NOT] EXISTS`` included: whether it did anything
    is not in the log)."""
    if _PRIMARY.match(clause):
        if clause.lower().startswith("drop"):
            return [ColumnOp("key")]
        inside = _KEY_COLUMNS.search(clause)
        parts = [] if inside is None else clauses(inside.group(1))
        names = [_KEY_PART.match(p) for p in parts]
        if not names or any(n is None for n in names):
            return None
        return [ColumnOp("key", keys=tuple(_name(n.group(1)) for n in names if n is not None))]
    if _KEEPS.match(clause):
        return []
    if _IF.match(clause):
        return None
    many = _ADD_MANY.match(clause)
    if many is not None:
        ops = []
        for part in clauses(many.group(1)):
            one = re.match(rf"^({_NAME})\s+(.+)$", part, re.S)
            if one is None or _PLACE.search(part):
                return None
            keyed = bool(_IN_DEFINITION.search(one.group(2)))
            ops.append(ColumnOp("add", _name(one.group(1)), keyed=keyed))
        return ops
    if (found := _ADD.match(clause)) is not None:
        definition = found.group(2)
        keyed = bool(_IN_DEFINITION.search(definition))
        return [ColumnOp("add", _name(found.group(1)), place=_place(definition), keyed=keyed)]
    if (found := _DROP_COLUMN.match(clause)) is not None:
        return [ColumnOp("drop", _name(found.group(1)))]
    if (found := _RENAME_COLUMN.match(clause)) is not None:
        return [ColumnOp("rename", _name(found.group(1)), _name(found.group(2)))]
    if (found := _CHANGE.match(clause)) is not None:
        old, new, definition = _name(found.group(1)), _name(found.group(2)), found.group(3)
    elif (found := _MODIFY.match(clause)) is not None:
        old, definition = _name(found.group(1)), found.group(2)
        new = old
    else:
        return None
    keyed = bool(_IN_DEFINITION.search(definition))
    return [ColumnOp("change", old, new, place=_place(definition), keyed=keyed)]


def column_ops(text: str) -> list[ColumnOp] | None:
    """What an ``ALTER TABLE`` does to its table's column list and primary key, clause by
    clause in the order written; None when that is not known for certain: another
    statement, a clause not understood, or one column named by two clauses (the server
    does not apply such clauses one after the other as written)."""
    sql = cleaned(text).strip().rstrip(";").strip()
    found = _ALTER.match(sql)
    if found is None or '"' in found.group(2):  # ANSI_QUOTES identifiers: not read here
        return None
    ops: list[ColumnOp] = []
    for clause in clauses(found.group(2)):
        done = _clause_ops(clause)
        if done is None:
            return None
        ops.extend(done)
    named = [n.lower() for op in ops for n in {op.name, op.new, op.place or ""} if n]
    if len(named) != len(set(named)):
        return None
    if sum(op.kind == "key" for op in ops) > 2:
        return None
    return ops


__all__ = ["ColumnOp", "altered", "clauses", "cleaned", "column_ops"]
