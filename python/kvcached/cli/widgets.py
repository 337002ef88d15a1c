"""Terminal widgets that kvtop and the demo's live view both draw: the usage bar and short sizes."""

from __future__ import annotations

from kvcached.sizes import format_bytes_short as short_bytes

# Bars stretch with the terminal between these widths (in cells).
MIN_BAR_WIDTH, MAX_BAR_WIDTH = 10, 40
USED_CHAR, FREE_MAPPED_CHAR, FREE_CHAR = "█", "▒", "·"
try:
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.measure import Measurement
    from rich.text import Text
except ImportError:  # the commands say so when they start, so importing this module never fails
    Console = None


class UsageBar:
    """A stacked bar filling its table cell: used, then mapped but free, then unmapped, of ``scale_bytes``."""

    def __init__(self, used_bytes: int, free_mapped_bytes: int, scale_bytes: int) -> None:
        self.used_bytes, self.free_mapped_bytes = used_bytes, free_mapped_bytes
        self.scale_bytes = max(scale_bytes, used_bytes + free_mapped_bytes, 1)

    def text(self, width: int) -> Text:
        used_cells = round(width * self.used_bytes / self.scale_bytes)
        free_mapped_cells = min(width - used_cells, round(width * self.free_mapped_bytes / self.scale_bytes))
        bar = Text(no_wrap=True)
        bar.append(USED_CHAR * used_cells, style="green")
        bar.append(FREE_MAPPED_CHAR * free_mapped_cells, style="yellow")
        bar.append(FREE_CHAR * (width - used_cells - free_mapped_cells), style="dim")
        return bar

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(MIN_BAR_WIDTH, MAX_BAR_WIDTH)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.text(max(MIN_BAR_WIDTH, min(MAX_BAR_WIDTH, options.max_width)))


__all__ = ["FREE_CHAR", "FREE_MAPPED_CHAR", "MAX_BAR_WIDTH", "MIN_BAR_WIDTH", "USED_CHAR", "UsageBar", "short_bytes"]
