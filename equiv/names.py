"""Import paths: the one place equiv turns a name into an object and back.

A user names their step (``equiv check my_steps.py:step``), a case names the
user's own model factory, loss or data (``"model": "my_lm:LogitsOnly"``), and
a replay line must name them again in another process.  All of these go
through :func:`resolve` and :func:`reference`:

- ``package.module:attribute`` (the attribute may be dotted) is resolved by the
  standard library's :func:`pkgutil.resolve_name`, with the working directory
  on ``sys.path`` while it imports (as ``python -m`` would have it);
- ``path/to/file.py:attribute`` loads that file as a module, with its folder on
  ``sys.path`` while it runs, so the file's own imports resolve.

Nothing is left on ``sys.path`` afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import pkgutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["on_sys_path", "reference", "resolve", "target_folder"]


@contextlib.contextmanager
def on_sys_path(directory: str) -> Iterator[None]:
    """``directory`` first on ``sys.path`` while a target is imported, removed after."""
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)


def target_folder(spec: str) -> str:
    """Where ``spec``'s own imports resolve from: a file target's folder, else the working
    directory (as ``python -m`` does); a case's factories next to the step resolve there too."""
    module_part = spec.rpartition(":")[0]
    return str(Path(module_part).resolve().parent) if module_part.endswith(".py") else str(Path.cwd())


def resolve(spec: str) -> Any:
    """The object ``spec`` names: ``package.module:attribute`` or
    ``path/to/file.py:attribute`` (the attribute may be dotted: ``Class.method``).

    Raises ``ValueError`` saying what is wrong with ``spec``: not of that form,
    no such file, the import failed (with the module's own error), or no such
    attribute."""
    if not isinstance(spec, str):
        raise ValueError(f"expected an import path 'package.module:attribute', got {type(spec).__name__}: {spec!r}")
    module_part, sep, attribute = spec.rpartition(":")
    if not sep or not module_part or not attribute:
        raise ValueError(
            f"{spec!r} is not an import path; expected 'package.module:attribute' or 'path/to/file.py:attribute'"
        )
    if module_part.endswith(".py"):
        module = _load_file(Path(module_part), spec)
        target: Any = module
        for part in attribute.split("."):
            if not hasattr(target, part):
                raise ValueError(f"{module_part!r} has no attribute {attribute!r}")
            target = getattr(target, part)
        return target
    try:
        with on_sys_path(str(Path.cwd())):
            return pkgutil.resolve_name(spec)
    except AttributeError as exc:
        raise ValueError(f"module {module_part!r} has no attribute {attribute!r} ({exc})") from None
    except ValueError as exc:  # pkgutil: not a valid name
        raise ValueError(f"{spec!r} is not an import path ({exc})") from None
    except Exception as exc:  # the module's own code failed while importing: say so, keep the cause
        raise ValueError(f"could not import {module_part!r}: {type(exc).__name__}: {exc}") from exc


def _load_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise ValueError(f"no such file {str(path)!r} (from {spec!r})")
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    try:
        with on_sys_path(str(path.resolve().parent)):
            module_spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"could not import {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    return module


def reference(target: Any, *, files: bool = False) -> str | None:
    """An import path :func:`resolve` gives ``target`` back from, in another
    process: ``module:qualname`` for a module-level function or class (checked
    by resolving it), or with ``files=True``, ``path/to/file.py:qualname`` for
    one defined in a file loaded by path.  None when it has no such name (a
    lambda, a function defined inside another, an instance, ``__main__``)."""
    module_name, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if not module_name or not qualname or "<" in qualname:
        return None
    module = sys.modules.get(module_name)
    if module_name != "__main__" and module is not None and getattr(module.__spec__, "name", None) == module_name:
        path = f"{module_name}:{qualname}"
        try:
            return path if resolve(path) is target else None
        except ValueError:
            return None
    if not files:
        return None
    try:
        source = inspect.getsourcefile(target)
    except TypeError:
        return None
    return f"{source}:{qualname}" if source and source.endswith(".py") else None
