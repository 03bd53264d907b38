"""What a read-only query may do: read the project's tables, and nothing else.

`gpu-trace sql`, :meth:`Store.sql <gpu_trace.store.client.Store.sql>` and the dashboard's queries
go through :func:`check`. The decision is ClickHouse's own parse, never a text pattern on the
query:

1. ``formatQuerySingleLine`` parses the text (one statement; a second one, or a syntax error, is
   the parser's message) and gives it back canonical: no comments, every name that needs quoting
   in backquotes. That canonical text is what is checked and what runs.
2. A name holding a control character is refused (in the canonical text it is an escape inside
   a backquoted name): ``EXPLAIN AST`` prints names raw, one node a line, so a newline in an alias
   could fake nodes. So is a ``{name:Identifier}`` parameter, whose value would become a name.
3. ``EXPLAIN AST`` of the canonical text is walked node by node against allow-lists: statement
   kinds (``SELECT``, ``SHOW TABLES``, ``DESCRIBE``, ``EXISTS``, ``EXPLAIN`` of those), node kinds,
   functions (:data:`FUNCTIONS` and the families in :data:`FUNCTION_PREFIXES`; anything unknown is
   refused, so ``file``, ``url``, ``s3``, ``remote``, ``executable``, ``dictGet``... are), tables
   (the store's database, a bare name, or a system table of :data:`SYSTEM_TABLES`). ``INTO
   OUTFILE``, ``SETTINGS`` and table functions are refused by where they sit in the tree.

The store runs what passes with ``readonly=1`` as a second layer. :class:`QueryRefused` carries one
line saying what was refused.

How much a read may take is :class:`Limits`: rows and bytes of its result, seconds, the engine's
memory. Each goes to the engine as a standard setting (:meth:`Limits.settings`: ``limit``, which
caps the top-level result only, ``max_result_bytes``, ``max_execution_time``,
``max_memory_usage``), and the store checks the rows, bytes (:func:`column_bytes`) and time of each
block it reads as well: embedded chDB leaves ``max_result_rows`` and ``max_result_bytes`` unapplied
to some plans (``SELECT arrayJoin(range(100000000))`` is one block of 10^8 rows that neither
stops), and one block is checked by the clock only when it is done.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "QueryRefused",
    "Checked",
    "check",
    "Limits",
    "column_bytes",
    "exceeded",
    "FUNCTIONS",
    "SYSTEM_TABLES",
]


def _words(text: str) -> list[str]:
    """A word list (function names read better unquoted, many to a line)."""
    return text.split()


#: System tables a query may read: harmless metadata of the store (names, columns, parts) and
#: the one-row ``one``. Others can show other users' queries and settings (``users``,
#: ``processes``, ``query_log``...) or never end (``numbers``).
SYSTEM_TABLES = frozenset({"one", "tables", "columns", "databases", "parts", "functions"})

#: Databases whose tables are reached only through :data:`SYSTEM_TABLES`, whatever the store lists.
_FOREIGN_DATABASES = frozenset({"system", "information_schema", "INFORMATION_SCHEMA"})

#: Root statement kinds (as ``EXPLAIN AST`` names them).
_STATEMENTS = frozenset(
    {"SelectWithUnionQuery", "ShowTables", "DescribeQuery", "ExistsTableQuery", "Explain"}
)

#: Every node kind a read may hold.
_KINDS = _STATEMENTS | frozenset(
    {
        "SelectIntersectExceptQuery",
        "SelectQuery",
        "ExpressionList",
        "Identifier",
        "TableIdentifier",
        "Literal",
        "Function",
        "Asterisk",
        "QualifiedAsterisk",
        "ColumnsRegexpMatcher",
        "ColumnsListMatcher",
        "QualifiedColumnsRegexpMatcher",
        "QualifiedColumnsListMatcher",
        "ColumnsTransformerList",
        "ColumnsExceptTransformer",
        "ColumnsReplaceTransformer",
        "ColumnsReplaceTransformerReplacement",
        "Subquery",
        "WithElement",
        "TablesInSelectQuery",
        "TablesInSelectQueryElement",
        "TableExpression",
        "TableJoin",
        "ArrayJoin",
        "OrderByElement",
        "InterpolateElement",
        "WindowDefinition",
        "WindowListElement",
        "SampleRatio",
        "QueryParameter",
    }
)

#: Functions allowed by exact name (compared lowercased): operators as ClickHouse names them,
#: arithmetic, strings, conditionals, dates, hashes, aggregates and window functions.
FUNCTIONS = frozenset(
    name.lower()
    for name in _words(
        """
    plus minus multiply divide intDiv intDivOrZero modulo moduloOrZero negate abs sign
    equals notEquals less greater lessOrEquals greaterOrEquals and or not xor
    like notLike ilike notILike match in notIn globalIn globalNotIn nullIn notNullIn
    isNull isNotNull isNotDistinctFrom coalesce ifNull nullIf assumeNotNull if multiIf
    CAST _CAST accurateCast accurateCastOrNull accurateCastOrDefault reinterpret
    arrayElement tupleElement array tuple map lambda exists range indexOf countEqual has hasAny
    hasAll hasToken hasSubsequence empty notEmpty length lengthUTF8 lower upper lowerUTF8
    upperUTF8 concat concatWithSeparator substring substringUTF8 left right leftPad rightPad
    trim trimLeft trimRight trimBoth reverse repeat position positionCaseInsensitive locate
    startsWith endsWith splitByChar splitByString splitByRegexp splitByWhitespace
    splitByNonAlpha replaceOne replaceAll replaceRegexpOne replaceRegexpAll regexpExtract
    extract extractAll extractGroups initcap format formatRow
    round roundBankers roundDown floor ceil ceiling trunc truncate sqrt cbrt exp exp2 exp10 log
    ln log2 log10 log1p pow power sin cos tan asin acos atan atan2 sinh cosh tanh pi e nan inf
    greatest least gcd lcm bitAnd bitOr bitXor bitNot bitShiftLeft bitShiftRight bitCount
    hex unhex bin unbin base64Encode base64Decode tryBase64Decode cityHash64 sipHash64
    sipHash128 xxHash32 xxHash64 murmurHash2_64 murmurHash3_64 farmHash64 halfMD5 MD5 SHA1
    SHA256 rand rand32 rand64 randCanonical generateUUIDv4 now now64 today yesterday
    dateDiff date_diff dateName dateTrunc date_trunc formatDateTime formatDateTimeInJodaSyntax
    timeSlot timeSlots timezone timeZone timezoneOf age makeDate makeDateTime makeDateTime64
    formatReadableSize formatReadableDecimalSize formatReadableQuantity
    formatReadableTimeDelta bar ignore identity materialize currentDatabase version
    runningDifference runningDifferenceStartingWithFirstValue neighbor
    row_number rank dense_rank percent_rank cume_dist ntile lagInFrame leadInFrame lag lead
    first_value last_value nth_value
    count sum sumWithOverflow sumKahan avg avgWeighted min max any anyLast anyHeavy
    argMin argMax topK topKWeighted histogram corr entropy skewPop skewSamp kurtPop kurtSamp
    sumMap minMap maxMap deltaSum simpleLinearRegression sparkbar singleValueOrNull
    """
    )
)

#: Function families allowed by their (lowercased) prefix: conversions, arrays, maps, tuples,
#: dates, JSON in strings, quantiles and the like. None of them reads a file, a URL or a table.
FUNCTION_PREFIXES = tuple(
    p.lower()
    for p in _words(
        """
    to array map tuple quantile median uniq groupArray groupUniqArray groupBit stddev var covar
    JSON simpleJSON visitParam is fromUnixTimestamp parseDateTime add subtract date multiSearch
    multiMatch bitmap toStartOf
    """
    )
)

#: Names a prefix would let through that read tables, files or other hosts, or stall the engine.
_DENIED = frozenset(
    n.lower()
    for n in _words(
        """
    hasColumnInTable addressToLine addressToLineWithInlines addressToSymbol joinGet
    joinGetOrNull dictGet dictHas sleep sleepEachRow
    """
    )
)

#: Aggregate combinators (``countIf``, ``sumArray``, ``uniqMerge``...): the base must be allowed.
_COMBINATORS = (
    "simplestate",
    "ordefault",
    "resample",
    "distinct",
    "foreach",
    "ornull",
    "argmin",
    "argmax",
    "array",
    "state",
    "merge",
    "map",
    "if",
)

#: ``IN`` and its kin: a name on the right is a table.
_IN_FUNCTIONS = frozenset(
    {"in", "notin", "globalin", "globalnotin", "nullin", "notnullin", "globalnullin"}
)

_LINE = re.compile(r"^( *)([A-Za-z_]+)(?: (.*?))?(?: \(alias (.*)\))?(?: \(children (\d+)\))?$")


class QueryRefused(ValueError):
    """A query that is not a plain read of the store's tables; the message says what, in one line."""


