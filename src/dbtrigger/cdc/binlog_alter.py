"""Does an ``ALTER TABLE`` change the column list a reader names a table map's values by?

Without column names in the binary log (``binlog_row_metadata`` not FULL) a table
map's values are named by position from ``information_schema``; a statement
between the table map and that reading that adds, drops, renames, moves or
retypes a column makes the names (or the reading of the values) wrong. Most
``ALTER TABLE`` statements do none of that: indexes, constraints, table options,
a column's default, partitions, a rebuild. Those must not stop delivery.

Each clause (the statement's top-level comma-separated parts) is checked against
the clauses known to leave every column as it was; anything else, a clause this
module does not know included, counts as a change (a stop is an outage, a wrong
name is wrong data). ``MODIFY`` and ``CHANGE`` count even without a new name or
place: they may change the column's type, and the reading of a value whose type
the log does not tell (UUID, INET6, binary strings) comes from the catalog; the
type before is not in the statement.
"""

from __future__ import annotations

import re

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
#: Clauses that leave every column's name, place and type as they were.
_KEEPS = re.compile(
    r"^(?:"
    r"add\s+(?:constraint|unique|index|key|fulltext|spatial|primary\s+key|foreign\s+key|check)\b"
    r"|drop\s+(?:index|key|primary\s+key|foreign\s+key|constraint|check)\b"
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


__all__ = ["altered", "clauses", "cleaned"]
