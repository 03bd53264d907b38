"""One home for settings.

Precedence, highest first: an explicit argument, a CLI flag, a ``GPU_TRACE_*`` environment
variable, the default. Every variable the project reads is listed in :data:`ENVIRONMENT`; nothing
else in the code base reads ``os.environ`` for a ``GPU_TRACE_*`` name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Every environment variable gpu-trace reads, with what it means.
ENVIRONMENT: dict[str, str] = {
    "GPU_TRACE_HOME": "Data directory: runs and the embedded store. Default ~/.local/share/gpu-trace.",
    "GPU_TRACE_STORE": "Store DSN: chdb:///path (embedded, the default under GPU_TRACE_HOME/store) "
    "or http(s)://user:password@host:port for a ClickHouse server.",
    "GPU_TRACE_CLUSTER": "ClickHouse cluster name; DDL runs ON CLUSTER with Distributed tables.",
    "GPU_TRACE_REMOTE": "Set by `gpu-trace record --remote HOST:PORT`: the program's CUDA work is "
    "forwarded to the `gpu-trace serve` server at HOST:PORT.",
    "GPU_TRACE_REMOTE_SYNC": "1: forwarded ops wait for the server one by one (for comparison); "
    "default 0, asynchronous.",
    "GPU_TRACE_REMOTE_TOKEN": "Token clients authenticate to `gpu-trace serve` with (at least 16 "
    "characters). Default: the token file a server writes under GPU_TRACE_HOME.",
    "GPU_TRACE_REMOTE_TIMEOUT": "Seconds without any message from the server before a forwarding "
    "client gives up on it. Default 30.",
    "GPU_TRACE_SPIN_US": "Microseconds a forwarding client waiting for a reply, or a server "
    "waiting for its client's next message while the device is idle, polls the socket (giving "
    "the CPU away between tries) before sleeping; 0 sleeps at once. Default 200: a synchronous "
    "round trip then wakes no sleeping thread. A process that may run on one CPU only never polls.",
    "GPU_TRACE_RUN_DIR": "Set by `gpu-trace record` for the traced program and its children: the "
    "run directory the recorder spools into. When set, recording starts at interpreter start.",
    "GPU_TRACE_RUN_ID": "Set by `gpu-trace record`: the run id.",
    "GPU_TRACE_FLUSH_INTERVAL": "Seconds between background flushes to the spool. Default 0.5.",
    "GPU_TRACE_BUFFER_EVENTS": "Per-thread buffer capacity in events; beyond it events are dropped "
    "and counted. Default 1048576.",
    "GPU_TRACE_NVTX": "NVTX capture: native (the C injection library, default), python (patch the "
    "Python nvtx package only) or off.",
    "GPU_TRACE_NVTX_CLOCK": "Clock the NVTX injection library stamps events with: auto (the TSC "
    "where it is invariant and the kernel's own clocksource, converted to CLOCK_MONOTONIC ns at "
    "each flush; the default) or monotonic (clock_gettime on every event).",
    "GPU_TRACE_CC": "C compiler used to build the NVTX injection library and the C gpu_trace.range "
    "on first use. Default cc.",
    "GPU_TRACE_TORCH": "PyTorch ranges when the program imports torch: module (every nn.Module's "
    "forward and backward, optimizer.step, backward, DataLoader waits, steps; the default), op "
    "(module plus every ATen op) or off. `gpu-trace record --torch` sets it.",
    "GPU_TRACE_TORCH_SHAPES": "1 to record input shapes and dtypes as attributes of PyTorch op "
    "ranges (op level; costs more per op). Default 0.",
    "GPU_TRACE_TF": "TensorFlow ranges when the program imports tensorflow: layer (Keras layer "
    "calls, tf.function calls, gradients, steps; the default), op (layer plus eager ops) or off. "
    "`gpu-trace record --tf` sets it.",
    "GPU_TRACE_NVML_HZ": "NVML samples per second in `gpu-trace record` (the record process "
    "samples, not the program). Default 10; 0 turns the NVML sampler off.",
    "GPU_TRACE_HOST_HZ": "Host samples per second (CPU, memory, network, disk, the program's CPU "
    "and RSS) in `gpu-trace record`. Default 2; 0 turns the host sampler off.",
    "GPU_TRACE_NVML_REPLAY": "An NVML sample file to play back instead of reading NVML (tests, "
    "demos without a GPU); see docs/collectors.md.",
    "TRACEPARENT": "W3C trace context of a parent; a run started under it joins that trace.",
}

DEFAULT_FLUSH_INTERVAL_S = 0.5
DEFAULT_BUFFER_EVENTS = 1 << 20


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def home() -> Path:
    """The data directory (``GPU_TRACE_HOME``)."""
    value = _env("GPU_TRACE_HOME")
    if value:
        return Path(value).expanduser()
    return Path("~/.local/share/gpu-trace").expanduser()


def store_dsn(explicit: str | None = None) -> str:
    """The store DSN: explicit value, ``GPU_TRACE_STORE``, or the embedded chDB under home."""
    if explicit:
        return explicit
    return _env("GPU_TRACE_STORE") or f"chdb://{home() / 'store'}"


def cluster(explicit: str | None = None) -> str | None:
    return explicit or _env("GPU_TRACE_CLUSTER")


def c_compiler() -> str | None:
    """``GPU_TRACE_CC``, the compiler command for the NVTX library (None: use ``cc``)."""
    return _env("GPU_TRACE_CC")


def nvtx_clock() -> str:
    """``GPU_TRACE_NVTX_CLOCK``: ``auto`` (default) or ``monotonic``."""
    value = (_env("GPU_TRACE_NVTX_CLOCK") or "auto").lower()
    if value not in ("auto", "monotonic"):
        raise ValueError(f"GPU_TRACE_NVTX_CLOCK must be auto or monotonic, got {value!r}")
    return value


def torch_level(explicit: str | None = None) -> str:
    """``GPU_TRACE_TORCH``: ``module`` (default), ``op`` or ``off``."""
    return _level("GPU_TRACE_TORCH", explicit, ("module", "op", "off"))


def tf_level(explicit: str | None = None) -> str:
    """``GPU_TRACE_TF``: ``layer`` (default), ``op`` or ``off``."""
    return _level("GPU_TRACE_TF", explicit, ("layer", "op", "off"))


def torch_shapes() -> bool:
    """``GPU_TRACE_TORCH_SHAPES``: record op input shapes and dtypes."""
    return (_env("GPU_TRACE_TORCH_SHAPES") or "0").lower() in ("1", "true", "yes", "on")


def _level(name: str, explicit: str | None, levels: tuple[str, ...]) -> str:
    value = (explicit or _env(name) or levels[0]).lower()
    if value not in levels:
        raise ValueError(f"{name} must be one of {', '.join(levels)}, got {value!r}")
    return value


DEFAULT_NVML_HZ = 10.0
DEFAULT_HOST_HZ = 2.0


def nvml_hz(explicit: float | None = None) -> float:
    """NVML sampling rate: ``--nvml-hz``, ``GPU_TRACE_NVML_HZ``, or 10 (0: off)."""
    return _rate("GPU_TRACE_NVML_HZ", explicit, DEFAULT_NVML_HZ)


def host_hz(explicit: float | None = None) -> float:
    """Host sampling rate: ``--host-hz``, ``GPU_TRACE_HOST_HZ``, or 2 (0: off)."""
    return _rate("GPU_TRACE_HOST_HZ", explicit, DEFAULT_HOST_HZ)


def nvml_replay(explicit: Path | None = None) -> Path | None:
    """An NVML sample file to play back instead of NVML (``GPU_TRACE_NVML_REPLAY``)."""
    value = explicit or _env("GPU_TRACE_NVML_REPLAY")
    return Path(value).expanduser() if value else None


def _rate(name: str, explicit: float | None, default: float) -> float:
    value = _float(name, default) if explicit is None else float(explicit)
    if not 0 <= value <= 1000:
        flag = name.removeprefix("GPU_TRACE_").lower().replace("_", "-")
        raise ValueError(f"--{flag} must be in [0, 1000] Hz, got {value:g}")
    return value


def runs_dir() -> Path:
    """Where `gpu-trace record` puts run directories unless told otherwise."""
    return home() / "runs"


@dataclass(frozen=True)
class RecorderSettings:
    """Settings of the in-process recorder."""

    run_dir: Path | None
    run_id: str | None
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    buffer_events: int = DEFAULT_BUFFER_EVENTS
    nvtx: str = "native"

    @classmethod
    def from_env(cls, **overrides: object) -> RecorderSettings:
        run_dir = _env("GPU_TRACE_RUN_DIR")
        values: dict[str, object] = {
            "run_dir": Path(run_dir) if run_dir else None,
            "run_id": _env("GPU_TRACE_RUN_ID"),
            "flush_interval_s": _float("GPU_TRACE_FLUSH_INTERVAL", DEFAULT_FLUSH_INTERVAL_S),
            "buffer_events": int(_float("GPU_TRACE_BUFFER_EVENTS", DEFAULT_BUFFER_EVENTS)),
            "nvtx": (_env("GPU_TRACE_NVTX") or "native").lower(),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)  # type: ignore[arg-type]
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.flush_interval_s <= 0 or self.flush_interval_s > 60:
            raise ValueError(
                f"flush interval must be in (0, 60] seconds, got {self.flush_interval_s}"
            )
        if self.buffer_events < 16:
            raise ValueError(
                f"buffer capacity must be at least 16 events, got {self.buffer_events}"
            )
        if self.nvtx not in ("native", "python", "off"):
            raise ValueError(f"GPU_TRACE_NVTX must be native, python or off, got {self.nvtx!r}")


def _float(name: str, default: float) -> float:
    value = _env(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None


DEFAULT_REMOTE_TIMEOUT_S = 30.0


DEFAULT_SPIN_US = 200.0


def spin_us(explicit: float | None = None) -> float:
    """How long a forwarding peer polls before sleeping (``GPU_TRACE_SPIN_US``)."""
    value = explicit if explicit is not None else _float("GPU_TRACE_SPIN_US", DEFAULT_SPIN_US)
    if not 0 <= value <= 1_000_000:
        raise ValueError(f"spin must be in [0, 1000000] microseconds, got {value}")
    return value


def remote_address(explicit: str | None = None) -> str | None:
    """``HOST:PORT`` of the forwarding server (``GPU_TRACE_REMOTE``), or None."""
    return explicit or _env("GPU_TRACE_REMOTE")


def remote_sync(explicit: bool | None = None) -> bool:
    """Whether forwarded ops run synchronously (``GPU_TRACE_REMOTE_SYNC``)."""
    if explicit is not None:
        return explicit
    return (_env("GPU_TRACE_REMOTE_SYNC") or "0").lower() in ("1", "true", "yes", "on")


def remote_token(explicit: str | None = None) -> str | None:
    """The forwarding token (``GPU_TRACE_REMOTE_TOKEN``), or None."""
    return explicit or _env("GPU_TRACE_REMOTE_TOKEN")


def remote_timeout(explicit: float | None = None) -> float:
    """Seconds of silence from the server before a client gives up (``GPU_TRACE_REMOTE_TIMEOUT``)."""
    value = (
        explicit
        if explicit is not None
        else _float("GPU_TRACE_REMOTE_TIMEOUT", DEFAULT_REMOTE_TIMEOUT_S)
    )
    if not 0 < value <= 3600:
        raise ValueError(f"remote timeout must be in (0, 3600] seconds, got {value}")
    return value
