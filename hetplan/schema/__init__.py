"""Strict schemas of the files users write, and how a violation becomes one line.

``node`` holds the node.yaml models (every key, its unit, its physical range, its default, and
the README table rendered from them); ``errors`` turns a pydantic error into "file:line: key:
what is wrong, what is accepted". Knows nothing about planning: readers such as
``hetplan.hardware`` validate with these and build their own specs.
"""
