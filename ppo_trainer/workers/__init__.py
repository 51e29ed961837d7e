"""Roles, worker groups and device placement."""
