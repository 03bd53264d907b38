"""Two tenants on one CUDA `gpu-trace serve --isolation process` (skipped without a GPU).

An index bug in one tenant (an out-of-range ``index_select`` is a device-side assert, which
leaves a CUDA context unusable) ends that tenant's session alone: the other tenant, training at
the same time in its own worker and context, finishes bitwise as it would alone, and the server
takes new sessions after. Memory another tenant freed is never readable through ``empty``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpu_trace.runtime.protocol.wire import ProtocolError
from tests import serving
from tests.integration.test_remote_server import Raw

ALICE = "alice-token-isolation-gpu-01"
BOB = "bob-token-isolation-gpu-0123"
TENANTS = f"""\
[[tenant]]
name = "alice"
token = "{ALICE}"
memory = "1GiB"

[[tenant]]
name = "bob"
token = "{BOB}"
memory = "4GiB"
"""
SECRET = 1234.5678
#: The server's device, as the wire names it.
R = {"v": "r"}

# Bob's training: one step, "ready", then (once the file argv[3] exists) the rest; losses as hex.
BOB_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    torch.use_deterministic_algorithms(True)
    if sys.argv[1] == "local":
        dev = torch.device("cuda")
    else:
        from gpu_trace import runtime
        assert not torch.cuda.is_available()
        dev = runtime.connect(sys.argv[1], token=sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 16)
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(128, 256).to(dev), torch.randn(128, 16).to(dev)
    losses = []
    for step in range(20):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
        if step == 0:
            print("ready", flush=True)
            waited = time.monotonic()
            while not os.path.exists(sys.argv[3]):
                if time.monotonic() - waited > 900:  # the test failed before saying go
                    sys.exit("no go within 900 s")
                time.sleep(0.02)
    print(" ".join(losses), flush=True)
    """
)


def _bob(where: str, go: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", BOB_SCRIPT, where, BOB, str(go)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _losses(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out.strip().splitlines()[-1]


def test_an_index_bug_ends_only_its_own_session(tmp_path: Path) -> None:
    (tmp_path / "tenants.toml").write_text(TENANTS)
    go = tmp_path / "go"
    go.touch()
    local_env = {**os.environ, **serving.DETERMINISTIC}
    alone = _losses(_bob("local", go, local_env))
    go.unlink()
    with serving.served(
        tmp_path / "home",
        BOB,
        "--tenants",
        str(tmp_path / "tenants.toml"),
        "--isolation",
        "process",
        deterministic=True,
    ) as (address, env):
        client_env = {**env, "CUDA_VISIBLE_DEVICES": ""}
        bob = _bob(address, go, client_env)
        assert bob.stdout is not None and bob.stdout.readline().strip() == "ready"
        alice = Raw(address, token=ALICE)
        done = alice.batch(
            [
                ["aten::ones.default", [[8, 4]], {"device": R}, [1]],
                ["aten::full.default", [[1], 1 << 20], {"dtype": {"d": "int64"}, "device": R}, [2]],
                ["aten::index_select.default", [{"h": 1}, 0, {"h": 2}], {}, [3]],
                ["aten::sum.default", [{"h": 3}], {}, [4]],
                ["rt::fetch", [{"h": 4}, 7], {}, None],
            ]
        )
        assert not done["ok"], done  # the assert, at the fetch's sync or at the op
        with pytest.raises(ProtocolError, match="CUDA context failed"):
            alice.batch([["aten::ones.default", [[1]], {}, [5]]])
        go.touch()
        assert _losses(bob) == alone  # bitwise as alone
        again = Raw(address, token=ALICE)  # a new context for a new session
        assert again.batch([["aten::ones.default", [[4]], {"device": R}, [1]]])["ok"]
        assert torch.equal(again.fetch(1).cpu(), torch.ones(4))


def test_empty_after_another_tenants_free_holds_none_of_its_bytes(tmp_path: Path) -> None:
    (tmp_path / "tenants.toml").write_text(TENANTS)
    with serving.served(tmp_path / "home", BOB, "--tenants", str(tmp_path / "tenants.toml")) as (
        address,
        _env,
    ):
        n = 64 << 20  # 256 MiB of float32
        bob = Raw(address, token=BOB)
        fill = ["aten::full.default", [[n], SECRET], {"dtype": {"d": "float32"}, "device": R}, [1]]
        assert bob.batch([fill, ["rt::sync", [], {}, None]])["ok"]
        assert bob.batch([["aten::sum.default", [{"h": 1}], {}, [2]]], free=[1])["ok"]
        bob.sock.close()
        alice = Raw(address, token=ALICE)
        done = alice.batch(
            [["aten::empty.memory_format", [[n]], {"dtype": {"d": "float32"}, "device": R}, [1]]]
        )
        assert done["ok"], done
        assert not (alice.fetch(1) == SECRET).any()
