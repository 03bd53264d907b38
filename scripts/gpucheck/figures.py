"""The GPU check's figures: each bench's JSON output read into rows of the report, each with its
target and a pass/miss verdict (``scripts/gpu_check.py``; the targets are issue 24's, explained
in docs/gpu-check.md).

Ratios are per round (a mode's median step over the plain run's of the same round: the runs of
a round are interleaved, so the machine's drift cancels), then the median over rounds with the
lowest and highest as the spread. A pass or miss from a single round is shown as such ("miss (1
round)", :func:`result`): a first round is often warm-up noise (on 2026-11-27's H100 NVML's cost
read 1.21x in round 1 and 1.01x in round 2), so it is not settled. On a CPU dry run the same figures are made from the benches'
CPU variants, so the reading is tested, but they mean nothing against GPU targets: their verdict
is ``n/a (CPU)``. Standard library only.
"""

from __future__ import annotations

import operator
import statistics
from collections.abc import Callable
from typing import Any

Figure = dict[str, Any]

_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge}


class Target:
    """``value <op> bound``, shown as ``text``."""

    def __init__(self, op: str, bound: float, text: str) -> None:
        self.op, self.bound, self.text = op, bound, text

    def met(self, value: float) -> bool:
        return _OPS[self.op](value, self.bound)


#: Issue 24's targets.
CAPTURE = Target("<=", 1.05, "<= 1.05x (+5%)")
KERNELS = Target("<=", 0.01, "within 1%")
NVML = Target("<=", 1.01, "<= 1.01x (+1%)")
NVML_CPU = Target("<=", 1.0, "<= 1% of a core")
MODULE = Target("<=", 1.03, "<= 1.03x (+3%)")
OP = Target("<=", 1.3, "<= 1.3x")
FORWARD = Target("<=", 1.5, "<= 1.5x")
WINDOW = Target("<=", 1.5, "<= 1.5x (no stall)")
ZERO = Target("<=", 0, "0")
BITWISE = Target("<=", 0, "yes")  # 0: bitwise the same


def figure(
    name: str,
    value: float | None,
    shown: str = "",
    *,
    target: Target | None = None,
    kind: str = "target",
    spread: str = "",
    note: str = "",
    rounds: int | None = None,
    dry: bool = False,
) -> Figure:
    """One row: ``kind`` is ``target`` (pass/miss against ``target``), ``peer`` (another tool's
    figure beside ours) or ``info`` (no target); ``rounds``: how many rounds it is taken over,
    where it is one over rounds."""
    if value is None:
        verdict = "not measured"
    elif dry:
        verdict = "n/a (CPU)"
    elif kind != "target" or target is None:
        verdict = kind
    else:
        verdict = "pass" if target.met(value) else "miss"
    return {
        "name": name,
        "value": shown if value is not None else "-",
        "number": value,
        "spread": spread,
        "target": target.text if target is not None else ("peer" if kind == "peer" else "-"),
        "verdict": verdict,
        "rounds": rounds,
        "note": note,
    }


def result(fig: Figure) -> str:
    """A figure's result as the report shows it: its verdict, and where a pass or a miss was
    measured on one round only, that it was ("miss (1 round)")."""
    verdict = str(fig["verdict"])
    if verdict in ("pass", "miss") and fig.get("rounds") == 1:
        return f"{verdict} (1 round)"
    return verdict


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def ratios(rounds: list[dict[str, float]], mode: str, base: str) -> list[float]:
    """``mode``'s over ``base``'s figure, each round where both have one."""
    return [r[mode] / r[base] for r in rounds if mode in r and base in r and r[base] > 0]


def ratio_figure(name: str, values: list[float], target: Target | None = None, **kw: Any) -> Figure:
    if not values:
        return figure(name, None, target=target, **kw)
    med = statistics.median(values)
    spread = f"{min(values):.3f}-{max(values):.3f} ({plural(len(values), 'round')})"
    return figure(name, med, f"{med:.3f}x", target=target, spread=spread, rounds=len(values), **kw)


# ---- bench/gpu_activity.py --json ---------------------------------------------------------------


