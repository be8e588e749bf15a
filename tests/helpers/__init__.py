"""Shared test helpers: single-thread references and parity checks the test modules build on."""
