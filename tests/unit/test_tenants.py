"""The tenants file: good files give the tenants they say; every malformed one is refused with its
line and field named; and a client's answer is matched against every tenant's token."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_trace.runtime.protocol import auth
from gpu_trace.runtime.sharing.tenants import (
    Tenant,
    TenantsError,
    check_tenants,
    load_tenants,
    parse_size,
    single_tenant,
)

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789xyz"

GOOD = f"""\
# Two teams and an operator.
[[tenant]]
name = "alice"
token = "{ALICE}"
memory = 0.5
weight = 2
priority = 1
on_quota = "wait"
wait_s = 30
idle_s = 45.5
max_sessions = 3

[[tenant]]
name = "bob"
token_env = "BOB_TOKEN"
memory = "8GiB"

[[tenant]]
name = "ops"
token = "ops-token-0123456789ab"
admin = true
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def test_a_good_file_gives_its_tenants(tmp_path: Path) -> None:
    tenants = load_tenants(_write(tmp_path, GOOD), environ={"BOB_TOKEN": BOB})
    alice, bob, ops = tenants
    assert alice == Tenant(
        name="alice",
        token=ALICE,
        memory_fraction=0.5,
        weight=2.0,
        priority=1,
        on_quota="wait",
        wait_s=30.0,
        idle_s=45.5,
        max_sessions=3,
    )
    assert bob == Tenant(name="bob", token=BOB, memory_bytes=8 << 30)
    assert ops.admin and ops.memory_fraction is None and ops.memory_bytes is None
    assert alice.limit_bytes(16 << 30) == 8 << 30
    assert bob.limit_bytes(16 << 30) == 8 << 30
    assert ops.limit_bytes(16 << 30) is None
    assert check_tenants(tenants) == tenants


def test_token_env_is_read_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BOB_TOKEN", BOB)
    tenants = load_tenants(_write(tmp_path, GOOD))
    assert tenants[1].token == BOB


@pytest.mark.parametrize(
    ("memory", "fields"),
    [
        ("1.0", {"memory_fraction": 1.0}),
        ("0.25", {"memory_fraction": 0.25}),
        ('"50%"', {"memory_fraction": 0.5}),
        ("1073741824", {"memory_bytes": 1 << 30}),
        ('"512MiB"', {"memory_bytes": 512 << 20}),
        ('"16GB"', {"memory_bytes": 16_000_000_000}),
        ('"1.5GiB"', {"memory_bytes": 3 << 29}),
    ],
)
def test_memory_is_a_fraction_or_a_size(tmp_path: Path, memory: str, fields: dict) -> None:
    text = f'[[tenant]]\nname = "a"\ntoken = "{ALICE}"\nmemory = {memory}\n'
    (tenant,) = load_tenants(_write(tmp_path, text))
    assert tenant == Tenant(name="a", token=ALICE, **fields)


@pytest.mark.parametrize(
    ("text", "size"),
    [("8GiB", 8 << 30), ("8gib", 8 << 30), ("8Gi", 8 << 30), ("2k", 2000), ("100", 100)],
)
def test_byte_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "8 parsecs", "-1GiB", "8iB", "1e9"])
def test_bad_byte_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="not a byte size"):
        parse_size(text)


def _tenant(extra: str, name: str = '"bob"', token: str = f'token = "{BOB}"') -> str:
    """The second tenant (line 5) has ``name`` (line 6), ``token`` (7) and ``extra`` (8)."""
    first = f'[[tenant]]\nname = "alice"\ntoken = "{ALICE}"\n\n'
    return f"{first}[[tenant]]\nname = {name}\n{token}\n{extra}\n"


