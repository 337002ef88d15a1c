"""The folders show the layers (docs/architecture.md): checked on the source tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CPP = REPO / "cpp"

pytestmark = pytest.mark.skipif(not (CPP / "include").is_dir(), reason="needs the source tree")

QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def quoted_includes(path: Path) -> list[str]:
    return QUOTED_INCLUDE.findall(path.read_text())


def sources_under(*folders: str) -> list[Path]:
    return sorted(
        p for folder in folders for p in (REPO / folder).rglob("*") if p.suffix in {".c", ".cpp", ".h", ".hpp"}
    )


def test_bindings_tests_and_benchmarks_include_no_private_header():
    """Outside cpp/src, only public headers (kvcached/...) and files of one's own folder are included."""
    private = []
    for path in sources_under("cpp/bindings", "tests/cpp", "tests/emulation", "bench/cpp"):
        for name in quoted_includes(path):
            if name.startswith("kvcached/"):
                assert (CPP / "include" / name).is_file(), f"{path}: {name}"
                continue
            own_folder = (path.parent / name).resolve()
            bindings_folder = (CPP / "bindings" / name).resolve()
            inside_repo_src = (CPP / "src") in own_folder.parents or (CPP / "src") in bindings_folder.parents
            if inside_repo_src or not (own_folder.is_file() or bindings_folder.is_file()):
                private.append(f"{path.relative_to(REPO)}: {name}")
    assert private == []


def test_public_headers_include_only_public_headers():
    for path in sources_under("cpp/include"):
        for name in quoted_includes(path):
            assert name.startswith("kvcached/"), f"{path.relative_to(REPO)} includes {name}"


def test_public_headers_hold_no_concrete_page_mapper():
    for path in sources_under("cpp/include"):
        assert "class LocalPageMapper" not in path.read_text() and "LocalPageMapper final" not in path.read_text()
    assert "class LocalPageMapper" in (CPP / "src/core/blocks/local_page_mapper.hpp").read_text()


def test_every_backend_has_a_public_factory_header_and_a_folder_of_its_own():
    for backend in ("host", "cuda", "hip"):
        header = CPP / "include/kvcached/backends" / f"{backend}_backend.hpp"
        assert f"make_{backend}_backend" in header.read_text()
        assert (CPP / "src" / backend / f"{backend}_backend.cpp").is_file()


def test_the_host_backend_is_a_library_of_its_own_linked_into_the_core_module():
    top = (REPO / "CMakeLists.txt").read_text()
    core_glob = re.search(r"file\(GLOB KVCACHED_CORE_SOURCES[^)]*\)", top).group(0)
    assert "cpp/src/host" not in core_glob
    assert re.search(r"add_library\(kvcached_host_backend STATIC", top)
    bindings = (CPP / "bindings/CMakeLists.txt").read_text()
    assert re.search(r"target_link_libraries\(_core PRIVATE [^)]*kvcached_host_backend", bindings)


def test_the_host_backend_is_always_there():
    import kvcached

    assert any(status.name == "host" and status.available for status in kvcached.backends())
    assert kvcached.open_device("cpu").backend == "host"
