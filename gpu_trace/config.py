"""One home for settings.

Precedence, highest first: an explicit argument, a CLI flag, a ``GPU_TRACE_*`` environment
variable, the default. Every variable the project reads is listed in :data:`ENVIRONMENT`; nothing
else in the code base reads ``os.environ`` for a ``GPU_TRACE_*`` name. Each has one parser in
:data:`CHECKS`, used where it is read and by :func:`check_environment` before a program is
recorded, so a bad value is refused up front with its variable, value and accepted range (the
parsers of each kind of value: :mod:`gpu_trace._value_parsers`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpu_trace import _value_parsers as v

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
    "GPU_TRACE_HANDSHAKE_TIMEOUT": "Seconds `gpu-trace serve` gives a new connection to "
    "authenticate (from accept to WELCOME; bytes trickling in do not extend it). Default 10.",
    "GPU_TRACE_MAX_HANDSHAKES": "Connections `gpu-trace serve` lets wait to authenticate at once, "
    "apart from sessions; one more ends the oldest of the busiest peer address. Default 64.",
    "GPU_TRACE_RECORD_OPS": "A file `gpu-trace serve` appends every ATen op name its clients send "
    "to, one a line, each once per process (refused ones too): how scripts/make_allowlist.py "
    "collects what forwarded programs send. Unset by default (nothing is recorded).",
    "GPU_TRACE_RUN_DIR": "Set by `gpu-trace record` for the traced program and its children: the "
    "run directory the recorder spools into. When set, recording starts at interpreter start.",
    "GPU_TRACE_RUN_ID": "Set by `gpu-trace record`: the run id.",
    "GPU_TRACE_JOB": "`gpu-trace record --job`'s default: the job this record is one part of "
    "(every record of a job, each rank under its own, on any host, lands in the run job-ID). "
    "Unset: the launcher's job id where it started several records (SLURM_JOB_ID, "
    "PMIX_NAMESPACE, TORCHELASTIC_RUN_ID), else none.",
    "GPU_TRACE_SIGNAL_ECHO": "Set by `gpu-trace record` for the program it starts: the pipe the "
    "program says on which signals it got, so a signal sent to the whole process group is not "
    "forwarded to it a second time (gpu_trace/signal_echo.py).",
    "GPU_TRACE_FLUSH_INTERVAL": "Seconds between background flushes to the spool; a thread's "
    "buffer a quarter full (and of 65536 events or more) is flushed at once. Default 0.5.",
    "GPU_TRACE_BUFFER_EVENTS": "Per-thread buffer capacity in events; beyond it events are dropped "
    "and counted. Default 1048576 (about 220 MiB for a thread that fills it with ranges).",
    "GPU_TRACE_NVTX": "NVTX capture: native (the C injection library, default), python (patch the "
    "Python nvtx package only) or off.",
    "GPU_TRACE_NVTX_CLOCK": "Clock the NVTX injection library stamps events with: auto (the TSC "
    "where it is invariant and the kernel's own clocksource, converted to CLOCK_MONOTONIC ns at "
    "each flush; the default) or monotonic (clock_gettime on every event).",
    "GPU_TRACE_CC": "C compiler used to build the NVTX injection library and the C gpu_trace.range "
    "on first use. Default cc.",
    "GPU_TRACE_GPU_ACTIVITY": "GPU activity capture (kernels, copies, memsets, CUDA calls through "
    "CUPTI; docs/gpu-activity.md): auto (on where an NVIDIA driver is installed; the default), on "
    "or off. `gpu-trace record --gpu-activity` sets it.",
    "GPU_TRACE_CUPTI_LIBRARY": "libcupti the GPU activity library opens. Default: found in the "
    "nvidia-cuda-cupti package or the CUDA toolkit; `gpu-trace record` sets it for the program.",
    "GPU_TRACE_TORCH": "PyTorch ranges when the program imports torch: module (every nn.Module's "
    "forward and backward, optimizer.step, backward, DataLoader waits, steps; the default), op "
    "(module plus every ATen op) or off. `gpu-trace record --torch` sets it.",
    "GPU_TRACE_TORCH_SHAPES": "1 to record input shapes and dtypes as attributes of PyTorch op "
    "ranges (op level; costs more per op). Default 0.",
    "GPU_TRACE_TORCH_OPS": "Where op level's PyTorch op ranges come from: native (a RecordFunction "
    "observer in C++, built with the C++ compiler, CXX or g++, and waited for), kineto (the "
    "profiler's collection in short sessions) or unset: native where its build is cached, else "
    "kineto while it builds in the background. GPU_TRACE_TORCH_SHAPES uses kineto. At module "
    "level: module backward ranges from the observer (native, unset where cached) or from "
    "Python hooks on autograd nodes (kineto).",
    "GPU_TRACE_TF": "TensorFlow ranges when the program imports tensorflow: layer (Keras layer "
    "calls, tf.function calls, gradients, steps; the default), op (layer plus eager ops) or off. "
    "`gpu-trace record --tf` sets it.",
    "GPU_TRACE_NVML_HZ": "NVML samples per second in `gpu-trace record` (the record process "
    "samples, not the program). Default 10; 0 turns the NVML sampler off.",
    "GPU_TRACE_HOST_HZ": "Host samples per second (CPU, memory, network, disk, the program's CPU "
    "and RSS) in `gpu-trace record`. Default 2; 0 turns the host sampler off.",
    "GPU_TRACE_NVML_REPLAY": "An NVML sample file to play back instead of reading NVML (tests, "
    "demos without a GPU); see docs/collectors.md.",
    "GPU_TRACE_NVML_FAMILIES": "Which NVML families `gpu-trace record` samples: `default`, `all`, "
    "a list of names, or changes to the default (`+pcie`, `-processes`). PCIe throughput (blocks "
    "~41 ms a call), NVML's sample buffers (`buffers`, 1.37 ms a call) and XID `events` are off by "
    "default; "
    "docs/collectors.md lists the families.",
    "GPU_TRACE_KEEP_SPOOL": "1: keep a run's spool files after it is ingested (`record`, "
    "`ingest`; like --keep-spool). Default 0: once the store is checked to hold every row the "
    "spool held, the spool files under GPU_TRACE_HOME/runs are removed (run.json, stats/ and "
    "ingested.json stay).",
    "TRACEPARENT": "W3C trace context of a parent; a run started under it joins that trace.",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "OpenTelemetry's standard: the collector's base URL; "
    "`--otlp` given without a URL sends to it (``/v1/traces`` appended). Read only by `--otlp`.",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "OpenTelemetry's standard: the traces URL, used as given "
    "by `--otlp` without a URL (before OTEL_EXPORTER_OTLP_ENDPOINT).",
    "OTEL_EXPORTER_OTLP_HEADERS": "OpenTelemetry's standard: KEY=VALUE,... (URL-encoded) headers "
    "sent with every OTLP request of `--otlp`; `--otlp-header` adds or overrides.",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "As OTEL_EXPORTER_OTLP_HEADERS, for traces; wins over it.",
}

DEFAULT_FLUSH_INTERVAL_S = 0.5
DEFAULT_BUFFER_EVENTS = 1 << 20
#: Largest per-thread buffer: beyond it a buffer is gigabytes of Python tuples.
MAX_BUFFER_EVENTS = 1 << 30


#: The parser of every variable in ENVIRONMENT. TRACEPARENT is never refused: a malformed
#: propagated context is ignored (W3C Trace Context), the run then starts a trace of its own.
CHECKS: dict[str, Callable[[str], object]] = {
    "GPU_TRACE_HOME": v.directory,
    "GPU_TRACE_STORE": v.dsn,
    "GPU_TRACE_CLUSTER": v.cluster,
    "GPU_TRACE_REMOTE": v.address,
    "GPU_TRACE_REMOTE_SYNC": v.flag,
    "GPU_TRACE_REMOTE_TOKEN": v.token,
    "GPU_TRACE_REMOTE_TIMEOUT": v.number(0, 3600, "seconds", lo_open=True),
    "GPU_TRACE_SPIN_US": v.number(0, 1_000_000, "microseconds"),
    "GPU_TRACE_HANDSHAKE_TIMEOUT": v.number(0, 3600, "seconds", lo_open=True),
    "GPU_TRACE_MAX_HANDSHAKES": v.number(1, 100_000, "connections", integer=True),
    "GPU_TRACE_RECORD_OPS": v.new_file,
    "GPU_TRACE_RUN_DIR": v.directory,
    "GPU_TRACE_RUN_ID": v.run_id,
    "GPU_TRACE_JOB": v.job,
    "GPU_TRACE_SIGNAL_ECHO": v.signal_echo,
    "GPU_TRACE_FLUSH_INTERVAL": v.number(0, 60, "seconds", lo_open=True),
    "GPU_TRACE_BUFFER_EVENTS": v.number(16, MAX_BUFFER_EVENTS, "events", integer=True),
    "GPU_TRACE_NVTX": v.choice("native", "python", "off"),
    "GPU_TRACE_NVTX_CLOCK": v.choice("auto", "monotonic"),
    "GPU_TRACE_CC": v.command,
    "GPU_TRACE_GPU_ACTIVITY": v.choice("auto", "on", "off"),
    "GPU_TRACE_CUPTI_LIBRARY": v.file,
    "GPU_TRACE_TORCH": v.choice("module", "op", "off"),
    "GPU_TRACE_TORCH_SHAPES": v.flag,
    "GPU_TRACE_TORCH_OPS": v.choice("native", "kineto"),
    "GPU_TRACE_TF": v.choice("layer", "op", "off"),
    "GPU_TRACE_NVML_HZ": v.number(0, 1000, "samples per second"),
    "GPU_TRACE_HOST_HZ": v.number(0, 1000, "samples per second"),
    "GPU_TRACE_NVML_REPLAY": v.file,
    "GPU_TRACE_NVML_FAMILIES": v.nvml_families,
    "GPU_TRACE_KEEP_SPOOL": v.flag,
    "TRACEPARENT": v.anything,
    # The program's own OpenTelemetry SDK reads these too: never refused up front; `--otlp`
    # checks them when it sends (export/endpoint.py: from_settings).
    "OTEL_EXPORTER_OTLP_ENDPOINT": v.anything,
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": v.anything,
    "OTEL_EXPORTER_OTLP_HEADERS": v.anything,
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS": v.anything,
}


#: Settings whose values are never printed, not even when refused (docs/remote.md: tokens are
#: never shown).
SECRETS = frozenset({"GPU_TRACE_REMOTE_TOKEN"})


def parse(name: str, text: str) -> object:
    """``text`` as variable ``name`` takes it; ValueError naming both and what is accepted."""
    try:
        return CHECKS[name](text)
    except v.Invalid as exc:
        got = f"{len(text)} characters (not shown)" if name in SECRETS else repr(text)
        raise ValueError(f"{name} must be {exc}, got {got}") from None


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Check every ``GPU_TRACE_*`` setting that is set; one ValueError naming each bad one.

    `gpu-trace record` calls this before it starts the program, ``gpu_trace.start()`` before it
    records: a bad value stops both with its reason instead of turning recording off later.
    """
    environ = os.environ if environ is None else environ
    problems = []
    for name in CHECKS:
        text = environ.get(name)
        if text in (None, ""):
            continue
        try:
            parse(name, text)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("; ".join(problems))


