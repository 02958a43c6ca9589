"""Strategies that re-read another engine's configuration: ``from-llama.cpp:ARGS``,
``from-accelerate:FILE|JSON``, ``from-vllm:ARGS``, ``from-ktransformers:FILE``.

Each module parses one engine's configuration as its users write it (what ``hetplan export``
writes) into the placement it means, and executes it as that engine does (the faithful
baselines' execution rules, ``hetplan.solvers.baselines``). The argument is the configuration
itself or a file holding it. Knows nothing about plans beyond the Decision it returns.
"""

from __future__ import annotations

from pathlib import Path

from hetplan.errors import HetplanError

MAX_INLINE_CHARS = 450
"""Longest configuration given inline (a plan records its ``--strategy``); longer ones go in a file."""
FILE_ONLY = ("from-ktransformers",)


def check_argument(name: str, arg: str) -> str:
    """``arg`` as given, after checking it is there (and, for file-only engines, a file)."""
    if not arg.strip():
        what = "FILE" if name in FILE_ONLY else "FILE or JSON" if name == "from-accelerate" else "ARGS or FILE"
        raise HetplanError(f"--strategy {name}: give the configuration after a colon, e.g. --strategy '{name}:{what}'")
    if len(arg) > MAX_INLINE_CHARS and not is_file(arg):
        raise HetplanError(f"--strategy {name}: the configuration is {len(arg)} characters; write it to a file "
                           f"(hetplan export -o FILE does) and pass --strategy {name}:FILE")
    if name in FILE_ONLY and not is_file(arg):
        raise HetplanError(f"--strategy {name}:{arg}: no such rule file; give the path of a kTransformers "
                           f"optimize-rule YAML (hetplan export --to ktransformers -o FILE writes one)")
    return arg


def is_file(arg: str) -> bool:
    """Whether ``arg`` names an existing file (a configuration given inline never does)."""
    if "\n" in arg or len(arg) > 4096:
        return False
    try:
        return Path(arg).is_file()
    except OSError:
        return False


def configuration(name: str, arg: str) -> str:
    """The configuration text: the file's content when ``arg`` names a file, else ``arg``."""
    if is_file(arg):
        p = Path(arg)
        from hetplan.files import read_text
        return read_text(p, f"configuration file for {name}", "a text file").strip()
    return arg


def decide(problem, name: str, arg: str, model_source: str | None = None):
    """The Decision the engine makes of configuration ``arg`` on ``problem``."""
    from hetplan.solvers.imported import accelerate, ktransformers, llama_cpp, vllm

    text = configuration(name, arg)
    if name == "from-llama.cpp":
        return llama_cpp.decide(problem, text, model_source)
    if name == "from-accelerate":
        return accelerate.decide(problem, text)
    if name == "from-vllm":
        return vllm.decide(problem, text)
    return ktransformers.decide(problem, text)
