"""Keep credentials out of every text dbtrigger emits: logs, state, quarantine, CLI.

The lowest layer of the package (it imports nothing of dbtrigger), so sources,
stores, the output binding, the queue, the runtime and the CLI can all use it.
Two mechanisms, and the database URL as it may be shown:

* **Known secrets.** Whatever secret is met while parsing configuration (a URL
  password, an account key, a SAS token; every credential of a database URL,
  :func:`url_secrets`, also URL-encoded) is registered with
  :func:`remember_secret` and removed, verbatim, wherever it appears later.
* **Database URLs** (:func:`safe_url_text`): without the password, without
  query options whose name looks like a secret, and with the credential fields
  of an option that holds a connection string masked (``PWD=`` inside
  ``mssql+pyodbc:///?odbc_connect=...``), so a banner, ``describe()`` or an
  error can name the database it means.
* **Credential-shaped text.** Patterns catch what was never registered: a
  handler's exception text quoting a connection string, a driver error echoing a
  URL, a request line with a SAS signature. Covered: ``name=value`` /
  ``name: value`` / ``"name": "value"`` for names such as ``password``,
  ``api_key``, ``access_token``, ``client_secret``, ``sig``; storage connection
  string fields (``AccountKey``, ``SharedAccessSignature``); passwords in URLs
  (``scheme://user:password@host``); ``Bearer``/``Basic`` authorisation values
  and JWTs.

Where it is applied: :func:`redact` by the CLI on every line it prints and by
the failure record and the quarantine on the error text they store;
:class:`RedactingFilter` on every dbtrigger logger (installed by
:func:`protect_loggers` when the package is imported) and, by the CLI, on its
log handlers, so third-party debug logs (urllib3 prints request URLs, SAS
signatures included) are masked too. Library users who log urllib3 or
azure-core at DEBUG themselves can add :class:`RedactingFilter` to their
handlers.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING
from urllib.parse import quote, quote_plus, unquote

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

MASK = "***"

_SECRETS: set[str] = set()
_LOCK = threading.Lock()

# Names whose value is a credential. "Strong" names are credentials whatever
# they are prefixed with (``db_password``, ``STRIPE_API_KEY``); "weak" ones only
# as they stand (``token`` yes, ``fencing_token`` - a plain number - no).
_STRONG = (
    r"(?:pass(?:word|wd|phrase)|pwd|secret|api[_-]?key|access[_-]?key|private[_-]?key"
    r"|account_?key|client_?secret|credentials?|shared_?access_?(?:signature|key))"
)
_WEAK = (
    r"(?:(?:access|refresh|id|auth|session|bearer|api)[_-]?token|token|sig|signature"
    r"|code|key|pass)"
)
_NAME = rf"(?:[A-Za-z0-9_-]*?{_STRONG}[A-Za-z0-9_]*|{_WEAK})"
# Values already masked (by us, or azure-core's "REDACTED") are left as they are.
_NOT_MASKED = rf"(?!{re.escape(MASK)}|REDACTED\b)"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # A SAS in a connection string: the whole value, up to the next field.
    (re.compile(r"(?i)\b(SharedAccessSignature)\s*=\s*[^;\s'\"]+"), rf"\1={MASK}"),
    # Authorisation schemes: the credential after the scheme name.
    (re.compile(r"(?i)\b(Bearer|Basic|SharedKey)\s+[A-Za-z0-9._~+/=:-]+"), rf"\1 {MASK}"),
    # name=value anywhere (query strings, connection strings, kwargs reprs):
    # any word followed by "=", kept only if the word names a credential (see
    # _credential_value); matching words first and checking them after is
    # what keeps this cheap on every log line.
    # A value may be braced, as in ODBC connection strings: PWD={a;b}}c}.
    (
        re.compile(
            rf"(?<![A-Za-z0-9_-])([A-Za-z0-9_-]+)\s*=\s*{_NOT_MASKED}"
            r"(\{(?:\}\}|[^}])*\}|[^;&,\s'\"]+)"
        ),
        "=",
    ),
    # The same, URL-encoded (a connection string inside a URL: ?odbc_connect=...PWD%3D...).
    (
        re.compile(
            r"(?i)(?:(?<=%3B)|(?<=%26)|(?<![A-Za-z0-9_%-]))([A-Za-z0-9_-]+)%3D(?!\*\*\*)"
            r"(%7B(?:%7D%7D|(?!%7D)[^\s'\"])*%7D|(?:(?!%3B|%26)[^&\s'\"])+)"
        ),
        "%3D",
    ),
    # JSON / dict reprs: "api_key": "value" or 'password': 'value'.
    (
        re.compile(rf"(?i)([\"']{_NAME}[\"']\s*:\s*)([\"'])(?:\\.|(?!\2).)*\2"),
        rf"\1\2{MASK}\2",
    ),
    # Header / YAML style: "password: value", "x-api-key: value".
    (
        re.compile(
            rf"(?<![A-Za-z0-9_\"'-])([A-Za-z0-9_-]+)(\s*:\s+){_NOT_MASKED}"
            r"(?!(?:Bearer|Basic|SharedKey)\b)([^\s,;'\"]+)"
        ),
        ":",
    ),
    # Passwords in URLs: scheme://user:password@host (the password may contain @).
    (
        re.compile(
            r"([A-Za-z][A-Za-z0-9+.-]*://[^:/@\s'\"]*):[^\s'\"]*@(?=[^@\s'\"/]*(?:[/?#\s'\"]|$))"
        ),
        rf"\1:{MASK}@",
    ),
    # JSON web tokens, wherever they appear.
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"), MASK),
)


#: Substrings (lower case) without which each of _PATTERNS cannot match.
_NEEDLES: tuple[tuple[str, ...], ...] = (
    ("sharedaccesssignature",),
    ("bearer", "basic", "sharedkey"),
    ("=",),
    ("%3d",),
    ("'", '"'),
    (":",),
    ("://",),
    ("eyj",),
)

_CREDENTIAL_NAME = re.compile(rf"(?i){_NAME}|authorization")

# A value that is a call (``event.dedup_key()``, ``vault.read("db")``) is a line of
# code - a traceback quotes the handler's source - not a credential: the README's
# handler once logged as ``key=***``. No secret format (base64, hex, SAS, URL-encoded
# text) is a dotted name followed by ``(``; a registered secret is masked regardless.
_CODE_CALL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\(")


def _credential_value(separator: str) -> Callable[[re.Match[str]], str]:
    """Replacement for the ``name=value`` / ``name: value`` patterns."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if not _CREDENTIAL_NAME.fullmatch(name):
            return match.group(0)
        if separator == "=" and _CODE_CALL.match(match.group(2)):
            return match.group(0)  # code, not a value: a traceback's `key=event.dedup_key()`
        if separator in ("=", "%3D"):
            return f"{name}{separator}{MASK}"
        return f"{name}{match.group(2)}{MASK}"

    return replace


