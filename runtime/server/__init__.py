"""The forwarding server: connections, sessions, the executor that runs ops, the runtime's own
ops, the bounds checks and allow-list it enforces, and the sink its spans go to."""
