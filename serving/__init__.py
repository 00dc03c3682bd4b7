"""Serving: engine, sampling, HTTP API."""
