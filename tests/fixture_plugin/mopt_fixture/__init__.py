"""Fixture plugin for mopt's tests."""
