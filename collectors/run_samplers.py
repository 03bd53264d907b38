"""The samplers of one `gpu-trace record` run, running in the record parent around the program.

They record into a :class:`~gpu_trace.tracer.recorder.Recorder` of their own: same run directory,
the parent's pid, its own spool files, the same clock as every process of the run. Nothing of
this runs in the traced program, so sampling does not perturb it.

``prepare`` (before the program starts) opens the sources and says in one line what is off;
``start(pid)`` begins sampling once the program's pid is known; ``stop()`` stops the samplers
and flushes their recorder, and must come before ingest. A `gpu-trace serve` builds the same
samplers (``NvmlSampler``, ``HostSampler``) with its own attribution.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from gpu_trace import config
from gpu_trace.collectors.host import HostSampler
from gpu_trace.collectors.nvml import NvmlSampler, NvmlSource, open_sampler, wants_buffers
from gpu_trace.collectors.periodic import Sampler
from gpu_trace.collectors.processes import ProcessTree
from gpu_trace.tracer.recorder import Recorder

log = logging.getLogger(__name__)

#: The samplers' recorder flushes at least this seldom: a flush costs ~1.5 ms of CPU whatever it
#: holds, and the record process is not the one that may be killed mid-run (stop() flushes).
FLUSH_INTERVAL_S = 2.0


class RunSamplers:
    """NVML and host samplers of one run; ``notes`` are lines for the user (what is off)."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.attrs: dict[str, str] = {}
        self.tree = ProcessTree()
        self.recorder: Recorder | None = None
        self.samplers: list[Sampler] = []
        self._started = False

    @classmethod
    def prepare(
        cls,
        run_dir: Path,
        *,
        run_id: str,
        trace_id: str,
        nvml_hz: float,
        host_hz: float,
        nvml_replay: Path | None = None,
        nvml_fallback: Path | None = None,
    ) -> RunSamplers:
        """Open the sources; never raises for a missing GPU or NVML (a note says so).

        ``nvml_fallback``: a sample file to play back where NVML is unavailable (the demo).
        """
        self = cls()
        if nvml_hz < 0 or host_hz < 0:
            raise ValueError("sampling rates must be >= 0 (0 turns a sampler off)")
        if not nvml_hz and not host_hz:
            return self
        try:
            settings = config.RecorderSettings.from_env(run_dir=run_dir, run_id=run_id)
        except ValueError:
            settings = config.RecorderSettings(run_dir=run_dir, run_id=run_id)
        interval = max(settings.flush_interval_s, FLUSH_INTERVAL_S)
        settings = dataclasses.replace(settings, flush_interval_s=interval)
        self.recorder = Recorder(
            settings, trace_id=trace_id, run_id=run_id, warn_write_errors=False
        )
        if nvml_hz:
            families = config.nvml_families()
            source = self._nvml_source(nvml_replay, families)
            sampler, note = open_sampler(
                self.recorder, source, nvml_hz, self.tree.labels, families=families
            )
            if sampler is None and nvml_replay is None and nvml_fallback is not None:
                source = self._nvml_source(nvml_fallback, families)
                sampler, _ = open_sampler(
                    self.recorder, source, nvml_hz, self.tree.labels, families=families
                )
                if sampler is not None:
                    note += f"; playing back {nvml_fallback.name} instead (not this machine's)"
                    self.notes.append(note)
            if sampler is None:
                self.notes.append(note)
                self.attrs["nvml"] = "off"
            else:
                self.samplers.append(sampler)
                self.attrs["nvml"] = source.description
                self.attrs["nvml_hz"] = f"{nvml_hz:g}"
                self.attrs["nvml_families"] = ",".join(sorted(sampler.families))
                self.attrs["gpus"] = ",".join(f"{d.key}={d.info.name}" for d in sampler.devices)
        if host_hz:
            self.samplers.append(HostSampler(self.recorder, host_hz, tree=self.tree))
            self.attrs["host_hz"] = f"{host_hz:g}"
        return self

    def _nvml_source(self, replay: Path | None, families: frozenset[str]) -> NvmlSource:
        if replay is not None:
            from gpu_trace.collectors.nvml.replay import ReplaySource

            tree = self.tree
            return ReplaySource(replay, root_pid=lambda: tree.root)
        from gpu_trace.collectors.nvml.live import PynvmlSource

        return PynvmlSource(buffers=wants_buffers(families))

    @property
    def nvml(self) -> NvmlSampler | None:
        return next((s for s in self.samplers if isinstance(s, NvmlSampler)), None)

    def start(self, pid: int) -> None:
        """Attribute to ``pid`` and its descendants and start sampling."""
        self.tree.root = pid
        if self.recorder is None or not self.samplers or self._started:
            return
        self._started = True
        self.recorder.start()
        for sampler in self.samplers:
            try:
                sampler.start()
            except Exception:
                log.exception("gpu-trace: %s could not start", sampler.name)

    def stop(self) -> None:
        """Stop every sampler, then flush their recorder (before ingest). Idempotent and bounded:
        a sampler stuck in a call is reported in one line and left behind (NvmlSampler.stop)."""
        for sampler in self.samplers:
            try:
                sampler.stop()
            except Exception:
                log.exception("gpu-trace: stopping %s failed", sampler.name)
        self.samplers = []
        rec, self.recorder = self.recorder, None
        if rec is not None and self._started:
            rec.close()
