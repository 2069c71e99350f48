"""The one rich console that progress displays and one-line errors go to (stderr).

Library code (model builder, ``LLM``, worker start-up) shows progress here without
importing the command-line package, which sits above it."""

from rich.console import Console

console = Console(stderr=True)
