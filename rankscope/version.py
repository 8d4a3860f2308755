"""The installed version of rankscope."""

from __future__ import annotations


def package_version() -> str:
    """The installed distribution's version, else the package's ``__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rankscope")
    except PackageNotFoundError:
        from rankscope import __version__

        return __version__