@dataclass
class Node:
    kind: str
    text: str  # what follows the kind: a function's or a table's name, a literal
    alias: str
    depth: int
    children: list[Node] = field(default_factory=list)
    parent: Node | None = None


@dataclass(frozen=True)
class Checked:
    """A query that passed: ``text`` is the canonical statement to run, ``statement`` its kind
    as ``EXPLAIN AST`` names it (``SelectWithUnionQuery`` for a ``SELECT``)."""

    text: str
    statement: str = "SelectWithUnionQuery"


@dataclass(frozen=True)
class Limits:
    """How much one read may take; 0 is no limit (the default for each).

    ``max_rows`` and ``max_bytes`` bound its result (bytes as :func:`column_bytes` counts them),
    ``timeout_s`` its time, ``max_memory`` what the engine may allocate for it.
    """

    max_rows: int = 0
    max_bytes: int = 0
    timeout_s: float = 0.0
    max_memory: int = 0

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_bytes", "timeout_s", "max_memory"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (no limit) or more, got {getattr(self, name)}")

    def settings(self) -> dict[str, int | float | str]:
        """The limits as standard ClickHouse settings (chDB and a server read the same)."""
        out: dict[str, int | float | str] = {}
        if self.max_rows:
            # One row more than allowed: its arrival is how the reader knows there were more.
            # `limit` caps the top-level result only (subqueries and UNION branches are whole).
            out["limit"] = self.max_rows + 1
        if self.max_bytes:
            out["max_result_bytes"] = self.max_bytes
            out["result_overflow_mode"] = "throw"
        if self.timeout_s:
            out["max_execution_time"] = self.timeout_s
            out["timeout_overflow_mode"] = "throw"
        if self.max_memory:
            out["max_memory_usage"] = self.max_memory
        return out


