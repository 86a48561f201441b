"""The worker writes its workflow modules' bytecode, which Temporal's sandbox would otherwise compile from
source for every workflow it builds in memory (worker.compile_workflow_modules says why)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

import workflows.task
from worker import compile_workflow_modules


def _code_without_compiling(path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What the import machinery loads for ``path`` when compiling its source is not allowed."""
    loader = importlib.machinery.SourceFileLoader(path.stem, str(path))

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{path.name} was compiled from source: no valid bytecode cache")

    monkeypatch.setattr(loader, "source_to_code", refuse)
    return loader.get_code(path.stem)


def test_bytecode_is_written_though_python_is_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "package"
    package.mkdir()
    module = package / "m.py"
    module.write_text("X = 1\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # PYTHONDONTWRITEBYTECODE=1

    with pytest.raises(AssertionError, match="compiled from source"):
        _code_without_compiling(module, monkeypatch)
    assert compile_workflow_modules([str(package)]) is True
    assert Path(importlib.util.cache_from_source(str(module))).exists()
    namespace: dict[str, Any] = {}
    exec(_code_without_compiling(module, monkeypatch), namespace)
    assert namespace["X"] == 1


def test_the_workflow_module_loads_from_its_cache_after_the_worker_compiled_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert compile_workflow_modules() is True
    code = _code_without_compiling(Path(workflows.task.__file__), monkeypatch)
    assert "TaskWorkflow" in code.co_names