# Each: the file's text, the line and the message expected.
BAD = {
    "memory-above-one": (
        _tenant("memory = 1.5"),
        8,
        'tenant "bob": memory must be a fraction in (0, 1] or a byte size, got 1.5',
    ),
    "memory-zero": (_tenant("memory = 0.0"), 8, "memory must be a fraction in (0, 1]"),
    "memory-negative-int": (_tenant("memory = -5"), 8, "got -5"),
    "memory-int-one": (_tenant("memory = 1"), 8, "less than 1 MiB"),
    "memory-bad-string": (_tenant('memory = "lots"'), 8, 'got "lots"'),
    "memory-percent-over": (_tenant('memory = "150%"'), 8, 'got "150%"'),
    "memory-bool": (_tenant("memory = true"), 8, "got true"),
    "memory-table": (_tenant("memory = {gib = 8}"), 8, "got a dict"),
    "weight-zero": (_tenant("weight = 0"), 8, 'tenant "bob": weight must be a number > 0, got 0'),
    "weight-string": (_tenant('weight = "2"'), 8, 'weight must be a number > 0, got "2"'),
    "weight-nan": (_tenant("weight = nan"), 8, "weight must be a number > 0"),
    "priority-float": (_tenant("priority = 1.5"), 8, "priority must be an integer"),
    "priority-bool": (_tenant("priority = true"), 8, "priority must be an integer"),
    "on-quota": (
        _tenant('on_quota = "queue"'),
        8,
        'on_quota must be one of fail, wait, got "queue"',
    ),
    "wait-negative": (_tenant("wait_s = -1"), 8, "wait_s must be a number of seconds >= 0"),
    "idle-zero": (_tenant("idle_s = 0"), 8, "idle_s must be a number of seconds > 0"),
    "admin-string": (_tenant('admin = "yes"'), 8, 'admin must be true or false, got "yes"'),
    "batch-zero": (_tenant("batch_s = 0"), 8, "batch_s must be a number of seconds > 0"),
    "max-sessions-zero": (_tenant("max_sessions = 0"), 8, "max_sessions must be an integer >= 1"),
    "max-sessions-float": (_tenant("max_sessions = 2.0"), 8, "max_sessions must be an integer"),
    "unknown-key": (_tenant("memroy = 0.5"), 8, "tenant \"bob\": unknown key 'memroy'"),
    "unknown-top-key": (
        f'quota = 3\n[[tenant]]\nname = "a"\ntoken = "{ALICE}"\n',
        1,
        "unknown key 'quota'",
    ),
    "unknown-top-table": (
        f'[[tenant]]\nname = "a"\ntoken = "{ALICE}"\n\n[server]\nport = 1\n',
        5,
        "unknown key 'server'",
    ),
    "no-name": (
        _tenant("", name="", token=f'token = "{BOB}"').replace("name = \n", ""),
        5,
        "tenant #2: name is required",
    ),
    "bad-name": (_tenant("", name='"bob smith"'), 6, "tenant #2: name must be 1-64 letters"),
    "name-not-string": (_tenant("", name="7"), 6, "tenant #2: name must be"),
    "duplicate-name": (
        _tenant("", name='"alice"'),
        6,
        'tenant "alice": name is already used by tenant #1',
    ),
    "no-token": (
        _tenant("weight = 1", token=""),
        5,
        'tenant "bob": give exactly one of token and token_env',
    ),
    "both-tokens": (
        _tenant('token_env = "BOB_TOKEN"'),
        7,
        'tenant "bob": give exactly one of token and token_env',
    ),
    "short-token": (
        _tenant("", token='token = "short"'),
        7,
        "token must be a string of at least 16",
    ),
    "token-not-string": (
        _tenant("", token="token = 12345678901234567890"),
        7,
        "token must be a string",
    ),
    "duplicate-token": (
        _tenant("", token=f'token = "{ALICE}"'),
        7,
        'tenant "bob": token gives the same token as tenant "alice"',
    ),
    "token-env-unset": (
        _tenant("", token='token_env = "NOT_SET_ANYWHERE"'),
        7,
        "token_env names NOT_SET_ANYWHERE, which is not set",
    ),
    "token-env-short": (
        _tenant("", token='token_env = "SHORT_TOKEN"'),
        7,
        "the token in SHORT_TOKEN is shorter than 16 characters",
    ),
    "no-tenants": ("# nobody\n", 1, "no tenants"),
    "empty-array": ("tenant = []\n", 1, "no tenants"),
    "tenant-not-table": ('tenant = "alice"\n', 1, "tenant must be an array of tables"),
    "syntax": (
        f'[[tenant]]\nname = "a"\ntoken = "{ALICE}"\nmemory = 0.5.5\n',
        4,
        "Expected newline",
    ),
    "duplicate-key": (f'[[tenant]]\nname = "a"\nname = "b"\ntoken = "{ALICE}"\n', 3, ""),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_malformed_file_names_its_line_and_field(tmp_path: Path, case: str) -> None:
    text, line, message = BAD[case]
    path = _write(tmp_path, text)
    with pytest.raises(TenantsError) as info:
        load_tenants(path, environ={"BOB_TOKEN": BOB, "SHORT_TOKEN": "short"})
    assert str(info.value).startswith(f"{path}:{line}: "), str(info.value)
    assert message in str(info.value)
    assert info.value.line == line
    for token in (ALICE, BOB):  # errors never show a token
        assert token not in str(info.value)


def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TenantsError, match="cannot read the tenants file"):
        load_tenants(tmp_path / "missing.toml")


def test_check_tenants_refuses_what_a_file_would() -> None:
    a, b = Tenant("a", ALICE), Tenant("b", BOB)
    with pytest.raises(ValueError, match="at least one"):
        check_tenants([])
    with pytest.raises(ValueError, match="names"):
        check_tenants([a, Tenant("a", BOB)])
    with pytest.raises(ValueError, match="tokens"):
        check_tenants([a, Tenant("b", ALICE)])
    with pytest.raises(ValueError, match="16"):
        check_tenants([a, Tenant("b", "short")])
    assert check_tenants([a, b]) == [a, b]


# ---- matching a client's answer ------------------------------------------------------------------


def test_match_finds_the_tenant_whose_token_answered() -> None:
    tenants = [Tenant("a", ALICE), Tenant("b", BOB), *single_tenant("c-token-0123456789abc")]
    nonce = auth.new_nonce()
    for tenant in tenants:
        assert auth.match(tenants, nonce, auth.mac(tenant.token, nonce)) is tenant
    assert auth.match(tenants, auth.new_nonce(), auth.mac(ALICE, nonce)) is None


@pytest.mark.parametrize(
    "answer", [None, 7, "", "ab", "é" * 64, "0" * 63, "0" * 65, "0" * 64, ["x"], b"0" * 64]
)
def test_match_refuses_malformed_and_wrong_answers(answer: object) -> None:
    tenants = [Tenant("a", ALICE), Tenant("b", BOB)]
    assert auth.match(tenants, auth.new_nonce(), answer) is None
    assert not auth.verify(ALICE, auth.new_nonce(), answer)


def test_match_computes_every_tenants_mac_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit: the same work whether the first tenant matches, the last, or none."""
    tenants = [Tenant(f"t{i}", f"token-{i}-0123456789abcdef") for i in range(5)]
    nonce = auth.new_nonce()
    calls: list[str] = []
    real = auth.mac

    def counting(token: str, n: bytes) -> str:
        calls.append(token)
        return real(token, n)

    answers = [real(tenants[0].token, nonce), real(tenants[-1].token, nonce), "0" * 64, "bad"]
    monkeypatch.setattr(auth, "mac", counting)
    for answer in answers:
        calls.clear()
        auth.match(tenants, nonce, answer)
        assert calls == [t.token for t in tenants]
