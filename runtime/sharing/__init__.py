"""Sharing one GPU between tenants: who they are, their sessions' tables (handles, uploads,
memory accounts), their memory, scheduling and its policies, paging idle sessions out and back,
usage. Below the server: it imports nothing of it, not even for types."""
