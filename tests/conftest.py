"""Shared fixtures for the unit tests (add yours below)."""

from tests.fixtures.postgres import fresh_postgres_url, postgres_cluster, postgres_url

__all__ = ["fresh_postgres_url", "postgres_cluster", "postgres_url"]