def activity(data: dict[str, Any], dry: bool) -> list[Figure]:
    """Capture cost and torch.profiler's, the worst window, kernels both ways, drops; and the
    conversion's rate."""
    out: list[Figure] = []
    capture = data.get("capture") or {}
    if "skipped" in capture or not capture.get("rounds"):
        why = capture.get("skipped", "no round finished")
        out.append(figure("GPU activity capture: LM step vs plain", None, target=CAPTURE, note=why))
    else:
        medians = capture["round_median_ms"]
        n = capture["rounds"]
        rounds = [{m: v[i] for m, v in medians.items() if len(v) > i} for i in range(n)]
        plain = statistics.median(medians["plain"])
        out.append(
            ratio_figure(
                "GPU activity capture: LM step vs plain",
                ratios(rounds, "gpu activity", "plain"),
                CAPTURE,
                note=f"plain step {plain:.2f} ms (median of rounds); {capture['steps']} steps",
                dry=dry,
            )
        )
        out.append(
            ratio_figure(
                "torch.profiler (CPU + CUDA activities): LM step vs plain",
                ratios(rounds, "profiler", "plain"),
                kind="peer",
                dry=dry,
            )
        )
        worst = max(capture["worst_window"].get("gpu activity") or [0.0])
        out.append(
            figure(
                "GPU activity: worst 5-step window / median",
                worst,
                f"{worst:.2f}x",
                target=WINDOW,
                dry=dry,
            )
        )
        k = capture.get("kernels") or {}
        if "gpu activity" in k and "profiler" in k:
            ours, theirs = k["gpu activity"], k["profiler"]
            diff = abs(ours - theirs) / max(1, theirs)
            out.append(
                figure(
                    "kernels captured vs torch.profiler's (timed steps)",
                    diff,
                    f"{ours:,} vs {theirs:,} ({diff:.2%} apart)",
                    target=KERNELS,
                    note=f"{ours / capture['steps']:.0f} kernels a step",
                    dry=dry,
                )
            )
            dropped = k.get("dropped", 0)
            out.append(
                figure("CUPTI records dropped", dropped, f"{dropped:,}", target=ZERO, dry=dry)
            )
        else:
            out.append(
                figure(
                    "kernels captured vs torch.profiler's (timed steps)",
                    None,
                    target=KERNELS,
                    note="not counted",
                )
            )
    conv = data.get("conversion") or {}
    rates = (conv.get("records_per_s") or {}).get("convert")
    if rates:
        med = statistics.median(rates)
        out.append(
            figure(
                "activity records -> spans (conversion)",
                med,
                f"{med / 1e6:.2f} M records/s",
                kind="info",
                note=f"{conv.get('records', 0):,} records (--scale {conv.get('scale')}); docs:"
                " 2 M/s at two million",
                dry=dry,
            )
        )
    return out


# ---- bench/gpu_overhead.py --json ---------------------------------------------------------------


def _median_window(times: list[float], size: int = 10) -> float:
    wins = [statistics.fmean(times[i : i + size]) for i in range(0, len(times) - size + 1, size)]
    return statistics.median(wins or [statistics.fmean(times)])


def _worst(times: list[float], size: int = 10) -> float:
    wins = [statistics.fmean(times[i : i + size]) for i in range(0, len(times) - size + 1, size)]
    return max(wins) / statistics.median(wins) if wins else 1.0


def overhead(data: dict[str, Any], dry: bool) -> list[Figure]:
    """NVML's default families, module and op level against no recording, from the same
    rounds; torch.profiler where it ran."""
    raw = data.get("rounds") or []
    rounds = [{c: _median_window(t) for c, t in r.items() if t} for r in raw]
    base = statistics.median([r["none"] for r in rounds if "none" in r] or [0.0])
    note = f"no recording: {base:.2f} ms a step" if base else ""
    out = [
        ratio_figure(
            "NVML default families: record --torch off vs --no-nvml",
            ratios(rounds, "off", "off-nonvml"),
            NVML,
            dry=dry,
        ),
        ratio_figure(
            "module level (record --torch module) vs no recording",
            ratios(rounds, "module", "none"),
            MODULE,
            note=note,
            dry=dry,
        ),
        ratio_figure(
            "op level (record --torch op) vs no recording",
            ratios(rounds, "op", "none"),
            OP,
            note=note,
            dry=dry,
        ),
        ratio_figure(
            "record --torch off (samplers only) vs no recording",
            ratios(rounds, "off", "none"),
            kind="info",
            dry=dry,
        ),
    ]
    if any("profiler-cuda" in r for r in rounds):
        out.append(
            ratio_figure(
                "torch.profiler (CPU + CUDA) vs no recording",
                ratios(rounds, "profiler-cuda", "none"),
                kind="peer",
                dry=dry,
            )
        )
    worst = [_worst(r[c]) for r in raw for c in ("module", "op") if r.get(c)]
    if worst:
        out.append(
            figure(
                "module/op level: worst 10-step window / median",
                max(worst),
                f"{max(worst):.2f}x",
                target=WINDOW,
                dry=dry,
            )
        )
    return out


# ---- bench/forward_gpu.py --json ----------------------------------------------------------------


