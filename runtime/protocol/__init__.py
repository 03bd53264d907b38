"""What both sides of the forwarding runtime speak: frames, values, templates, the handshake's
proof, errors, addresses. It imports no other room of the runtime
(tests/unit/test_runtime_layers.py holds that), so either side can be loaded without the other."""
