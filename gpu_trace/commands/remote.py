"""`gpu-trace serve` and `gpu-trace tenants`: the forwarding server and its admin listing."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from gpu_trace import _format as fmt
from gpu_trace import config
from gpu_trace.commands import CLIError, check_settings, echo, err


def cmd_serve(args: argparse.Namespace) -> int:
    import signal

    from gpu_trace import runtime

    runtime.serving_process()  # before torch loads: CUDA stays this process's accelerator
    from gpu_trace.runtime.protocol import auth
    from gpu_trace.runtime.server.device_activity import start_capture
    from gpu_trace.runtime.server.server import Server
    from gpu_trace.runtime.sharing.policies import make_policy
    from gpu_trace.runtime.sharing.scheduler import PolicyScheduler
    from gpu_trace.runtime.sharing.tenants import load_tenants, parse_size

    check_settings()  # every setting, before the server listens
    if args.tenants is not None and args.token:
        raise CLIError("give --tenants or --token, not both (tenants' tokens are in the file)", 2)
    try:
        tenants = token = token_path = None
        if args.tenants is not None:
            tenants = load_tenants(args.tenants)
        else:
            token, token_path = auth.server_token(args.token)
        device_memory = None
        if args.device_memory is not None:
            device_memory = parse_size(args.device_memory)
            if device_memory <= 0:
                raise ValueError("--device-memory must be more than 0 bytes")
        scheduler = PolicyScheduler(make_policy(args.policy, **policy_options(args)))
        device = args.device
        if args.standby < 0:
            raise ValueError("--standby must be 0 or more")
        if args.max_sessions < 1:  # a server no client could join
            raise ValueError(f"--max-sessions must be 1 or more, got {args.max_sessions}")
        # GPU activity: the injection library is named before CUDA initializes in this process.
        activity, activity_note = None, None
        process = args.isolation == "process"
        worker_env = None
        if process:  # each worker captures its own session's (runtime/worker/process.py)
            setting = config.gpu_activity(args.gpu_activity)
            worker_env = {**os.environ, "GPU_TRACE_GPU_ACTIVITY": setting}
            if device is None or device.startswith("cuda"):  # why not, said here (no env set)
                from gpu_trace.collectors import gpu_activity

                activity_note = gpu_activity.prepare(setting)[2]
        elif device is None or device.startswith("cuda"):
            activity, activity_note = start_capture(args.gpu_activity)
        if device is None:
            import torch

            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        if activity is not None and not device.startswith("cuda"):
            activity.source.close()  # its directory goes: no CUDA here after all
            activity = None
        sink = None
        if args.store:
            from gpu_trace.runtime.server.sink import StoreSink

            sink = StoreSink(args.store, config.home() / "serve-spool")
        server = Server(
            args.listen,
            device=device,
            token=token,
            tenants=tenants,
            device_memory=device_memory,
            scheduler=scheduler,
            max_sessions=args.max_sessions,
            max_handshakes=args.max_handshakes,
            handshake_timeout_s=args.handshake_timeout,
            sink=sink,
            idle_s=args.idle_s,
            spin_us=args.spin_us,
            gpu_activity=activity,
            isolation=args.isolation,
            standby=args.standby,
            worker_env=worker_env,
        )
        server.start()
        if process:
            state = server.gpu_activity_state()
            if state not in ("on", "off") and device.startswith("cuda"):
                activity_note = state  # a worker's own reason wins
    except (ValueError, OSError) as exc:
        raise CLIError(f"cannot serve: {exc}", 2) from None
    try:
        metrics = _serve_metrics(server, args.listen, args.metrics)
    except CLIError:
        server.close()
        raise
    if tenants is not None:
        where = f"{len(tenants)} tenants from {args.tenants}"
    elif token_path:
        where = f"token in {token_path}"
    else:
        where = "token from --token/GPU_TRACE_REMOTE_TOKEN"
    policy = args.policy
    if args.las_thresholds is not None:
        policy += f" (thresholds {args.las_thresholds} s)"
    where += f"; policy {policy}; isolation {args.isolation}"
    where += f"; GPU activity {'on' if server.gpu_activity_state() == 'on' else 'off'}"
    if sink is not None:
        where += f"; spans to {sink.display}"
    if metrics is not None:
        where += f"; metrics at {metrics.url}"
    err(f"serving {server.device} on {server.address} ({where}); Ctrl-C stops")
    if activity_note:
        err(activity_note)
    signal.signal(signal.SIGTERM, lambda *_: server.stop("SIGTERM"))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.stop("SIGINT")
    finally:
        if metrics is not None:
            metrics.close()
        server.close()
    why = f" ({server.stop_reason})" if server.stop_reason else ""
    gpu = ""
    c = server.gpu_activity_counts()  # this process's capture, or its workers'
    if c is not None:
        gpu = (
            f"; {c.spans} GPU activity spans sent ({c.dropped} records dropped by CUPTI,"
            f" {c.unattributed} outside traced ops, {c.late} after their session ended)"
        )
    err(f"stopped{why}: served {server.batches_served()} batches{gpu}")
    return 0


def policy_options(args: argparse.Namespace) -> dict[str, list[int]]:
    """``--policy``'s options from the command line (``--las-thresholds``)."""
    spec = args.las_thresholds
    if spec is None:
        return {}
    if args.policy != "las":
        raise ValueError(f"--las-thresholds is for --policy las, not {args.policy}")
    try:
        seconds = [float(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"--las-thresholds takes seconds separated by commas (like 1,10,100), got {spec!r}"
        ) from None
    if not all(math.isfinite(s) and s > 0 for s in seconds) or sorted(set(seconds)) != seconds:
        raise ValueError(f"--las-thresholds must be positive and increasing, got {spec!r}")
    return {"thresholds_ns": [round(s * 1e9) for s in seconds]}


def _serve_metrics(server: Any, listen: str, spec: str | None) -> Any:
    """``--metrics``: the /metrics server, started; None if off. The default (the listen port
    + 1 on 127.0.0.1) gives way with a warning when taken; an explicit address must work."""
    from gpu_trace.runtime.protocol.addresses import parse_address
    from gpu_trace.runtime.server.metrics import MetricsServer

    if spec is not None and spec.lower() == "off":
        return None
    if spec is None:
        port = parse_address(listen)[1]
        spec = f"127.0.0.1:{port + 1 if port else 0}"
        explicit = False
    else:
        explicit = True
    try:
        return MetricsServer(server, spec).start()
    except (ValueError, OSError) as exc:
        if explicit:
            raise CLIError(f"cannot serve metrics on {spec}: {exc}", 2) from None
        err(f"no /metrics: {spec}: {exc} (--metrics HOST:PORT picks another address)")
        return None


def cmd_tenants(args: argparse.Namespace) -> int:
    from gpu_trace.runtime.client import admin_requests
    from gpu_trace.runtime.protocol.errors import RemoteError

    try:
        if args.page_out is not None:
            moved = admin_requests.page_out(args.address, args.page_out, args.token)
            if args.json:
                echo(json.dumps({"paged_out": args.page_out, "bytes": moved}))
            else:
                echo(f"paged out session {args.page_out}: {fmt.size(moved)} to host memory")
            return 0
        if args.evict is not None:
            admin_requests.evict(args.address, args.evict, args.token)
            if args.json:
                echo(json.dumps({"evicted": args.evict}))
            else:
                echo(f"evicted session {args.evict}")
            return 0
        listing = admin_requests.list_sessions(args.address, args.token)
    except RemoteError as exc:
        raise CLIError(str(exc)) from None
    except ValueError as exc:  # no token, a malformed address
        raise CLIError(str(exc), 2) from None
    listing.pop("ok", None)
    echo(json.dumps(listing, indent=2) if args.json else admin_requests.format_listing(listing))
    return 0
