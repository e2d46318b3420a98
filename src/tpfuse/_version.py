"""The package's version (the one place it is written) and how a message tells a user to install
one of its extras."""

__version__ = "0.1.0"


def extra_hint(extra: str) -> str:
    """The install command for an optional extra, quoted so zsh keeps the brackets, in both forms:
    from the package registry and from a checkout of the repository."""
    return f"`pip install 'tpfuse[{extra}]'` (from a checkout: `pip install '.[{extra}]'`)"