def forward(data: dict[str, Any], dry: bool) -> list[Figure]:
    """The forwarded LM step against the local one, with a client that sees the GPU and one
    that does not; whether the losses were bitwise the local run's."""
    out: list[Figure] = []
    for model, res in (data.get("models") or {}).items():
        summary = res.get("summary") or {}
        local = summary.get("local", {})
        for peer, who in (
            ("forwarded", "client sees the GPU"),
            ("forwarded-gpuless", "GPU-less client"),
        ):
            if peer not in summary:
                continue
            row = summary[peer]
            name = f"forwarded {model} step vs local ({who})"
            errors = row.get("errors") or []
            if "ratio" not in row:
                out.append(
                    figure(name, None, target=FORWARD, note=(errors or ["no round"])[0][:200])
                )
                continue
            cpu = f"CPU ms a step: client {row.get('client_cpu_ms', 0):.2f}" + (
                f", server {row['server_cpu_ms']:.2f}" if "server_cpu_ms" in row else ""
            )
            out.append(
                figure(
                    name,
                    row["ratio"],
                    f"{row['ratio']:.2f}x",
                    target=FORWARD,
                    spread=f"{row['low']:.2f}-{row['high']:.2f} ({plural(row['rounds'], 'round')})",
                    rounds=row["rounds"],
                    note=f"local {local.get('median_ms', 0):.2f} ms, forwarded"
                    f" {row['median_ms']:.2f} ms; {cpu}"
                    + (f"; {len(errors)} round(s) failed: {errors[0][:120]}" if errors else ""),
                    dry=dry,
                )
            )
            same = bool(row.get("bitwise"))
            out.append(
                figure(
                    f"forwarded {model} losses bitwise the local run's ({who})",
                    0.0 if same else 1.0,
                    "yes" if same else "NO",
                    target=BITWISE,
                    dry=dry,
                )
            )
    return out


# ---- bench/paging.py --out, bench/sharing.py --part restore --out --------------------------------


def paging(data: dict[str, Any], dry: bool) -> list[Figure]:
    """Restore and page-out bandwidth against a plain pinned copy of the same bytes, per size."""
    out: list[Figure] = []
    for r in data.get("results") or []:
        gbs = [r["mb"] * (1 << 20) / (ns / 1e9) / 1e9 for ns in r["rounds_ns"]["restore"] if ns]
        out.append(
            figure(
                f"restore vs plain pinned host-to-device copy, {r['mb']:.0f} MiB",
                r["restore_over_plain"],
                f"{r['restore_over_plain']:.2f}x",
                kind="info",
                spread=f"restore {min(gbs):.1f}-{max(gbs):.1f} GB/s" if gbs else "",
                note=f"restore {r['restore_gbps']:.2f} GB/s, plain {r['plain_in_gbps']:.2f}"
                " GB/s (medians)",
                dry=dry,
            )
        )
        out.append(
            figure(
                f"page-out copies vs plain pinned device-to-host copy, {r['mb']:.0f} MiB",
                r["page_out_over_plain"],
                f"{r['page_out_over_plain']:.2f}x",
                kind="info",
                note=f"page-out {r['page_out_copy_gbps']:.2f} GB/s, plain"
                f" {r['plain_out_gbps']:.2f} GB/s; first call {r['page_out_first_call_gbps']:.2f}"
                " GB/s",
                dry=dry,
            )
        )
    return out


def restore(data: dict[str, Any], dry: bool) -> list[Figure]:
    """The first op after a restore (pipelined) and the whole restore, per size."""
    out: list[Figure] = []
    for r in (data.get("restore") or {}).get("results") or []:
        if not r.get("pipelined"):
            continue
        firsts = [x[1] / 1e6 for x in r.get("rounds", [])]
        out.append(
            figure(
                f"first op after a restore (pipelined), {r['bytes'] / (1 << 30):.2f} GB",
                r["first_op_ms"],
                f"{r['first_op_ms']:.2f} ms",
                kind="info",
                spread=f"{min(firsts):.2f}-{max(firsts):.2f} ms" if firsts else "",
                note=f"whole restore {r['all_ms']:.1f} ms ({r['all_ms_per_gb']:.1f} ms/GB);"
                f" client round trip {r['client_ms']:.2f} ms (resident"
                f" {r['client_resident_ms']:.2f}); PipeSwitch: 3.6-6.6 ms task start-up, V100,"
                " PCIe 3.0",
                dry=dry,
            )
        )
    return out


# ---- bench/collectors.py --json -----------------------------------------------------------------


def nvml(data: dict[str, Any], dry: bool) -> list[Figure]:
    """The NVML sampler's CPU at the default 10 Hz, and its NVML calls' latencies."""
    out: list[Figure] = []
    for s in data.get("samplers") or []:
        if not s["sampler"].startswith("nvml"):
            continue
        calls = data.get("calls") or {}
        slow = sorted(calls.items(), key=lambda kv: -kv[1].get("mean_us", 0))[:3]
        out.append(
            figure(
                f"NVML sampler CPU at 10 Hz ({data.get('nvml')} source, default families)",
                s["share_10hz"] * 100,
                f"{s['share_10hz'] * 100:.2f}% of a core",
                target=NVML_CPU,
                note=f"{s['total_us']:.0f} us a sample incl. flush; slowest calls: "
                + ", ".join(f"{k} {v.get('mean_us', 0):.0f} us" for k, v in slow),
                dry=dry,
            )
        )
    return out
