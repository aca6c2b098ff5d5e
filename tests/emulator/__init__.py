"""The emulator itself: the Agents API it stands in for, over HTTP with the real SDK."""
