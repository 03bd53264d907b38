"""Two tenants on one live `gpu-trace serve`: one tries to read and overwrite the other's memory
through views past the end of its own storages (docs/remote.md, "Security"). Each attack is
refused before it runs, the victim's tensors stay bitwise intact, both sessions go on and the
server lives (it runs in its own process: a crash fails these tests instead of ending pytest)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.integration import test_remote_server
from tests.integration.test_remote_server import Raw

ATTACKER = "attacker-token-0123456789"
VICTIM = "victim-token-0123456789"
TENANTS = f"""\
[[tenant]]
name = "attacker"
token = "{ATTACKER}"

[[tenant]]
name = "victim"
token = "{VICTIM}"
"""
#: The victim's data: a pattern an out-of-bounds read would carry back.
SECRET = torch.full((4096,), 1234.5678, dtype=torch.float32)


class Served:
    """A `gpu-trace serve` process with the two tenants."""

    def __init__(self, tmp: Path) -> None:
        (tmp / "tenants.toml").write_text(TENANTS)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TRACE_")}
        env["GPU_TRACE_HOME"] = str(tmp / "home")
        argv = [sys.executable, "-m", "gpu_trace", "serve", "--listen", "127.0.0.1:0"]
        argv += ["--device", "cpu", "--tenants", str(tmp / "tenants.toml")]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        assert "serving cpu on" in line, line + self.proc.stderr.read()
        self.address = line.split(" on ")[1].split()[0]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> str:
        """Stops it (if it runs); what it wrote to stderr since it started."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        assert self.proc.stderr is not None
        if self.proc.stderr.closed:
            return ""
        rest = self.proc.stderr.read()
        self.proc.stderr.close()
        return rest


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Served]]:
    """The module's server (one start for all its tests), replaced if a test killed it."""
    s = [Served(tmp_path_factory.mktemp("serve"))]
    yield s
    s[0].close()


@pytest.fixture
def server(served: list[Served], tmp_path: Path) -> Iterator[Served]:
    """The module's server; the test fails if the server did not survive it."""
    if not served[0].alive():
        served[0].close()
        served[0] = Served(tmp_path)
    yield served[0]
    while test_remote_server._open:
        test_remote_server._open.pop().close()
    if not served[0].alive():
        pytest.fail(
            f"the server died: exit {served[0].proc.returncode}; {served[0].close()[-2000:]}"
        )


def _two_tenants(server: Served) -> tuple[Raw, Raw]:
    victim = Raw(server.address, token=VICTIM)
    secret = ["aten::full.default", [[4096], 1234.5678], {"dtype": {"d": "float32"}}, [1]]
    assert victim.batch([secret])["ok"]
    attacker = Raw(server.address, token=ATTACKER)
    assert attacker.batch([["aten::ones.default", [[4]], {}, [1]]])["ok"]
    return attacker, victim


def _refused(done: dict, op: str) -> str:
    assert not done["ok"], done
    assert done["error"]["op"] == op
    return done["error"]["message"]


@pytest.mark.parametrize(
    "view",
    [
        ["aten::_reshape_alias.default", [{"h": 1}, [131072], [1]], {}, [2]],
        ["aten::_reshape_alias_copy.default", [{"h": 1}, [131072], [1]], {}, [2]],
        ["aten::as_strided.default", [{"h": 1}, [131072], [1]], {}, [2]],
        ["aten::as_strided.default", [{"h": 1}, [2], [1], 1 << 61], {}, [2]],  # offset overflows
        ["aten::as_strided_copy.default", [{"h": 1}, [2, 2], [1 << 62, 1]], {}, [2]],
    ],
    ids=["reshape_alias", "reshape_alias_copy", "as_strided", "as_strided_offset", "strided_copy"],
)
def test_a_view_past_its_storage_is_refused_and_reads_nothing(server: Served, view: list) -> None:
    """The original attack: a [131072] view of a 4-element tensor, cloned and fetched, carried
    1 MiB of the server's heap back, another tenant's tensors among it."""
    attacker, victim = _two_tenants(server)
    done = attacker.batch([view, ["aten::clone.default", [{"h": 2}], {}, [3]]])
    message = _refused(done, view[0])  # by our check; the last two by ATen's or the server's too
    if "reshape_alias" in view[0]:
        assert "out of bounds" in message and "needs 524288 bytes of a 16-byte storage" in message
    assert not attacker.batch([["rt::fetch", [{"h": 3}, 99], {}, None]])["ok"]  # nothing made
    assert torch.equal(attacker.fetch(1), torch.ones(4))  # the attacker's session goes on
    assert torch.equal(victim.fetch(1), SECRET)