def exceeded(message: str, limits: Limits) -> str | None:
    """Which of ``limits`` the engine's error ``message`` says was hit ("rows", "bytes", "time",
    "memory"), or None for another error (or a limit that was not set)."""
    if "(TIMEOUT_EXCEEDED)" in message and limits.timeout_s:
        return "time"
    if "(TOO_MANY_ROWS_OR_BYTES)" in message:
        if "max bytes" in message and limits.max_bytes:
            return "bytes"
        if "max rows" in message and limits.max_rows:
            return "rows"
    if "(MEMORY_LIMIT_EXCEEDED)" in message and limits.max_memory:
        return "memory"
    return None


def column_bytes(column: Sequence[object]) -> int:
    """About how many bytes a result column (a block's values of one column) takes, counted as
    ClickHouse sizes them: a number's width, a string's length, a container's contents."""
    itemsize = getattr(column, "itemsize", None)  # array.array: numbers, packed
    if isinstance(itemsize, int):
        return len(column) * itemsize
    nbytes = getattr(column, "nbytes", None)  # a numpy array
    if isinstance(nbytes, int):
        return nbytes
    return sum(map(_value_bytes, column))


def _value_bytes(value: object) -> int:
    if isinstance(value, (str, bytes, bytearray)):
        return len(value) + 1
    if value is None or isinstance(value, (bool, int, float)):
        return 8
    if isinstance(value, dict):
        return 8 + sum(_value_bytes(k) + _value_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 8 + sum(map(_value_bytes, value))
    return 16  # dates, UUIDs, decimals, addresses


def allowed_function(name: str) -> bool:
    """True if ``name`` is an allowed function, directly, by family, or as a base + combinator."""
    low = name.lower()
    if low in _DENIED:
        return False
    if low in FUNCTIONS or low.startswith(FUNCTION_PREFIXES):
        return True
    for suffix in _COMBINATORS:
        if low.endswith(suffix) and len(low) > len(suffix):
            return allowed_function(name[: -len(suffix)])
    return False


def check(
    query: str,
    parameters: dict[str, Any] | None,
    ask: Callable[[str, dict[str, Any]], list[tuple[Any, ...]]],
    *,
    database: str,
    databases: Iterable[str] = (),
) -> Checked:
    """Decide whether ``query`` is a read of ``database``; raise :class:`QueryRefused` if not.

    ``ask(sql, parameters)`` runs one of this module's own queries on the store and returns its
    rows (``formatQuerySingleLine`` and ``EXPLAIN AST``). ``databases`` are the other databases
    the store has: their tables are refused, and so are aliases that would shadow them.
    """
    params = dict(parameters or {})
    if not query.strip():
        raise QueryRefused("the query is empty")
    try:
        (row,) = ask("SELECT formatQuerySingleLine({q:String})", {"q": query})
    except QueryRefused:
        raise
    except Exception as exc:
        raise QueryRefused(f"not one valid statement: {_reason(exc)}") from None
    text = str(row[0])
    _check_names(text)
    try:
        rows = ask("EXPLAIN AST " + text, params)
    except Exception as exc:
        raise QueryRefused(f"cannot parse the query: {_reason(exc)}") from None
    root = _tree([str(r[0]) for r in rows])
    foreign = (_FOREIGN_DATABASES | set(databases)) - {database}
    _Walk(database, foreign).statement(root)
    return Checked(text, root.kind)


# ---- the canonical text's names ---------------------------------------------------------------


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _check_names(text: str) -> None:
    """Refuse a quoted name that ClickHouse had to escape (a control character or a backslash).

    The canonical text holds no raw control characters: string literals and quoted names are
    escaped. A backslash inside a backquoted name is such an escape. A ``{name:Identifier}``
    parameter is refused too: its value would become a name after this check.
    """
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "'":
            i += 1
            while i < n and text[i] != "'":
                i += 2 if text[i] == "\\" else 1
        elif c == "`":
            end = i + 1
            while end < n and text[end] != "`":
                if text[end] == "\\":
                    raise QueryRefused("names may not hold control characters or backslashes")
                end += 1
            i = end
        elif c == "{":
            end = text.find("}", i)
            if end > 0 and text[i:end].replace(" ", "").lower().endswith(":identifier"):
                raise QueryRefused(
                    "{name:Identifier} parameters are not allowed: name tables in the query"
                )
        i += 1
    if _has_control(text):
        raise QueryRefused("names may not hold control characters")


# ---- the tree --------------------------------------------------------------------------------


def _tree(lines: list[str]) -> Node:
    root: Node | None = None
    stack: list[Node] = []
    for line in lines:
        m = _LINE.match(line)
        if not m or m.group(2) not in _KINDS:
            what = m.group(2) if m else line.strip()[:40]
            raise QueryRefused(f"{_describe(what)} is not allowed in a read-only query")
        indent, kind, text, alias, _ = m.groups()
        node = Node(kind, (text or "").strip(), alias or "", len(indent))
        while stack and stack[-1].depth >= node.depth:
            stack.pop()
        if stack:
            node.parent = stack[-1]
            stack[-1].children.append(node)
        elif root is None and node.depth == 0:
            root = node
        else:
            raise QueryRefused("the query's parse is not one statement")
        stack.append(node)
    if root is None:
        raise QueryRefused("the query is empty")
    return root


def _describe(kind: str) -> str:
    names = {
        "Set": "SETTINGS",
        "InsertQuery": "INSERT",
        "DropQuery": "DROP",
        "AlterQuery": "ALTER",
        "CreateQuery": "CREATE",
        "SetQuery": "SET",
        "SystemQuery": "SYSTEM",
        "ShowProcesslistQuery": "SHOW PROCESSLIST",
        "ShowCreateTableQuery": "SHOW CREATE",
        "KillQueryQuery": "KILL",
        "OptimizeQuery": "OPTIMIZE",
        "RenameQuery": "RENAME",
        "UseQuery": "USE",
        "GrantQuery": "GRANT",
    }
    if kind in names:
        return names[kind]
    if kind.endswith("Query"):
        return kind[: -len("Query")].upper() or kind
    return kind


class _Walk:
    def __init__(self, database: str, foreign: Set[str]) -> None:
        self.database = database
        self.foreign = foreign
        self.foreign_lower = {d.lower() for d in foreign}

    def statement(self, root: Node) -> None:
        if root.kind not in _STATEMENTS:
            raise QueryRefused(f"{_describe(root.kind)} is not allowed in a read-only query")
        if root.kind == "Explain":
            inner = [c for c in root.children if c.kind != "Identifier"]
            if not inner or any(c.kind not in ("SelectWithUnionQuery",) for c in inner):
                raise QueryRefused("EXPLAIN takes a SELECT and no settings")
        self.node(root)

    def node(self, node: Node) -> None:
        if node.alias and node.alias.lower() in self.foreign_lower:
            raise QueryRefused(f"the alias {node.alias} names a database")
        parent = node.parent
        if parent is not None and parent.kind == "SelectWithUnionQuery" and parent.parent is None:
            if node.kind == "Literal":
                raise QueryRefused("INTO OUTFILE is not allowed: gpu-trace sql only reads")
            if node.kind == "Identifier" and node.text != "Native":  # the client's own FORMAT
                raise QueryRefused("FORMAT is not allowed: the rows come back as a table or JSON")
        if node.kind == "Literal" and parent is not None and parent.kind == "SelectWithUnionQuery":
            raise QueryRefused("INTO OUTFILE is not allowed: gpu-trace sql only reads")
        if node.kind == "Function":
            name = node.text
            if parent is not None and parent.kind == "TableExpression":
                raise QueryRefused(
                    f"table function {name}() is not allowed: read the tables of {self.database}"
                )
            if not allowed_function(name):
                raise QueryRefused(f"function {name}() is not allowed in a read-only query")
            if name.lower() in _IN_FUNCTIONS and node.children:
                args = node.children[0].children
                if len(args) == 2 and args[1].kind == "Identifier":
                    self.table(args[1].text)
        elif node.kind == "TableIdentifier":
            self.table(node.text)
        elif node.kind == "Identifier":
            parts = node.text.split(".")
            if len(parts) >= 2 and parts[0] in self.foreign:
                self.table(".".join(parts[:2]))
        elif node.kind == "QueryParameter" and node.text.lower().endswith(":identifier"):
            raise QueryRefused("{name:Identifier} parameters are not allowed: name tables in SQL")
        for child in node.children:
            self.node(child)

    def table(self, name: str) -> None:
        parts = name.split(".")
        if len(parts) == 1:
            return  # a table of the default database (the store's), or a WITH name
        if len(parts) == 2:
            db, table = parts
            if db == self.database:
                return
            if db == "system" and table in SYSTEM_TABLES:
                return
        raise QueryRefused(
            f"table {name} is not allowed: read the tables of {self.database}"
            f" (and system.{', system.'.join(sorted(SYSTEM_TABLES))})"
        )


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    for marker in ("e.what() = ", "DB::Exception: "):
        if marker in text:
            text = text.rsplit(marker, 1)[-1]
    text = text.splitlines()[0] if text else type(exc).__name__
    if "Multi-statements" in text:
        return "it holds more than one statement (run one at a time)"
    text = text.split(": In scope", 1)[0].rstrip(" .:")
    return re.sub(r"\s*\((SYNTAX_ERROR|[A-Z_]+)\)\s*$", "", text)[:300]
