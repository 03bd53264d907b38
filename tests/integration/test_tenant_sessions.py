"""A tenant's sessions at once are bounded: by its ``max_sessions``, else by the server's bound
less one per other tenant, so that one tenant cannot take every slot ("server full" for the
others)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from gpu_trace.runtime.protocol.wire import MsgType
from gpu_trace.runtime.server.server import Server
from gpu_trace.runtime.sharing.tenants import Tenant
from tests.integration import test_remote_server
from tests.integration.test_remote_server import Raw

ALICE = "alice-token-sessions-0123"
BOB = "bob-token-sessions-012345"
CAROL = "carol-token-sessions-0123"


@pytest.fixture
def server() -> Iterator[Server]:
    tenants = [
        Tenant(name="alice", token=ALICE),
        Tenant(name="bob", token=BOB),
        Tenant(name="carol", token=CAROL, max_sessions=1),
    ]
    with Server("127.0.0.1:0", tenants=tenants, max_sessions=4, isolation="shared") as s:
        yield s
    while test_remote_server._open:
        test_remote_server._open.pop().close()


def _refusal(token: str, server: Server) -> str:
    """What the server answers a HELLO it refuses."""
    mtype, body = Raw(server.address, token=token).welcome
    assert mtype == MsgType.ERROR, (mtype, body)
    return str(json.loads(body)["message"])


def test_one_tenant_cannot_take_every_slot(server: Server) -> None:
    assert server.tenant_sessions(server.tenants[0]) == 2  # 4, less one for each other tenant
    held = [Raw(server.address, token=ALICE) for _ in range(2)]
    assert "tenant 'alice' has its 2 sessions open already" in _refusal(ALICE, server)
    bob = Raw(server.address, token=BOB)  # the others still get in
    assert bob.batch([["aten::ones.default", [[2]], {}, [1]]])["ok"]
    held[0].sock.close()


def test_a_tenants_own_bound_wins(server: Server) -> None:
    carol = Raw(server.address, token=CAROL)
    assert carol.batch([["aten::ones.default", [[2]], {}, [1]]])["ok"]
    assert "tenant 'carol' has its 1 sessions open already" in _refusal(CAROL, server)
