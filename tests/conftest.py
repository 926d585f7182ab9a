"""Shared fixtures for the unit tests (add yours below)."""

from tests.fixtures.certs import dev_certs, foreign_certs
from tests.fixtures.postgres import fresh_postgres_url, postgres_cluster, postgres_url

__all__ = ["dev_certs", "foreign_certs", "fresh_postgres_url", "postgres_cluster", "postgres_url"]