def _get(name: str, default: object) -> object:
    """The typed value of ``name`` from the environment, or ``default`` when it is not set."""
    text = _env(name)
    return default if text is None else parse(name, text)


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


def record_ops() -> Path | None:
    """``GPU_TRACE_RECORD_OPS``: the file a server appends the op names it is sent to."""
    value = _get("GPU_TRACE_RECORD_OPS", None)
    return None if value is None else Path(str(value))


def c_compiler() -> str | None:
    """``GPU_TRACE_CC``, the compiler command for the NVTX library (None: use ``cc``)."""
    return _env("GPU_TRACE_CC")


def gpu_activity(explicit: str | None = None) -> str:
    """``--gpu-activity`` or ``GPU_TRACE_GPU_ACTIVITY``: ``auto`` (default), ``on`` or ``off``."""
    if explicit is not None:
        value = explicit.strip().lower()
        if value not in ("auto", "on", "off"):
            raise ValueError(f"GPU activity must be auto, on or off, got {explicit!r}")
        return value
    return str(_get("GPU_TRACE_GPU_ACTIVITY", "auto"))


def nvtx_clock() -> str:
    """``GPU_TRACE_NVTX_CLOCK``: ``auto`` (default) or ``monotonic``."""
    return str(_get("GPU_TRACE_NVTX_CLOCK", "auto"))