def test_a_write_through_such_a_view_is_refused_and_the_other_tenant_is_intact(
    server: Served,
) -> None:
    """``eq`` + ``masked_fill_`` through the view overwrote other tenants' tensors, and once
    aborted the server (``munmap_chunk(): invalid pointer``)."""
    attacker, victim = _two_tenants(server)
    done = attacker.batch(
        [
            ["aten::_reshape_alias.default", [{"h": 1}, [131072], [1]], {}, [2]],
            ["aten::eq.Scalar", [{"h": 2}, 1234.5678], {}, [3]],
            ["aten::masked_fill_.Scalar", [{"h": 2}, {"h": 3}, -1.0], {}, [None]],
        ]
    )
    _refused(done, "aten::_reshape_alias.default")
    assert torch.equal(victim.fetch(1), SECRET)
    assert victim.batch([["aten::sum.default", [{"h": 1}], {}, [2]]])["ok"]
    assert torch.equal(attacker.fetch(1), torch.ones(4))


def test_enums_sent_as_bare_numbers_are_refused(server: Served) -> None:
    """A dtype or layout sent as a number is not decoded: ATen would take any number, index its
    type tables past their end (dtype -1), or make sparse (layout 1) and quantized (dtype 12)
    tensors the allow-list keeps out."""
    attacker, victim = _two_tenants(server)
    for op in (
        ["aten::view.dtype", [{"h": 1}, -1], {}, [2]],
        ["aten::empty.memory_format", [[2, 2]], {"layout": 1}, [2]],
        ["aten::empty.memory_format", [[2]], {"dtype": 12}, [2]],
        ["aten::to.dtype", [{"h": 1}, 7], {}, [2]],
    ):
        assert "tagged value" in _refused(attacker.batch([op]), op[0])
    assert attacker.batch([["aten::to.dtype", [{"h": 1}, {"d": "float64"}], {}, [2]]])["ok"]
    assert torch.equal(attacker.fetch(2), torch.ones(4, dtype=torch.float64))
    assert torch.equal(victim.fetch(1), SECRET)


def test_views_inside_the_storage_still_work(server: Served) -> None:
    attacker, _ = _two_tenants(server)
    done = attacker.batch(
        [
            ["aten::_reshape_alias.default", [{"h": 1}, [2, 2], [2, 1]], {}, [2]],
            ["aten::as_strided.default", [{"h": 1}, [2], [2], 1], {}, [3]],
            ["aten::_reshape_alias_copy.default", [{"h": 1}, [4], [1]], {}, [4]],
        ]
    )
    assert done["ok"], done
    assert torch.equal(attacker.fetch(2), torch.ones(2, 2))
    assert torch.equal(attacker.fetch(3), torch.ones(2))
    assert torch.equal(attacker.fetch(4), torch.ones(4))


@pytest.mark.parametrize(
    "op",
    [
        ["aten::__round_to_zero_floordiv.int", [0, 0], {}, None],  # SIGFPE
        ["aten::to.prim_Device", [{"h": 1}, None, None, False, True], {}, [2]],  # SIGSEGV
        [
            "aten::_fused_adam_.default",
            [[{"h": 1}], [{"h": 3}], [{"h": 1}], [{"h": 1}], [], [{"h": 3}]],
            {"lr": 0.1, "beta1": 0.9, "beta2": 0.9, "weight_decay": 0.0, "eps": 1e-8},
            [None],
        ],  # a 1-element grad for a 4-element param: SIGSEGV
    ],
    ids=["int_floordiv", "to_prim_device", "fused_adam"],
)
def test_ops_that_crashed_the_server_are_refused(server: Served, op: list) -> None:
    """Each of these ended the server, and every tenant's session with it."""
    attacker, victim = _two_tenants(server)
    assert attacker.batch([["aten::ones.default", [[1]], {}, [3]]])["ok"]
    if op[0] == "aten::_fused_adam_.default":
        op[2].update({"amsgrad": False, "maximize": False})
    message = _refused(attacker.batch([op]), op[0])
    assert "allow-list" in message or "must" in message or "needed" in message, message
    assert server.alive()
    assert torch.equal(victim.fetch(1), SECRET)
    assert torch.equal(attacker.fetch(1), torch.ones(4))
