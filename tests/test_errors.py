"""Every exception kvcached raises is a KvcachedError and keeps the built-in base callers expect."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import kvcached
from kvcached import errors
from kvcached.errors import KvcachedError

PACKAGE_DIR = Path(kvcached.__file__).parent
REPO = Path(__file__).resolve().parent.parent
BINDINGS = REPO / "cpp/bindings"
#: Raising these directly would break the promise; kvcached.errors has a subclass of each.
BARE_BUILTINS = {
    "Exception",
    "ValueError",
    "TypeError",
    "RuntimeError",
    "KeyError",
    "IndexError",
    "LookupError",
    "OSError",
    "MemoryError",
    "FileNotFoundError",
    "PermissionError",
}
#: Its parsers' ValueErrors are re-raised as ConfigurationError, naming the variable (test_config).
PARSERS_REPORTED_BY_THEIR_CALLER = {"config.py"}


def _builtin_exception(name: str) -> bool:
    value = getattr(builtins, name, None)
    return inspect.isclass(value) and issubclass(value, BaseException)


def _base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def exception_classes_in_source() -> dict[str, tuple[str, list[str]]]:
    """Every class defined in kvcached's Python sources that derives from an exception:
    name -> (file, base names). Read from the source, so version packages whose engine
    is not installed are covered too."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (str(path.relative_to(PACKAGE_DIR)), _base_names(node))

    def is_exception(name: str, seen: frozenset = frozenset()) -> bool:
        if _builtin_exception(name):
            return True
        if name not in classes or name in seen:
            return False
        return any(is_exception(base, seen | {name}) for base in classes[name][1])

    return {name: found for name, found in classes.items() if is_exception(name)}


def derives_from_kvcached_error(name: str, classes: dict[str, tuple[str, list[str]]]) -> bool:
    if name == "KvcachedError":
        return True
    return any(derives_from_kvcached_error(base, classes) for base in classes.get(name, ("", []))[1])


def test_every_exception_class_in_the_sources_derives_from_kvcached_error():
    classes = exception_classes_in_source()
    assert {"KvcachedError", "DriverError", "UnsupportedSGLangVersion", "UnsupportedVLLMVersion"} <= set(classes)
    outside = {name: file for name, (file, _) in classes.items() if not derives_from_kvcached_error(name, classes)}
    assert outside == {}


def importable_kvcached_modules():
    """Every module of the package that imports here (engine version packages need their engine)."""
    for info in pkgutil.walk_packages(kvcached.__path__, prefix="kvcached."):
        if info.name.endswith("__main__"):
            continue  # running it is the CLI
        try:
            yield importlib.import_module(info.name)
        except ImportError as exc:
            if exc.name is None or exc.name.split(".")[0] == "kvcached":
                raise  # only a missing engine or optional dependency may stop an import


def test_every_exception_class_kvcached_exposes_keeps_the_promise():
    found = {}
    for module in importable_kvcached_modules():
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__.startswith("kvcached"):
                found[value.__qualname__] = value
    assert {"KvcachedError", "InvalidArgumentError", "UnsupportedSGLangVersion"} <= set(found)
    for name, cls in found.items():
        assert issubclass(cls, KvcachedError), name
        if cls is KvcachedError:
            continue
        builtin_bases = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (object, BaseException)]
        assert builtin_bases != [Exception], f"{name} should also keep a built-in base such as ValueError"


def test_kvcached_raises_no_bare_builtin_exception():
    bare = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.name in PARSERS_REPORTED_BY_THEIR_CALLER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                if node.exc.func.id in BARE_BUILTINS:
                    bare.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} {node.exc.func.id}")
    assert bare == []


def binding_sources() -> list[Path]:
    return sorted(p for p in BINDINGS.rglob("*") if p.suffix in {".cpp", ".hpp"})


def translated_class_names() -> set[str]:
    """The kvcached.errors classes the bindings raise (C++ exception translators included), read from their source."""
    names = set()
    for path in binding_sources():
        names |= set(re.findall(r'raise_(?:python|driver)_error\("(\w+)"', path.read_text()))
    return names


@pytest.mark.skipif(not BINDINGS.is_dir(), reason="needs the source tree (cpp/bindings)")
def test_every_translated_cpp_exception_is_a_kvcached_error():
    names = translated_class_names()
    assert {"InvalidArgumentError", "InvalidTypeError", "DriverError", "OutOfMemoryError", "RegistryError"} <= names
    for name in names:
        assert issubclass(getattr(errors, name), KvcachedError), name
    # No C++ exception, and no argument check of the bindings, becomes a bare built-in exception.
    for path in binding_sources():
        text = path.read_text()
        assert "PyExc_" not in text and "nb::type_error" not in text and "nb::value_error" not in text, path


def test_a_block_id_of_the_wrong_type_is_an_invalid_type_error_and_still_a_type_error(host_device):
    with kvcached.KVPool(
        2, 4096, num_blocks=8, page_bytes=16 << 10, device=host_device, background_worker=False
    ) as pool:
        with pytest.raises(errors.InvalidTypeError, match="integer") as raised:
            pool.free(["one"])
        assert isinstance(raised.value, TypeError)


def test_cpp_misuse_is_an_invalid_argument_error_and_still_a_value_error(host_device):
    granularity = host_device.granularity[0]
    with pytest.raises(kvcached.InvalidArgumentError) as raised:
        host_device.reserve(granularity + 1)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, KvcachedError)


def test_a_translated_registry_error_keeps_both_bases(tmp_path, monkeypatch):
    from kvcached.registry import DeviceRegistry

    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    with pytest.raises(errors.RegistryNotFoundError) as raised:
        DeviceRegistry("cuda-GPU-00000000-0000-0000-0000-000000000000")
    assert isinstance(raised.value, FileNotFoundError) and isinstance(raised.value, KvcachedError)
