"""The forwarding server: connections, the executor that runs ops, the runtime's own ops, the
bounds checks and allow-list it enforces, the sink its spans go to, the front and standby of
worker processes (``--isolation process``), the admin listing and ``/metrics``."""
