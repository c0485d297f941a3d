"""The applications on top of autopart's API: the ``autopart`` command line, the demo and
showcase, ``bench`` (plans run on real local ranks), terminal reports and figures."""

from __future__ import annotations

__all__: list[str] = []
