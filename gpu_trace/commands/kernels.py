"""`gpu-trace show`'s GPU part: top kernels per device, and how busy each device was."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpu_trace import _format as fmt

if TYPE_CHECKING:
    from gpu_trace.query.gpu import GpuSummary


def render_kernels(gpu: GpuSummary, width: int = 60) -> str:
    """Per device: busy and idle share of its window, then its top kernels by total GPU time
    (count, total, mean, share of the device's busy time)."""
    lines: list[str] = []
    for d in gpu.get("devices", []):
        lines.append("")
        lines.append(
            f"gpu{d['device']}: {fmt.count(d['kernels'])} kernels, {fmt.count(d['work'])} "
            f"kernels+copies+memsets; busy {fmt.duration(d['busy_ns'])} "
            f"({100 * d['busy_share']:.1f}%), idle {fmt.duration(d['idle_ns'])} of "
            f"{fmt.duration(d['window_ns'])}"
        )
        rows = [
            [
                k["name"] if len(k["name"]) <= width else k["name"][: width - 1] + "…",
                fmt.count(k["count"]),
                fmt.duration(k["total_ns"]),
                fmt.duration(k["mean_ns"]),
                f"{100 * k['share']:.1f}%",
            ]
            for k in d["top"]
        ]
        lines.append(
            fmt.table(["KERNEL", "COUNT", "TOTAL", "MEAN", "BUSY %"], rows, right={1, 2, 3, 4})
        )
    return "\n".join(lines)
