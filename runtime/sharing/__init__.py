"""Sharing one GPU between tenants: who they are, their memory, scheduling and its policies,
paging idle sessions out and back, usage, the admin listing and ``/metrics``."""
