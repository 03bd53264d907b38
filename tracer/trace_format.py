"""Names of the Chrome trace format that both directions share.

``gpu-trace export`` writes them (:mod:`gpu_trace.export.chrome`, :mod:`gpu_trace.export.flows`)
and ``gpu-trace import`` reads them back (:mod:`gpu_trace.store.importer`); they live here, below
both, so the importer never imports the exporter.
"""

from __future__ import annotations

#: The category of the flow arrows the exporter draws from a span to its parent in another process.
FLOW_CATEGORY = "flow"
#: Kineto's flow from a CUDA call to the kernel, copy or memset it launched.
LAUNCH_CATEGORY = "ac2g"
#: Kineto's flow from a forward op to the backward op autograd ran for it.
BACKWARD_CATEGORY = "fwdbwd"
#: The attribute naming a backward op's forward op by its span id (decimal, so SQL can join on
#: it): ``gpu-trace import`` sets it from a trace's ``fwdbwd`` flows, the Chrome exporter's
#: Kineto dialect draws it as a ``fwdbwd`` arrow again.
FORWARD_SPAN = "forward span"
#: Argument names the exporter writes itself; an attribute with one of these names (or whose name
#: starts with "attr.") gets "attr." in front, so the importer can take exactly one off again.
RESERVED_ARGS = ("span_id", "parent_span_id", "category", "lane", "device", "stream", "depth")