_REPLACERS: dict[str, Callable[[re.Match[str]], str]] = {
    "=": _credential_value("="),
    "%3D": _credential_value("%3D"),
    ":": _credential_value(":"),
}


def remember_secret(value: str | None) -> None:
    """Have :func:`redact` remove this exact value wherever it appears."""
    if value and len(value) >= 4:
        with _LOCK:
            _SECRETS.add(value)


def remember_connection_string(value: str) -> None:
    """Register the secret fields of a storage connection string (a SAS's signature
    alone too, as written and decoded: a request line quotes only that)."""
    for part in value.split(";"):
        key, _, secret = part.partition("=")
        if key.strip().lower() in ("accountkey", "sharedaccesssignature", "sharedaccesskey"):
            remember_secret(secret.strip())
            for name, _, signature in (p.partition("=") for p in secret.split("&")):
                if name.strip().lower() == "sig":
                    remember_secret(signature.strip())
                    remember_secret(unquote(signature.strip()))


#: URL query options whose name contains one of these are dropped from a shown URL,
#: and so are the fields so named inside an option that is a connection string.
SECRET_QUERY_KEYS = ("pass", "pwd", "secret", "token", "key", "credential", "sig")


def is_secret_option(name: str) -> bool:
    """True for a URL option or connection-string field whose value is a credential."""
    lowered = name.strip().lower()
    return any(s in lowered for s in SECRET_QUERY_KEYS)


def _connection_fields(text: str) -> list[tuple[str, str, str]]:
    """``KEY=value;KEY={va;lue}`` as ``(key, raw field, value)``; ``}}`` escapes ``}``.

    The ODBC grammar (``mssql+pyodbc:///?odbc_connect=...``). A field without
    ``=`` is kept whole with an empty key.
    """
    fields: list[tuple[str, str, str]] = []
    i, n = 0, len(text)
    while i < n:
        eq, semi = text.find("=", i), text.find(";", i)
        if eq < 0 or (0 <= semi < eq):
            end = n if semi < 0 else semi
            fields.append(("", text[i:end], ""))
            i = end + 1
            continue
        j = eq + 1
        while j < n and text[j] == " ":
            j += 1
        if j < n and text[j] == "{":
            k, chars = j + 1, []
            while k < n:
                if text[k] == "}":
                    if text[k + 1 : k + 2] == "}":
                        chars.append("}")
                        k += 2
                        continue
                    k += 1
                    break
                chars.append(text[k])
                k += 1
            value = "".join(chars)
            end = text.find(";", k)
        else:
            end = text.find(";", j)
            value = text[j : n if end < 0 else end].strip()
        end = n if end < 0 else end
        fields.append((text[i:eq].strip(), text[i:end], value))
        i = end + 1
    return fields


def without_secret_fields(value: str, replacement: str | None = MASK) -> tuple[str, list[str]]:
    """An option's value with the credential fields of a connection string it holds
    (``PWD=...`` in ``odbc_connect``) masked (or, with ``replacement=None``,
    removed), and the secret values found; any other value as it is."""
    if "=" not in value:
        return value, []
    fields = _connection_fields(value)
    if not any(key and is_secret_option(key) for key, _, _ in fields):
        return value, []
    kept: list[str] = []
    secrets: list[str] = []
    for key, raw, field_value in fields:
        if key and is_secret_option(key):
            secrets += [field_value, raw.partition("=")[2].strip()]
            if replacement is not None:
                kept.append(f"{key}={replacement}")
        else:
            kept.append(raw)
    return ";".join(kept), secrets


