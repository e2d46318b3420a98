"""Optional packages that strategies and tools may use: importable here, which version, or why not.

`find_spec` answers "is it installed" without importing; only packages marked `import_check`
are imported (Triton: cheap, about 0.3 s, and a broken install must show up here rather than in
a kernel launch). Strategies name these packages in `Needs.package`, by the `name` below.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass

from tpfuse.probe.capabilities import PackageStatus


@dataclass(frozen=True)
class OptionalPackage:
    name: str  # what Needs.package and Capabilities.package() use
    module: str  # import name
    distributions: tuple[str, ...]  # pip distribution names that provide the module
    install: str  # the fix, as a command
    import_check: bool = False


OPTIONAL_PACKAGES: tuple[OptionalPackage, ...] = (
    OptionalPackage("triton", "triton", ("triton", "pytorch-triton"), "pip install 'triton>=3.4'", import_check=True),
    OptionalPackage("flashinfer", "flashinfer", ("flashinfer-python", "flashinfer"), "pip install flashinfer-python"),
    OptionalPackage("pynvml", "pynvml", ("nvidia-ml-py",), "pip install nvidia-ml-py"),
    OptionalPackage("cuda-python", "cuda.bindings", ("cuda-python", "cuda-bindings"), "pip install cuda-python"),
    OptionalPackage("matplotlib", "matplotlib", ("matplotlib",), "pip install matplotlib"),
)


def _version(package: OptionalPackage) -> str | None:
    for dist in package.distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def read_package(package: OptionalPackage) -> PackageStatus:
    """Whether `package` is importable here; `reason` names the failure and the fix."""
    try:
        spec = importlib.util.find_spec(package.module)
    except (ImportError, ValueError) as exc:  # a missing parent package ("cuda") raises here
        spec, error = None, exc
    else:
        error = None
    if spec is None:
        why = f"not installed ({package.install})" if error is None or isinstance(error, ModuleNotFoundError) else (
            f"cannot be located: {type(error).__name__}: {error} ({package.install})"
        )
        return PackageStatus(package.name, False, None, why)
    version = _version(package)
    if package.import_check:
        try:
            module = importlib.import_module(package.module)
        except Exception as exc:  # any import failure (missing shared library, ABI mismatch) is the reason
            return PackageStatus(package.name, False, version,
                                 f"installed but import failed: {type(exc).__name__}: {exc}")
        version = version or getattr(module, "__version__", None)
    return PackageStatus(package.name, True, version, "")


def read_packages(packages: tuple[OptionalPackage, ...] = OPTIONAL_PACKAGES) -> tuple[PackageStatus, ...]:
    return tuple(read_package(p) for p in packages)
