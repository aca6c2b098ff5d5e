"""Helpers shared by tests of several parts: polling, and nothing that belongs to one part."""
