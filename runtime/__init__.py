"""Forwarding client, GPU server, wire protocol and sharing (quotas, scheduler, reclamation)."""
