"""The ``hetplan`` command line: one module per subcommand, each a thin click shell over library
functions that the tests call too.

``app`` holds the group and ``main`` (the console entry point); ``compile``, ``show``, ``check``,
``exec`` and ``profile`` hold one command each and are imported only when used, so planning never
imports torch. Knows nothing about costs, solvers or devices beyond calling into them: every
decision is made by the library, every mistake is a ``HetplanError`` turned into one line here.
"""

from hetplan.cli.app import main

__all__ = ["main"]
