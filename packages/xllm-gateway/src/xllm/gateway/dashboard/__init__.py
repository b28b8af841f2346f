"""The live cluster page served by the gateway at ``/dashboard``: :mod:`.hub` (the event hub, the
snapshot, the ``RequestTimelines`` protocol tracing provides) and :mod:`.routes` (the page, its
assets, the snapshot and the Server-Sent Events stream: :func:`add_dashboard_routes`)."""

from xllm.gateway.dashboard.hub import EventHub, RequestTimelines
from xllm.gateway.dashboard.routes import DashboardOptions, add_dashboard_routes

__all__ = ["DashboardOptions", "EventHub", "RequestTimelines", "add_dashboard_routes"]
