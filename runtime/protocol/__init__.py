"""What both sides of the forwarding runtime speak: frames, values, templates, the handshake's
proof, errors, addresses. It imports neither the client, the server nor sharing
(tests/unit/test_layers.py holds that), so either side can be loaded without the other."""
