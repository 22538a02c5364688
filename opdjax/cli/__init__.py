from opdjax.cli.main import main

__all__ = ["main"]
