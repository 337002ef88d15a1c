"""Terminal widgets that kvtop and the demo's live view both draw: the usage bar and short sizes."""

from __future__ import annotations

from kvcached.sizes import format_bytes_short as short_bytes

# Bars stretch with the terminal between these widths (in cells).
MIN_BAR_WIDTH, MAX_BAR_WIDTH = 10, 40
WEIGHTS_CHAR, USED_CHAR, FREE_MAPPED_CHAR, FREE_CHAR = "▓", "█", "▒", "·"
try:
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.measure import Measurement
    from rich.text import Text
except ImportError:  # the commands say so when they start, so importing this module never fails
    Console = None


class UsageBar:
    """A stacked bar filling its table cell, of ``scale_bytes``: model weights (awake), then KV
    memory used, then KV memory mapped but free, then the rest."""

    def __init__(self, used_bytes: int, free_mapped_bytes: int, scale_bytes: int, weights_bytes: int = 0) -> None:
        self.weights_bytes, self.used_bytes, self.free_mapped_bytes = weights_bytes, used_bytes, free_mapped_bytes
        self.scale_bytes = max(scale_bytes, weights_bytes + used_bytes + free_mapped_bytes, 1)

    def text(self, width: int) -> Text:
        # Each part rounded at its end, so the parts always add up to what they hold together.
        ends = []
        held = 0
        for part_bytes in (self.weights_bytes, self.used_bytes, self.free_mapped_bytes):
            held += part_bytes
            ends.append(round(width * held / self.scale_bytes))
        bar = Text(no_wrap=True)
        start = 0
        for end, char, style in zip(ends, (WEIGHTS_CHAR, USED_CHAR, FREE_MAPPED_CHAR), ("blue", "green", "yellow")):
            bar.append(char * (end - start), style=style)
            start = end
        bar.append(FREE_CHAR * (width - start), style="dim")
        return bar

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(MIN_BAR_WIDTH, MAX_BAR_WIDTH)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.text(max(MIN_BAR_WIDTH, min(MAX_BAR_WIDTH, options.max_width)))


__all__ = [
    "FREE_CHAR",
    "FREE_MAPPED_CHAR",
    "MAX_BAR_WIDTH",
    "MIN_BAR_WIDTH",
    "USED_CHAR",
    "WEIGHTS_CHAR",
    "UsageBar",
    "short_bytes",
]