def url_secrets(url: URL) -> list[str]:
    """Every credential in a database URL: the password, options named like one,
    and credential fields of an option holding a connection string (``odbc_connect``)."""
    found: list[str] = [url.password] if isinstance(url.password, str) else []
    for name, values in url.query.items():
        for value in (values,) if isinstance(values, str) else values:
            if is_secret_option(name):
                found.append(value)
            else:
                found += without_secret_fields(value)[1]
    return [s for s in found if s]


def remember_url_secrets(url: URL) -> None:
    """Register every credential of a database URL (see :func:`url_secrets`), also
    as it appears URL-encoded, so that a driver error or a repr echoing it is masked.

    A password that is part of what the URL shows anyway (``postgres:postgres@``,
    a password equal to the user or the database name) is not registered: masking
    it would garble every line naming the user, the host or the dialect, and it
    hides nothing the shown URL does not already say.
    """
    shown = safe_url_text(url).lower()
    for secret in url_secrets(url):
        if secret.lower() in shown:
            continue
        for form in {secret, quote(secret, safe=""), quote_plus(secret)}:
            remember_secret(form)


def redact_url(url: URL) -> URL:
    """The URL without password, without query options that look like secrets, and
    with the credential fields of a connection string option (``odbc_connect``) masked."""
    query: dict[str, str | tuple[str, ...]] = {}
    for name, values in url.query.items():
        if is_secret_option(name):
            continue
        if isinstance(values, str):
            query[name] = without_secret_fields(values)[0]
        else:
            query[name] = tuple(without_secret_fields(v)[0] for v in values)
    return url.set(password=None, query=query)


def safe_url_text(url: URL) -> str:
    """:func:`redact_url` as text: what a banner, ``describe()`` or an error may show."""
    return redact_url(url).render_as_string(hide_password=True)


def redact(text: str, extra: Iterable[str] = ()) -> str:
    """``text`` with every known secret and credential-looking field masked."""
    with _LOCK:
        secrets = sorted({*_SECRETS, *(s for s in extra if s and len(s) >= 4)}, key=len)
    # The credential-looking fields first: a known secret that is also part of a field's
    # name (a password "secret", then "client_secret=...") masked first would leave the
    # field unrecognisable and its value shown.
    lowered = text.lower()
    for (pattern, replacement), needles in zip(_PATTERNS, _NEEDLES, strict=True):
        # Most log lines hold none of a pattern's needles: skip its scan.
        if any(needle in lowered for needle in needles):
            text = pattern.sub(_REPLACERS.get(replacement, replacement), text)
    for secret in reversed(secrets):  # longest first, so a prefix cannot leave a tail
        text = text.replace(secret, MASK)
    return text


# --- logging ------------------------------------------------------------------------

#: Attributes every LogRecord has; anything else came in through ``extra=``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("n", logging.INFO, "p", 1, "m", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


class RedactingFilter(logging.Filter):
    """Masks credentials in a record's message, exception text and ``extra`` strings.

    The message is formatted once here (``msg % args``) and the record carries
    the redacted result, so every handler downstream sees the masked text.
    Never drops a record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format is the handler's to report
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        for name, value in list(vars(record).items()):
            if name not in _RECORD_ATTRS and isinstance(value, str):
                setattr(record, name, redact(value))
        return True


_FILTER = RedactingFilter()

#: Every logger the package logs through. A test checks that no other
#: ``dbtrigger*`` logger exists, so a new one cannot slip past the filter.
LOGGER_NAMES = (
    "dbtrigger",
    "dbtrigger.runtime",
    "dbtrigger.runner",
    "dbtrigger.cli",
    "dbtrigger.queue",
    "dbtrigger.checks",
    "dbtrigger.sources",
    "dbtrigger.sources.visibility",
    "dbtrigger.azure",
    "dbtrigger.metrics",
    "dbtrigger.metrics_prometheus",
    "dbtrigger.state.stores.blob",
    "dbtrigger.partitions",
    "dbtrigger.changelog",
    "dbtrigger.output",
    "dbtrigger.cdc",
    "dbtrigger.history",
)


def protect_loggers(names: Iterable[str] = LOGGER_NAMES) -> None:
    """Attach the redacting filter to each named logger (once)."""
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def protect_handlers(handlers: Iterable[logging.Handler]) -> None:
    """Attach the redacting filter to handlers: covers third-party loggers too."""
    for handler in handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)


# Our own loggers are protected as soon as the package is imported: a library
# must not configure handlers, but it may keep its own records clean.
protect_loggers()

__all__ = [
    "LOGGER_NAMES",
    "MASK",
    "SECRET_QUERY_KEYS",
    "RedactingFilter",
    "is_secret_option",
    "protect_handlers",
    "protect_loggers",
    "redact",
    "redact_url",
    "remember_connection_string",
    "remember_secret",
    "remember_url_secrets",
    "safe_url_text",
    "url_secrets",
    "without_secret_fields",
]
