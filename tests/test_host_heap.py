"""An engine computing on the CPU keeps its freed heap: glibc's trim threshold (integration.common.heap)."""

import ctypes
import ctypes.util
import subprocess
import sys
import textwrap

import pytest

from kvcached.integration.common.heap import keep_freed_heap


def _has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")
    except OSError:
        return False


needs_glibc = pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc 2.33+ (mallopt, mallinfo2)")

# A burst of 1 MiB blocks freed at once, as a step's temporaries are; prints how
# much free memory glibc then keeps at the top of its heap (mallinfo2's keepcost).
_BURST = textwrap.dedent("""
    import ctypes, ctypes.util, sys
    from kvcached.integration.common.heap import keep_freed_heap
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = (ctypes.c_void_p,)
    print(keep_freed_heap(int(sys.argv[1])))
    blocks = [libc.malloc(1 << 20) for _ in range(48)]
    for block in blocks:
        ctypes.memset(block, 1, 1 << 20)
    for block in reversed(blocks):
        libc.free(block)
    print(libc.mallinfo2().keepcost)
""")


def _burst(keep_bytes: int) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", _BURST, str(keep_bytes)], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    return out[0] == "True", int(out[1])


@needs_glibc
def test_freed_heap_stays_with_the_process_up_to_the_kept_size():
    applied, kept = _burst(256 << 20)
    assert applied
    assert kept >= 40 << 20  # the whole burst stays at the heap's top for the next step


@needs_glibc
def test_without_it_glibc_gives_the_burst_back():
    applied, kept = _burst(0)
    assert not applied
    assert kept < 8 << 20  # 1 MiB blocks are mmapped or trimmed: nothing of the burst is kept


def test_zero_changes_nothing_and_negative_sizes_are_refused():
    assert keep_freed_heap(0) is False
    with pytest.raises(ValueError, match=">= 0"):
        keep_freed_heap(-1)


@needs_glibc
def test_it_says_so_on_the_logger_it_is_given():
    script = textwrap.dedent("""
        import logging
        from kvcached.integration.common.heap import keep_freed_heap
        records = []
        log = logging.getLogger("engine")
        log.setLevel(logging.INFO)
        log.addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: records.append(r.getMessage())})())
        keep_freed_heap(64 << 20, log)
        print(records)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert "keeps up to 64 MiB of freed heap memory" in out.stdout