def torch_level(explicit: str | None = None) -> str:
    """``GPU_TRACE_TORCH``: ``module`` (default), ``op`` or ``off``."""
    return _level("GPU_TRACE_TORCH", explicit, ("module", "op", "off"))


def torch_ops() -> str | None:
    """``GPU_TRACE_TORCH_OPS``: ``native``, ``kineto`` or None (native where built)."""
    value = _get("GPU_TRACE_TORCH_OPS", None)
    return None if value is None else str(value)


def tf_level(explicit: str | None = None) -> str:
    """``GPU_TRACE_TF``: ``layer`` (default), ``op`` or ``off``."""
    return _level("GPU_TRACE_TF", explicit, ("layer", "op", "off"))


def torch_shapes() -> bool:
    """``GPU_TRACE_TORCH_SHAPES``: record op input shapes and dtypes."""
    return bool(_get("GPU_TRACE_TORCH_SHAPES", False))


def _level(name: str, explicit: str | None, levels: tuple[str, ...]) -> str:
    if explicit:
        value = explicit.lower()
        if value not in levels:
            raise ValueError(f"{name} must be one of {', '.join(levels)}, got {value!r}")
        return value
    return str(_get(name, levels[0]))


DEFAULT_NVML_HZ = 10.0
DEFAULT_HOST_HZ = 2.0


