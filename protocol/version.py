"""The one place the release version lives (pyproject.toml carries the same string)."""

VERSION = "0.1.0"