def nvml_hz(explicit: float | None = None) -> float:
    """NVML sampling rate: ``--nvml-hz``, ``GPU_TRACE_NVML_HZ``, or 10 (0: off)."""
    return _rate("GPU_TRACE_NVML_HZ", explicit, DEFAULT_NVML_HZ)


def host_hz(explicit: float | None = None) -> float:
    """Host sampling rate: ``--host-hz``, ``GPU_TRACE_HOST_HZ``, or 2 (0: off)."""
    return _rate("GPU_TRACE_HOST_HZ", explicit, DEFAULT_HOST_HZ)


def nvml_replay(explicit: Path | None = None) -> Path | None:
    """An NVML sample file to play back instead of NVML (``--nvml-replay``, else
    ``GPU_TRACE_NVML_REPLAY``); ValueError for one that is not a file, as for the variable."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ValueError(f"--nvml-replay must be an existing file, got {str(explicit)!r}")
        return path
    value = _env("GPU_TRACE_NVML_REPLAY")
    return Path(value).expanduser() if value else None


def nvml_families() -> frozenset[str]:
    """NVML families to sample (``GPU_TRACE_NVML_FAMILIES``; default: the cheap ones)."""
    value = _get("GPU_TRACE_NVML_FAMILIES", None)
    return value if isinstance(value, frozenset) else v.nvml_families("default")


def _rate(name: str, explicit: float | None, default: float) -> float:
    value = float(_get(name, default)) if explicit is None else float(explicit)  # type: ignore[arg-type]
    if not 0 <= value <= 1000:
        flag = name.removeprefix("GPU_TRACE_").lower().replace("_", "-")
        raise ValueError(f"--{flag} must be in [0, 1000] Hz, got {value:g}")
    return value


def keep_spool(explicit: bool | None = None) -> bool:
    """Whether a run's spool stays after a verified ingest: ``--keep-spool`` or
    ``GPU_TRACE_KEEP_SPOOL`` (default: removed)."""
    if explicit:
        return True
    return bool(_get("GPU_TRACE_KEEP_SPOOL", False))


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
            "flush_interval_s": _get("GPU_TRACE_FLUSH_INTERVAL", DEFAULT_FLUSH_INTERVAL_S),
            "buffer_events": _get("GPU_TRACE_BUFFER_EVENTS", DEFAULT_BUFFER_EVENTS),
            "nvtx": _get("GPU_TRACE_NVTX", "native"),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)  # type: ignore[arg-type]
        settings.validate()
        return settings

    def validate(self) -> None:
        interval = self.flush_interval_s
        # Written so that NaN fails too (it compares false with everything).
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise ValueError(f"flush interval must be a number of seconds, got {interval!r}")
        if not 0 < interval <= 60:
            raise ValueError(f"flush interval must be in (0, 60] seconds, got {interval}")
        events = self.buffer_events
        if isinstance(events, bool) or not isinstance(events, int):
            raise ValueError(f"buffer capacity must be a whole number of events, got {events!r}")
        if not 16 <= events <= MAX_BUFFER_EVENTS:
            raise ValueError(
                f"buffer capacity must be in [16, {MAX_BUFFER_EVENTS}] events, got {events}"
            )
        if self.nvtx not in ("native", "python", "off"):
            raise ValueError(f"GPU_TRACE_NVTX must be native, python or off, got {self.nvtx!r}")


DEFAULT_REMOTE_TIMEOUT_S = 30.0


DEFAULT_SPIN_US = 200.0


def spin_us(explicit: float | None = None) -> float:
    """How long a forwarding peer polls before sleeping (``GPU_TRACE_SPIN_US``)."""
    value = explicit if explicit is not None else float(_get("GPU_TRACE_SPIN_US", DEFAULT_SPIN_US))  # type: ignore[arg-type]
    if not 0 <= value <= 1_000_000:
        raise ValueError(f"spin must be in [0, 1000000] microseconds, got {value}")
    return value


DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
DEFAULT_MAX_HANDSHAKES = 64


def handshake_timeout(explicit: float | None = None) -> float:
    """Seconds a server gives a connection to authenticate (``GPU_TRACE_HANDSHAKE_TIMEOUT``)."""
    value = explicit
    if value is None:
        value = float(_get("GPU_TRACE_HANDSHAKE_TIMEOUT", DEFAULT_HANDSHAKE_TIMEOUT_S))  # type: ignore[arg-type]
    if not 0 < value <= 3600:  # NaN fails this too
        raise ValueError(f"handshake timeout must be in (0, 3600] seconds, got {value}")
    return float(value)


def max_handshakes(explicit: int | None = None) -> int:
    """Connections a server lets wait to authenticate at once (``GPU_TRACE_MAX_HANDSHAKES``)."""
    value = explicit
    if value is None:
        value = int(_get("GPU_TRACE_MAX_HANDSHAKES", DEFAULT_MAX_HANDSHAKES))  # type: ignore[call-overload]
    if not (1 <= value <= 100_000 and value == int(value)):
        raise ValueError(f"handshake limit must be a whole number in [1, 100000], got {value}")
    return int(value)


def remote_address(explicit: str | None = None) -> str | None:
    """``HOST:PORT`` of the forwarding server (``GPU_TRACE_REMOTE``), or None."""
    return explicit or _env("GPU_TRACE_REMOTE")


def remote_sync(explicit: bool | None = None) -> bool:
    """Whether forwarded ops run synchronously (``GPU_TRACE_REMOTE_SYNC``)."""
    if explicit is not None:
        return explicit
    return bool(_get("GPU_TRACE_REMOTE_SYNC", False))


def remote_token(explicit: str | None = None) -> str | None:
    """The forwarding token (``GPU_TRACE_REMOTE_TOKEN``), or None."""
    return explicit or _env("GPU_TRACE_REMOTE_TOKEN")


def remote_timeout(explicit: float | None = None) -> float:
    """Seconds of silence from the server before a client gives up (``GPU_TRACE_REMOTE_TIMEOUT``)."""
    value = (
        explicit
        if explicit is not None
        else float(_get("GPU_TRACE_REMOTE_TIMEOUT", DEFAULT_REMOTE_TIMEOUT_S))  # type: ignore[arg-type]
    )
    if not 0 < value <= 3600:
        raise ValueError(f"remote timeout must be in (0, 3600] seconds, got {value}")
    return value


#: OpenTelemetry's standard OTLP exporter variables, read by `--otlp` (export, record).
OTLP_VARIABLES = (
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_HEADERS",
)


def otlp_setting(name: str) -> str | None:
    """One of :data:`OTLP_VARIABLES` when set (its text: export/endpoint.py parses it)."""
    if name not in OTLP_VARIABLES:
        raise KeyError(name)
    return _env(name)
